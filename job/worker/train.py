"""The training loop, run once per worker: the same function under Ray Train and under torchrun.

`train_loop` (given the driver's `LoopConfig` and the `contract.Launcher` that runs it) sets up the device, the
process group and the run record, then `fit` reads as three steps:
`build` (tokenizer, data, model, FSDP2, optimizer, resume) → `train` (the loop: step, log, evaluate, checkpoint)
→ `finish` (last checkpoint, final task evaluation and sample, export). Every phase is timed (`metrics.Timeline`),
so each run records where its wall time went and its goodput.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from . import checkpoint as checkpoint_lib
from . import compile_cache
from .contract import Launcher, LoopConfig
from .. import config as config_lib
from . import data as data_lib
from ..records import evidence, failures, nccl
from . import export as export_lib
from ..records import preflight as preflight_lib
from .evaluate import (TaskShare, evaluate, generate_sample, heldout_batches, kv_cache_bytes, rank_items,
                       synthetic_heldout, task_decode, task_evaluate, task_items, task_record)
from .metrics import MetricsLogger, StepProfiler, Timeline, flops_per_token, format_timeline, peak_flops
from .model import (CausalLMWithLoss, add_adapters, adapter_state_dict, build_causal_lm, device_mesh, gathered_copy,
                    load_tokenizer, parallelize, weights_fingerprint)
from ..records.tracking import MlflowMetrics
from .watchdog import HangError, LossSpikes, Watchdog

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# Without `preflight.enabled`, every run still takes one small all-reduce: it creates NCCL's communicators, so
# the transport NCCL chose is in its log, and gathers each worker's environment for the run record.
RECORD_ONLY_PREFLIGHT = config_lib.PreflightConfig(sizes_mib=[1], iters=1, warmup=1)


def train_loop(loop_config: LoopConfig, launcher: Launcher) -> None:
    """Entry point of every worker: `loop_config` is what the driver prepared; `launcher` (`contract.Launcher`) is
    what this loop asks of the launcher that runs it.

    Around the training itself (`fit`), rank 0 keeps the run record `run.json`: opened after the preflight,
    closed with the results, or with the error when anything fails.
    """
    cfg, run_dir = loop_config.cfg, loop_config.run_dir
    nccl_log_dir = os.path.join(tempfile.gettempdir(), "job-nccl", cfg.name)
    nccl.enable_nccl_debug(nccl_log_dir)  # before the first collective: NCCL reads it at communicator creation
    device = launcher.setup_device(cfg.scaling.use_gpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank = dist.get_rank()
    timeline = Timeline(loop_config.started_at, device, loop_config.startup)

    full_preflight = cfg.preflight.enabled or cfg.mode == "preflight"
    record_args = dict(config=config_lib.to_dict(cfg), config_text=config_lib.to_yaml(cfg), run_name=cfg.name,
                       seed=cfg.train.seed)
    try:
        with timeline.phase("startup"):
            preflight = preflight_lib.run_preflight(cfg.preflight if full_preflight else RECORD_ONLY_PREFLIGHT,
                                                    device, log_dir=nccl_log_dir)
    except preflight_lib.PreflightError as exc:
        failures.save_traceback(run_dir, loop_config.started_at, rank, exc)
        if rank == 0:
            record = evidence.start_record(run_dir, preflight=exc.result, **record_args)
            evidence.finish_record(run_dir, record, status="failed", error=exc, rank=rank)
        raise
    record = evidence.start_record(run_dir, preflight=preflight, **record_args) if rank == 0 else None
    if rank == 0 and full_preflight:
        print(json.dumps({"kind": "preflight", **{k: v for k, v in preflight.items() if k != "workers"}}), flush=True)
    if cfg.mode == "preflight":
        if record:
            evidence.finish_record(run_dir, record)
        return

    try:
        results = fit(loop_config, launcher, device, record, timeline)
    except BaseException as exc:
        preempted = isinstance(exc, failures.Preempted)
        if not preempted:
            failures.save_traceback(run_dir, loop_config.started_at, rank, exc)
        if record:  # a Ctrl-C in a terminal reaches the workers too: cancelled, not failed
            status = "cancelled" if isinstance(exc, KeyboardInterrupt) else "failed"
            saved = {"checkpoints": {"dir": run_dir, "latest": exc.checkpoint, "keep_last": cfg.checkpoint.keep_last}
                     } if preempted else {}
            evidence.finish_record(run_dir, record, status=status, error=exc, rank=rank, time=timeline.summary(),
                                   **saved)
        if preempted:  # every rank ends together, once rank 0's record says so (Ray stops the group at the first)
            dist.barrier()
        raise
    if record:
        evidence.finish_record(run_dir, record, **results)
    launcher.report({"step": cfg.train.max_steps})


@dataclass
class Run:
    """Everything `build` makes and `train` / `finish` use, for one worker."""

    cfg: config_lib.RunConfig
    run_dir: str
    device: torch.device
    rank: int
    world: int
    bf16: bool
    tokenizer: PreTrainedTokenizerBase | None
    dataset: data_lib.Dataset
    model: CausalLMWithLoss
    optimizer: torch.optim.Optimizer
    schedule: Callable[[int], float]
    batches: Iterator[dict]
    start_step: int
    flops_per_token: float
    peak_flops: float | None
    checkpointer: checkpoint_lib.Checkpointer
    timeline: Timeline
    logger: MetricsLogger | None
    """Rank 0's metrics log (None on the other ranks)."""
    task_items: list[dict] = field(default_factory=list)
    compile_cache: str | None = None
    """Where to keep the compiled code on the storage after the first step (None without `parallel.compile`, or
    when this attempt loaded it from there)."""
    latest_checkpoint: str | None = None
    preempted: Callable[[], bool] = lambda: False
    """Whether this worker was asked to stop for a preemption (`contract.Launcher.preempted`)."""
    baseline: PendingTaskEval | None = None
    """The task baseline's decoding, begun in `build` beside the data's tokenizing (`start_baseline`); None when
    it was not (no room on the device beside it, or none due): then it is decoded at step 0."""
    final_eval: float | None = None
    task_results: list[dict] = field(default_factory=list)
    watchdog: Watchdog | None = None
    """The hang watchdog, from the training loop's start (`start_watchdog`)."""

    def log(self, record: dict) -> None:
        if self.logger:
            self.logger.log(record)


