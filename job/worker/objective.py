"""The training objective: how a micro-batch becomes the loss the step minimises (`Objective`).

The step scales each micro-batch's loss sum by `world / units in the global batch` before backward, so every unit
weighs the same however units fall across micro-batches and ranks; an objective's metrics (sums over the same units)
are logged per unit beside the loss. A new objective is a subclass chosen in `build.build` (docs/architecture.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import DpoConfig
from .data import IGNORE_INDEX
from .model.causal_lm import CausalLMWithLoss


class Objective:
    def units(self, batch: dict[str, torch.Tensor]) -> int:
        """The loss's units in a host batch (counted before the batch moves to the device)."""
        raise NotImplementedError

    def loss(self, model: CausalLMWithLoss, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """(the loss summed over the batch's units, {metric name: sum over the same units}), on the device."""
        raise NotImplementedError


class NextTokenPrediction(Objective):
    """Supervised fine-tuning and language modelling: cross-entropy of each target token (`labels` other than
    `IGNORE_INDEX`: the data's loss mask), a sum over target tokens."""

    def units(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def loss(self, model: CausalLMWithLoss, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        loss_sum, _ = model(**batch)
        return loss_sum, {}


def completion_logps(model: CausalLMWithLoss, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probability and the token count of each completion of a pair batch (`data.PairBlocks.batch`), in
    its numbering: chosen 2·i, rejected 2·i + 1 for its i-th pair."""
    token = model(input_ids=batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"],
                  per_token=True)
    n = 2 * batch["pairs"].numel()
    slot = batch["completion"].flatten()
    slot = torch.where(slot >= 0, slot, n)  # a label of no completion lands in the extra slot n
    sums = torch.zeros(n + 1, device=token.device).index_add_(0, slot, token)
    lengths = torch.zeros(n + 1, device=token.device).index_add_(0, slot, torch.ones_like(token))
    return sums[:n], lengths[:n]


def preference_terms(policy: torch.Tensor, reference: torch.Tensor, lengths: torch.Tensor, beta: float,
                     nll_weight: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO's loss summed over pairs and its metrics (sums over pairs, under TRL's names) from the completions'
    log-probabilities under the policy and the reference, chosen and rejected interleaved; `nll_weight` adds the
    chosen completion's negative log-likelihood per token (DPO+NLL)."""
    chosen, rejected = beta * (policy[0::2] - reference[0::2]), beta * (policy[1::2] - reference[1::2])
    margin = chosen - rejected
    loss = -F.logsigmoid(margin)
    metrics = {"rewards/chosen": chosen.sum(), "rewards/rejected": rejected.sum(),
               "rewards/accuracies": (margin > 0).float().sum(), "rewards/margins": margin.sum(),
               "logps/chosen": policy[0::2].sum(), "logps/rejected": policy[1::2].sum()}
    if nll_weight:
        nll = -policy[0::2] / lengths[0::2].clamp(min=1)
        loss = loss + nll_weight * nll
        metrics["nll_loss"] = nll.sum()
    return loss.sum(), {name: value.detach() for name, value in metrics.items()}


class DirectPreference(Objective):
    """DPO (`train.objective: dpo`): a sum over pairs of -log σ(β · margin of the policy's log-ratios to the
    reference), the reference's log-probabilities in the batch (`evaluation.preference.reference_logps`)."""

    def __init__(self, cfg: DpoConfig):
        self.beta, self.nll_weight = cfg.beta, cfg.nll_weight

    def units(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["pairs"].numel())

    def loss(self, model: CausalLMWithLoss, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        policy, lengths = completion_logps(model, batch)
        return preference_terms(policy, batch["reference"], lengths, self.beta, self.nll_weight)
