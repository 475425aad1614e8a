"""The training loop, run once per worker, the same under Ray Train and torchrun.

`train_loop` sets up the device, the process group and the run record; `fit` then reads as three steps:
`build.build` → `train` (one optimizer step, then each part asked whether its work is due) → `finish.finish`. Every
phase is timed (`metrics.Timeline`), so each run records where its wall time went.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import config as config_lib
from ..records import failures, nccl, run_record
from ..records import preflight as preflight_lib
from ..signals import SavedThenStopped, Stopped
from . import compile_cache, schedule
from .build import build
from .contract import Launcher, LoopConfig
from .finish import export_due, finish
from .metrics import INNER_PHASES, StepProfiler, Timeline
from .model import export
from .optimizer import clip_in_step
from .pairs import make_pairs
from .parts import Interval, LoopState, StepResult
from .trainer import Trainer

# Without `preflight.enabled`, every run still takes one small all-reduce: it creates NCCL's communicators, so
# the transport NCCL chose is in its log, and gathers each worker's environment for the run record.
RECORD_ONLY_PREFLIGHT = config_lib.PreflightConfig(sizes_mib=[1], iters=1, warmup=1)


def train_loop(loop_config: LoopConfig, launcher: Launcher) -> None:
    """Entry point of every worker: `loop_config` is what the driver prepared, `launcher` what runs this loop.

    Around `fit`, rank 0 keeps run.json: opened after the preflight, closed with the results or the error.
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
                       seed=cfg.train.seed, logs=failures.attempt_logs(run_dir, loop_config.started_at))
    try:
        with timeline.phase("startup"):
            preflight = preflight_lib.run_preflight(cfg.preflight if full_preflight else RECORD_ONLY_PREFLIGHT,
                                                    device, log_dir=nccl_log_dir)
    except preflight_lib.PreflightError as exc:
        failures.save_traceback(run_dir, loop_config.started_at, rank, exc)
        if rank == 0:
            record = run_record.start_record(run_dir, preflight=exc.result, **record_args)
            run_record.finish_record(run_dir, record, status="failed", error=exc, rank=rank)
        raise
    record = run_record.start_record(run_dir, preflight=preflight, **record_args) if rank == 0 else None
    if rank == 0 and full_preflight:
        print(json.dumps({"kind": "preflight", **{k: v for k, v in preflight.items() if k != "workers"}}), flush=True)
    if cfg.mode == "preflight":
        if record:
            run_record.finish_record(run_dir, record)
        return

    try:
        results = (make_pairs if cfg.mode == "pairs" else fit)(loop_config, launcher, device, record, timeline)
    except BaseException as exc:
        saved = isinstance(exc, SavedThenStopped)
        if not saved:
            failures.save_traceback(run_dir, loop_config.started_at, rank, exc)
        if record:  # a Ctrl-C in a terminal reaches the workers too: cancelled, not failed
            status = "cancelled" if isinstance(exc, (KeyboardInterrupt, Stopped)) else "failed"
            checkpoints = {"checkpoints": {"dir": run_dir, "latest": exc.checkpoint,
                                           "keep_last": cfg.checkpoint.keep_last}} if saved else {}
            run_record.finish_record(run_dir, record, status=status, error=exc, rank=rank, time=timeline.summary(),
                                   **checkpoints)
        if saved:  # every rank ends together, once rank 0's record says so (Ray stops the group at the first)
            dist.barrier()
        if isinstance(exc, Stopped):  # the run ends here, recorded: an error would have Ray Train retry it
            return
        raise
    if record:
        run_record.finish_record(run_dir, record, **results)
    launcher.report({"step": cfg.train.max_steps})


def fit(loop_config: LoopConfig, launcher: Launcher, device: torch.device, record: dict | None,
        timeline: Timeline) -> dict:
    """Builds, trains and finishes the run; returns results for the run record (rank 0's are used)."""
    trainer = build(loop_config, launcher, device, record, timeline)
    exporting = export_due(trainer.worker.cfg, trainer.worker.run_dir)
    # The export's checking process starts now, so its imports are done when the export is written.
    acceptance = export.start_acceptance() if exporting else None
    state = LoopState(step=trainer.start_step, interval=Interval.on(device), latest_checkpoint=trainer.resumed_from)
    try:
        train(trainer, state)
        return finish(trainer, state, exporting, acceptance)
    except BaseException:
        trainer.checkpointer.abandon()
        raise
    finally:
        if acceptance is not None:
            acceptance.close()
        trainer.checkpointer.close()
        trainer.watchdog.stop()


