"""One worker's training, as `build.build` makes it (`Trainer`: everything built once, each part a named, typed
attribute) and the loop (`train.train`) and `finish.finish` use it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from . import data as data_lib
from .checkpoint.writer import Checkpointer
from .evaluation.heldout import HeldoutEvaluation
from .evaluation.task import TaskEvaluation
from .faults import FaultInjection
from .model.causal_lm import CausalLMWithLoss
from .model.parallelize import gathered_copy
from .objective import Objective
from .parts import Checkpointing, LogStep, Part, Worker
from .watchdog import Watchdog

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class Trainer:
    """Everything `build` makes for one worker: what trains (model, optimizer, objective, batches), where the run
    resumes, and the loop's parts. What changes from step to step is the loop's `parts.LoopState`."""

    worker: Worker
    tokenizer: PreTrainedTokenizerBase | None
    dataset: data_lib.Dataset
    model: CausalLMWithLoss
    optimizer: torch.optim.Optimizer
    objective: Objective
    batches: Iterator[dict]
    start_step: int
    """The step the attempt resumes after (0: from the start)."""
    resumed_from: str | None
    """The checkpoint it resumes from."""
    checkpointer: Checkpointer
    faults: FaultInjection
    watchdog: Watchdog
    log_step: LogStep
    checkpointing: Checkpointing
    heldout: HeldoutEvaluation
    task: TaskEvaluation
    weights: Callable[[], dict]
    """The weights' fingerprint for the run record (hashed in a background thread on rank 0: gigabytes take
    seconds)."""
    compile_cache: str | None = None
    """Where to keep the compiled code on the storage after the first step (None without `parallel.compile`, or
    when this attempt loaded it from there)."""

    @property
    def parts(self) -> list[Part]:
        """The loop's parts, in the order it asks them after each step (`parts` module docstring)."""
        return [self.log_step, self.checkpointing, self.heldout, self.task]

    def unsharded_copy(self) -> PreTrainedModel:
        """The model gathered into a plain copy on this rank, in the dtype training computes in (collective)."""
        worker = self.worker
        return gathered_copy(self.model, torch.bfloat16 if worker.bf16 else torch.float32, worker.device)
