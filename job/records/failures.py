"""How a run ended, in one place: what its record's `error` says, and whether a `running` record is still live.

* `describe(exc, step=, rank=)` -- the structured `error` of `run.json`: `{"class", "reason", "message",
  "exception", "step", "rank"}`. The class comes from the exception chain alone (types are matched by name, so
  Ray's need not be imported): a lost worker process is `infrastructure`/`worker_lost`, a lost Ray Train
  controller (its node or the cluster gone) `infrastructure`/`cluster_lost`, a `DataError` is `data`,
  a `ConfigError` `config` (a refused resume, `ResumeRefused`, `config`/`resume_refused`), a non-finite loss or
  a loss spike `model`, a hang, out of memory and a full disk `infrastructure`, a KeyboardInterrupt `cancelled`,
  a `Preempted` attempt `infrastructure`/`preempted`; by message, a peer lost under gloo
  `infrastructure`/`worker_lost` and an NCCL error or timeout `infrastructure`/`nccl`; anything else
  `unknown`/`exception`. Used by the worker's `except` branch (`train.train_loop`, through
  `evidence.finish_record`) and by the driver (`launch.run_with_ray`, `watch.driver_watch`).
* `Heartbeat` -- the driver rewrites `<run_dir>/heartbeat.json` every `HEARTBEAT_EVERY_S` while it holds the run
  lease (`job/records/lease.py`, which the beats renew), and once more with `"final": true` when it lets go; `liveness`
  reads it: a `running` record whose heartbeat is older than its `timeout_s` (or whose driver
  process is gone from this host) is stale, and the next start of the run marks it `abandoned`
  (`watch.hold` -> `evidence.abandon_stale`).
* Preemption (a worker's SIGTERM, or Ray Train's drain signal): `catch_preemption` turns a worker's SIGTERM into
  a flag (`preemption_signalled`) that the loop agrees on at its next log step; it saves a checkpoint and ends
  the attempt with `Preempted`, which the retry resumes from. Once the worker's loop has returned
  (`stop_catching_preemption`), a SIGTERM is the ordinary end of the worker and goes to the handler it replaced.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import json
import os
import re
import signal
import socket
import sys
import threading

from .. import storage

CLASSES = ("infrastructure", "data", "config", "model", "cancelled", "unknown")
COLLECTIVE_REASONS = ("nccl", "hang")
"""The `infrastructure` reasons whose error also names the run's transport (`evidence.finish_record`)."""
HEARTBEAT_FILE = "heartbeat.json"
HEARTBEAT_EVERY_S = 10.0
"""How often the driver rewrites its heartbeat."""
HEARTBEAT_TIMEOUT_S = 60.0
"""How old a heartbeat may be before its run counts as abandoned (several missed beats: slow storage is no death)."""

# (exception type name, class, reason), first match wins; matched against every type in each exception's MRO.
_BY_TYPE = (
    ("Preempted", "infrastructure", "preempted"),
    ("KeyboardInterrupt", "cancelled", "signal"),
    ("ClusterLost", "infrastructure", "cluster_lost"),  # before the Ray actor errors it wraps
    ("OutOfMemoryError", "infrastructure", "out_of_memory"),  # torch's (CUDA) and Ray's (host memory monitor)
    ("MemoryError", "infrastructure", "out_of_memory"),
    ("WorkerHealthCheckFailedError", "infrastructure", "worker_lost"),
    ("WorkerHealthCheckTimeoutError", "infrastructure", "worker_lost"),
    ("ActorDiedError", "infrastructure", "worker_lost"),
    ("RayActorError", "infrastructure", "worker_lost"),
    ("NodeDiedError", "infrastructure", "worker_lost"),
    ("PreflightError", "infrastructure", "preflight"),
    ("HangError", "infrastructure", "hang"),  # the hang watchdog's (job/worker/watchdog.py)
    ("NonFiniteError", "model", "non_finite_loss"),
    ("LossSpikeError", "model", "loss_spike"),
    ("DataError", "data", "exception"),
    ("ResumeRefused", "config", "resume_refused"),  # the checkpoint's run is not this config's
    ("ConfigError", "config", "exception"),
    ("MissingPackage", "config", "missing_package"),
)


