"""The learning-rate schedule, in one place: the rate at each step (the loop sets it before the step), and the
settings it is computed from, which every checkpoint keeps (`checkpoint.train_state`) and a resume compares
(`changes`)."""

from __future__ import annotations

import math

from .. import config as config_lib

KIND = "warmup_cosine"
"""The schedule's name in a checkpoint's train state."""


def learning_rate(step: int, cfg: config_lib.TrainConfig) -> float:
    """Learning rate at optimizer step `step` (1-based): linear warmup, then cosine down to min_lr_ratio."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / max(1, cfg.warmup_steps)
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def settings(cfg: config_lib.TrainConfig) -> dict:
    """The settings `learning_rate` computes the rate at a step from."""
    return {"lr": cfg.lr, "warmup_steps": cfg.warmup_steps, "max_steps": cfg.max_steps, "min_lr_ratio": cfg.min_lr_ratio}


def changes(state: dict, cfg: config_lib.TrainConfig) -> dict[str, list]:
    """The schedule's settings that differ from a checkpoint's train state, `{field: [saved, now]}`. The rate is a
    pure function of the step and these settings, so a change (e.g. a nearer `train.max_steps`) changes every
    update from the resumed step on, and the losses after it differ from what the saved settings gave."""
    saved = state.get("lr_schedule", {})
    return {field: [saved[field], value] for field, value in settings(cfg).items() if saved.get(field, value) != value}
