"""The driver's watch over its run: the lease held from the storage check to the last line (`hold`), renewed by the
heartbeat (`Heartbeat`), SIGINT/SIGTERM turned into `Cancelled` while it waits on the workers (`driver_watch`), and
the stopped driver's wait for the workers' save (`await_stop_save`). They close or read a record left running, so
they sit above `records.run_record`, not in the modules they use."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from ..records import lease as lease_lib
from ..records import run_record
from ..signals import Cancelled

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []  # the stop signals this process received (driver_watch's handler)
STOP_SAVE_WAIT_S = 120.0
"""How long a stopped driver waits for the workers' save where nothing bounds it (a Ctrl-C): the chart's
default grace period, sized for a 1.5B model's save after the next log step."""
STOP_MARGIN_S = 10.0
"""What a stopped driver keeps, of the time `ray job stop` gives it, to close the record and stop the workers."""


@contextlib.contextmanager
def hold(run_dir: str):
    """Take the lease (`LeaseHeld` if another driver has it), close a record its dead holder left running (before
    this driver's heartbeat replaces the dead one's), renew it while the body runs, release it after the final beat."""
    lease = lease_lib.acquire(run_dir)
    if lease["took_over"]:
        print(f"took over the stale lease of {lease_lib.describe(lease['took_over'])}: "
              f"{lease['took_over']['stale']}", flush=True)
    try:
        if (abandoned := run_record.abandon_stale(run_dir)) is not None:
            print(f"run.json of the attempt started at {abandoned['started_at']} was still running, its driver's "
                  f"heartbeat stale: marked abandoned ({abandoned['error']['message']})", flush=True)
        heartbeat = Heartbeat(run_dir, lease=lease["id"]).start()
    except BaseException:
        lease_lib.release(run_dir, lease)
        raise
    try:
        yield lease
    finally:
        heartbeat.stop()
        lease_lib.release(run_dir, lease)


def as_cancelled(exc: KeyboardInterrupt) -> Cancelled:
    """`exc` as the `Cancelled` of the signal received: Ray's wait re-raises it as a plain KeyboardInterrupt, losing
    the signal; a bare one is a SIGINT."""
    if isinstance(exc, Cancelled):
        return exc
    return Cancelled(_received[0] if _received else signal.SIGINT)


@contextlib.contextmanager
def driver_watch(run_dir: str):
    """While the driver waits on the workers, SIGINT/SIGTERM raise `Cancelled` (Ray's handlers, which exit without
    closing the record, are put back after). An exception ending the wait closes a still-`running` record:
    `cancelled` for a KeyboardInterrupt (propagated as `Cancelled`), else `failed`. A second signal raises again
    (it ends the wait for the workers' save, `await_stop_save`); a third ends the driver at once."""
    received = 0

    def stop(signum, frame):
        nonlocal received
        received += 1
        _received.append(signum)
        if received > 1:
            for s in STOP_SIGNALS:
                signal.signal(s, signal.SIG_DFL)
        raise Cancelled(signum)

    main = threading.current_thread() is threading.main_thread()  # signal handlers can be set there only
    before = {s: signal.signal(s, stop) for s in STOP_SIGNALS} if main else {}
    try:
        yield
    except KeyboardInterrupt as exc:
        cancelled = as_cancelled(exc)
        run_record.close_if_running(run_dir, "cancelled", cancelled)
        raise cancelled from None
    except BaseException as exc:
        run_record.close_if_running(run_dir, "failed", exc)
        raise
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def stop_save_wait_s(env=os.environ) -> float:
    """How long a stopped driver waits for the workers' save: less `STOP_MARGIN_S` than `ray job stop` gives it
    before its SIGKILL (Ray's `RAY_JOB_STOP_WAIT_TIME_S`, which the chart sets from the pods' grace period: a
    RayJob deleted by `helm uninstall` or its deletion rule is stopped so), else `STOP_SAVE_WAIT_S`."""
    given = env.get("RAY_JOB_STOP_WAIT_TIME_S")
    return max(float(given) - STOP_MARGIN_S, 0.0) if given else STOP_SAVE_WAIT_S


def await_stop_save(run_dir: str, since: float, wait_s: float | None = None, every_s: float = 0.5) -> dict | None:
    """After the workers were asked to save and end (`signals.StopRequest`): wait, while this attempt's record
    (opened at or after epoch second `since`) is `running`, for rank 0 to close it, at most `wait_s` (default
    `stop_save_wait_s()`). Returns the closed record, or None: none running (no step trained yet: nothing to save),
    or the wait was over first (the driver closes it). A second signal interrupts it (KeyboardInterrupt)."""
    wait_s = stop_save_wait_s() if wait_s is None else wait_s
    deadline = time.monotonic() + wait_s
    announced = False
    while True:
        try:
            record = run_record.load_latest(run_dir)
        except (OSError, ValueError):  # none yet
            return None
        if not run_record.opened_since(record, since):
            return None
        if record.get("status") != "running":
            return record
        if not announced:
            print(f"asking the workers to save at their next log step (waiting up to {wait_s:.0f} s; a second "
                  "signal stops them at once)", flush=True)
            announced = True
        if time.monotonic() >= deadline:
            print(f"no save within {wait_s:.0f} s: the steps since the last checkpoint are not kept", flush=True)
            return None
        time.sleep(every_s)


class Heartbeat:
    """A daemon thread rewriting `heartbeat.json` every `every_s` until `stop`, renewing lease id `lease`."""

    def __init__(self, run_dir: str, every_s: float = lease_lib.HEARTBEAT_EVERY_S, timeout_s: float = lease_lib.HEARTBEAT_TIMEOUT_S,
                 lease: str | None = None):
        self.run_dir, self.every_s, self.timeout_s, self.lease = run_dir, every_s, timeout_s, lease
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="job-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        lease_lib.write_heartbeat(self.run_dir, self.timeout_s, lease=self.lease)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                lease_lib.write_heartbeat(self.run_dir, self.timeout_s, lease=self.lease)
            except Exception as e:  # a storage hiccup must not end the run; several missed beats mean stale
                print(f"heartbeat: cannot write {lease_lib.HEARTBEAT_FILE}: {type(e).__name__}: {e}", flush=True)

    def stop(self) -> None:
        """End the beats with a final one, which stays, saying when the watch ended."""
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            lease_lib.write_heartbeat(self.run_dir, self.timeout_s, final=True, lease=self.lease)
        except Exception as e:  # as in `_beat`: the record, not the heartbeat, says how the run ended
            print(f"heartbeat: cannot write the final {lease_lib.HEARTBEAT_FILE}: {type(e).__name__}: {e}", flush=True)