class Cancelled(KeyboardInterrupt):
    """A signal (SIGINT, SIGTERM) asked the driver to stop the run: classified `cancelled`/`signal`."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name} to the driver (pid {os.getpid()}): the run was stopped")


class Preempted(RuntimeError):
    """The ranks agreed to stop for a preemption (a SIGTERM to a worker, or Ray Train's drain signal) and saved
    checkpoint `step` first: `infrastructure`/`preempted`; the retry resumes from that checkpoint."""

    def __init__(self, step: int, checkpoint: str, ranks: int):
        self.step, self.checkpoint = step, checkpoint
        super().__init__(f"preempted at step {step} (signalled on {ranks} rank(s)): checkpoint {checkpoint} saved; "
                         "the retry resumes from it")


class ClusterLost(RuntimeError):
    """The driver lost Ray Train's controller (its node or the whole Ray cluster went away): `infrastructure`/
    `cluster_lost` (the Ray error it came from is its cause)."""




_preemption_signals: list[int] = []  # the SIGTERMs this worker process received (catch_preemption's handler)
_loop_returned: list[bool] = []  # set by stop_catching_preemption: from then on a SIGTERM is not a preemption


def catch_preemption() -> bool:
    """In a worker's main thread: a SIGTERM (what Kubernetes sends a pod's processes before it evicts it) is noted,
    not obeyed, so the loop can finish the step and save (`preemption_signalled`); the handler it replaces (Ray's
    exits at once) comes back for a second SIGTERM. False where signals cannot be handled (not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    before = signal.getsignal(signal.SIGTERM)
    _loop_returned.clear()  # a loop starting in this process again (torchrun, tests): caught once more

    def note(signum, frame):
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)
        if _loop_returned:  # the worker being shut down after its loop: nothing to save, no claim that it will
            signal.raise_signal(signum)
            return
        _preemption_signals.append(signum)
        print(f"SIGTERM to worker pid {os.getpid()}: saving a checkpoint at the ranks' next log step", flush=True)

    signal.signal(signal.SIGTERM, note)
    return True


def stop_catching_preemption() -> None:
    """The worker's loop has returned (from any thread): a SIGTERM from now on goes straight to the handler
    `catch_preemption` replaced (Ray's, which ends the worker), as if it had never been caught."""
    _loop_returned.append(True)


def preemption_signalled() -> bool:
    """Whether this process received a SIGTERM since `catch_preemption` (a flag read: costs nothing per step)."""
    return bool(_preemption_signals)


_ENOSPC_TEXT = os.strerror(errno.ENOSPC)  # "No space left on device"
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
# The storage failing under a run that could use it at its start (read-only remount, lost NFS server, denied
# writes, a dropped connection; s3fs raises S3's errors as OSErrors too): `infrastructure`/`storage`.
_STORAGE_ERRNOS = {errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM, errno.ESTALE, errno.ETIMEDOUT,
                   errno.ECONNRESET, errno.ECONNREFUSED, errno.ENOTCONN, errno.EHOSTUNREACH}
# (message pattern, reason) for errors torch.distributed raises as plain RuntimeErrors, all `infrastructure`: a
# peer whose process died, seen by a surviving rank under gloo (gloo's tcp/pair.cc: EOF, a reset connection, or a
# pair already closed by one of those); NCCL errors, aborted communicators and the watchdog's collective timeouts
# (`WorkNCCL(...) ran for ... milliseconds before timing out`).
_BY_MESSAGE = (
    (re.compile(r"Connection closed by peer|Read error \S+: Connection reset by peer|Socket (unexpectedly )?closed \["),
     "worker_lost"),
    (re.compile(r"NCCL error|NCCL communicator was aborted|WorkNCCL\(.*timing out|ProcessGroupNCCL's watchdog"), "nccl"),
)


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
    for e in chain:  # the OSError itself where the chain has it
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            return "infrastructure", "disk_full", e
    for e in chain:  # a failed save's CheckpointError from another rank names its OSError only in its message
        if _ENOSPC_TEXT in str(e):
            return "infrastructure", "disk_full", e
    for e in chain:
        if isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS:
            return "infrastructure", "storage", e
    for pattern, reason in _BY_MESSAGE:
        for e in chain:
            if pattern.search(str(e)):
                return "infrastructure", reason, e
    return "unknown", "exception", exc


def describe(exc: BaseException | str | dict | None, *, step: int | None = None, rank: int | None = None) -> dict | None:
    """The record's `error` for `exc` (an exception, a message, an already structured error, or None)."""
    if exc is None or isinstance(exc, dict):
        return exc
    if isinstance(exc, str):
        return error("unknown", "exception", exc, step=step, rank=rank)
    cls, reason, decisive = classify(exc)
    if isinstance(decisive, Preempted):  # the step it saved, which the last logged step may precede
        step = decisive.step
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


def write_heartbeat(run_dir: str, timeout_s: float = HEARTBEAT_TIMEOUT_S, final: bool = False,
                    lease: str | None = None) -> None:
    """`final`: the driver's last beat, as its watch ends (the run over, however it ended); `lease`: the id of
    the run lease it renews (`job/records/lease.py`)."""
    beat = {"at": _now().isoformat(timespec="seconds"), "pid": os.getpid(), "host": socket.gethostname(),
            "timeout_s": timeout_s, "final": final, "lease": lease}
    storage.write_atomic(storage.join(run_dir, HEARTBEAT_FILE), json.dumps(beat) + "\n")


def read_heartbeat(run_dir: str) -> dict | None:
    try:
        return json.loads(storage.read_text(storage.join(run_dir, HEARTBEAT_FILE)))
    except (OSError, ValueError):
        return None


