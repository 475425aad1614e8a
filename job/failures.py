"""How a run ended, in one place: what its record's `error` says, and whether a `running` record is still live.

* `describe(exc, step=, rank=)` -- the structured `error` of `run.json`: `{"class", "reason", "message",
  "exception", "step", "rank"}`. The class comes from the exception chain alone (types are matched by name, so
  Ray's need not be imported): a lost worker process is `infrastructure`/`worker_lost`, a `DataError` is `data`,
  a `ConfigError` `config`, a non-finite loss `model`, out of memory and a full disk `infrastructure`, a KeyboardInterrupt
  `cancelled`; anything else `unknown`/`exception`. Used by the worker's `except` branch (`train.train_loop`,
  through `evidence.finish_record`) and by the driver (`launch.run_with_ray`, `driver_watch`).
* `Heartbeat` -- the driver rewrites `<run_dir>/heartbeat.json` every `HEARTBEAT_EVERY_S` while the run lives;
  `liveness` reads it: a `running` record whose heartbeat is older than its `timeout_s` (or whose driver
  process is gone from this host) is stale, and the next start of the run marks it `abandoned`
  (`launch.prepare` -> `evidence.abandon_stale`).
* `driver_watch(run_dir)` -- around the driver's wait on the workers: the heartbeat, and an exception ending the
  wait (a KeyboardInterrupt: `cancelled`) closing a record left running. A SIGTERM to the driver is not caught
  yet (a handler raising in the main thread did not interrupt Ray Train's wait): such a driver dies with its
  heartbeat, and the next start marks its record `abandoned`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import json
import os
import socket
import threading

from . import storage

CLASSES = ("infrastructure", "data", "config", "model", "cancelled", "unknown")
HEARTBEAT_FILE = "heartbeat.json"
HEARTBEAT_EVERY_S = 10.0
"""How often the driver rewrites its heartbeat."""
HEARTBEAT_TIMEOUT_S = 60.0
"""How old a heartbeat may be before its run counts as abandoned (several missed beats: slow storage is no death)."""

# (exception type name, class, reason), first match wins; matched against every type in each exception's MRO.
_BY_TYPE = (
    ("KeyboardInterrupt", "cancelled", "signal"),
    ("OutOfMemoryError", "infrastructure", "out_of_memory"),  # torch's (CUDA) and Ray's (host memory monitor)
    ("MemoryError", "infrastructure", "out_of_memory"),
    ("WorkerHealthCheckFailedError", "infrastructure", "worker_lost"),
    ("WorkerHealthCheckTimeoutError", "infrastructure", "worker_lost"),
    ("ActorDiedError", "infrastructure", "worker_lost"),
    ("RayActorError", "infrastructure", "worker_lost"),
    ("NodeDiedError", "infrastructure", "worker_lost"),
    ("PreflightError", "infrastructure", "preflight"),
    ("NonFiniteError", "model", "non_finite_loss"),
    ("DataError", "data", "exception"),
    ("ConfigError", "config", "exception"),
    ("MissingPackage", "config", "missing_package"),
)


_ENOSPC_TEXT = os.strerror(errno.ENOSPC)  # "No space left on device"


def _chain(exc: BaseException):
    """`exc`, then what it wraps: causes, contexts and Ray's wrapped worker exception, each once."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen or not isinstance(e, BaseException):
            continue
        seen.add(id(e))
        yield e
        todo += [getattr(e, "_base_exc", None), getattr(e, "cause", None), e.__cause__, e.__context__]


def classify(exc: BaseException) -> tuple[str, str, BaseException]:
    """(class, reason, the exception in the chain that decided it)."""
    chain = list(_chain(exc))
    for name, cls, reason in _BY_TYPE:
        for e in chain:
            if name in {t.__name__ for t in type(e).__mro__}:
                return cls, reason, e
    for e in chain:  # a failed save's CheckpointError names each rank's OSError only in its message
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or _ENOSPC_TEXT in str(e):
            return "infrastructure", "disk_full", e
    return "unknown", "exception", exc


