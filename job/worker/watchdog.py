"""Two watches over the training loop, costing nothing per step beyond a clock read:

* `Watchdog` -- a daemon thread per worker: when no step finished within `train.hang_timeout_s` (longer in the
  phases between steps), it writes this rank's thread stacks to `<run_dir>/hang/attempt-<n>-rank<r>.txt`, rank 0
  closes the record `infrastructure`/`hang` (naming the rank that hung where the stacks tell), and the process
  ends, so Ray Train sees a lost worker and retries from the last checkpoint. A thread, because the loop's thread
  is then blocked in a collective or device work, with the GIL released.
* `LossSpikes` -- at each log interval: a loss above `train.loss_spike_factor` x the recent median for
  `train.loss_spike_intervals` intervals in a row raises `LossSpikeError`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from typing import Callable

from .. import storage

HANG_FLOOR_S = 600.0
"""The automatic timeout's floor: at least this long without a step."""
HANG_STEP_FACTOR = 10
"""The automatic timeout: this many times the slowest step after the first, when that is above the floor."""
HANG_PHASE_FACTOR = 6
"""The allowance for the first step and each phase between steps, in timeouts."""
HANG_PEERS_WAIT_S = 3.0
"""How long rank 0 waits for the other ranks' stack files to name the rank that hung (well within HANG_GRACE_S)."""
HANG_GRACE_S = 10.0
"""How long a rank without the record (not rank 0) waits after its dump before it ends, so that rank 0 closes the
record first: the first lost worker ends the whole group, and the driver would close it as `worker_lost`."""
SPIKE_WINDOW = 20
"""Logged losses whose median a spike is measured against (spiking intervals are left out of it)."""
SPIKE_MIN_HISTORY = 5
"""Logged losses needed before a spike is judged."""


class HangError(RuntimeError):
    """No training step finished within the hang timeout: `infrastructure`/`hang`; `rank` is the rank that hung
    when the stacks tell (`hung_ranks`), else None."""

    rank: int | None = None


class LossSpikeError(RuntimeError):
    """The loss stayed above its spike factor x its running median: `model`/`loss_spike`."""


