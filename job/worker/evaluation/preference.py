"""DPO's reference log-probabilities (`compute_reference`) and its held-out evaluation (`PreferenceEvaluation`).

The reference policy is the model as the run starts, so a completion's reference log-probability never changes: it is
computed once, before the first step, for the pairs the steps will see and the held-out ones, and kept in
`<run>/reference/<data key>.pt` (a resume computes only what it lacks, from the initial weights `build` holds until it
restores the checkpoint). Why not a reference model beside the policy: docs/preference.md, "The reference policy".
"""

from __future__ import annotations

import io
import math
import time

import torch
import torch.distributed as dist

from ... import storage
from ...config import RunConfig
from ..data import Dataset, PairBlocks, blocks_trained, completions_of
from ..model.causal_lm import CausalLMWithLoss
from ..objective import completion_logps, preference_terms
from ..parts import LoopState
from .heldout import HeldoutEvaluation, eval_batches, evaluating, heldout_batches

REFERENCE_DIR = "reference"


def real_rows(blocks: PairBlocks, index: list[int], real: list[bool], device: torch.device) -> dict:
    """The micro-batch of rows `index` whose weight-0 repeats (`real` False) hold no completion, on `device`."""
    rows = blocks.select(torch.tensor(index))
    rows.sequence[~torch.tensor(real)] = -1
    return {k: v.to(device) for k, v in rows.batch().items()}


def measured_logps(model: CausalLMWithLoss, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """`completion_logps` of a forward that only measures, detached before anything names it: under
    `parallel.compile` such forwards run with autograd on (`evaluating`), and a named result would keep its batch's
    activations alive through the next batch's forward (twice the memory: a 1.5B full fine-tune at micro-batch 16
    ran out of an H100's 80 GB in its reference pass)."""
    logps, lengths = completion_logps(model, batch)
    return logps.detach(), lengths


def compute_reference(model: CausalLMWithLoss, dataset: Dataset, cfg: RunConfig, run_dir: str, key: str, rank: int,
                      world: int, device: torch.device) -> dict:
    """Sets `reference` on the dataset's pair blocks: what `<run>/reference/<key>.pt` holds, and the completions of
    the rows the run needs that it lacks, computed by the ranks in turns and saved (collective). Returns the
    `reference` record."""
    uri = storage.join(run_dir, REFERENCE_DIR, f"{key}.pt")
    box = [torch.load(io.BytesIO(storage.read_bytes(uri)), weights_only=True)
           if rank == 0 and storage.exists(uri) else {}]
    dist.broadcast_object_list(box, src=0)
    saved, start, computed = box[0], time.perf_counter(), 0
    train = cfg.train
    needed = {"train": blocks_trained(len(dataset.train), train.micro_batch_size, world, train.seed,
                                      train.max_steps * train.grad_accum_steps)}
    if dataset.validation is not None:
        needed["validation"] = torch.tensor(sorted({i for batch in heldout_batches(
            len(dataset.validation), world, train.micro_batch_size, cfg.eval.max_batches) for i in batch}))
    for name, rows in needed.items():
        blocks: PairBlocks = getattr(dataset, name)
        n_pairs = int(blocks.sequence.max()) // 2 + 1
        table = saved.get(name, torch.full((2 * n_pairs,), math.nan))
        sequence = blocks.sequence[rows]
        missing = rows[(table[sequence.clamp(min=0)].isnan() & (sequence >= 0)).any(dim=1)]
        if len(missing):
            found = torch.zeros(2, 2 * n_pairs, device=device)  # log-probabilities, and which are computed
            with evaluating(model, cfg):
                for index, real in eval_batches(len(missing), rank, world, train.micro_batch_size, 0):
                    batch = real_rows(blocks, missing[index].tolist(), real, device)
                    logps, _ = measured_logps(model, batch)
                    numbers = completions_of(batch["pairs"])
                    found[0].index_add_(0, numbers, logps)
                    found[1].index_add_(0, numbers, torch.ones_like(logps))
            dist.all_reduce(found)
            found = found.cpu()
            table = saved[name] = torch.where(found[1] > 0, found[0], table)
            computed += len(missing)
        blocks.reference = table
    if computed and rank == 0:
        blob = io.BytesIO()
        torch.save(saved, blob)
        storage.write_atomic(uri, blob.getvalue())
    return {"kind": "reference", "file": uri, "rows_computed": computed, "seconds": time.perf_counter() - start}


class PreferenceEvaluation(HeldoutEvaluation):
    """On held-out pairs, when the held-out loss would be measured: DPO's loss, TRL's reward metrics, and
    `eval_preference_accuracy` (the share of pairs whose chosen completion the model finds likelier: at step 0, where
    every reward is 0, the starting model's). The export's check keeps the held-out loss per token (`finish`)."""

    NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected", "preference_accuracy")

    def run(self, state: LoopState) -> None:
        self.measure(state.step)

    def measure(self, step: int) -> float | None:
        worker, cfg = self.worker, self.worker.cfg
        if self.blocks is None:
            return None
        totals = torch.zeros(len(self.NAMES) + 2, device=worker.device)
        with worker.timeline.phase("eval"), evaluating(self.model, cfg):
            for index, real in eval_batches(len(self.blocks), worker.rank, worker.world, cfg.train.micro_batch_size,
                                            cfg.eval.max_batches):
                batch = real_rows(self.blocks, index, real, worker.device)
                policy, lengths = measured_logps(self.model, batch)
                loss, metrics = preference_terms(policy, batch["reference"], lengths, cfg.train.dpo.beta, 0.0)
                metrics["preference_accuracy"] = (policy[0::2] > policy[1::2]).float().sum()
                totals += torch.stack([loss, batch["pairs"].new_tensor(len(batch["pairs"])).float(),
                                       *(metrics[name] for name in self.NAMES)])
        dist.all_reduce(totals)
        loss, pairs, *values = (totals / totals[1].clamp(min=1)).tolist()
        worker.log({"kind": "eval", "step": step, "eval_loss": loss, "eval_pairs": int(totals[1].item()),
                    **{f"eval_{name}": value for name, value in zip(self.NAMES, values)}})
        return loss
