"""The training objective: how a micro-batch becomes the loss the step minimises (`Objective`).

The step scales each micro-batch's loss sum by `world / units in the global batch` before backward, so every unit
weighs the same however units fall across micro-batches and ranks; an objective's metrics (sums over the same units)
are logged per unit beside the loss. A new objective is a subclass chosen in `build.build` (docs/architecture.md).
"""

from __future__ import annotations

import torch

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
