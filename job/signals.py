"""How a process of the run is asked to stop. A signal to the driver stops the run (`Cancelled`): the driver first
asks the ranks, through a `StopRequest`, to save at their next log step, and they end with `Stopped`, which a rerun
resumes from. A SIGTERM to a worker (Kubernetes' before an eviction) or Ray Train's drain signal asks for a save too,
after which the ranks end the attempt with `Preempted`, which the retry resumes from. Once the worker's loop has
returned, a SIGTERM is the worker's ordinary end and goes to the handler it replaced."""

from __future__ import annotations

import asyncio
import os
import signal
import threading


class Cancelled(KeyboardInterrupt):
    """A signal (SIGINT, SIGTERM) asked the driver to stop the run: classified `cancelled`/`signal`."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name} to the driver (pid {os.getpid()}): the run was stopped")


class SavedThenStopped(RuntimeError):
    """The ranks agreed to stop at step `step` and saved it first, as checkpoint `checkpoint`. Its `args` are its
    constructor's (`__str__` words them), so that Ray, which pickles a worker's exception for the driver, rebuilds it
    whole rather than failing on the message alone."""

    def __init__(self, step: int, checkpoint: str, cause: int):
        super().__init__(step, checkpoint, cause)
        self.step, self.checkpoint = step, checkpoint


class Preempted(SavedThenStopped):
    """The ranks agreed to stop for a preemption (signalled on `ranks` of them) and saved checkpoint `step` first:
    `infrastructure`/`preempted`; the retry resumes from it."""

    def __init__(self, step: int, checkpoint: str, ranks: int):
        super().__init__(step, checkpoint, ranks)

    def __str__(self) -> str:
        return (f"preempted at step {self.step} (signalled on {self.args[2]} rank(s)): checkpoint {self.checkpoint} "
                "saved; the retry resumes from it")


class Stopped(SavedThenStopped):
    """The driver got signal `signum` and asked the ranks to stop: they saved checkpoint `step` first and ended the
    run (`cancelled`/`signal`), which a rerun resumes from."""

    def __init__(self, step: int, checkpoint: str, signum: int):
        super().__init__(step, checkpoint, signum)

    def __str__(self) -> str:
        return (f"{signal.Signals(self.args[2]).name} to the driver: the ranks saved step {self.step} "
                f"({self.checkpoint}) and stopped; rerunning the same command resumes from it")


class StopRequest:
    """A stopped driver's request to its ranks, as a Ray actor (the driver's `ray.remote`; torch-free, so the actor
    starts light): `request(signum)` once; each worker's thread waits on `requested` (no polling: the call returns
    when the request comes), and a worker group started after it finds it in `pending`."""

    def __init__(self):
        self._signum: int | None = None
        self._event = asyncio.Event()

    async def request(self, signum: int) -> None:
        self._signum = signum
        self._event.set()

    async def requested(self) -> int:
        await self._event.wait()
        return self._signum

    async def pending(self) -> int | None:
        return self._signum


def exit_status(exc: BaseException) -> int:
    """The driver's exit status for a run ended by `exc`: 128 + the signal's number for a `Cancelled` (130 for
    SIGINT, 143 for SIGTERM, as a shell reports a process the signal ended), else 1."""
    return 128 + exc.signum if isinstance(exc, Cancelled) else 1


_preemption_signals: list[int] = []  # the SIGTERMs this worker process received (catch_preemption's handler)
_sigterm_ends: list[bool] = []  # set by stop_catching_preemption: from then on a SIGTERM is not a preemption


def catch_preemption() -> bool:
    """In a worker's main thread: a SIGTERM is noted, not obeyed, so the loop can finish the step and save
    (`preemption_signalled`); the handler it replaces (Ray's exits at once) comes back for a second SIGTERM. False
    where signals cannot be handled (not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    before = signal.getsignal(signal.SIGTERM)
    _sigterm_ends.clear()  # a loop starting in this process again (torchrun, tests): caught once more

    def note(signum, frame):
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)
        if _sigterm_ends:  # the worker being ended: nothing to save, no claim that it will
            signal.raise_signal(signum)
            return
        _preemption_signals.append(signum)
        print(f"SIGTERM to worker pid {os.getpid()}: saving a checkpoint at the ranks' next log step", flush=True)

    signal.signal(signal.SIGTERM, note)
    return True


def stop_catching_preemption() -> None:
    """From now on (any thread) a SIGTERM goes to the handler `catch_preemption` replaced (Ray's, which ends the
    worker) and claims no save: the worker's loop has returned, or the stopped driver asked the ranks to save and
    will end them itself (`StopRequest`)."""
    _sigterm_ends.append(True)


def preemption_signalled() -> bool:
    """Whether this process received a SIGTERM since `catch_preemption` (a flag read: costs nothing per step)."""
    return bool(_preemption_signals)