def fit(loop_config: LoopConfig, launcher: Launcher, device: torch.device, record: dict | None,
        timeline: Timeline) -> dict:
    """Builds, trains and finishes the run; returns results for the run record (rank 0's are used)."""
    run, weights = build(loop_config, launcher, device, record, timeline)
    exporting = export_due(run)
    # The export's checking process starts now: its imports (~20 s) are long done when the export is written.
    acceptance = export_lib.start_acceptance() if exporting else None
    run.watchdog = start_watchdog(run, record)
    try:
        train(run)
        return finish(run, weights, exporting, acceptance)
    except BaseException:
        run.checkpointer.abandon()
        raise
    finally:
        if acceptance is not None:
            acceptance.close()
        run.checkpointer.close()
        run.watchdog.stop()


def start_watchdog(run: Run, record: dict | None) -> Watchdog:
    """This attempt's hang watchdog (collective: the attempt's number, as rank 0's record counts it, names the
    stack files); on rank 0 it closes the record before the process ends."""
    attempt = torch.tensor(len(record["previous_attempts"]) + 1 if record else 0, device=run.device)
    dist.broadcast(attempt, src=0)

    def close_record(error: HangError) -> None:
        evidence.finish_record(run.run_dir, record, status="failed", error=error, rank=error.rank,
                               time=run.timeline.summary())

    watchdog = Watchdog(run.cfg.train.hang_timeout_s, run.run_dir, run.rank, int(attempt.item()), run.start_step,
                        close_record if record else None, dist.get_world_size(), dist.get_backend() == "gloo")
    run.timeline.on_phase = watchdog.phase
    return watchdog


def export_due(run: Run) -> bool:
    """Whether this run ends with an export (not when a finished run is re-run and its export is accepted)."""
    return run.cfg.checkpoint.export and not export_lib.export_is_valid(run.run_dir, run.cfg.train.max_steps)


