"""How a process of the run is asked to stop: a signal to the driver ends the run (`Cancelled`); a SIGTERM to a
worker (Kubernetes' before an eviction) or Ray Train's drain signal asks for a save first, after which the ranks end
the attempt with `Preempted`, which the retry resumes from. Once the worker's loop has returned, a SIGTERM is the
worker's ordinary end and goes to the handler it replaced."""

from __future__ import annotations

import os
import signal
import threading


class Cancelled(KeyboardInterrupt):
    """A signal (SIGINT, SIGTERM) asked the driver to stop the run: classified `cancelled`/`signal`."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name} to the driver (pid {os.getpid()}): the run was stopped")


class Preempted(RuntimeError):
    """The ranks agreed to stop for a preemption and saved checkpoint `step` first: `infrastructure`/`preempted`."""

    def __init__(self, step: int, checkpoint: str, ranks: int):
        self.step, self.checkpoint = step, checkpoint
        super().__init__(f"preempted at step {step} (signalled on {ranks} rank(s)): checkpoint {checkpoint} saved; "
                         "the retry resumes from it")


def exit_status(exc: BaseException) -> int:
    """The driver's exit status for a run ended by `exc`: 128 + the signal's number for a `Cancelled` (130 for
    SIGINT, 143 for SIGTERM, as a shell reports a process the signal ended), else 1."""
    return 128 + exc.signum if isinstance(exc, Cancelled) else 1


_preemption_signals: list[int] = []  # the SIGTERMs this worker process received (catch_preemption's handler)
_loop_returned: list[bool] = []  # set by stop_catching_preemption: from then on a SIGTERM is not a preemption


def catch_preemption() -> bool:
    """In a worker's main thread: a SIGTERM is noted, not obeyed, so the loop can finish the step and save
    (`preemption_signalled`); the handler it replaces (Ray's exits at once) comes back for a second SIGTERM. False
    where signals cannot be handled (not the main thread)."""
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
    """The worker's loop has returned (any thread): a SIGTERM now goes to the handler `catch_preemption` replaced
    (Ray's, which ends the worker)."""
    _loop_returned.append(True)


def preemption_signalled() -> bool:
    """Whether this process received a SIGTERM since `catch_preemption` (a flag read: costs nothing per step)."""
    return bool(_preemption_signals)