def train(trainer: Trainer, state: LoopState) -> None:
    """The loop, from the step after the resume point to `train.max_steps`: one optimizer step per iteration, then
    each part asked, in order, whether its work is due (each timed as its own phase; the rest is training)."""
    cfg = trainer.worker.cfg
    for part in trainer.parts:
        part.start(state)
    clock = LoopClock.begin(trainer)
    tokens_per_step = cfg.train.grad_accum_steps * cfg.train.micro_batch_size * cfg.train.seq_len
    try:
        for step in range(trainer.start_step + 1, cfg.train.max_steps + 1):
            state.begin_step(step)
            logged_loss_factor = trainer.faults.at_step(step)  # debug.fail_at_step; 1.0 but after a spike or nan
            profiling = trainer.worker.logger and step == cfg.debug.profile_step
            profiler = StepProfiler(trainer.worker.device) if profiling else None
            state.lr = schedule.learning_rate(step, cfg.train)
            result = train_step(trainer, state.lr)
            state.grad_norm = result.grad_norm
            state.interval.add(result, logged_loss_factor, tokens_per_step)
            if profiler:
                trainer.worker.log({"kind": "profile", "step": step, **profiler.finish(trainer.worker.run_dir, step)})
            clock.step_done(trainer)
            trainer.watchdog.step_done(step)
            for part in trainer.parts:
                if part.due(state):
                    part.run(state)
    except BaseException:  # what a failed attempt trained counts too; no sync: the device may be what failed
        clock.account(trainer, sync=False)
        raise
    clock.account(trainer)


def train_step(trainer: Trainer, lr: float) -> StepResult:
    """One optimizer step over `grad_accum_steps` micro-batches, on the device (no host sync)."""
    worker, objective = trainer.worker, trainer.objective
    for group in trainer.optimizer.param_groups:
        group["lr"] = lr
    micro = [next(trainer.batches) for _ in range(worker.cfg.train.grad_accum_steps)]
    # The objective's loss is a sum over units (target tokens): each rank scales its sum by world / (units in the
    # global batch), as FSDP averages gradients over ranks. Counting happens on the host, before transfer.
    units = to_device(torch.tensor(sum(objective.units(b) for b in micro)), worker.device)
    global_units = units.clone()
    dist.all_reduce(global_units)
    loss_sum, metrics = torch.zeros((), device=worker.device), {}
    for batch in micro:
        batch = {k: to_device(v, worker.device) for k, v in batch.items()}
        loss, batch_metrics = objective.loss(trainer.model, batch)
        (loss * worker.world / global_units).backward()
        loss_sum += loss.detach()
        for name, value in batch_metrics.items():
            metrics[name] = metrics[name] + value.detach() if name in metrics else value.detach()
    grad_norm = clip_in_step(trainer.optimizer, worker.cfg.train.grad_clip)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_sum, units, grad_norm, metrics)


@dataclass
class LoopClock:
    """The loop's wall time, split at its end into `warmup` (the first step's time beyond a typical step) and
    `train` (the rest, less the phases timed inside it)."""

    start: float
    outside_train: float
    """The seconds of the phases timed inside the loop (eval, checkpoint, task_eval) spent before it began."""
    first_step_s: float | None = None
    steps: int = 0
    """Steps finished since the loop began."""

    @classmethod
    def begin(cls, trainer: Trainer) -> LoopClock:
        """The clock started as the loop begins (the device's peak memory counted from here)."""
        timeline = trainer.worker.timeline
        if trainer.worker.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.worker.device)
        timeline.sync()
        clock = cls(time.perf_counter(), sum(timeline.seconds[p] for p in INNER_PHASES))
        timeline.training_since = (clock.start, clock.outside_train)
        return clock

    def step_done(self, trainer: Trainer) -> None:
        """After each step; after the first, everything the training step compiles has been compiled (and is kept
        on the storage for the next attempt, `compile_cache`)."""
        self.steps += 1
        if self.steps > 1:
            return
        if trainer.compile_cache and trainer.worker.rank == 0:
            compile_cache.save(trainer.compile_cache)
        trainer.worker.timeline.sync()
        self.first_step_s = time.perf_counter() - self.start

    def account(self, trainer: Trainer, sync: bool = True) -> None:
        """The loop's time into `warmup` and `train`, over the steps it finished (none finished: left as `other`)."""
        timeline = trainer.worker.timeline
        if sync:
            timeline.sync()
        timeline.training_since = None
        loop_s = time.perf_counter() - self.start
        train_s = loop_s - (sum(timeline.seconds[p] for p in INNER_PHASES) - self.outside_train)
        if self.first_step_s is None:
            return
        steps = self.steps
        warmup = max(0.0, self.first_step_s - (train_s - self.first_step_s) / (steps - 1)) if steps > 1 else 0.0
        timeline.add("warmup", warmup)
        timeline.add("train", train_s - warmup)


def to_device(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """Copy without making the host wait: a copy from pageable memory blocks until the GPU's queue is done, so the
    host could not queue the next step's kernels ahead."""
    if tensor is None:
        return None
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
