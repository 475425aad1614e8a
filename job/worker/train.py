"""The training loop, run once per worker: the same function under Ray Train and under torchrun.

`train_loop` (given the driver's `LoopConfig` and the `contract.Launcher` that runs it) sets up the device, the
process group and the run record, then `fit` reads as three steps: `build.build` (tokenizer, data, model, FSDP2,
optimizer, resume) → `train` (the loop: step, log, evaluate, checkpoint) → `finish.finish` (last checkpoint,
final task evaluation and sample, export). Every phase is timed (`metrics.Timeline`), so each run records where
its wall time went and its goodput.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import config as config_lib
from ..records import evidence, failures, nccl
from ..records import preflight as preflight_lib
from . import compile_cache, schedule
from . import data as data_lib
from . import export as export_lib
from .build import build
from .contract import Launcher, LoopConfig
from .evaluate import evaluate
from .finish import finish
from .metrics import StepProfiler, Timeline
from .optimizer import clip_in_step
from .run import Run, complete_checkpoint
from .task_eval import baseline_at_step_0, finish_task_eval, run_task_eval
from .watchdog import HangError, LossSpikes, Watchdog

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


def train(run: Run) -> None:
    """The loop, from the step after the resume point to `train.max_steps`: one optimizer step per iteration;
    logs, evaluations and checkpoints at their intervals (each timed as its own phase, the rest is training)."""
    cfg = run.cfg
    start_training(run)
    interval = Interval(torch.zeros((), device=run.device), torch.zeros((), device=run.device))
    clock = LoopClock.begin(run)
    spikes, signalled = LossSpikes(cfg.train.loss_spike_factor, cfg.train.loss_spike_intervals), 0
    for step in range(run.start_step + 1, cfg.train.max_steps + 1):
        logged_loss_factor = run.faults.at_step(step)  # debug.fail_at_step; 1.0 but after a loss_spike or nan
        profiler = StepProfiler(run.device) if run.logger and step == cfg.debug.profile_step else None
        lr = schedule.learning_rate(step, cfg.train)
        loss, targets, grad_norm = train_step(run, lr)
        interval.add(loss if logged_loss_factor == 1 else loss * logged_loss_factor, targets, cfg.train)
        if profiler:
            run.log({"kind": "profile", "step": step, **profiler.finish(run.run_dir, step)})
        if clock.first_step_s is None:
            clock.first_step_done(run)
        if step == run.start_step + 2:  # the first step that holds AdamW's state throughout: training's peak is known
            run.checkpointer.prepare_staging(run.model, run.optimizer)
        if step % cfg.logging.every_steps == 0 or step == cfg.train.max_steps:
            signalled = log_step(run, step, lr, grad_norm, interval, spikes)
        run.watchdog.step_done(step)
        if run.checkpointer.due(step) or signalled:  # before the evaluations: the write goes on while they run
            save_checkpoint(run, step, interval.loss_sum, grad_norm, signalled)
        evaluate_when_due(run, step)
    clock.account(run)


def start_training(run: Run) -> None:
    """Before the first step: the checkpoint writer chosen and started (it runs beside the steps), and on a fresh
    run the untrained baselines that later evaluations are read against."""
    cfg = run.cfg
    with run.timeline.phase("checkpoint"):
        run.log({"kind": "checkpoint_writer", "step": run.start_step, **run.checkpointer.prepare(run.model)})
    if run.start_step == 0:
        baseline = baseline_at_step_0(run) if cfg.eval.task and cfg.eval.task_at_start else None
        if cfg.eval.every_steps:
            log_eval(run, 0)
        if baseline is not None:
            finish_task_eval(run, 0, baseline)


@dataclass
class Interval:
    """What the loop sums between two log steps: loss and targets kept on the device (reading them, at the log
    step, is the loop's only host sync), and the tokens trained and since when, for the throughput."""

    loss_sum: torch.Tensor
    target_sum: torch.Tensor
    tokens: int = 0
    start: float = field(default_factory=time.perf_counter)

    def add(self, loss: torch.Tensor, targets: torch.Tensor, cfg: config_lib.TrainConfig) -> None:
        self.loss_sum += loss
        self.target_sum += targets
        self.tokens += cfg.grad_accum_steps * cfg.micro_batch_size * cfg.seq_len

    def restart(self) -> None:
        self.loss_sum.zero_(), self.target_sum.zero_()
        self.tokens, self.start = 0, time.perf_counter()


class LogTotals(NamedTuple):
    """What a log step's one all-reduce gives every rank."""

    mean_loss: float
    """The interval's loss per target token, over all ranks."""
    writes_done: int
    """How many ranks have no checkpoint write in flight."""
    preempted: int
    """How many ranks were asked to stop for a preemption: the ranks agree to stop at this step."""


def all_reduce_log_totals(run: Run, interval: Interval) -> LogTotals:
    """The log step's all-reduce: the interval's loss and target sums, with each rank's flags beside them."""
    flags = torch.tensor([float(run.checkpointer.write_done()), float(run.preempted())], device=run.device)
    totals = torch.cat([torch.stack([interval.loss_sum, interval.target_sum]), flags])
    dist.all_reduce(totals)
    loss_sum, target_sum, writes_done, preempted = totals
    preempted = int(preempted.item())
    mean_loss = (loss_sum / target_sum).item()  # syncs with the device, so the interval's time is real
    return LogTotals(mean_loss, int(writes_done.item()), preempted)


def log_step(run: Run, step: int, lr: float, grad_norm: torch.Tensor, interval: Interval, spikes: LossSpikes) -> int:
    """The log step: the interval's metrics logged and checked (finite, no spike), the checkpoint every rank has
    written completed, the interval restarted; returns how many ranks were asked to stop for a preemption."""
    totals = all_reduce_log_totals(run, interval)
    check_finite(step, totals.mean_loss, grad_norm.item())
    tokens_per_s_device = interval.tokens / (time.perf_counter() - interval.start)
    run.log({
        "kind": "train",
        "step": step,
        "loss": totals.mean_loss,
        "lr": lr,
        "grad_norm": grad_norm.item(),
        "tokens_per_s": tokens_per_s_device * run.world,
        "tokens_per_s_per_device": tokens_per_s_device,
        "mfu": tokens_per_s_device * run.flops_per_token / run.peak_flops if run.peak_flops else None,
        "peak_mem_gib": torch.cuda.max_memory_allocated(run.device) / 2**30 if run.device.type == "cuda" else None,
    })
    spikes.check(step, totals.mean_loss)  # after the log: the record's step is the spike's
    if totals.writes_done == run.world:  # every rank's checkpoint write (if any) has returned
        complete_checkpoint(run)
    interval.restart()
    return totals.preempted


def save_checkpoint(run: Run, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor, signalled: int) -> None:
    """Saves `step` (the previous save completed first: training waits for it); with a preemption `signalled`
    before the last step, completes the save and ends the attempt (`Preempted`), within the grace period."""
    check_finite(step, *finite_probe(loss_sum, grad_norm))
    with run.timeline.phase("checkpoint"):
        start = time.perf_counter()
        complete_checkpoint(run)
        run.checkpointer.save(step, run.model, run.optimizer, last=step == run.cfg.train.max_steps)
        run.timeline.checkpoint_blocking_s.append(time.perf_counter() - start)
        if signalled and step < run.cfg.train.max_steps:
            complete_checkpoint(run)
            raise failures.Preempted(step, run.latest_checkpoint, signalled)


def evaluate_when_due(run: Run, step: int) -> None:
    """The held-out evaluation and the task evaluation due at `step` (the final task evaluation runs in
    `finish`, on the export's copy of the model)."""
    cfg = run.cfg
    if (cfg.eval.every_steps and step % cfg.eval.every_steps == 0) or step == cfg.train.max_steps:
        eval_loss = log_eval(run, step)
        run.final_eval = eval_loss if step == cfg.train.max_steps else None
    if cfg.eval.task and cfg.eval.task_every_steps and step % cfg.eval.task_every_steps == 0 \
            and step != cfg.train.max_steps:
        run_task_eval(run, step)


@dataclass
class LoopClock:
    """The loop's wall time, split at its end into `warmup` (compilation and warm-up: the first step's time
    beyond a typical step) and `train` (the rest, less the evaluations and checkpoints timed inside it)."""

    start: float
    outside_train: float
    """The seconds of the phases timed inside the loop (eval, checkpoint, task_eval) spent before it began."""
    first_step_s: float | None = None

    PHASES_INSIDE = ("eval", "checkpoint", "task_eval")

    @classmethod
    def begin(cls, run: Run) -> LoopClock:
        """The clock started as the loop begins (the device's peak memory counted from here)."""
        if run.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(run.device)
        run.timeline.sync()
        return cls(time.perf_counter(), sum(run.timeline.seconds[p] for p in cls.PHASES_INSIDE))

    def first_step_done(self, run: Run) -> None:
        """After the first step: everything the training step compiles has been compiled (and is kept on the
        storage for the next attempt, `compile_cache`)."""
        if run.compile_cache and run.rank == 0:
            compile_cache.save(run.compile_cache)
        run.timeline.sync()
        self.first_step_s = time.perf_counter() - self.start

    def account(self, run: Run) -> None:
        run.timeline.sync()
        loop_s = time.perf_counter() - self.start
        train_s = loop_s - (sum(run.timeline.seconds[p] for p in self.PHASES_INSIDE) - self.outside_train)
        steps = run.cfg.train.max_steps - run.start_step
        if steps:
            warmup = max(0.0, self.first_step_s - (train_s - self.first_step_s) / (steps - 1)) if steps > 1 else 0.0
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


def log_eval(run: Run, step: int) -> float | None:
    """Held-out loss and perplexity at `step` (None without a held-out split)."""
    if run.dataset.validation is None:
        return None
    with run.timeline.phase("eval"):
        eval_loss = evaluate(run.model, run.dataset.validation, run.cfg, run.rank, run.world, run.device)
    run.log({"kind": "eval", "step": step, "eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 50))})
    return eval_loss


def to_device(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """Copies without making the host wait for the GPU: a copy from pageable memory would block until the
    GPU has finished all queued work, so the host could not queue the next step's kernels ahead."""
    if tensor is None:
        return None
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
