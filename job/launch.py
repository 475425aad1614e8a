"""The driver: resolve the run, prepare what every worker shares, and start the workers.

Two launchers run the same `train.train_loop`:
* Ray Train (default): a `TorchTrainer` on the Ray cluster at `RAY_ADDRESS` (inside a RayJob), or on an
  embedded single-node Ray started here when `RAY_ADDRESS` is unset (laptops, CI).
* torchrun: `torchrun --nproc-per-node N -m job --config run.yaml` runs the loop in each torchrun process,
  for benchmarks and debugging without Ray.
"""

from __future__ import annotations

import copy
import os
import time

from . import checkpoint as checkpoint_lib
from . import config as config_lib
from . import data as data_lib
from . import storage
from .train import train_loop


def resolve_paths(cfg: config_lib.RunConfig) -> config_lib.RunConfig:
    """The config with local relative paths made absolute, as the workers do not share the driver's working
    directory. Model and tokenizer paths change only where they exist locally (otherwise they are hub ids)."""
    cfg = copy.deepcopy(cfg)
    local = lambda p: p is not None and "://" not in p and not p.startswith(("hf:", "builtin:"))  # noqa: E731
    if local(cfg.storage_path):
        cfg.storage_path = os.path.abspath(cfg.storage_path)
    if cfg.checkpoint.resume not in ("auto", "never") and local(cfg.checkpoint.resume):
        cfg.checkpoint.resume = os.path.abspath(cfg.checkpoint.resume)
    for source in (cfg.data.train, cfg.data.validation):
        if source is not None and local(source.path):
            source.path = os.path.abspath(source.path)
    for field in ("path", "tokenizer"):
        value = getattr(cfg.model, field)
        if local(value) and os.path.exists(value):
            setattr(cfg.model, field, os.path.abspath(value))
    return cfg


def run_directory(cfg: config_lib.RunConfig) -> str:
    """`<storage_path>/<name>`, with a local storage path made absolute (Ray requires it)."""
    storage = cfg.storage_path if "://" in cfg.storage_path else os.path.abspath(cfg.storage_path)
    return f"{storage.rstrip('/')}/{cfg.name}"


def prepare(cfg: config_lib.RunConfig, run_dir: str) -> dict:
    """Work done once, before the workers start: save the resolved config and train a tokenizer if asked.

    Returns the workers' `loop_config`, without the launcher name. Raises `CheckpointError` first when
    `checkpoint.resume` forbids starting (`never` on a run name that has checkpoints, a missing start point).
    """
    started_at = time.time()  # the run's time accounting starts here (metrics.Timeline)
    checkpoint_lib.check_before_start(cfg, run_dir)
    # Read and check every data source here, before any worker starts: a missing path, bad row or unreachable
    # hub id fails now with the source named. The training text also trains the tokenizer, if one is asked for.
    corpus = data_lib.tokenizer_corpus(cfg.data, cfg.train.seed) if cfg.data.format != "synthetic" else []
    fs, path = storage.filesystem(run_dir)
    fs.makedirs(path, exist_ok=True)
    storage.write_atomic(storage.join(run_dir, "config.yaml"), config_lib.to_yaml(cfg))
    loop_config = {"config": config_lib.to_dict(cfg), "run_dir": run_dir, "started_at": started_at}
    if cfg.model.train_tokenizer_vocab:
        tokenizer = data_lib.train_bpe_tokenizer(corpus, cfg.model.train_tokenizer_vocab)
        # Saved for export and inspection; the workers get the JSON itself, as they may not share a filesystem.
        if "://" not in run_dir:
            tokenizer.save_pretrained(os.path.join(run_dir, "tokenizer"))
        loop_config["tokenizer_json"] = tokenizer.backend_tokenizer.to_str()
    return loop_config


def run_with_ray(cfg: config_lib.RunConfig, loop_config: dict) -> str | None:
    """Runs the workers under Ray Train; returns None on success, else the workers' error in one line each."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, TrainingFailedError, WorkerGroupError
    from ray.train.torch import TorchTrainer

    # Workers print their metric lines themselves; Ray's print patching would print each line twice.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    if not ray.is_initialized():
        # Inside a RayJob, RAY_ADDRESS points at the cluster; otherwise start an embedded local Ray.
        ray.init(address=os.environ.get("RAY_ADDRESS"), logging_level="WARNING")
    storage, name = loop_config["run_dir"].rsplit("/", 1)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={**loop_config, "launcher": "ray"},
        scaling_config=ScalingConfig(
            num_workers=cfg.scaling.num_workers,
            use_gpu=cfg.scaling.use_gpu,
            resources_per_worker={"CPU": cfg.scaling.cpus_per_worker, **({"GPU": 1} if cfg.scaling.use_gpu else {})},
        ),
        # Same name + storage_path = same run: Ray Train reloads its checkpoint snapshot from there, so a restarted
        # driver (retried RayJob, helm upgrade, re-run) hands the latest checkpoint to ray.train.get_checkpoint().
        run_config=RunConfig(
            name=name,
            storage_path=storage,
            failure_config=FailureConfig(max_failures=cfg.scaling.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep_last),
        ),
    )
    try:
        trainer.fit()
    except WorkerGroupError as e:
        return "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, exc in sorted(e.worker_failures.items()))
    except TrainingFailedError as e:  # e.g. a worker process lost with no `scaling.max_failures` left
        return f"{type(e).__name__}: {' '.join(str(e).split())[:2000]}"
    return None


def run_with_torchrun(loop_config: dict) -> None:
    import torch.distributed as dist

    try:
        train_loop({**loop_config, "launcher": "torchrun"})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ
