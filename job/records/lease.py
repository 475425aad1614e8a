"""One run, one writer: the run lease, `<run_dir>/lease.json`.

The driver (`python -m job`; under torchrun, rank 0) takes it after checking that the run directory is writable and
before writing anything else there, and holds it until it exits (`watch.hold`). A second driver of the run (a RayJob
retry beside the old driver, a second release on the same claim, a local run beside the cluster's) is refused
(`LeaseHeld`) in one line naming the holder and how to take over from a dead one.

* Taken with `storage.create_exclusive` (a hard link on a local path, PVC or NFS; an `If-None-Match: *` PUT on S3):
  of two drivers starting at once exactly one creates it. Written once, never rewritten.
* Renewed by the driver's heartbeat (`heartbeat.json`, rewritten every `HEARTBEAT_EVERY_S` by `watch.Heartbeat`,
  once more `"final"` when the driver lets go), which names the lease.
* Stale when its heartbeat is older than its `timeout_s`, final, or from a process gone from this host; without a
  heartbeat yet it counts from its `started_at`.
* Watched when it looks live but its holder is on another host: a driver killed with its pod looks live for up to
  `timeout_s`, and a RayJob retry starts a new head within seconds. The new driver watches the heartbeat
  (`await_staleness`): a beat refuses it within about one interval; silence takes over, at most `timeout_s` after
  the last beat. A holder on this host is asked directly (its process), never waited for.
* Taken over when stale: the taker creates `.lease-takeover-<id>` exclusively (one of two takers wins), then
  replaces the lease with its own, naming the old one (`took_over`); `start_record` copies it into the record.
* Released (deleted) when the driver ends, after its last beat; one killed outright leaves it, taken over once stale.

The heartbeat also tells whether a `running` record is live (`liveness`): a stale one is marked `abandoned` at the
run's next start (`run_record.abandon_stale`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import socket
import time
import uuid

from .. import storage

LEASE_FILE = "lease.json"
HEARTBEAT_FILE = "heartbeat.json"
HEARTBEAT_EVERY_S = 10.0
"""How often the driver rewrites its heartbeat."""
HEARTBEAT_TIMEOUT_S = 60.0
"""How old a heartbeat may be before its run counts as abandoned (several missed beats: slow storage is no death)."""
WATCH_EVERY_S = 1.0
"""How often a driver watching a live-looking lease of another host reads the holder's heartbeat again."""


class LeaseHeld(RuntimeError):
    """The run's lease cannot be taken: another driver holds it (the message names it and how to take over from
    a dead one), or the storage cannot create a file exclusively."""


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def _path(run_dir: str) -> str:
    return storage.join(run_dir, LEASE_FILE)


def write_heartbeat(run_dir: str, timeout_s: float = HEARTBEAT_TIMEOUT_S, final: bool = False,
                    lease: str | None = None) -> None:
    """`final`: the driver's last beat, as its watch ends; `lease`: the id of the lease it renews."""
    beat = {"at": _now().isoformat(timespec="seconds"), "pid": os.getpid(), "host": socket.gethostname(),
            "timeout_s": timeout_s, "final": final, "lease": lease}
    storage.write_atomic(storage.join(run_dir, HEARTBEAT_FILE), json.dumps(beat) + "\n")


def read_heartbeat(run_dir: str) -> dict | None:
    try:
        return json.loads(storage.read_text(storage.join(run_dir, HEARTBEAT_FILE)))
    except (OSError, ValueError):
        return None


def liveness(run_dir: str, record: dict, now: _dt.datetime | None = None) -> str:
    """For a record: `closed` (not `running`), `live` (fresh heartbeat), `stale` (heartbeat past its timeout or
    final, or its driver's process gone from this host) or `unknown` (no heartbeat, e.g. torchrun: never taken
    for dead)."""
    if record.get("status") != "running":
        return "closed"
    beat = read_heartbeat(run_dir)
    if not beat:
        return "unknown"
    if beat.get("final"):
        return "stale"
    try:
        age = ((now or _now()) - _dt.datetime.fromisoformat(beat["at"])).total_seconds()
        timeout = float(beat.get("timeout_s", HEARTBEAT_TIMEOUT_S))
    except (KeyError, TypeError, ValueError):
        return "unknown"
    if age > timeout:
        return "stale"
    if (beat.get("host") == socket.gethostname() and beat.get("pid") != os.getpid()
            and not process_alive(beat.get("pid"))):
        return "stale"
    return "live"


def process_alive(pid) -> bool:
    """Whether process `pid` of this host exists (one that cannot be asked counts as alive)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True
    return True


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


def _timeout(lease: dict) -> float:
    """Seconds without a heartbeat after which `lease` is stale."""
    return float(lease.get("timeout_s") or HEARTBEAT_TIMEOUT_S)


def staleness(run_dir: str, lease: dict, now: _dt.datetime | None = None) -> str | None:
    """Why `lease` is stale (its driver gone), or None while it is live."""
    beat = read_heartbeat(run_dir) or {}
    if beat.get("lease") != lease["id"]:  # not renewed yet: counts from the lease's start
        beat = {"at": lease.get("started_at"), "host": lease.get("host"), "pid": lease.get("pid")}
    if beat.get("final"):
        return f"its driver's last heartbeat at {beat.get('at')} was final"
    timeout = _timeout(lease)
    try:
        age = ((now or _now()) - _dt.datetime.fromisoformat(beat["at"])).total_seconds()
    except (KeyError, TypeError, ValueError):
        return "it has no readable time"
    if age > timeout:
        return f"its heartbeat is {age:.0f} s old (timeout {timeout:g} s)"
    if beat.get("host") == socket.gethostname() and not process_alive(beat.get("pid")):
        return f"its driver (pid {beat.get('pid')}) is gone from this host"
    return None


def _last_beat(run_dir: str, lease: dict) -> str | None:
    """When the holder of `lease` last renewed it (None: not yet)."""
    beat = read_heartbeat(run_dir) or {}
    return beat.get("at") if beat.get("lease") == lease["id"] else None


def await_staleness(run_dir: str, lease: dict) -> str | None:
    """Watch a live-looking `lease` of another host until its holder beats or the lease changes hands (None: look
    again, or refuse), or it goes stale (why). Bounded by its timeout plus one interval, so a holder whose clock
    runs ahead cannot keep this driver waiting."""
    timeout = _timeout(lease)
    seen = _last_beat(run_dir, lease)
    print(f"run {run_dir}: its lease is held by {describe(lease)}, last heartbeat {seen or 'none yet'}: waiting up "
          f"to {timeout:g} s for that driver's next heartbeat (alive: this one is refused) or for the lease to go "
          "stale (its driver died: this one takes over)", flush=True)
    deadline = time.monotonic() + timeout + HEARTBEAT_EVERY_S
    while time.monotonic() < deadline:
        time.sleep(WATCH_EVERY_S)
        if (read(run_dir) or {}).get("id") != lease["id"] or _last_beat(run_dir, lease) != seen:
            return None
        if why := staleness(run_dir, lease):
            return why
    return None


def describe(lease: dict) -> str:
    """The holder in a few words: host, pid, pod, when it started."""
    pod = f", pod {lease['pod']}" if lease.get("pod") else ""
    return f"host {lease.get('host')}, pid {lease.get('pid')}{pod}, started at {lease.get('started_at')}"


def _refusal(run_dir: str, lease: dict) -> LeaseHeld:
    renewed = f", last heartbeat {at}" if (at := _last_beat(run_dir, lease)) else ""
    timeout = _timeout(lease)
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
            "timeout_s": HEARTBEAT_TIMEOUT_S, "took_over": None}
    for _ in range(3):  # a lease released or taken over between our reads: look again
        if _create(run_dir, _path(run_dir), mine):
            return mine
        current = read(run_dir)
        if current is None:
            continue
        why = staleness(run_dir, current)
        if why is None and current.get("host") != socket.gethostname():
            why = await_staleness(run_dir, current)
        if why is None:
            if (read(run_dir) or {}).get("id") != current["id"]:  # released or taken over while watched
                continue
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
