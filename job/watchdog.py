"""Two watches over the training loop, both costing nothing per step beyond a clock read:

* `Watchdog` -- a daemon thread per worker: when no training step finished within `train.hang_timeout_s` (a
  longer allowance inside the phases between steps, see that field), it writes every thread's Python stack of
  this rank to `<run_dir>/hang/attempt-<n>-rank<r>.txt`, rank 0 closes the run record `failed` as
  `infrastructure`/`hang` (`HangError`), and the process ends (`os._exit`), so Ray Train sees a lost worker and
  retries from the last checkpoint (`scaling.max_failures`). A thread, because the main thread is then blocked in
  a collective or in device work, with the GIL released.
* `LossSpikes` -- at each log interval (where the loop reads the loss anyway): a loss above
  `train.loss_spike_factor` x the median of the recent logged losses for `train.loss_spike_intervals` intervals
  in a row raises `LossSpikeError` (`model`/`loss_spike`).
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import threading
import time
import traceback
from typing import Callable

from . import storage

HANG_FLOOR_S = 600.0
"""The automatic timeout's floor: at least this long without a step."""
HANG_STEP_FACTOR = 10
"""The automatic timeout: this many times the slowest step after the first, when that is above the floor."""
HANG_PHASE_FACTOR = 6
"""The allowance for the first step and each phase between steps, in timeouts."""
HANG_GRACE_S = 10.0
"""How long a rank without the record (not rank 0) waits after its dump before it ends, so that rank 0 closes the
record first: the first lost worker ends the whole group, and the driver would close it as `worker_lost`."""
SPIKE_WINDOW = 20
"""Logged losses whose median a spike is measured against (spiking intervals are left out of it)."""
SPIKE_MIN_HISTORY = 5
"""Logged losses needed before a spike is judged."""


class HangError(RuntimeError):
    """No training step finished within the hang timeout: `infrastructure`/`hang`."""


class LossSpikeError(RuntimeError):
    """The loss stayed above its spike factor x its running median: `model`/`loss_spike`."""


class Watchdog:
    """`step_done` after each step and `phase` on entering and leaving each phase between steps (the
    `metrics.Timeline` hook) mark progress; the thread fires when the time since the last mark exceeds its allowance
    (`timeout_s`: fixed; None: automatic; 0: no thread). `on_hang(HangError)` runs before the process ends."""

    def __init__(self, timeout_s: float | None, run_dir: str, rank: int, attempt: int, step: int,
                 on_hang: Callable[[HangError], None] | None = None):
        self.fixed, self.run_dir, self.rank, self.attempt, self.on_hang = timeout_s, run_dir, rank, attempt, on_hang
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
            storage.write_atomic(stacks.format(r=self.rank), f"{error}\n\n{all_stacks()}")
            if self.on_hang:
                self.on_hang(error)
            else:
                time.sleep(HANG_GRACE_S)
        finally:
            os._exit(70)  # EX_SOFTWARE; the main thread cannot be interrupted inside a collective


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
