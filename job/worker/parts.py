"""What the loop knows of its parts, and the two that keep its own books (`LogStep`, `Checkpointing`).

After each optimizer step the loop (`train.train`) asks each part, in `Trainer.parts`'s order, whether work is due
(`Part.due`) and does it (`Part.run`); a part may `start` before the first step and `finish` after the last. It
reads and changes `LoopState`; what it needs besides is given when `build.build` makes it. The parts and when each
is due: docs/architecture.md, which also has a worked example of a new one; the loop's body does not change.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch
import torch.distributed as dist

from .. import config as config_lib
from ..signals import Preempted, Stopped
from .checkpoint.writer import Checkpointer
from .metrics import MetricsLogger, Timeline
from .watchdog import LossSpikes

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class Worker:
    """This training process: its config and run directory, its device and rank, its precision and clock, and
    (rank 0) the metrics log every part writes to."""

    cfg: config_lib.RunConfig
    run_dir: str
    device: torch.device
    rank: int
    world: int
    bf16: bool
    timeline: Timeline
    logger: MetricsLogger | None
    """Rank 0's metrics log (None on the other ranks)."""

    def log(self, record: dict) -> None:
        if self.logger:
            self.logger.log(record)


@dataclass
class StepResult:
    """What one optimizer step gives, on the device (no host sync)."""

    loss_sum: torch.Tensor
    units: torch.Tensor
    """What the loss is a sum over on this rank: target tokens (or, for a preference objective, pairs)."""
    grad_norm: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """The objective's own sums over the same units (`objective.Objective.loss`)."""


@dataclass
class Interval:
    """What the loop sums between two log steps, on the device (read at the log step: the loop's only host sync),
    and the tokens trained and since when."""

    loss_sum: torch.Tensor
    units: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: int = 0
    start: float = field(default_factory=time.perf_counter)

    @classmethod
    def on(cls, device: torch.device) -> Interval:
        return cls(torch.zeros((), device=device), torch.zeros((), device=device))

    def add(self, result: StepResult, loss_factor: float, tokens: int) -> None:
        """`loss_factor` scales the logged loss only (`debug.fail_mode` loss_spike, nan)."""
        self.loss_sum += result.loss_sum if loss_factor == 1 else result.loss_sum * loss_factor
        self.units += result.units
        for name, value in result.metrics.items():
            self.metrics[name] = self.metrics[name] + value if name in self.metrics else value.clone()
        self.tokens += tokens

    def restart(self) -> None:
        self.loss_sum.zero_(), self.units.zero_()
        for value in self.metrics.values():
            value.zero_()
        self.tokens, self.start = 0, time.perf_counter()


class LogTotals(NamedTuple):
    """What a log step's one all-reduce gives every rank."""

    mean_loss: float
    """The interval's loss per unit, over all ranks."""
    metrics: dict[str, float]
    """The objective's metrics per unit, over all ranks."""
    writes_done: int
    """How many ranks have no checkpoint write in flight."""
    preempted: int
    """How many ranks were asked to stop for a preemption: the ranks agree to stop at this step."""
    stopping: int
    """How many ranks the stopped driver asked to save and end (`Launcher.stop_requested`): the ranks agree to stop
    at this step, ending the run."""
    stop_signal: int
    """The signal that stopped the driver (every rank asked was given the same), when `stopping`."""


@dataclass
class LoopState:
    """What the loop carries from step to step; its parts read and change it."""

    step: int
    """The step just trained (the resume point before the first)."""
    interval: Interval
    lr: float = 0.0
    """The last step's learning rate."""
    grad_norm: torch.Tensor | None = None
    """The last step's gradient norm (on the device)."""
    synced: LogTotals | None = None
    """This step's log-step totals, when it had a log step (`LogStep`); None on the other steps."""
    latest_checkpoint: str | None = None
    final_eval: float | None = None
    """The held-out loss at the last step, once measured (the export's acceptance check is held against it)."""
    task_results: list[dict] = field(default_factory=list)

    def begin_step(self, step: int) -> None:
        self.step, self.synced = step, None