class Watchdog:
    """`step_done` after each step and `phase` around each phase between steps (`metrics.Timeline`'s hook) mark
    progress; the thread fires when the last mark is older than its allowance (`timeout_s`: fixed; None:
    automatic; 0: no thread). `on_hang(HangError)` runs before the process ends."""

    def __init__(self, timeout_s: float | None, run_dir: str, rank: int, attempt: int, step: int,
                 on_hang: Callable[[HangError], None] | None = None, world: int = 1, blocking: bool = False):
        self.fixed, self.run_dir, self.rank, self.attempt, self.on_hang = timeout_s, run_dir, rank, attempt, on_hang
        self.world, self.blocking = world, blocking  # blocking: collectives block the calling thread (gloo)
        self.loop_thread = threading.get_ident()  # the training loop's (Ray Train runs it beside the main thread)
        self.slowest = 0.0
        self.steps = 0
        self.step = step
        self.where = "the first step"
        self._mark = (time.monotonic(), HANG_PHASE_FACTOR)  # one tuple: the thread reads both at once
        self._stop = threading.Event()
        if timeout_s != 0:
            threading.Thread(target=self._watch, name="job-hang-watchdog", daemon=True).start()

    def timeout(self) -> float:
        return self.fixed if self.fixed is not None else max(HANG_FLOOR_S, HANG_STEP_FACTOR * self.slowest)

    def step_done(self, step: int) -> None:
        now = time.monotonic()
        if self.steps:  # the first step (compilation, warm-up) is no measure of the others
            self.slowest = max(self.slowest, now - self._mark[0])
        self.steps, self.step, self.where = self.steps + 1, step, "a training step"
        self._mark = (now, 1)

    def phase(self, name: str, entering: bool) -> None:
        self.where = f"the {name} phase" if entering else ("the first step" if not self.steps else "a training step")
        self._mark = (time.monotonic(), HANG_PHASE_FACTOR if entering or not self.steps else 1)

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(5.0, max(0.1, self.timeout() / 20))):
            since, factor = self._mark
            waited, allowed = time.monotonic() - since, factor * self.timeout()
            if waited > allowed and not self._stop.is_set():
                self._fire(waited, allowed)

    def _fire(self, waited: float, allowed: float) -> None:
        stacks = storage.join(self.run_dir, "hang", f"attempt-{self.attempt}-rank{{r}}.txt")
        error = HangError(
            f"rank {self.rank}: no progress for {waited:.0f} s (allowed {allowed:.0f} s, train.hang_timeout_s) in "
            f"{self.where} after step {self.step}; every rank's Python stacks: {stacks.format(r='*')}")
        print(f"hang watchdog: {error}", flush=True)
        try:
            storage.write_atomic(stacks.format(r=self.rank), f"{error}\n{json.dumps(self._where())}\n\n{all_stacks()}")
            if self.on_hang:
                self._name_hung(error, stacks)
                self.on_hang(error)
            else:
                time.sleep(HANG_GRACE_S)
        finally:
            os._exit(70)  # EX_SOFTWARE; the main thread cannot be interrupted inside a collective

    def _where(self) -> dict:
        """This rank's progress, its stack file's second line: its last finished step, and whether the loop waits
        inside a collective or elsewhere (its innermost frame)."""
        frame = sys._current_frames().get(self.loop_thread)
        stack = traceback.extract_stack(frame) if frame is not None else []
        inside = any(f"{os.sep}torch{os.sep}distributed{os.sep}" in f.filename for f in stack)
        at = f"{os.path.basename(stack[-1].filename)}:{stack[-1].lineno} in {stack[-1].name}" if stack else None
        return {"rank": self.rank, "step": self.step, "in_collective": inside, "at": at}

    def _name_hung(self, error: HangError, stacks: str) -> None:
        """Rank 0, before closing the record: wait briefly for the other ranks' stack files, then name the rank
        that hung in `error`."""
        if self.world == 1:
            error.rank = self.rank
            return
        if not self.blocking:  # NCCL's collectives and kernels run apart from the Python thread: no verdict
            error.args = (f"{error}; which rank hung: not told by the stacks under NCCL (each rank's shows where "
                          "its training loop waits)",)
            return
        deadline, states = time.monotonic() + HANG_PEERS_WAIT_S, {}
        while True:
            for r in set(range(self.world)) - set(states):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    states[r] = json.loads(storage.read_text(stacks.format(r=r)).split("\n", 2)[1])
            if len(states) == self.world or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        hung = hung_ranks(list(states.values()))
        error.rank = hung[0] if len(hung) == 1 else None
        if hung:
            first = states[hung[0]]
            verdict = (f"hung: rank {', '.join(map(str, hung))}; rank {hung[0]} after step {first['step']}, "
                       f"{'in a collective' if first['in_collective'] else 'outside any collective'} at {first['at']}")
        else:
            verdict = "which rank hung: not told by the stacks (every rank waits in a collective after the same step)"
        if missing := sorted(set(range(self.world)) - set(states)):
            verdict += f"; no stacks from rank {', '.join(map(str, missing))} within {HANG_PEERS_WAIT_S:g} s"
        error.args = (f"{error}; {verdict}",)


def hung_ranks(states: list[dict]) -> list[int]:
    """Under blocking collectives (gloo), the ranks that hung, from each rank's `Watchdog._where`: those outside any
    collective (the others wait inside one for them) and those behind the others' last finished step."""
    latest = max((s["step"] for s in states), default=0)
    return sorted(s["rank"] for s in states if not s["in_collective"] or s["step"] < latest)


def all_stacks() -> str:
    """Every thread's Python stack, named, with its source lines (what faulthandler prints, and more)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = [f"pid {os.getpid()} on {socket.gethostname()}, {time.strftime('%Y-%m-%dT%H:%M:%S%z')}"]
    for ident, frame in sys._current_frames().items():
        parts.append(f"Thread {names.get(ident, '?')} ({ident}), most recent call last:\n"
                     + "".join(traceback.format_stack(frame)))
    return "\n".join(parts) + "\n"


class LossSpikes:
    """The loss-spike check of the log intervals (`factor` 0: off)."""

    def __init__(self, factor: float, intervals: int):
        self.factor, self.intervals = factor, intervals
        self.history: list[float] = []
        self.run = 0

    def check(self, step: int, loss: float) -> None:
        median = statistics.median(self.history) if len(self.history) >= SPIKE_MIN_HISTORY else None
        if self.factor and median is not None and loss > self.factor * median:
            self.run += 1
            if self.run >= self.intervals:
                raise LossSpikeError(
                    f"step {step}: loss {loss:.4g} above train.loss_spike_factor {self.factor:g} x the median "
                    f"{median:.4g} of the last {len(self.history)} logged losses for {self.run} log intervals in a "
                    "row: training diverged; lower train.lr or raise train.warmup_steps, then resume from a "
                    "checkpoint before the spike")
            return
        self.run = 0
        self.history = [*self.history[1 - SPIKE_WINDOW:], loss]
