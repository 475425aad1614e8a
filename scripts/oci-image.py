#!/usr/bin/env python3
"""OCI packaging for scripts/k8s-image.sh, standard library only.

  oci-image.py layer DIR < tar          compress one layer tar (stdin) with zstd into DIR/blobs/sha256/; prints its
                                        JSON descriptor (digest, size, diff_id: the uncompressed tar's digest)
  oci-image.py archive DIR OUT CONFIG --ref NAME ...
                                        write the image config (CONFIG: a JSON object of `config`/`history` keys),
                                        manifest and index for the layers made so far, and pack DIR into the OCI
                                        image archive OUT (`ctr images import`, `skopeo copy oci-archive:`), one index
                                        entry per reference; DIR's blobs are removed as they are packed
  oci-image.py trim SITE_PACKAGES       print the NVIDIA libraries no shared library outside nvidia/ loads, directly
                                        or through other libraries (DT_NEEDED): only dlopen()ed for GPU work
  oci-image.py pins PYTHON REQUIREMENTS fail with one line per `name==version` pin of REQUIREMENTS that PYTHON's
                                        environment lacks or has at another version
"""

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile

LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+zstd"
CHUNK = 1 << 20


def _blob_path(directory: str, digest: str) -> str:
    return os.path.join(directory, "blobs", "sha256", digest.removeprefix("sha256:"))


def _write_blob(directory: str, data: bytes, media_type: str) -> dict:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    os.makedirs(os.path.dirname(_blob_path(directory, digest)), exist_ok=True)
    with open(_blob_path(directory, digest), "wb") as f:
        f.write(data)
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def layer(directory: str) -> None:
    """Stream stdin through zstd into a blob, hashing both sides; the descriptors accumulate in DIR/layers.json."""
    os.makedirs(os.path.join(directory, "blobs", "sha256"), exist_ok=True)
    partial = os.path.join(directory, "layer.partial")
    diff_id = hashlib.sha256()
    with open(partial, "wb") as out:
        zstd = subprocess.Popen(["zstd", "-q", "-T0", "-3", "-c"], stdin=subprocess.PIPE, stdout=out)
        while chunk := sys.stdin.buffer.read(CHUNK):
            diff_id.update(chunk)
            zstd.stdin.write(chunk)
        zstd.stdin.close()
        if zstd.wait() != 0:
            sys.exit(f"oci-image: zstd exited with {zstd.returncode}")
    digest = hashlib.sha256()
    with open(partial, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    descriptor = {
        "mediaType": LAYER_MEDIA_TYPE,
        "digest": "sha256:" + digest.hexdigest(),
        "size": os.path.getsize(partial),
        "diff_id": "sha256:" + diff_id.hexdigest(),
    }
    os.replace(partial, _blob_path(directory, descriptor["digest"]))
    layers_file = os.path.join(directory, "layers.json")
    layers = json.load(open(layers_file)) if os.path.exists(layers_file) else []
    with open(layers_file, "w") as f:
        json.dump(layers + [descriptor], f)
    print(json.dumps(descriptor))


def archive(directory: str, out: str, config_json: str, refs: list[str]) -> None:
    layers = json.load(open(os.path.join(directory, "layers.json")))
    image = json.loads(config_json)
    config = _write_blob(
        directory,
        json.dumps(
            {
                "architecture": "amd64",
                "os": "linux",
                "created": "1970-01-01T00:00:00Z",  # the reference carries the inputs' hash; no build time
                "config": image["config"],
                "rootfs": {"type": "layers", "diff_ids": [layer["diff_id"] for layer in layers]},
                "history": image["history"],
            },
            sort_keys=True,
        ).encode(),
        "application/vnd.oci.image.config.v1+json",
    )
    manifest = _write_blob(
        directory,
        json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": config,
                "layers": [{k: v for k, v in layer.items() if k != "diff_id"} for layer in layers],
            },
            sort_keys=True,
        ).encode(),
        "application/vnd.oci.image.manifest.v1+json",
    )
    # containerd names an imported image by `io.containerd.image.name`; `org.opencontainers.image.ref.name` is
    # the OCI layout's own tag (what skopeo and podman read).
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
    members = {
        "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
        "index.json": json.dumps(index, sort_keys=True).encode(),
    }
    partial = out + ".partial"
    with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, fileobj=io.BytesIO(data))
        for descriptor in [config, manifest, *layers]:
            path = _blob_path(directory, descriptor["digest"])
            info = tarfile.TarInfo("blobs/sha256/" + os.path.basename(path))
            info.size = os.path.getsize(path)
            with open(path, "rb") as f:
                tar.addfile(info, fileobj=f)
            os.remove(path)  # the disk holds each layer once: in DIR or in the archive
    os.replace(partial, out)
    shutil.rmtree(directory)


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
    commands.add_parser("layer").add_argument("directory")
    pack = commands.add_parser("archive")
    pack.add_argument("directory")
    pack.add_argument("out")
    pack.add_argument("config")
    pack.add_argument("--ref", action="append", required=True)
    commands.add_parser("trim").add_argument("site_packages")
    check = commands.add_parser("pins")
    check.add_argument("python")
    check.add_argument("requirements")
    args = parser.parse_args()
    if args.command == "layer":
        layer(args.directory)
    elif args.command == "archive":
        archive(args.directory, args.out, args.config, args.ref)
    elif args.command == "trim":
        trim(args.site_packages)
    else:
        pins(args.python, args.requirements)


if __name__ == "__main__":
    main()