def build(loop_config: LoopConfig, launcher: Launcher, device: torch.device, record: dict | None,
          timeline: Timeline) -> tuple[Run, Callable[[], dict]]:
    """Tokenizer, model, data (a fresh run's task baseline decoding beside it), FSDP2 sharding, optimizer, and the
    resume point. Returns the run and a function that returns the weights fingerprint (hashed in a background
    thread on rank 0: gigabytes take seconds)."""
    cfg, run_dir = loop_config.cfg, loop_config.run_dir
    rank, world = dist.get_rank(), dist.get_world_size()
    checkpoint_lib.write_pid(run_dir, rank)
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
        optimizer, schedule = build_optimizer(model, cfg.train)
        identity = checkpoint_lib.run_identity(cfg, world, dataset.fingerprint)
        if adapted:
            identity.update(lora_preflight(cfg, run_dir, weights, n_params - n_trainable, bf16))
        checkpointer = checkpoint_lib.Checkpointer(cfg, run_dir, device, identity)

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
    run = Run(cfg, run_dir, device, rank, world, bf16, tokenizer, dataset, model, optimizer, schedule, batches,
              start_step, flops_tok, peak_flops(device, cfg.logging.peak_flops), checkpointer, timeline, logger,
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
                                 lr_schedule_changes=checkpoint_lib.schedule_changes(resumed, cfg))
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


