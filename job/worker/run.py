"""One worker's run, as `build` makes it and the loop (`train.train`), the task evaluations and `finish` use it
(`Run`), with the few things all of them do with it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from .. import config as config_lib
from . import data as data_lib
from .checkpoint_writer import Checkpointer
from .evaluate import TaskShare
from .faults import FaultInjection
from .metrics import MetricsLogger, Timeline
from .model import CausalLMWithLoss, gathered_copy
from .watchdog import Watchdog

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class Run:
    """Everything `build` makes and the loop (`train.train`) and `finish` use, for one worker."""

    cfg: config_lib.RunConfig
    run_dir: str
    device: torch.device
    rank: int
    world: int
    bf16: bool
    tokenizer: PreTrainedTokenizerBase | None
    dataset: data_lib.Dataset
    model: CausalLMWithLoss
    optimizer: torch.optim.Optimizer
    batches: Iterator[dict]
    start_step: int
    flops_per_token: float
    peak_flops: float | None
    checkpointer: Checkpointer
    faults: FaultInjection
    timeline: Timeline
    logger: MetricsLogger | None
    """Rank 0's metrics log (None on the other ranks)."""
    task_items: list[dict] = field(default_factory=list)
    compile_cache: str | None = None
    """Where to keep the compiled code on the storage after the first step (None without `parallel.compile`, or
    when this attempt loaded it from there)."""
    latest_checkpoint: str | None = None
    preempted: Callable[[], bool] = lambda: False
    """Whether this worker was asked to stop for a preemption (`contract.Launcher.preempted`)."""
    baseline: PendingTaskEval | None = None
    """The task baseline's decoding, begun in `build` beside the data's tokenizing (`task_eval.start_baseline`); None when
    it was not (no room on the device beside it, or none due): then it is decoded at step 0."""
    final_eval: float | None = None
    task_results: list[dict] = field(default_factory=list)
    watchdog: Watchdog | None = None
    """The hang watchdog, from the training loop's start (`train.start_watchdog`)."""

    def log(self, record: dict) -> None:
        if self.logger:
            self.logger.log(record)


@dataclass
class PendingTaskEval:
    """A task decoding begun: in a thread (`background`; `wait` joins it) or already done."""

    wait: Callable[[], TaskShare]
    background: bool


def in_background(fn: Callable, *args) -> Callable[[], object]:
    """Runs `fn(*args)` in a daemon thread; returns a function that waits for its result (or raises its error)."""
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


def unsharded_copy(run: Run) -> PreTrainedModel:
    """The model gathered into a plain copy on this rank, in the dtype training computes in (collective)."""
    return gathered_copy(run.model, torch.bfloat16 if run.bf16 else torch.float32, run.device)


def complete_checkpoint(run: Run) -> None:
    """Completes the checkpoint in flight, if any (collective), and logs how long its write took."""
    done = run.checkpointer.finish()
    if done is not None:
        run.latest_checkpoint = done["uri"]
        run.log({"kind": "checkpoint", "step": done["step"], "dir": done["uri"], "write_s": done["write_s"],
                 "checksum_s": done["checksum_s"], "blocking_s": run.timeline.checkpoint_blocking_s[-1],
                 "staging": done["staging"]})
