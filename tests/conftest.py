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


LAST_MODULES = ("test_k8s_live.py", "test_k8s_pods.py")
"""Run after every other test: their control plane is built from source in the background by scripts/test.sh
(about 40 minutes of a cold 2-core machine's spare CPU), so the rest of the suite runs meanwhile instead of
waiting for it."""


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name in LAST_MODULES)  # stable: the order within each part stays


def pytest_configure(config):
    config.addinivalue_line("markers", "image_set: also run on the Ray image's library versions "
                                       "(requirements-image.txt; scripts/test.sh runs them on .venv-image)")


@pytest.fixture(scope="module")
def helm_home(tmp_path_factory):
    """helm's own state (repositories, cache, registry logins) in the test's temporary directory."""
    home = tmp_path_factory.mktemp("helm-home")
    with pytest.MonkeyPatch.context() as mp:
        for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
            mp.setenv(var, str(home / var.lower()))
        yield home


@pytest.fixture(scope="module")
def chart_package(tmp_path_factory) -> Path:
    """`helm package` of the repository's chart: the .tgz."""
    from chart_helpers import helm
    from job import __version__

    out = tmp_path_factory.mktemp("package")
    helm("package", str(REPO), "--destination", str(out))
    return out / f"ray-finetune-{__version__}.tgz"


@pytest.fixture
def s3_endpoint():
    """A moto S3 server on 127.0.0.1 (bounded to the test) with bucket `runs`: the AWS environment pointing at it."""
    from servers import moto_s3

    with moto_s3() as env:
        yield env


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance shared by every test that runs a Ray Train job (starting Ray costs seconds)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture
def single_process(tmp_path):
    """A one-process gloo group, for code that makes collective calls (FSDP2, DCP, the training step)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


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


def tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """The scalars of a folder of TensorBoard event files, read by TensorBoard's own reader (which applies the
    purges a resumed attempt's file starts with): tag -> [(step, value)] in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return {tag: sorted((e.step, e.value) for e in events.Scalars(tag)) for tag in events.Tags()["scalars"]}


def assert_tensorboard_matches_metrics(folder, rows: list[dict]) -> None:
    """Every number of metrics.jsonl's train, eval and time records is in the event files at its step, once."""
    scalars = tensorboard_scalars(folder)
    expected: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        if row["kind"] in ("train", "eval", "time"):
            for key, value in row.items():
                if isinstance(value, (int, float)) and key not in ("step", "time"):
                    expected.setdefault(f"{row['kind']}/{key}", []).append((row["step"], value))
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "time/goodput"} <= set(expected)
    for tag, points in expected.items():
        assert [s for s, _ in scalars.get(tag, [])] == [s for s, _ in points], tag
        assert [v for _, v in scalars[tag]] == pytest.approx([v for _, v in points], rel=1e-6), tag
