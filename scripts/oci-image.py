#!/usr/bin/env python3
"""OCI packaging for scripts/k8s-image.sh, standard library only.

  oci-image.py layer ARCHIVE < tar      compress one layer tar (stdin) with zstd straight into the archive being
                                        written (ARCHIVE.partial); its descriptor (digest, size, diff_id: the
                                        uncompressed tar's digest) goes to ARCHIVE.partial.json
  oci-image.py finish ARCHIVE CONFIG --ref NAME ...
                                        add the image config (CONFIG: a JSON object of `config`/`history` keys),
                                        manifest and index for those layers, one index entry per reference, and
                                        close the archive: an OCI image layout as a tar (`ctr images import`,
                                        `skopeo copy oci-archive:`), renamed to ARCHIVE when complete
  oci-image.py trim SITE_PACKAGES       print the NVIDIA libraries no shared library outside nvidia/ loads, directly
                                        or through other libraries (DT_NEEDED): only dlopen()ed for GPU work
  oci-image.py pins PYTHON REQUIREMENTS fail with one line per `name==version` pin of REQUIREMENTS that PYTHON's
                                        environment lacks or has at another version

The layers are written into the archive as they are compressed (the member's header is filled in once the digest
and size are known), so the disk holds each compressed layer once, and the blobs come before index.json, which
importers read whole before resolving.
"""

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import threading

LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+zstd"
CHUNK = 1 << 20


def _member(f, name: str, size: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = size, 0o644
    f.write(info.tobuf(format=tarfile.USTAR_FORMAT))


def _pad(f, size: int) -> None:
    f.write(b"\0" * (-size % tarfile.BLOCKSIZE))


def _add_json(f, document: dict, media_type: str, name: str | None = None) -> dict:
    data = json.dumps(document, sort_keys=True).encode()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    _member(f, name or "blobs/sha256/" + digest.removeprefix("sha256:"), len(data))
    f.write(data)
    _pad(f, len(data))
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def layer(archive: str) -> None:
    """Stream stdin through zstd into the archive, hashing both sides; the descriptors accumulate beside it."""
    partial, layers_file = archive + ".partial", archive + ".partial.json"
    layers = json.load(open(layers_file)) if os.path.exists(layers_file) else []
    diff_id, digest = hashlib.sha256(), hashlib.sha256()
    with open(partial, "r+b" if layers else "wb") as f:
        f.seek(0, os.SEEK_END)
        header = f.tell()
        f.write(b"\0" * tarfile.BLOCKSIZE)  # the member's header, once its name (the digest) and size are known
        zstd = subprocess.Popen(["zstd", "-q", "-T0", "-3", "-c"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        feeder = threading.Thread(target=_feed, args=(zstd.stdin, diff_id))
        feeder.start()
        size = 0
        while chunk := zstd.stdout.read(CHUNK):
            digest.update(chunk)
            f.write(chunk)
            size += len(chunk)
        feeder.join()
        if zstd.wait() != 0:
            sys.exit(f"oci-image: zstd exited with {zstd.returncode}")
        _pad(f, size)
        end = f.tell()
        f.seek(header)
        _member(f, "blobs/sha256/" + digest.hexdigest(), size)
        f.seek(end)
    descriptor = {"mediaType": LAYER_MEDIA_TYPE, "digest": "sha256:" + digest.hexdigest(), "size": size,
                  "diff_id": "sha256:" + diff_id.hexdigest()}
    with open(layers_file, "w") as f:
        json.dump(layers + [descriptor], f)


def _feed(sink, diff_id) -> None:
    while chunk := sys.stdin.buffer.read(CHUNK):
        diff_id.update(chunk)
        sink.write(chunk)
    sink.close()


def finish(archive: str, config_json: str, refs: list[str]) -> None:
    partial, layers_file = archive + ".partial", archive + ".partial.json"
    layers = json.load(open(layers_file))
    image = json.loads(config_json)
    with open(partial, "ab") as f:
        config = _add_json(
            f,
            {
                "architecture": "amd64",
                "os": "linux",
                "created": "1970-01-01T00:00:00Z",  # the reference carries the inputs' hash; no build time
                "config": image["config"],
                "rootfs": {"type": "layers", "diff_ids": [layer["diff_id"] for layer in layers]},
                "history": image["history"],
            },
            "application/vnd.oci.image.config.v1+json",
        )
        manifest = _add_json(
            f,
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": config,
                "layers": [{k: v for k, v in layer.items() if k != "diff_id"} for layer in layers],
            },
            "application/vnd.oci.image.manifest.v1+json",
        )
        # containerd names an imported image by `io.containerd.image.name`; `org.opencontainers.image.ref.name`
        # is the OCI layout's own tag (what skopeo and podman read).
        index = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {
                    **manifest,
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref},
                }
                for ref in refs
            ],
        }
        _add_json(f, index, "", name="index.json")
        _add_json(f, {"imageLayoutVersion": "1.0.0"}, "", name="oci-layout")
        f.write(b"\0" * 2 * tarfile.BLOCKSIZE)  # end of archive
    os.replace(partial, archive)
    os.remove(layers_file)


def _needed(path: str) -> list[str]:
    dynamic = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+)\]", dynamic)


def trim(site_packages: str) -> None:
    by_name: dict[str, list[str]] = {}
    for root, _, files in os.walk(site_packages):
        for name in files:
            if re.search(r"\.so(\.|$)", name):
                by_name.setdefault(name, []).append(os.path.join(root, name))
    nvidia = os.path.join(site_packages, "nvidia") + os.sep
    loaded: set[str] = set()
    pending = [path for paths in by_name.values() for path in paths if not path.startswith(nvidia)]
    while pending:
        path = pending.pop()
        if path not in loaded:
            loaded.add(path)
            pending.extend(dep for name in _needed(path) for dep in by_name.get(name, []))
    for paths in by_name.values():
        for path in paths:
            if path.startswith(nvidia) and path not in loaded:
                print(os.path.relpath(path, site_packages))


def pins(python: str, requirements: str) -> None:
    wanted = {}
    for line in open(requirements):
        match = re.match(r"^([A-Za-z0-9_.-]+)(\[[^]]*\])?==(\S+)", line.strip())
        if match:
            wanted[match.group(1)] = match.group(3)
    probe = (
        "import importlib.metadata as m, json, sys\n"
        "def version(name):\n"
        "    try: return m.version(name)\n"
        "    except m.PackageNotFoundError: return None\n"
        "print(json.dumps({name: version(name) for name in sys.argv[1:]}))"
    )
    found = json.loads(subprocess.run([python, "-c", probe, *wanted], capture_output=True, text=True, check=True).stdout)
    wrong = [f"{name}=={pin} (found {found[name] or 'none'})" for name, pin in wanted.items() if found[name] != pin]
    if wrong:
        sys.exit(f"oci-image: {python} lacks pins of {requirements}: {', '.join(wrong)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("layer").add_argument("archive")
    pack = commands.add_parser("finish")
    pack.add_argument("archive")
    pack.add_argument("config")
    pack.add_argument("--ref", action="append", required=True)
    commands.add_parser("trim").add_argument("site_packages")
    check = commands.add_parser("pins")
    check.add_argument("python")
    check.add_argument("requirements")
    args = parser.parse_args()
    if args.command == "layer":
        layer(args.archive)
    elif args.command == "finish":
        finish(args.archive, args.config, args.ref)
    elif args.command == "trim":
        trim(args.site_packages)
    else:
        pins(args.python, args.requirements)


if __name__ == "__main__":
    main()
