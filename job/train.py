"""The training loop, run once per worker: the same function under Ray Train and under torchrun.

Read top to bottom: set up the process group and device → tokenizer, data, model → FSDP2 → optimizer and
schedule → loop (step, log, evaluate) → final evaluation and sample → clean up.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import time

import torch
import torch.distributed as dist

from . import checkpoint as checkpoint_lib
from . import config as config_lib
from . import data as data_lib
from . import evidence, nccl
from . import preflight as preflight_lib
from .evaluate import evaluate, generate_sample, task_evaluate, task_items
from .metrics import MetricsLogger, StepProfiler, flops_per_token, peak_flops
from .model import CausalLMWithLoss, build_causal_lm, device_mesh, load_tokenizer, parallelize


# Without `preflight.enabled`, every run still takes one small all-reduce: it creates NCCL's communicators, so
# the transport NCCL chose is in its log, and gathers each worker's environment for the run record.
RECORD_ONLY_PREFLIGHT = {"sizes_mib": [1], "iters": 1, "warmup": 1, "expect": None}


def train_loop(loop_config: dict) -> None:
    """Entry point of every worker. `loop_config` holds the resolved config dict, the launcher name, the run
    directory and, when the driver trained one, the tokenizer's JSON.

    Around the training itself (`fit`), rank 0 keeps the run record `run.json`: opened after the preflight,
    closed with the results, or with the error when anything fails.
    """
    cfg = config_lib.load_dict(loop_config["config"])
    run_dir = loop_config["run_dir"]
    nccl_log_dir = os.path.join(tempfile.gettempdir(), "job-nccl", cfg.name)
    nccl.enable_nccl_debug(nccl_log_dir)  # before the first collective: NCCL reads it at communicator creation
    device = _setup_distributed(loop_config["launcher"], cfg.scaling.use_gpu)
    rank = dist.get_rank()

    full_preflight = cfg.preflight.enabled or cfg.mode == "preflight"
    record_args = dict(config=config_lib.to_dict(cfg), config_text=config_lib.to_yaml(cfg), run_name=cfg.name,
                       seed=cfg.train.seed, runtime_env=loop_config.get("runtime_env"))
    try:
        preflight = preflight_lib.run_preflight(cfg.preflight if full_preflight else RECORD_ONLY_PREFLIGHT, device,
                                                log_dir=nccl_log_dir)
    except preflight_lib.PreflightError as exc:
        if rank == 0:
            record = evidence.start_record(run_dir, preflight=exc.result, **record_args)
            evidence.finish_record(run_dir, record, status="failed", error=exc)
        raise
    record = evidence.start_record(run_dir, preflight=preflight, **record_args) if rank == 0 else None
    if rank == 0 and full_preflight:
        print(json.dumps({"kind": "preflight", **{k: v for k, v in preflight.items() if k != "workers"}}), flush=True)
    if cfg.mode == "preflight":
        if record:
            evidence.finish_record(run_dir, record)
        return

    try:
        results = fit(cfg, loop_config, device, record)
    except BaseException as exc:
        if record:
            evidence.finish_record(run_dir, record, status="failed", error=exc)
        raise
    if record:
        evidence.finish_record(run_dir, record, **results)
    _report({"step": cfg.train.max_steps}, loop_config["launcher"])


def fit(cfg: config_lib.RunConfig, loop_config: dict, device: torch.device, record: dict | None) -> dict:
    """Builds data and model, trains, evaluates. Returns results for the run record (rank 0's are used)."""
    run_dir = loop_config["run_dir"]
    rank, world = dist.get_rank(), dist.get_world_size()
    checkpoint_lib.write_pid(run_dir, rank)
    bf16 = cfg.parallel.mixed_precision == "bf16" or (cfg.parallel.mixed_precision == "auto" and device.type == "cuda")

    # ---- Tokenizer and data: every rank builds the same packed blocks, then reads only its shard of them.
    tokenizer_json = loop_config.get("tokenizer_json")
    tokenizer = data_lib.tokenizer_from_json(tokenizer_json) if tokenizer_json else load_tokenizer(cfg.model)
    dataset = data_lib.build(cfg.data, cfg.train, tokenizer)
    if record:
        evidence.update_record(run_dir, record, dataset=dataset.fingerprint, tokenizer_sha256=tokenizer_hash(tokenizer))

    # ---- Model: seeded init on the target device, then FSDP2 shards it (each rank keeps 1/world of it).
    with torch.device(device):
        lm = build_causal_lm(cfg.model, len(tokenizer) if cfg.model.train_tokenizer_vocab else None, cfg.train.seed)
    arch = lm.config
    n_params = sum(p.numel() for p in lm.parameters())
    mesh = device_mesh(device.type, world, cfg.parallel.shard_group_size)
    model = parallelize(
        CausalLMWithLoss(lm, cfg.train.loss_chunk_size, cfg.model.sdpa_backend),
        cfg.parallel,
        mesh,
        bf16,
    )
    optimizer, schedule = build_optimizer(model, cfg.train, device)

    # ---- Resume: the run's latest complete checkpoint (or checkpoint.resume's), resharded onto this world size.
    accum, mb, seq = cfg.train.grad_accum_steps, cfg.train.micro_batch_size, cfg.train.seq_len
    start_step, start_micro, resumed = 0, 0, None
    task_results, items = [], task_items(dataset.validation_examples, cfg.data, tokenizer) if cfg.eval.task else []
    resume_from = checkpoint_lib.find_resume_point(cfg, run_dir, loop_config["launcher"])
    if resume_from is not None:
        resumed = checkpoint_lib.restore(resume_from, model, optimizer, cfg)
        start_step = resumed["step"]
        start_micro, data_exact = checkpoint_lib.data_start(
            resumed, cfg, world, len(dataset.train) if dataset.train is not None else None)

    # ---- Batches: a pure function of (seed, rank, micro-batch index), so a resumed run sees the same data.
    vocab = cfg.data.synthetic_vocab or arch.vocab_size
    if dataset.train is None:
        batches = data_lib.synthetic_batches(vocab, mb, seq, rank, cfg.train.seed, start=start_micro)
    else:
        batches = data_lib.micro_batches(dataset.train, mb, rank, world, cfg.train.seed, start=start_micro)

    flops_tok = flops_per_token(n_params, arch.num_hidden_layers, arch.hidden_size, seq)
    peak = peak_flops(device, cfg.logging.peak_flops)
    logger = (MetricsLogger(run_dir, cfg.train.max_steps, cfg.logging.progress_bar, keep_until_step=start_step)
              if rank == 0 else None)
    if logger:
        logger.log({"kind": "start", "params": n_params, "flops_per_token": flops_tok, "world_size": world,
                    "mesh": list(mesh.shape), "device": str(device), "bf16": bf16, "data": dataset.fingerprint})
        if resumed is not None:
            resume_record = {"step": start_step, "checkpoint": resume_from, "saved_world_size": resumed["world_size"],
                             "micro_batch_index": start_micro, "data_exact": data_exact}
            logger.log({"kind": "resume", **resume_record})
            evidence.update_record(run_dir, record, resumed_from=resume_record)

    # Running sums since the last log, kept on the device: reading them (.item()) is the only host sync.
    loss_sum = torch.zeros((), device=device)
    target_sum = torch.zeros((), device=device)
    interval_tokens, interval_start = 0, time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def log_eval(step: int) -> float | None:
        if dataset.validation is None:
            return None
        eval_loss = evaluate(model, dataset.validation, cfg, rank, world, device)
        if logger:
            logger.log({"kind": "eval", "step": step, "eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 50))})
        return eval_loss

    if cfg.eval.every_steps and start_step == 0:
        log_eval(0)  # the untrained baseline that later evaluations are read against
    final_eval, latest_checkpoint, accepted = None, resume_from, None
    for step in range(start_step + 1, cfg.train.max_steps + 1):
        checkpoint_lib.maybe_fail(cfg, step, rank, run_dir)
        profiler = StepProfiler(device) if logger and step == cfg.debug.profile_step else None
        lr = schedule(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro = [next(batches) for _ in range(accum)]
        # Token-weighted mean over the global batch: FSDP averages gradients over ranks, so each rank scales
        # its loss sum by world / (targets in the global batch). Counting happens on the host, before transfer.
        targets = to_device(torch.tensor(sum(int((b["labels"] != data_lib.IGNORE_INDEX).sum()) for b in micro)), device)
        global_targets = targets.clone()
        dist.all_reduce(global_targets)
        for batch in micro:
            batch = {k: to_device(v, device) for k, v in batch.items()}
            step_loss, _ = model(**batch)
            (step_loss * world / global_targets).backward()
            loss_sum += step_loss.detach()
        target_sum += targets
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        interval_tokens += accum * mb * seq
        if profiler:
            logger.log({"kind": "profile", "step": step, **profiler.finish(run_dir, step)})

        if step % cfg.logging.every_steps == 0 or step == cfg.train.max_steps:
            totals = torch.stack([loss_sum, target_sum])
            dist.all_reduce(totals)
            grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            loss = (totals[0] / totals[1]).item()  # syncs with the device, so the interval below is real
            elapsed = time.perf_counter() - interval_start
            tokens_per_s_device = interval_tokens / elapsed
            if logger:
                logger.log({
                    "kind": "train",
                    "step": step,
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": grad_norm.item(),
                    "tokens_per_s": tokens_per_s_device * world,
                    "tokens_per_s_per_device": tokens_per_s_device,
                    "mfu": tokens_per_s_device * flops_tok / peak if peak else None,
                    "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
                })
            loss_sum.zero_(), target_sum.zero_()
            interval_tokens, interval_start = 0, time.perf_counter()

        if (cfg.eval.every_steps and step % cfg.eval.every_steps == 0) or step == cfg.train.max_steps:
            eval_loss = log_eval(step)
            final_eval = eval_loss if step == cfg.train.max_steps else None
        if cfg.eval.task and (step % (cfg.eval.task_every_steps or cfg.train.max_steps) == 0 or step == cfg.train.max_steps):
            task_results.append(task_evaluate(model, tokenizer, items, cfg.eval, rank, world, device, step))
            if logger:
                logger.log(task_results[-1])

        if checkpoint_lib.due(step, cfg):
            latest_checkpoint = checkpoint_lib.save(step, model, optimizer, cfg, run_dir, loop_config["launcher"])

    if cfg.eval.sample_prompt is not None:
        text = generate_sample(model, tokenizer, cfg.eval.sample_prompt, cfg.eval.sample_tokens, device)
        if logger:
            logger.log({"kind": "sample", "step": cfg.train.max_steps, "prompt": cfg.eval.sample_prompt, "text": text})
    # ---- Export: full weights gathered on rank 0 only, saved as safetensors, reloaded and checked in a fresh
    # process against the final held-out loss (measured here when the loop did not, e.g. a finished run re-run).
    if cfg.checkpoint.export and not checkpoint_lib.export_is_valid(run_dir, cfg.train.max_steps):
        heldout = dataset.validation if dataset.validation is not None else checkpoint_lib.synthetic_heldout(vocab, cfg, world)
        if final_eval is None or dataset.validation is None:
            final_eval = evaluate(model, heldout, cfg, rank, world, device)
        accepted = checkpoint_lib.export(model, tokenizer, cfg, run_dir, {
            "eval_loss": final_eval, "step": cfg.train.max_steps, "world_size": world, "bf16": bf16, "vocab": vocab,
            "heldout": "validation" if dataset.validation is not None else "synthetic"})
        if logger:
            logger.log({"kind": "export", "step": cfg.train.max_steps, "dir": accepted["export_dir"],
                        "eval_loss": accepted["eval_loss"], "reference_eval_loss": final_eval,
                        "abs_diff": accepted["abs_diff"], "generation": accepted["generation"]["text"]})
    if logger:
        logger.close()
    results = {"checkpoints": {"dir": run_dir, "latest": latest_checkpoint, "keep_last": cfg.checkpoint.keep_last}}
    if accepted is not None:
        results["export"] = accepted
    if cfg.eval.task:
        results["evaluation"] = task_results
    return results


def build_optimizer(model: torch.nn.Module, cfg: config_lib.TrainConfig, device: torch.device):
    """AdamW (fused kernels on GPU) with weight decay on matrices only, and the warmup + cosine schedule."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        fused=device.type == "cuda",
    )

    def schedule(step: int) -> float:
        """Learning rate at optimizer step `step` (1-based): linear warmup, then cosine down to min_lr_ratio."""
        if step <= cfg.warmup_steps:
            return cfg.lr * step / max(1, cfg.warmup_steps)
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)

    return optimizer, schedule


def to_device(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """Copies without making the host wait for the GPU: a copy from pageable memory would block until the
    GPU has finished all queued work, so the host could not queue the next step's kernels ahead."""
    if tensor is None:
        return None
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def tokenizer_hash(tokenizer) -> str | None:
    """sha256 of the tokenizer's full JSON (vocabulary, merges, normalisation): equal hashes tokenize equally."""
    if tokenizer is None:
        return None
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()


def _setup_distributed(launcher: str, use_gpu: bool) -> torch.device:
    """The worker's device. Ray Train has already created the process group; torchrun leaves it to us."""
    if launcher == "ray":
        import ray.train.torch

        device = ray.train.torch.get_device()
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank) if use_gpu else torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("nccl" if use_gpu else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _report(metrics: dict, launcher: str) -> None:
    if launcher == "ray":
        import ray.train

        ray.train.report(metrics)
