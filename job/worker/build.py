"""Building one worker's run before its first step (`build`): tokenizer, model, data (a fresh run's task
baseline decoding beside it), FSDP2 sharding, optimizer, checkpointer, and the resume point."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from .. import config as config_lib
from ..records import evidence
from ..records.tracking import MlflowMetrics
from . import checkpoint as checkpoint_lib
from . import compile_cache, schedule
from . import data as data_lib
from . import export as export_lib
from . import faults as faults_lib
from .checkpoint_writer import Checkpointer
from .contract import Launcher, LoopConfig
from .evaluate import task_items
from .metrics import MetricsLogger, Timeline, flops_per_token, peak_flops
from .model import (CausalLMWithLoss, add_adapters, build_causal_lm, device_mesh, load_tokenizer, parallelize,
                    weights_fingerprint)
from .optimizer import build_optimizer
from .run import PendingTaskEval, Run, in_background
from .task_eval import start_baseline


def build(loop_config: LoopConfig, launcher: Launcher, device: torch.device, record: dict | None,
          timeline: Timeline) -> tuple[Run, Callable[[], dict]]:
    """Tokenizer, model, data (a fresh run's task baseline decoding beside it), FSDP2 sharding, optimizer, and the
    resume point. Returns the run and a function that returns the weights fingerprint (hashed in a background
    thread on rank 0: gigabytes take seconds)."""
    cfg, run_dir = loop_config.cfg, loop_config.run_dir
    rank, world = dist.get_rank(), dist.get_world_size()
    faults_lib.write_pid(run_dir, rank)
    bf16 = cfg.parallel.mixed_precision == "bf16" or (cfg.parallel.mixed_precision == "auto" and device.type == "cuda")

    # ---- Tokenizer, then the model (as loaded, or seeded), then the data: a fresh run's task baseline decodes
    # on a plain copy of that model while the data is tokenized, on a device busy with nothing else
    # (`start_baseline`). Every rank gets the same packed blocks and reads only its shard of them.
    with timeline.phase("data"):
        tokenizer_json = loop_config.tokenizer_json
        tokenizer = data_lib.tokenizer_from_json(tokenizer_json) if tokenizer_json else load_tokenizer(cfg.model)
    with timeline.phase("resume"):
        resume_from, skipped = checkpoint_lib.find_resume_point(cfg, run_dir)
    with timeline.phase("model"):
        cache_uri = compile_cache.cache_uri(cfg, device) if cfg.parallel.compile else None
        cache_state = compile_cache.load(cache_uri) if cache_uri else None  # before anything compiles
        with torch.device(device):
            lm = build_causal_lm(cfg.model, len(tokenizer) if cfg.model.train_tokenizer_vocab else None, cfg.train.seed)
            adapted = add_adapters(lm, cfg.model.lora) if cfg.model.lora.rank else []
        arch = lm.config
        n_params = sum(p.numel() for p in lm.parameters())
        n_trainable = sum(p.numel() for p in lm.parameters() if p.requires_grad)
        unsharded = CausalLMWithLoss(lm, cfg.train.loss_chunk_size, cfg.model.sdpa_backend)
    baseline: PendingTaskEval | None = None
    baseline_due = resume_from is None and cfg.eval.task and cfg.eval.task_at_start

    def start_baseline_on(examples: list[dict]) -> None:
        nonlocal baseline
        baseline = start_baseline(unsharded, tokenizer, task_items(examples, cfg.data, tokenizer), cfg, rank, world,
                                  device, bf16)

    with timeline.phase("data"):
        dataset, data_cache = data_lib.build_once(cfg.data, cfg.train, tokenizer, run_dir,
                                                  start_baseline_on if baseline_due else None)
    weights = in_background(weights_fingerprint, cfg.model) if record else dict
    if record:
        tokenizer_sha = (dataset.fingerprint.get("tokenizer") or {}).get("sha256")
        evidence.update_record(run_dir, record, dataset=dataset.fingerprint, tokenizer_sha256=tokenizer_sha)

    # ---- FSDP2 shards the model across the ranks.
    with timeline.phase("model"):
        mesh = device_mesh(device.type, world, cfg.parallel.shard_group_size)
        model = parallelize(unsharded, cfg.parallel, mesh, bf16)
        optimizer = build_optimizer(model, cfg.train)
        identity = checkpoint_lib.run_identity(cfg, world, dataset.fingerprint)
        if adapted:
            identity.update(lora_preflight(cfg, run_dir, weights, n_params - n_trainable, bf16))
        checkpointer = Checkpointer(cfg, run_dir, device, identity)
        faults = faults_lib.FaultInjection(cfg, rank, run_dir, checkpointer)

    # ---- Resume: the run's latest complete checkpoint (or checkpoint.resume's), resharded onto this world size.
    start_step, start_micro, resumed, data_exact = 0, 0, None, True
    with timeline.phase("resume"):
        if resume_from is not None:
            resumed = checkpoint_lib.restore(resume_from, model, optimizer, cfg, identity)
            start_step = resumed["step"]
            start_micro, data_exact = checkpoint_lib.data_start(
                resumed, cfg, world, len(dataset.train) if dataset.train is not None else None)

    # ---- Batches: a pure function of (seed, rank, micro-batch index), so a resumed run sees the same data.
    mb, seq = cfg.train.micro_batch_size, cfg.train.seq_len
    if dataset.train is None:
        vocab = cfg.data.synthetic_vocab or arch.vocab_size
        batches = data_lib.synthetic_batches(vocab, mb, seq, rank, cfg.train.seed, start=start_micro)
    else:
        batches = data_lib.micro_batches(dataset.train, mb, rank, world, cfg.train.seed, start=start_micro)

    flops_tok = flops_per_token(n_params, arch.num_hidden_layers, arch.hidden_size, seq, frozen=n_params - n_trainable)
    logger = None
    if rank == 0:
        sinks = [MlflowMetrics(cfg.logging.mlflow.tracking_uri, loop_config.mlflow_run_id)
                 ] if loop_config.mlflow_run_id else []
        logger = MetricsLogger(run_dir, cfg.train.max_steps, launcher.progress_style(cfg.logging.progress_bar),
                               keep_until_step=start_step, sinks=sinks)
    run = Run(cfg, run_dir, device, rank, world, bf16, tokenizer, dataset, model, optimizer, batches,
              start_step, flops_tok, peak_flops(device, cfg.logging.peak_flops), checkpointer, faults, timeline, logger,
              task_items(dataset.validation_examples, cfg.data, tokenizer) if cfg.eval.task else [],
              compile_cache=cache_uri if cache_state and not cache_state["loaded"] else None,
              latest_checkpoint=resume_from, preempted=launcher.preempted, baseline=baseline)
    run.log({"kind": "start", "params": n_params, "trainable_params": n_trainable,
             "method": "lora" if adapted else "full", "lora_rank": cfg.model.lora.rank, "lora_layers": len(adapted),
             "flops_per_token": flops_tok, "world_size": world,
             "mesh": list(mesh.shape), "sharded": isinstance(model, FSDPModule), "device": str(device), "bf16": bf16,
             "data": dataset.fingerprint, "data_cache": data_cache, "compile_cache": cache_state})
    if resumed is not None or skipped:
        resume_record = {"step": start_step, "checkpoint": resume_from, "skipped": skipped}
        if resumed is not None:
            resume_record.update(saved_world_size=resumed["world_size"], micro_batch_index=start_micro,
                                 data_exact=data_exact,
                                 lr_schedule_changes=schedule.changes(resumed, cfg.train))
        run.log({"kind": "resume", **resume_record})
        if record:
            evidence.update_record(run_dir, record, resumed_from=resume_record)
    return run, weights


def lora_preflight(cfg: config_lib.RunConfig, run_dir: str, weights: Callable[[], dict], n_frozen: int,
                   bf16: bool) -> dict:
    """A LoRA run's identity keys (`checkpoint.adapter_identity`, from rank 0's fingerprint of the base weights),
    and, with `model.lora.merged_export`, rank 0's check that the export's storage has room for the merged
    weights: both before the first step, on every rank (collective)."""
    problem = None
    if dist.get_rank() == 0:
        identity = checkpoint_lib.adapter_identity(cfg, weights())
        if cfg.model.lora.merged_export:
            problem = export_lib.merged_room_problem(run_dir, n_frozen * (2 if bf16 else 4))
    box = [identity if dist.get_rank() == 0 else None, problem]
    dist.broadcast_object_list(box, src=0)
    if box[1]:
        raise config_lib.ConfigError(box[1])
    return box[0]