def train(run: Run) -> None:
    """The loop, from the step after the resume point to `train.max_steps`: one optimizer step per iteration;
    logs, evaluations and checkpoints at their intervals (each timed as its own phase, the rest is training)."""
    cfg, device, world = run.cfg, run.device, run.world
    with run.timeline.phase("checkpoint"):  # the writer, chosen and started before the steps it runs beside
        run.log({"kind": "checkpoint_writer", "step": run.start_step, **run.checkpointer.prepare(run.model)})
    if run.start_step == 0:  # the untrained baselines that later evaluations are read against
        baseline = baseline_at_step_0(run) if cfg.eval.task and cfg.eval.task_at_start else None
        if cfg.eval.every_steps:
            log_eval(run, 0)
        if baseline is not None:
            finish_task_eval(run, 0, baseline)
    # Running sums since the last log, kept on the device: reading them (.item()) is the only host sync.
    loss_sum = torch.zeros((), device=device)
    target_sum = torch.zeros((), device=device)
    interval_tokens, interval_start = 0, time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    run.timeline.sync()
    loop_start = time.perf_counter()
    outside_train = sum(run.timeline.seconds[p] for p in ("eval", "checkpoint", "task_eval"))
    first_step_s, signalled = None, 0
    spikes, logged_loss_factor = LossSpikes(cfg.train.loss_spike_factor, cfg.train.loss_spike_intervals), 1.0
    for step in range(run.start_step + 1, cfg.train.max_steps + 1):
        logged_loss_factor = checkpoint_lib.maybe_fail(cfg, step, run.rank, run.run_dir) or logged_loss_factor
        profiler = StepProfiler(device) if run.logger and step == cfg.debug.profile_step else None
        lr = run.schedule(step)
        loss, targets, grad_norm = train_step(run, lr)
        loss_sum += loss if logged_loss_factor == 1 else loss * logged_loss_factor  # debug.fail_mode: loss_spike, nan
        target_sum += targets
        interval_tokens += cfg.train.grad_accum_steps * cfg.train.micro_batch_size * cfg.train.seq_len
        if profiler:
            run.log({"kind": "profile", "step": step, **profiler.finish(run.run_dir, step)})
        if first_step_s is None:  # compilation and warm-up: the first step's time beyond a typical step
            if run.compile_cache and run.rank == 0:  # everything the training step compiles has been compiled
                compile_cache.save(run.compile_cache)
            run.timeline.sync()
            first_step_s = time.perf_counter() - loop_start

        if step % cfg.logging.every_steps == 0 or step == cfg.train.max_steps:
            # The log step's all-reduce also carries each rank's preemption flag: the ranks agree to stop here.
            flags = torch.tensor([float(run.checkpointer.write_done()), float(run.preempted())], device=device)
            totals = torch.cat([torch.stack([loss_sum, target_sum]), flags])
            dist.all_reduce(totals)
            signalled = int(totals[3].item())
            mean_loss = (totals[0] / totals[1]).item()  # syncs with the device, so the interval below is real
            check_finite(step, mean_loss, grad_norm.item())
            tokens_per_s_device = interval_tokens / (time.perf_counter() - interval_start)
            run.log({
                "kind": "train",
                "step": step,
                "loss": mean_loss,
                "lr": lr,
                "grad_norm": grad_norm.item(),
                "tokens_per_s": tokens_per_s_device * world,
                "tokens_per_s_per_device": tokens_per_s_device,
                "mfu": tokens_per_s_device * run.flops_per_token / run.peak_flops if run.peak_flops else None,
                "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            })
            spikes.check(step, mean_loss)  # after the log: the record's step is the spike's
            if totals[2].item() == world:  # every rank's checkpoint write (if any) has returned
                complete_checkpoint(run)
            loss_sum.zero_(), target_sum.zero_()
            interval_tokens, interval_start = 0, time.perf_counter()
        run.watchdog.step_done(step)

        if checkpoint_lib.due(step, cfg) or signalled:  # before the evaluations: the write goes on while they run
            check_finite(step, *finite_probe(loss_sum, grad_norm))
            with run.timeline.phase("checkpoint"):
                start = time.perf_counter()
                complete_checkpoint(run)  # the previous save, if still writing: training waits for it
                run.checkpointer.save(step, run.model, run.optimizer, last=step == cfg.train.max_steps)
                run.timeline.checkpoint_blocking_s.append(time.perf_counter() - start)
                if signalled and step < cfg.train.max_steps:  # in the grace period: the save completes, the attempt ends
                    complete_checkpoint(run)
                    raise failures.Preempted(step, run.latest_checkpoint, signalled)
        if (cfg.eval.every_steps and step % cfg.eval.every_steps == 0) or step == cfg.train.max_steps:
            eval_loss = log_eval(run, step)
            run.final_eval = eval_loss if step == cfg.train.max_steps else None
        if cfg.eval.task and cfg.eval.task_every_steps and step % cfg.eval.task_every_steps == 0 \
                and step != cfg.train.max_steps:  # the final one runs in `finish`, on the export's copy
            run_task_eval(run, step)
    run.timeline.sync()
    loop_s = time.perf_counter() - loop_start
    train_s = loop_s - (sum(run.timeline.seconds[p] for p in ("eval", "checkpoint", "task_eval")) - outside_train)
    steps = cfg.train.max_steps - run.start_step
    if steps:
        warmup = max(0.0, first_step_s - (train_s - first_step_s) / (steps - 1)) if steps > 1 else 0.0
        run.timeline.add("warmup", warmup)
        run.timeline.add("train", train_s - warmup)


def train_step(run: Run, lr: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One optimizer step over `grad_accum_steps` micro-batches; returns (loss sum, target count, grad norm),
    on the device (no host sync)."""
    cfg, world = run.cfg, run.world
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    micro = [next(run.batches) for _ in range(cfg.train.grad_accum_steps)]
    # Token-weighted mean over the global batch: FSDP averages gradients over ranks, so each rank scales
    # its loss sum by world / (targets in the global batch). Counting happens on the host, before transfer.
    targets = to_device(torch.tensor(sum(int((b["labels"] != data_lib.IGNORE_INDEX).sum()) for b in micro)), run.device)
    global_targets = targets.clone()
    dist.all_reduce(global_targets)
    loss_sum = torch.zeros((), device=run.device)
    for batch in micro:
        batch = {k: to_device(v, run.device) for k, v in batch.items()}
        step_loss, _ = run.model(**batch)
        (step_loss * world / global_targets).backward()
        loss_sum += step_loss.detach()
    grad_norm = clip_in_step(run.optimizer, cfg.train.grad_clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return loss_sum, targets, grad_norm


def clip_in_step(optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """The global gradient norm, as `clip_grad_norm_` computes it, and the clipping (`max_norm` > 0) left to the
    optimizer's next (fused) step: its `grad_scale` divides each gradient as the step reads it, by the inverse of
    the factor `clip_grad_norm_` would multiply it by. Multiplying first is one more pass over every gradient
    (~3 ms of a Qwen2.5-1.5B step on an H200)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    norm = full(torch.nn.utils.get_total_norm(grads, foreach=True))
    optimizer.grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0) if max_norm else None
    return norm


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm is NaN or infinite: the run stops before anything is saved."""


def finite_probe(loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> tuple[float, float]:
    """The running loss sum and the last gradient norm as host numbers (a sync; only before a save)."""
    totals = torch.stack([loss_sum.float(), grad_norm.float()])
    dist.all_reduce(totals)
    return totals[0].item(), totals[1].item()


def check_finite(step: int, loss: float, grad_norm: float) -> None:
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise NonFiniteError(f"step {step}: loss {loss}, gradient norm {grad_norm}: training diverged; nothing was "
                             "saved from this point; lower train.lr or raise train.warmup_steps, then resume from the "
                             "last checkpoint")


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (the gradient norm is one when FSDP shards the gradients); any other tensor as is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def unsharded_copy(run: Run) -> PreTrainedModel:
    """The model gathered into a plain copy on this rank, in the dtype training computes in (collective)."""
    return gathered_copy(run.model, torch.bfloat16 if run.bf16 else torch.float32, run.device)


def log_eval(run: Run, step: int) -> float | None:
    """Held-out loss and perplexity at `step` (None without a held-out split)."""
    if run.dataset.validation is None:
        return None
    with run.timeline.phase("eval"):
        eval_loss = evaluate(run.model, run.dataset.validation, run.cfg, run.rank, run.world, run.device)
    run.log({"kind": "eval", "step": step, "eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 50))})
    return eval_loss


def run_task_eval(run: Run, step: int, lm: PreTrainedModel | None = None) -> None:
    """Task evaluation at `step` on an unsharded copy of the model (`lm`, or gathered here)."""
    with run.timeline.phase("checkpoint"):
        run.checkpointer.wait_device_copy()  # the decoding's cache may need the room a save's copy holds
    with run.timeline.phase("task_eval"):
        start = time.perf_counter()
        lm = lm if lm is not None else unsharded_copy(run)
        result = task_evaluate(lm, run.tokenizer, run.task_items, run.cfg.eval, run.rank, run.world, run.device, step)
        result["seconds"] = time.perf_counter() - start
    log_task_eval(run, result)


@dataclass
class PendingTaskEval:
    """A task decoding begun: in a thread (`background`; `wait` joins it) or already done."""

    wait: Callable[[], TaskShare]
    background: bool


def start_baseline(model: CausalLMWithLoss, tokenizer: PreTrainedTokenizerBase, items: list[dict],
                   cfg: config_lib.RunConfig, rank: int, world: int, device: torch.device,
                   bf16: bool) -> PendingTaskEval | None:
    """The task baseline (the model before any step) decoding in a thread on a plain copy of `model`, which is
    not sharded yet (no collective), when the device has room for it beside the work that goes on meanwhile
    (`room_to_decode_beside`); None without room (then `baseline_at_step_0` decodes it).

    Beside the data's tokenizing (host work) the decoding has the device to itself. Beside the first held-out
    evaluation, which compiles the forward, each slowed the other: 20 s together against 23 s one after the
    other; the compiler's kernel benchmarks wait for the device, which the decoding keeps busy. The thread makes no
    collective call, so the ranks' collectives stay in one order."""
    lm = gathered_copy(model, torch.bfloat16 if bf16 else torch.float32, device)
    if not room_to_decode_beside(device, lm, tokenizer, items, cfg.eval, rank, world):
        return None
    return PendingTaskEval(in_background(task_decode, lm, tokenizer, items, cfg.eval, rank, world, device),
                           background=True)


def baseline_at_step_0(run: Run) -> PendingTaskEval:
    """The task baseline's decoding: the one `build` began on this rank, or, when any rank had no room for it
    there, decoded now, on a copy of the model that every rank gathers (collective: all ranks take part in the
    gather if any rank needs it, so they stay in step)."""
    missing = torch.tensor(float(run.baseline is None), device=run.device)
    dist.all_reduce(missing, op=dist.ReduceOp.MAX)
    if not missing.item():
        return run.baseline
    with run.timeline.phase("task_eval"):
        lm = unsharded_copy(run)
        if run.baseline is not None:
            return run.baseline
        share = task_decode(lm, run.tokenizer, run.task_items, run.cfg.eval, run.rank, run.world, run.device)
    return PendingTaskEval(lambda: share, background=False)


def finish_task_eval(run: Run, step: int, pending: PendingTaskEval) -> None:
    """Waits for the decoding `pending` and logs the task evaluation at `step` (collective). A background
    decoding is charged to the `task_eval` phase only for the wait: the record's `seconds` is the decoding's own,
    `overlapped_s` the part of it that overlapped other phases."""
    with run.timeline.phase("task_eval"):
        start = time.perf_counter()
        share = pending.wait()
        result = task_record(share, run.cfg.eval, run.device, step)
    waited = time.perf_counter() - start
    overlapped = max(0.0, share.seconds - waited) if pending.background else 0.0
    log_task_eval(run, {**result, "seconds": share.seconds, "overlapped_s": overlapped})


def log_task_eval(run: Run, result: dict) -> None:
    run.task_results.append(result)
    run.log(result)


DECODE_HEADROOM = 0.25
"""Share of the device's memory kept free beside a background decoding's KV cache, for what runs meanwhile
(sharding the model, the first held-out forward: one micro-batch's activations, and the compiler's scratch)."""


def room_to_decode_beside(device: torch.device, lm: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                          items: list[dict], eval_cfg: config_lib.EvalConfig, rank: int, world: int) -> bool:
    """Whether this rank's task decoding by `lm` fits beside other work: on CPU always; on a GPU when twice its
    largest batch's KV cache (the cache and the prefill's passing activations) leaves `DECODE_HEADROOM` of the
    device free. (Tokenizing the prompts here, on every device before the thread starts, also leaves the
    tokenizer in the state both threads then use it in.)"""
    mine = rank_items(items, eval_cfg, rank, world)
    longest = max(len(ids) for ids in tokenizer([x["prompt"] for x in mine], add_special_tokens=False)["input_ids"])
    if device.type != "cuda":
        return True
    cache = kv_cache_bytes(lm.config, min(eval_cfg.task_batch_size, len(mine)), longest + eval_cfg.task_max_new_tokens,
                           lm.dtype)
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free - 2 * cache >= DECODE_HEADROOM * total


def complete_checkpoint(run: Run) -> None:
    """Completes the checkpoint in flight, if any (collective), and logs how long its write took."""
    done = run.checkpointer.finish()
    if done is not None:
        run.latest_checkpoint = done["uri"]
        run.log({"kind": "checkpoint", "step": done["step"], "dir": done["uri"], "write_s": done["write_s"],
                 "checksum_s": done["checksum_s"], "blocking_s": run.timeline.checkpoint_blocking_s[-1],
                 "staging": done["staging"]})


def finish(run: Run, weights: Callable[[], dict], exporting: bool,
           acceptance: export_lib.AcceptanceProcess | None) -> dict:
    """After the last step, on one unsharded copy of the model: the export (when `exporting`), written first and
    checked in its own process (`acceptance`, rank 0's) while the final task evaluation and the sample run here,
    all while the last checkpoint's write goes on; that checkpoint is completed before the export's verdict is
    collected, or last when there is no export or it fails, and always before the job reports success. Returns
    the results for the run record."""
    cfg = run.cfg
    accepted = None
    try:
        task_due = cfg.eval.task and run.start_step < cfg.train.max_steps  # a re-run of a finished run has it
        lm = pending = None
        if task_due or exporting or cfg.eval.sample_prompt is not None:
            with run.timeline.phase("checkpoint"):
                run.checkpointer.wait_device_copy()  # the model's copy and the decoding may need its room
            with run.timeline.phase("export"):
                lm = unsharded_copy(run)
                if exporting:  # written now and checked in the acceptance process while the task evaluation runs
                    pending = start_export(run, lm, acceptance)
        if task_due:
            run_task_eval(run, cfg.train.max_steps, lm)
        if cfg.eval.sample_prompt is not None:
            text = generate_sample(lm, run.tokenizer, cfg.eval.sample_prompt, cfg.eval.sample_tokens, run.device)
            run.log({"kind": "sample", "step": cfg.train.max_steps, "prompt": cfg.eval.sample_prompt, "text": text})
        if exporting:
            # The last save's write is usually done by now: completing it (and pruning the checkpoint it
            # replaces, seconds for 19 GB) overlaps the export's check, which goes on in its own process.
            with run.timeline.phase("checkpoint"):
                complete_checkpoint(run)
            with run.timeline.phase("export"):
                accepted = finish_export(run, pending, acceptance)
        del lm
    finally:
        with run.timeline.phase("checkpoint"):
            complete_checkpoint(run)
    time_summary = run.timeline.summary()
    run.log({"kind": "time", "step": cfg.train.max_steps, **time_summary})
    if run.logger:
        print(format_timeline(time_summary), flush=True)
        run.logger.close()
    results = {"checkpoints": {"dir": run.run_dir, "latest": run.latest_checkpoint, "keep_last": cfg.checkpoint.keep_last},
               "time": time_summary, "weights": weights()}
    if accepted is not None:
        results["export"] = accepted
    if cfg.eval.task:
        results["evaluation"] = run.task_results
    return results


def start_export(run: Run, lm: PreTrainedModel, acceptance: export_lib.AcceptanceProcess | None) -> dict | None:
    """Writes the export of the final model and starts its check (`export.start_export`) against the final
    held-out loss (measured here when the loop did not, e.g. a finished run re-run, or on seeded random blocks
    for runs without a held-out split)."""
    cfg = run.cfg
    heldout, kind = run.dataset.validation, "validation"
    if heldout is None:
        heldout, kind = synthetic_heldout(lm.config.vocab_size, 2 * run.world * cfg.train.micro_batch_size,
                                          cfg.train.seq_len, cfg.train.seed), "synthetic"
    if run.final_eval is None or kind == "synthetic":
        run.final_eval = evaluate(run.model, heldout, cfg, run.rank, run.world, run.device)
    reference = {"eval_loss": run.final_eval, "step": cfg.train.max_steps, "world_size": run.world, "heldout": kind}
    batches = heldout_batches(len(heldout), run.world, cfg.train.micro_batch_size, cfg.eval.max_batches)
    adapters = adapter_state_dict(run.model.lm) if cfg.model.lora.rank else None  # collective when sharded
    return export_lib.start_export(lm, run.tokenizer, cfg, run.run_dir, reference, heldout, batches, acceptance,
                                   adapters)


def finish_export(run: Run, pending: dict | None, acceptance: export_lib.AcceptanceProcess | None) -> dict:
    """The verdict on the export `start_export` began (collective), logged."""
    accepted = export_lib.finish_export(pending, acceptance)
    run.log({"kind": "export", "step": run.cfg.train.max_steps, "dir": accepted["export_dir"],
             "eval_loss": accepted["eval_loss"], "reference_eval_loss": run.final_eval,
             "abs_diff": accepted["abs_diff"], "generation": accepted["generation"]["text"],
             "timings": accepted["timings"]})
    return accepted


def in_background(fn: Callable, *args) -> Callable[[], object]:
    """Runs `fn(*args)` in a daemon thread; returns a function that waits for its result (or raises its error)."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn(*args)
        except Exception as e:  # re-raised in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()

    def wait():
        thread.join()
        if "error" in result:
            raise result["error"]
        return result["value"]

    return wait


def build_optimizer(model: torch.nn.Module,
                    cfg: config_lib.TrainConfig) -> tuple[torch.optim.Optimizer, Callable[[int], float]]:
    """Fused AdamW (which also applies the gradient clipping, `clip_in_step`) over the trainable parameters, with
    weight decay on matrices only, and the warmup + cosine schedule."""
    trained = [p for p in model.parameters() if p.requires_grad]  # with LoRA, the adapters
    decay = [p for p in trained if p.ndim >= 2]
    no_decay = [p for p in trained if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        fused=True,
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