def liveness(run_dir: str, record: dict, now: _dt.datetime | None = None) -> str:
    """For a record: `closed` (not `running`), `live` (its driver's heartbeat is fresh), `stale` (the heartbeat is
    older than its timeout, final (its driver's watch ended without closing the record), or its driver's process
    is gone from this host) or `unknown` (no heartbeat: a torchrun run, or one of a version without heartbeats;
    never taken for dead)."""
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


class Heartbeat:
    """A daemon thread rewriting `<run_dir>/heartbeat.json` every `every_s` until `stop`, renewing the run lease
    `lease` (its id) with each beat."""

    def __init__(self, run_dir: str, every_s: float = HEARTBEAT_EVERY_S, timeout_s: float = HEARTBEAT_TIMEOUT_S,
                 lease: str | None = None):
        self.run_dir, self.every_s, self.timeout_s, self.lease = run_dir, every_s, timeout_s, lease
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="job-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        write_heartbeat(self.run_dir, self.timeout_s, lease=self.lease)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                write_heartbeat(self.run_dir, self.timeout_s, lease=self.lease)
            except Exception as e:  # a storage hiccup must not end the run; several missed beats mean stale
                print(f"heartbeat: cannot write {HEARTBEAT_FILE}: {type(e).__name__}: {e}", flush=True)

    def stop(self) -> None:
        """Ends the beats with a final one: the file stays, saying when the driver's watch ended."""
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            write_heartbeat(self.run_dir, self.timeout_s, final=True, lease=self.lease)
        except Exception as e:  # as in `_beat`: the record, not the heartbeat, says how the run ended
            print(f"heartbeat: cannot write the final {HEARTBEAT_FILE}: {type(e).__name__}: {e}", flush=True)


def exit_status(exc: BaseException) -> int:
    """The driver's exit status for a run ended by `exc`: 128 + the signal's number for a `Cancelled` (130 for
    SIGINT, 143 for SIGTERM, as a shell reports a process the signal ended), else 1."""
    return 128 + exc.signum if isinstance(exc, Cancelled) else 1


# --- the verdict --------------------------------------------------------------------------------

LOGS_DIR = "logs"


def attempt_logs(run_dir: str, started_at: float) -> str:
    """`<run_dir>/logs/<driver start, UTC>/`: the worker tracebacks of the attempt whose driver started then."""
    stamp = _dt.datetime.fromtimestamp(started_at, _dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return storage.join(run_dir, LOGS_DIR, stamp)


def save_traceback(run_dir: str, started_at: float, rank: int, exc: BaseException) -> None:
    """Appends `exc`'s traceback to this rank's log of the attempt (`attempt_logs`), where the driver's verdict
    names it; a log that cannot be written is said on stderr, never raised over `exc`."""
    import traceback

    path = storage.join(attempt_logs(run_dir, started_at), f"rank{rank}.log")
    text = f"{_now().isoformat(timespec='seconds')} rank {rank}, pid {os.getpid()}, host {socket.gethostname()}\n"
    text += "".join(traceback.format_exception(exc))
    try:
        with contextlib.suppress(FileNotFoundError):
            text = storage.read_text(path) + "\n" + text  # a Ray Train retry of the same attempt
        storage.write_atomic(path, text)
    except Exception as e:
        print(f"cannot write {path}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


_RESUME = "rerun; it resumes from its newest complete checkpoint, if any"
_NEXT = {  # (class, reason or None for any): what to do before the command
    ("infrastructure", "disk_full"): f"free space on the run's storage, then {_RESUME}",
    ("infrastructure", "preflight"): "fix what the preflight names (the cluster's network, or preflight.expect), "
                                     "then rerun",
    ("infrastructure", None): _RESUME,
    ("config", None): "fix the config field the cause names (or choose a new run name), then rerun",
    ("data", None): "fix the data row or source the cause names, then rerun",
    ("cancelled", None): _RESUME,
}


def verdict(run_dir: str, status: str, err: dict | None, fallback: str, command: str, logs: list[str]) -> str:
    """The driver's last words on a run that did not succeed, at most 5 lines: the status and class, the one-line
    cause, the run directory with the worker logs, and the next command."""
    err = err or describe(fallback)
    where = ", ".join(f"{k} {err[k]}" for k in ("step", "rank") if err.get(k) is not None)
    cause = " ".join(str(err.get("message") or fallback).split())
    lines = [f"run {status}: {err.get('class')}/{err.get('reason')}{' at ' + where if where else ''}",
             f"cause: {cause[:400]}{'...' if len(cause) > 400 else ''}",
             f"run directory: {run_dir} (run.json)"]
    if logs:
        lines.append(f"worker tracebacks: {', '.join(logs)}")
    cls, reason = err.get("class"), err.get("reason")
    todo = _NEXT.get((cls, reason)) or _NEXT.get((cls, None))
    if todo:
        lines.append(f"next: {todo}: {command}")
    else:  # a model's or an unknown failure: look at the run before running it again
        lines.append(f"next: read the run's report and logs: python -m job report {run_dir}")
    return "\n".join(lines)
