"""Shared test setup: offline Hugging Face, quiet Ray, one embedded Ray instance per test session."""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

# Nothing may be downloaded: tests build tiny models from a config and use data in the repo or ../shared.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Ray Train: check worker health often (short tests), print each worker line once.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
sys.path.insert(0, str(REPO))


def pytest_configure(config):
    config.addinivalue_line("markers", "image_set: also run on the Ray image's library versions "
                                       "(requirements-image.txt; scripts/test.sh runs them on .venv-image)")


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance shared by every test that runs a Ray Train job (starting Ray costs seconds)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def tiny_run_config(tmp_path: Path, **sections) -> dict:
    """A small valid run config (tiny Qwen2, stdlib text, 2 CPU workers) with per-section overrides."""
    cfg = {
        "name": "test-run",
        "storage_path": str(tmp_path / "runs"),
        "model": {"preset": "qwen2-tiny", "init": "random", "train_tokenizer_vocab": 512,
                  "overrides": {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}},
        "data": {"format": "text", "train": "builtin:python-docs", "validation_fraction": 0.05},
        "train": {"max_steps": 20, "micro_batch_size": 4, "seq_len": 64, "lr": 3e-3, "warmup_steps": 2},
        "scaling": {"num_workers": 2},
        "logging": {"every_steps": 5},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            cfg.setdefault(section, {}).update(values)
        else:
            cfg[section] = values
    return cfg
