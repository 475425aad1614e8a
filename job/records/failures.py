"""How a run ended, in one place: its record's `error` (`describe`) and the driver's last words on it (`verdict`).

`describe` gives run.json's structured `error`, `{"class", "reason", "message", "exception", "step", "rank"}`,
classed from the exception chain alone: by type name (`_BY_TYPE`; by name, so Ray's need not be imported), then a
full disk or failing storage by errno, then a lost gloo peer or an NCCL error by message (`_BY_MESSAGE`); anything
else is `unknown`/`exception`. Used by the worker's `except` (through `run_record.finish_record`) and the driver.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import os
import re
import socket
import sys

from .. import storage
from ..signals import SavedThenStopped

CLASSES = ("infrastructure", "data", "config", "model", "cancelled", "unknown")
COLLECTIVE_REASONS = ("nccl", "hang")
"""The `infrastructure` reasons whose error also names the run's transport (`run_record.finish_record`)."""

# (exception type name, class, reason), first match wins; matched against every type in each exception's MRO.
_BY_TYPE = (
    ("Preempted", "infrastructure", "preempted"),
    ("Stopped", "cancelled", "signal"),  # the driver's signal, the ranks' save made first
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
    ("ExportError", "model", "export_refused"),  # the export failed its acceptance check (worker/model/export.py)
    ("DataError", "data", "exception"),
    ("ResumeRefused", "config", "resume_refused"),  # the checkpoint's run is not this config's
    ("ConfigError", "config", "exception"),
    ("MissingPackage", "config", "missing_package"),
)


_ENOSPC_TEXT = os.strerror(errno.ENOSPC)  # "No space left on device"
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
# The storage failing under a run that could use it at its start (read-only remount, lost NFS server, denied
# writes, a dropped connection; s3fs raises S3's errors as OSErrors too): `infrastructure`/`storage`.
_STORAGE_ERRNOS = {errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM, errno.ESTALE, errno.ETIMEDOUT,
                   errno.ECONNRESET, errno.ECONNREFUSED, errno.ENOTCONN, errno.EHOSTUNREACH}
# (message pattern, reason), `infrastructure`, for torch.distributed's plain RuntimeErrors: a dead peer seen by a
# surviving rank under gloo (tcp/pair.cc: EOF, a reset, a pair closed by those); NCCL errors, aborted
# communicators and the watchdog's collective timeouts.
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


LOST_PROCESS = ("ActorDiedError", "RayActorError", "NodeDiedError", "WorkerHealthCheckFailedError",
                "WorkerHealthCheckTimeoutError")
"""Ray's errors for a worker whose process is gone (its own error, as Ray Train reports it per rank)."""


def lost_ranks(errors: dict[int, BaseException]) -> list[int]:
    """The ranks of a failed worker group whose process died, from each rank's error as Ray Train reports it: the
    others saw their peers go (a gloo or NCCL error), or failed on their own."""
    return sorted(rank for rank, exc in errors.items()
                  if any(t.__name__ in LOST_PROCESS for e in _chain(exc) for t in type(e).__mro__))


def describe(exc: BaseException | str | dict | None, *, step: int | None = None, rank: int | None = None) -> dict | None:
    """The record's `error` for `exc` (an exception, a message, an already structured error, or None)."""
    if exc is None or isinstance(exc, dict):
        return exc
    if isinstance(exc, str):
        return error("unknown", "exception", exc, step=step, rank=rank)
    cls, reason, decisive = classify(exc)
    if isinstance(decisive, SavedThenStopped):  # the step it saved, which the last logged step may precede
        step = decisive.step
    message = " ".join(f"{type(exc).__name__}: {exc}".split())[:2000]
    return error(cls, reason, message, exception=type(decisive).__name__, step=step, rank=rank)


def error(cls: str, reason: str, message: str, *, exception: str | None = None, step: int | None = None,
          rank: int | None = None) -> dict:
    assert cls in CLASSES, cls
    return {"class": cls, "reason": reason, "message": message, "exception": exception, "step": step, "rank": rank}


def one_line(err: dict | str | None) -> str | None:
    """A record's `error` in one line, `class/reason at step S, rank R: message` (an older record's plain string
    as it is)."""
    if not err or isinstance(err, str):
        return err or None
    where = ", ".join(f"{k} {err[k]}" for k in ("step", "rank") if err.get(k) is not None)
    return f"{err.get('class')}/{err.get('reason')}{' at ' + where if where else ''}: {err.get('message')}"


# --- the verdict --------------------------------------------------------------------------------

LOGS_DIR = "logs"


def attempt_logs(run_dir: str, started_at: float) -> str:
    """`<run_dir>/logs/<driver start, UTC>/`: the driver's output (`driver.log`) and the worker tracebacks
    (`rank<r>.log`) of the attempt whose driver started then."""
    stamp = _dt.datetime.fromtimestamp(started_at, _dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return storage.join(run_dir, LOGS_DIR, stamp)


def save_traceback(run_dir: str, started_at: float, rank: int, exc: BaseException) -> None:
    """Append `exc`'s traceback to this rank's log of the attempt (`attempt_logs`), which the verdict names; a
    failed write is said on stderr, never raised over `exc`."""
    import traceback

    path = storage.join(attempt_logs(run_dir, started_at), f"rank{rank}.log")
    text = f"{_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')} rank {rank}, pid {os.getpid()}, host {socket.gethostname()}\n"
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


def verdict(run_dir: str, status: str, err: dict | None, fallback: str, command: str, logs_dir: str,
            logs: list[str]) -> str:
    """The driver's last words on a run that did not succeed, at most 5 lines: the status and class, the one-line
    cause, the run directory, the attempt's logs (`logs` in `logs_dir`: the driver's, the workers' tracebacks), and
    the next command."""
    err = err or describe(fallback)
    where = ", ".join(f"{k} {err[k]}" for k in ("step", "rank") if err.get(k) is not None)
    cause = " ".join(str(err.get("message") or fallback).split())
    lines = [f"run {status}: {err.get('class')}/{err.get('reason')}{' at ' + where if where else ''}",
             f"cause: {cause[:400]}{'...' if len(cause) > 400 else ''}",
             f"run directory: {run_dir} (run.json)"]
    if logs:
        lines.append(f"logs: {logs_dir}/ ({', '.join(logs)})")
    cls, reason = err.get("class"), err.get("reason")
    todo = _NEXT.get((cls, reason)) or _NEXT.get((cls, None))
    if todo:
        lines.append(f"next: {todo}: {command}")
    else:  # a model's or an unknown failure: look at the run before running it again
        lines.append(f"next: read the run's report and logs: python -m job report {run_dir}")
    return "\n".join(lines)


def success(run_dir: str, record: dict) -> str:
    """The driver's last words on a run that succeeded: how far it trained and what it scored, where it is, and what
    to read next."""
    metrics = record.get("metrics") or {}
    reached = [f"{metrics.get('steps')} steps"]
    if isinstance(metrics.get("final_eval_loss"), (int, float)):
        reached.append(f"held-out loss {metrics['final_eval_loss']:.4g}")
    scores = {}
    for result in record.get("evaluation") or []:
        scores.setdefault(result.get("task"), []).append(result.get("exact_match"))
    reached += [f"{task} {' -> '.join(f'{s:.1%}' for s in (v[0], v[-1])[:len(v)])}" for task, v in scores.items()]
    return "\n".join([f"run succeeded: {', '.join(reached)}", f"run directory: {run_dir} (run.json)",
                      f"next: python -m job report {run_dir}"])