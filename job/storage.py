"""Run storage: the same few operations on a local directory (a PVC or NFS mount, a `file://` URI) and on an
object store (`s3://…` through fsspec and the optional s3fs; credentials from the environment).

Small files are written atomically (locally beside the target, synced and renamed; an object-store PUT is
all-or-nothing), so a reader, or a run resumed after a crash, never sees half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

import fsspec

from . import packages


def is_remote(uri: str) -> bool:
    """Whether `uri` is on a filesystem other than the local one (`s3://…`, any fsspec URI). A `file://` URI is
    local: `local_path` gives the OS path that local operations use."""
    return "://" in uri and not uri.startswith("file://")


def local_path(uri: str) -> str:
    """The OS path of a local path or `file://` URI."""
    return uri.removeprefix("file://")


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


def _backend(uri: str, field: str = "storage") -> None:
    """Import the fsspec backend `uri` needs if it is an optional package; `MissingPackage` naming `field` if absent."""
    module = packages.for_uri(uri)
    if module:
        packages.require(module, f"{field}: {uri}")


def filesystem(uri: str, field: str = "storage"):
    """(fsspec filesystem, path within it) of a local path or URI; `field` names it in a missing-package error."""
    _backend(uri, field)
    return fsspec.core.url_to_fs(uri)


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    return fs.exists(path)


def remove(uri: str) -> None:
    """Deletes a file or a directory tree, if present (another process deleting it at the same time is fine)."""
    fs, path = filesystem(uri)
    try:
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass


def read_bytes(uri: str) -> bytes:
    _backend(uri)
    with fsspec.open(uri, "rb") as f:
        return f.read()


def read_text(uri: str) -> str:
    return read_bytes(uri).decode("utf-8")


def digest(uri: str) -> dict:
    """sha256 and size of a file's content as storage holds it (read back in 16 MiB pieces)."""
    fs, path = filesystem(uri)
    h, size = hashlib.sha256(), 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
            size += len(chunk)
    return {"sha256": h.hexdigest(), "bytes": size}


def digest_all(uris: list[str]) -> list[dict | None]:
    """`digest` of each file in order (None: missing), in parallel threads: a checkpoint rank's shards are a few
    files of gigabytes each, and hashing them one after the other was most of a save's background time."""
    from concurrent.futures import ThreadPoolExecutor

    def one(uri: str) -> dict | None:
        try:
            return digest(uri)
        except FileNotFoundError:
            return None

    with ThreadPoolExecutor(max_workers=min(8, max(1, len(uris)))) as pool:
        return list(pool.map(one, uris))


def json_sha256(value) -> str:
    """sha256 of a JSON-serialisable value in canonical form (sorted keys): a key for what the value describes."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def write_atomic(uri: str, data: bytes | str) -> None:
    """Writes a whole small file so that no reader ever sees part of it."""
    data = data.encode("utf-8") if isinstance(data, str) else data
    if is_remote(uri):
        _backend(uri)
        with fsspec.open(uri, "wb") as f:
            f.write(data)
        return
    path = local_path(uri)
    try:
        tmp = _written_beside(path, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        if e.filename is None:  # a full disk's ENOSPC from write() names no file
            e.filename = path
        raise


def create_exclusive(uri: str, data: bytes | str) -> bool:
    """Write a whole small file only if none is there; False if one is. Locally it is hard-linked into place, which
    fails if the target exists (atomic on local filesystems and NFS); on S3 a PUT with `If-None-Match: *`. A
    filesystem with neither raises, rather than letting two writers both believe they created it."""
    data = data.encode("utf-8") if isinstance(data, str) else data
    if is_remote(uri):
        fs, path = filesystem(uri)
        try:
            fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        return True
    path = local_path(uri)
    tmp = _written_beside(path, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    return True


def _written_beside(path: str, data: bytes) -> str:
    """A temporary file in `path`'s directory (made if missing) holding `data` on disk; the caller moves or links
    it into place. Removed again if writing fails."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp
