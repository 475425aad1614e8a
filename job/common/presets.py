"""The model's architecture without its weights: the presets, and the Hugging Face config a run builds from.

Apart from `worker/model/` (which builds, wraps and shards the model), so that the driver can check a config
against the model's architecture (`launch.check_before_start`, through `config_fields`) without importing what
training needs, nor Transformers itself (its config classes import much of it: ~7 s of the driver's start).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from ..config import ModelConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig

PRESETS = {
    # Qwen2.5-1.5B's architecture (the reference workload); random init, since weights come from a hub.
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # A few million parameters: trains on 2 CPU cores in minutes.
    "qwen2-tiny": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=384,
        vocab_size=4096,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}


def hf_config(cfg: ModelConfig, vocab_size: int | None = None) -> PretrainedConfig:
    """The Hugging Face config of the model to build, without its weights: the preset's (its vocabulary resized
    to `vocab_size`, if given) or `path`'s, with `overrides` applied."""
    from transformers import AutoConfig, Qwen2Config

    if cfg.preset is not None:
        vocab = {"vocab_size": vocab_size} if vocab_size else {}
        return Qwen2Config(**{**PRESETS[cfg.preset], **vocab, **cfg.overrides})
    return AutoConfig.from_pretrained(cfg.path, revision=cfg.revision, token=os.environ.get("HF_TOKEN"), **cfg.overrides)


def config_fields(cfg: ModelConfig) -> dict:
    """The fields of the model's config as written (`config.json`, or the preset), with `overrides` applied:
    what the driver checks the settings against. Fields a config leaves out (Transformers' defaults) are absent.
    Raises `OSError` or `ValueError` when there is no readable config."""
    if cfg.preset is not None:
        return {**PRESETS[cfg.preset], **cfg.overrides}
    if os.path.isdir(cfg.path):
        path = os.path.join(cfg.path, "config.json")
    elif os.path.isabs(cfg.path) or cfg.path.startswith("."):  # a local path, not a hub id
        raise FileNotFoundError(f"{cfg.path} is not a directory")
    else:  # a hub id: its config.json alone
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(cfg.path, "config.json", revision=cfg.revision, token=os.environ.get("HF_TOKEN"))
    with open(path) as f:
        fields = json.load(f)
    if not isinstance(fields, dict):
        raise ValueError(f"{path} holds {type(fields).__name__}, not a JSON object")
    return {**fields, **cfg.overrides}