def describe(exc: BaseException | str | dict | None, *, step: int | None = None, rank: int | None = None) -> dict | None:
    """The record's `error` for `exc` (an exception, a message, an already structured error, or None)."""
    if exc is None or isinstance(exc, dict):
        return exc
    if isinstance(exc, str):
        return error("unknown", "exception", exc, step=step, rank=rank)
    cls, reason, decisive = classify(exc)
    message = " ".join(f"{type(exc).__name__}: {exc}".split())[:2000]
    return error(cls, reason, message, exception=type(decisive).__name__, step=step, rank=rank)


def error(cls: str, reason: str, message: str, *, exception: str | None = None, step: int | None = None,
          rank: int | None = None) -> dict:
    assert cls in CLASSES, cls
    return {"class": cls, "reason": reason, "message": message, "exception": exception, "step": step, "rank": rank}


def one_line(err: dict | str | None) -> str | None:
    """A record's `error` in one line, `class/reason at step S, rank R: message` (a record of an older version
    has a plain string)."""
    if not err or isinstance(err, str):
        return err or None
    where = ", ".join(f"{k} {err[k]}" for k in ("step", "rank") if err.get(k) is not None)
    return f"{err.get('class')}/{err.get('reason')}{' at ' + where if where else ''}: {err.get('message')}"


# --- heartbeat ---------------------------------------------------------------------------------

def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def write_heartbeat(run_dir: str, timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
    beat = {"at": _now().isoformat(timespec="seconds"), "pid": os.getpid(), "host": socket.gethostname(),
            "timeout_s": timeout_s}
    storage.write_atomic(storage.join(run_dir, HEARTBEAT_FILE), json.dumps(beat) + "\n")


def read_heartbeat(run_dir: str) -> dict | None:
    try:
        return json.loads(storage.read_text(storage.join(run_dir, HEARTBEAT_FILE)))
    except (OSError, ValueError):
        return None


def liveness(run_dir: str, record: dict, now: _dt.datetime | None = None) -> str:
    """For a record: `closed` (not `running`), `live` (its driver's heartbeat is fresh), `stale` (the heartbeat is
    older than its timeout, or its driver's process is gone from this host) or `unknown` (no heartbeat: a
    torchrun run, or one of a version without heartbeats; never taken for dead)."""
    if record.get("status") != "running":
        return "closed"
    beat = read_heartbeat(run_dir)
    if not beat:
        return "unknown"
    try:
        age = ((now or _now()) - _dt.datetime.fromisoformat(beat["at"])).total_seconds()
        timeout = float(beat.get("timeout_s", HEARTBEAT_TIMEOUT_S))
    except (KeyError, TypeError, ValueError):
        return "unknown"
    if age > timeout:
        return "stale"
    if beat.get("host") == socket.gethostname() and beat.get("pid") != os.getpid() and not _alive(beat.get("pid")):
        return "stale"
    return "live"


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True
    return True


class Heartbeat:
    """A daemon thread rewriting `<run_dir>/heartbeat.json` every `every_s` until `stop`."""

    def __init__(self, run_dir: str, every_s: float = HEARTBEAT_EVERY_S, timeout_s: float = HEARTBEAT_TIMEOUT_S):
        self.run_dir, self.every_s, self.timeout_s = run_dir, every_s, timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="job-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        write_heartbeat(self.run_dir, self.timeout_s)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                write_heartbeat(self.run_dir, self.timeout_s)
            except Exception as e:  # a storage hiccup must not end the run; several missed beats mean stale
                print(f"heartbeat: cannot write {HEARTBEAT_FILE}: {type(e).__name__}: {e}", flush=True)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@contextlib.contextmanager
def driver_watch(run_dir: str):
    """The driver's watch over a run while it waits on the workers: a `Heartbeat`; whatever ends the wait with an
    exception closes a still-`running` record (`evidence.close_if_running`): `cancelled` for a KeyboardInterrupt,
    else `failed`; the exception then propagates."""
    from . import evidence

    heartbeat = Heartbeat(run_dir).start()
    try:
        yield
    except BaseException as exc:
        evidence.close_if_running(run_dir, "cancelled" if isinstance(exc, KeyboardInterrupt) else "failed", exc)
        raise
    finally:
        heartbeat.stop()
