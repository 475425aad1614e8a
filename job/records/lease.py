"""One run, one writer: the run lease, `<run_dir>/lease.json`.

The driver (`python -m job`; under torchrun, rank 0) takes the lease right after checking that the run directory
is writable and before it writes anything else there (config.yaml, the record, checkpoints), and holds it until it
exits (`watch.hold`). A second driver of the same run directory -- a RayJob retry while the old driver still runs, a
second release on the same claim, a local run beside the cluster's -- is refused (`LeaseHeld`) with one line
naming the holder and how to take over from a dead one.

* Taken with a create-exclusive write (`storage.create_exclusive`): a hard link on a local path, PVC or NFS; an
  `If-None-Match: *` PUT on S3. Of two drivers starting at once exactly one creates the file.
* Renewed by the driver's heartbeat (`failures.Heartbeat`, every `failures.HEARTBEAT_EVERY_S`), which names the
  lease it renews. The lease itself is written once and never rewritten.
* Stale when its heartbeat is older than the lease's `timeout_s` (`failures.HEARTBEAT_TIMEOUT_S`), final (the
  driver's watch ended without a release), or its process is gone from this host; a lease with no heartbeat yet
  counts from its own `started_at`. A stale lease is taken over: the taker first creates
  `.lease-takeover-<id>` exclusively (of two takers one wins), then replaces the lease with its own, which names
  the one it replaced (`took_over`); `evidence.start_record` copies the lease into the run record.
* Released (deleted) when the driver ends, after its last heartbeat; a driver killed outright leaves it, and the
  next start takes it over once it is stale.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import socket
import uuid

from .. import storage
from . import failures

LEASE_FILE = "lease.json"


class LeaseHeld(RuntimeError):
    """The run's lease cannot be taken: another driver holds it (the message names it and how to take over from
    a dead one), or the storage cannot create a file exclusively."""


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def _path(run_dir: str) -> str:
    return storage.join(run_dir, LEASE_FILE)


def read(run_dir: str) -> dict | None:
    """The lease as stored; None when there is none."""
    try:
        lease = json.loads(storage.read_text(_path(run_dir)))
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise LeaseHeld(f"{_path(run_dir)} is not a lease ({e}): delete it if no driver runs this run") from None
    if not isinstance(lease, dict) or not isinstance(lease.get("id"), str):
        raise LeaseHeld(f"{_path(run_dir)} is not a lease (no id): delete it if no driver runs this run")
    return lease


def staleness(run_dir: str, lease: dict, now: _dt.datetime | None = None) -> str | None:
    """Why `lease` is stale (its driver gone), or None while it is live."""
    beat = failures.read_heartbeat(run_dir) or {}
    if beat.get("lease") != lease["id"]:  # not renewed yet: counts from the lease's start
        beat = {"at": lease.get("started_at"), "host": lease.get("host"), "pid": lease.get("pid")}
    if beat.get("final"):
        return f"its driver's last heartbeat at {beat.get('at')} was final"
    timeout = float(lease.get("timeout_s") or failures.HEARTBEAT_TIMEOUT_S)
    try:
        age = ((now or _now()) - _dt.datetime.fromisoformat(beat["at"])).total_seconds()
    except (KeyError, TypeError, ValueError):
        return "it has no readable time"
    if age > timeout:
        return f"its heartbeat is {age:.0f} s old (timeout {timeout:g} s)"
    if beat.get("host") == socket.gethostname() and not failures.process_alive(beat.get("pid")):
        return f"its driver (pid {beat.get('pid')}) is gone from this host"
    return None


def describe(lease: dict) -> str:
    """The holder in a few words: host, pid, pod, when it started."""
    pod = f", pod {lease['pod']}" if lease.get("pod") else ""
    return f"host {lease.get('host')}, pid {lease.get('pid')}{pod}, started at {lease.get('started_at')}"


def _refusal(run_dir: str, lease: dict) -> LeaseHeld:
    beat = failures.read_heartbeat(run_dir) or {}
    renewed = f", last heartbeat {beat.get('at')}" if beat.get("lease") == lease["id"] else ""
    timeout = float(lease.get("timeout_s") or failures.HEARTBEAT_TIMEOUT_S)
    return LeaseHeld(
        f"run {run_dir} is being written by another driver ({describe(lease)}{renewed}): refused before writing "
        f"anything. If that driver is dead, rerun once its heartbeat is {timeout:g} s old (the lease is then taken "
        f"over), or delete {_path(run_dir)} if you are sure it no longer runs")


def _create(run_dir: str, path: str, lease: dict) -> bool:
    try:
        return storage.create_exclusive(path, json.dumps(lease) + "\n")
    except OSError as e:  # no hard links (some FUSE mounts), or an object store without conditional writes
        raise LeaseHeld(f"run {run_dir}: cannot create {path} exclusively ({type(e).__name__}: {e}): this storage "
                        "cannot hold a run lease") from None


def acquire(run_dir: str) -> dict:
    """Takes the run's lease (a stale one is taken over) and returns it; `LeaseHeld` while a live driver holds it."""
    mine = {"id": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(),
            "pod": os.environ.get("POD_NAME") or None, "started_at": _now().isoformat(timespec="seconds"),
            "timeout_s": failures.HEARTBEAT_TIMEOUT_S, "took_over": None}
    for _ in range(3):  # a lease released or taken over between our reads: look again
        if _create(run_dir, _path(run_dir), mine):
            return mine
        current = read(run_dir)
        if current is None:
            continue
        why = staleness(run_dir, current)
        if why is None:
            raise _refusal(run_dir, current)
        marker = storage.join(run_dir, f".lease-takeover-{current['id']}")
        if not _create(run_dir, marker, mine):
            raise LeaseHeld(f"run {run_dir}: another driver is taking over the stale lease of {describe(current)} "
                            f"({marker})")
        try:
            if (read(run_dir) or {}).get("id") == current["id"]:  # not replaced before we held the marker
                storage.remove(_path(run_dir))
                mine["took_over"] = {**{k: current.get(k) for k in ("id", "host", "pid", "pod", "started_at")},
                                     "stale": why}
                if _create(run_dir, _path(run_dir), mine):
                    return mine
                mine["took_over"] = None
        finally:
            storage.remove(marker)
    current = read(run_dir)
    raise _refusal(run_dir, current) if current else LeaseHeld(f"run {run_dir}: cannot take the lease")


def release(run_dir: str, lease: dict) -> None:
    """Deletes the lease if it is still `lease` (not taken over meanwhile)."""
    with contextlib.suppress(LeaseHeld):
        if (read(run_dir) or {}).get("id") == lease["id"]:
            storage.remove(_path(run_dir))
