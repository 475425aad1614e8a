"""Held-out loss and perplexity (`evaluate`), and the loop's part that measures it (`HeldoutEvaluation`).

The held-out loss runs on every rank with FSDP2-sharded parameters, so every rank makes the same calls in the
same order: each gets the same number of micro-batches, ranks with fewer blocks filling in with weight-0
repeats, so the result is exact and no rank waits on a collective that another never starts.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from ...config import RunConfig
from .. import data as data_lib
from ..model.causal_lm import CausalLMWithLoss
from ..parts import LoopState, Part, Worker

def _rank_slots(n: int, rank: int, world: int) -> tuple[list[int], list[bool]]:
    """Rank `rank`'s item indices (rank, rank + world, …), padded to ceil(n / world) with weight-0 repeats."""
    per_rank = -(-n // world)
    index = [rank + k * world for k in range(per_rank)]
    return [i if i < n else 0 for i in index], [i < n for i in index]


def eval_batches(n_blocks: int, rank: int, world: int, micro_batch_size: int, max_batches: int):
    """Rank `rank`'s held-out micro-batches as (block indices, real?) pairs: the same number of full micro-batches
    on every rank (filled with weight-0 repeats, so every forward has training's shape), at most `max_batches` (>0)."""
    index, real = _rank_slots(n_blocks, rank, world)
    n_batches = math.ceil(len(index) / micro_batch_size)
    if max_batches:
        n_batches = min(n_batches, max_batches)
    fill = n_batches * micro_batch_size - len(index)
    index, real = index + [0] * max(fill, 0), real + [False] * max(fill, 0)
    starts = range(0, n_batches * micro_batch_size, micro_batch_size)
    return [(index[s : s + micro_batch_size], real[s : s + micro_batch_size]) for s in starts]


def heldout_batches(n_blocks: int, world: int, micro_batch_size: int, max_batches: int) -> list[list[int]]:
    """Every held-out block `evaluate` reads on `world` ranks, repeats left out, as micro-batches: the export's
    check measures exactly the final in-training evaluation's blocks."""
    batches = []
    for rank in range(world):
        for index, real in eval_batches(n_blocks, rank, world, micro_batch_size, max_batches):
            chunk = [j for j, ok in zip(index, real) if ok]
            if chunk:
                batches.append(chunk)
    return batches


def synthetic_heldout(vocab: int, n: int, seq_len: int, seed: int) -> data_lib.Blocks:
    """`n` seeded random blocks, disjoint in seed from the training stream, for runs without a held-out split."""
    g = torch.Generator().manual_seed(seed * 7919 + 104729)
    tokens = torch.randint(0, vocab, (n, seq_len + 1), generator=g)
    return data_lib.Blocks(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(),
                           torch.arange(seq_len).expand(n, seq_len).contiguous())


def evaluate(model: CausalLMWithLoss, blocks: data_lib.Blocks, cfg: RunConfig, rank: int, world: int,
             device: torch.device) -> float:
    """Mean held-out loss per target token over all ranks (collective; micro-batches as `eval_batches`).

    With `parallel.compile` the forward runs as training's does (train mode, autograd on, results detached at
    once), so it reuses the training step's graph rather than compiling one of its own (~20 s for Qwen2.5-1.5B).
    That needs a model without dropout; one with dropout is evaluated in eval mode, under `no_grad`.
    """
    totals = torch.zeros(2, device=device)
    with evaluating(model, cfg):
        for index, real in eval_batches(len(blocks), rank, world, cfg.train.micro_batch_size, cfg.eval.max_batches):
            b = blocks.select(torch.tensor(index))
            labels = b.labels.clone()
            labels[~torch.tensor(real)] = data_lib.IGNORE_INDEX  # weight-0 repeats
            # Detached at once and never named: a batch's autograd graph (its activations) is gone before the next.
            totals += torch.stack([t.detach().float() for t in model(input_ids=b.input_ids.to(device),
                                                                     labels=labels.to(device),
                                                                     position_ids=b.position_ids.to(device))])
    dist.all_reduce(totals)
    return (totals[0] / totals[1].clamp(min=1)).item()


@contextmanager
def evaluating(model: CausalLMWithLoss, cfg: RunConfig) -> Iterator[None]:
    """Forwards that only measure: in train mode with autograd on under `parallel.compile` (their results detached
    at once), see `evaluate`; else in eval mode under `no_grad`."""
    as_training = cfg.parallel.compile and not has_dropout(model)
    if not as_training:
        model.eval()
    try:
        with torch.set_grad_enabled(as_training):
            yield
    finally:
        model.train()


def has_dropout(model: CausalLMWithLoss) -> bool:
    """Whether the model drops anything out in train mode (a dropout module, or a dropout rate in its config)."""
    rates = [v for k, v in vars(model.lm.config).items() if k.endswith("dropout") and isinstance(v, (int, float))]
    rates += [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    return any(rate > 0 for rate in rates)


class HeldoutEvaluation(Part):
    """Held-out loss and perplexity every `eval.every_steps`, at a fresh run's step 0 and at the last step (the
    export's check is held against it: `LoopState.final_eval`); nothing without a held-out split."""

    def __init__(self, worker: Worker, model: CausalLMWithLoss, blocks: data_lib.Blocks | None, start_step: int):
        self.worker, self.model, self.blocks, self.start_step = worker, model, blocks, start_step

    def start(self, state: LoopState) -> None:
        if self.start_step == 0 and self.worker.cfg.eval.every_steps:
            self.measure(0)

    def due(self, state: LoopState) -> bool:
        every = self.worker.cfg.eval.every_steps
        return bool(every and state.step % every == 0) or state.step == self.worker.cfg.train.max_steps

    def run(self, state: LoopState) -> None:
        loss = self.measure(state.step)
        state.final_eval = loss if state.step == self.worker.cfg.train.max_steps else None

    def measure(self, step: int) -> float | None:
        """Held-out loss and perplexity at `step`, logged (None without a held-out split)."""
        worker = self.worker
        if self.blocks is None:
            return None
        with worker.timeline.phase("eval"):
            loss = evaluate(self.model, self.blocks, worker.cfg, worker.rank, worker.world, worker.device)
        worker.log({"kind": "eval", "step": step, "eval_loss": loss, "eval_ppl": math.exp(min(loss, 50))})
        return loss