class Part:
    """One periodic part of the loop (see the module docstring). Every method but `due` and `run` may be left as is."""

    def start(self, state: LoopState) -> None:
        """Before the first step of the attempt."""

    def due(self, state: LoopState) -> bool:
        raise NotImplementedError

    def run(self, state: LoopState) -> None:
        raise NotImplementedError

    def finish(self, state: LoopState, copy: Callable[[], PreTrainedModel]) -> None:
        """After the last step; `copy()` gives the model's one unsharded copy, gathered on first use (collective)."""


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm is NaN or infinite: the run stops before anything is saved."""


def check_finite(step: int, loss: float, grad_norm: float) -> None:
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise NonFiniteError(f"step {step}: loss {loss}, gradient norm {grad_norm}: training diverged; nothing was "
                             "saved from this point; lower train.lr or raise train.warmup_steps, then resume from the "
                             "last checkpoint")


class LogStep(Part):
    """The log step: the interval's metrics logged and checked (finite, no spike) and the ranks' flags told to every
    rank (`LoopState.synced`), in one all-reduce."""

    def __init__(self, worker: Worker, checkpointer: Checkpointer, preempted: Callable[[], bool],
                 stop_requested: Callable[[], int | None], flops_per_token: float, peak_flops: float | None):
        self.worker, self.checkpointer = worker, checkpointer
        self.preempted, self.stop_requested = preempted, stop_requested
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        train = worker.cfg.train
        self.spikes = LossSpikes(train.loss_spike_factor, train.loss_spike_intervals)

    def due(self, state: LoopState) -> bool:
        return state.step % self.worker.cfg.logging.every_steps == 0 or state.step == self.worker.cfg.train.max_steps

    def run(self, state: LoopState) -> None:
        worker, interval, step = self.worker, state.interval, state.step
        state.synced = totals = self.all_reduce(interval)
        check_finite(step, totals.mean_loss, state.grad_norm.item())
        tokens_per_s_device = interval.tokens / (time.perf_counter() - interval.start)
        device = worker.device
        worker.log({
            "kind": "train",
            "step": step,
            "loss": totals.mean_loss,
            **totals.metrics,
            "lr": state.lr,
            "grad_norm": state.grad_norm.item(),
            "tokens_per_s": tokens_per_s_device * worker.world,
            "tokens_per_s_per_device": tokens_per_s_device,
            "mfu": tokens_per_s_device * self.flops_per_token / self.peak_flops if self.peak_flops else None,
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            **worker.timeline.so_far(),  # goodput and phases so far: the driver's metrics (driver.follow)
        })
        self.spikes.check(step, totals.mean_loss)  # after the log: the record's step is the spike's
        interval.restart()

    def all_reduce(self, interval: Interval) -> LogTotals:
        """The log step's all-reduce: the interval's sums, with each rank's flags beside them."""
        names = list(interval.metrics)
        stop_signal = self.stop_requested() or 0
        flags = torch.tensor([float(self.checkpointer.write_done()), float(self.preempted()), float(stop_signal > 0),
                              float(stop_signal)], device=self.worker.device)
        totals = torch.cat([torch.stack([interval.loss_sum, interval.units, *(interval.metrics[n] for n in names)]),
                            flags])
        dist.all_reduce(totals)
        sums, units = torch.cat([totals[:1], totals[2:len(names) + 2]]), totals[1]
        # One read of the device, which syncs with it, so the interval's time is real.
        mean_loss, *means, writes_done, preempted, stopping, signals_sum = \
            torch.cat([sums / units, totals[-len(flags):]]).tolist()
        return LogTotals(mean_loss, dict(zip(names, means)), int(writes_done), int(preempted), int(stopping),
                         int(signals_sum) // max(int(stopping), 1))


class Checkpointing(Part):
    """Saves beside the steps (`Checkpointer`). A save comes before the evaluations of its step, so its write
    overlaps them; before the last step, a preemption ends the attempt after its save (`Preempted`), within the
    grace period, and a stopped driver's request ends the run after its save (`Stopped`)."""

    def __init__(self, worker: Worker, checkpointer: Checkpointer, model, optimizer: torch.optim.Optimizer,
                 start_step: int):
        self.worker, self.checkpointer, self.model, self.optimizer = worker, checkpointer, model, optimizer
        self.staging_step = start_step + 2
        """The attempt's first step that holds the optimizer's state throughout: training's peak is known."""

    def start(self, state: LoopState) -> None:
        with self.worker.timeline.phase("checkpoint"):
            self.worker.log({"kind": "checkpoint_writer", "step": state.step, **self.checkpointer.prepare(self.model)})

    def due(self, state: LoopState) -> bool:
        return (state.step == self.staging_step or self.writes_done(state) or self.checkpointer.due(state.step)
                or self.stopping(state))

    def run(self, state: LoopState) -> None:
        if state.step == self.staging_step:
            self.checkpointer.prepare_staging(self.model, self.optimizer)
        if self.writes_done(state):
            self.complete(state)
        if self.checkpointer.due(state.step) or self.stopping(state):
            self.save(state)

    def writes_done(self, state: LoopState) -> bool:
        return state.synced is not None and state.synced.writes_done == self.worker.world

    @staticmethod
    def stopping(state: LoopState) -> bool:
        """Whether the ranks agreed at this step's log step to save and end (a preemption, a stopped driver)."""
        return state.synced is not None and (state.synced.preempted > 0 or state.synced.stopping > 0)

    def save(self, state: LoopState) -> None:
        worker, step = self.worker, state.step
        check_finite(step, *self.finite_probe(state))
        with worker.timeline.phase("checkpoint"):
            start = time.perf_counter()
            self.complete(state)
            self.checkpointer.save(step, self.model, self.optimizer, last=step == worker.cfg.train.max_steps)
            worker.timeline.checkpoint_blocking_s.append(time.perf_counter() - start)
            if self.stopping(state) and step < worker.cfg.train.max_steps:
                self.complete(state)
                synced = state.synced
                if synced.stopping:  # the run ends: the driver's request outranks a preemption's retry
                    raise Stopped(step, state.latest_checkpoint, synced.stop_signal)
                raise Preempted(step, state.latest_checkpoint, synced.preempted)

    def finite_probe(self, state: LoopState) -> tuple[float, float]:
        """The running loss sum and the last gradient norm as host numbers (a sync; only before a save)."""
        totals = torch.stack([state.interval.loss_sum.float(), state.grad_norm.float()])
        dist.all_reduce(totals)
        return totals[0].item(), totals[1].item()

    def complete(self, state: LoopState) -> None:
        """Completes the checkpoint in flight, if any (collective), and logs how long its write took."""
        done = self.checkpointer.finish()
        if done is not None:
            state.latest_checkpoint = done["uri"]
            self.worker.log({"kind": "checkpoint", "step": done["step"], "dir": done["uri"], "write_s": done["write_s"],
                             "checksum_s": done["checksum_s"],
                             "blocking_s": self.worker.timeline.checkpoint_blocking_s[-1], "staging": done["staging"]})


def in_background(fn: Callable, *args) -> Callable[[], object]:
    """Run `fn(*args)` in a daemon thread beside the loop; returns a function that waits for its result (or raises
    its error)."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn(*args)
        except Exception as e:  # re-raised in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()

    def wait():
        thread.join()
        if "error" in result:
            raise result["error"]
        return result["value"]

    return wait
