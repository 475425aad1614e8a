"""The driver's watch over its run: the lease held from the storage check to the last line (`hold`), renewed by the
heartbeat (`Heartbeat`), and SIGINT/SIGTERM turned into `Cancelled` while it waits on the workers (`driver_watch`).
Both close a record left running, so they sit above `records.run_record`, not in the modules they use."""

from __future__ import annotations

import contextlib
import signal
import threading

from ..records import lease as lease_lib
from ..records import run_record
from ..signals import Cancelled

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []  # the stop signals this process received (driver_watch's handler)


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
    `cancelled` for a KeyboardInterrupt (propagated as `Cancelled`), else `failed`. A second signal ends the driver
    at once."""

    def stop(signum, frame):
        _received.append(signum)
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
