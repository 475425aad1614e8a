"""The optimizer: fused AdamW over what trains, with the gradient clipping folded into its step."""

from __future__ import annotations

import torch

from .. import config as config_lib
from .model.causal_lm import full


def build_optimizer(model: torch.nn.Module, cfg: config_lib.TrainConfig) -> torch.optim.Optimizer:
    """Fused AdamW (which also applies the gradient clipping, `clip_in_step`) over the trainable parameters, with
    weight decay on matrices only; the loop sets each step's rate (`schedule.learning_rate`)."""
    trained = [p for p in model.parameters() if p.requires_grad]  # with LoRA, the adapters
    decay = [p for p in trained if p.ndim >= 2]
    no_decay = [p for p in trained if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        fused=True,
    )

    return optimizer


def clip_in_step(optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """The global gradient norm, as `clip_grad_norm_` computes it, and the clipping (`max_norm` > 0) left to the
    optimizer's next (fused) step: its `grad_scale` divides each gradient as the step reads it, by the inverse of
    the factor `clip_grad_norm_` would multiply it by. Multiplying first is one more pass over every gradient
    (~3 ms of a Qwen2.5-1.5B step on an H200)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    norm = full(torch.nn.utils.get_total_norm(grads, foreach=True))
    optimizer.grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0) if max_norm else None
    return norm
