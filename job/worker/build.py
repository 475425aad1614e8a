"""Building one worker's training before its first step (`build`): tokenizer, model, data (a fresh run's task
baseline decoding beside it), FSDP2 sharding, optimizer, the resume point, and the loop's parts."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from .. import config as config_lib
from ..common import checkpoints
from ..common.sources import tokenizer_from_json
from ..records import run_record
from ..records.tracking import MlflowMetrics
from . import compile_cache, schedule
from . import data as data_lib
from .checkpoint.resume import data_start, find_resume_point, restore
from .checkpoint.writer import Checkpointer
from .contract import Launcher, LoopConfig
from .evaluation.heldout import HeldoutEvaluation
from .evaluation.preference import PreferenceEvaluation, compute_reference
from .evaluation.task import PendingTaskEval, TaskEvaluation, start_baseline, task_items
from .faults import FaultInjection, write_pid
from .metrics import MetricsLogger, Timeline, flops_per_token, peak_flops
from .model.causal_lm import CausalLMWithLoss, build_causal_lm, load_tokenizer, weights_fingerprint
from .model.export import merged_room_problem
from .model import nf4
from .model.lora import add_adapters
from .model.parallelize import device_mesh, parallelize
from .objective import DirectPreference, NextTokenPrediction
from .optimizer import build_optimizer
from .parts import Checkpointing, LogStep, Worker, in_background
from .trainer import Trainer
from .watchdog import Watchdog


def build(loop_config: LoopConfig, launcher: Launcher, device: torch.device, record: dict | None,
          timeline: Timeline) -> Trainer:
    """Tokenizer, model, data (the task baseline beside it), sharding, optimizer, resume point and parts, in that
    order; `record` is rank 0's run record (None elsewhere)."""
    cfg, run_dir = loop_config.cfg, loop_config.run_dir
    rank, world = dist.get_rank(), dist.get_world_size()
    write_pid(run_dir, rank)
    bf16 = cfg.parallel.mixed_precision == "bf16" or (cfg.parallel.mixed_precision == "auto" and device.type == "cuda")
    dpo = cfg.train.objective == "dpo"

    # ---- Tokenizer, then the model (as loaded, or seeded), then the data: a fresh run's task baseline decodes
    # on a plain copy of that model while the data is tokenized, on a device busy with nothing else
    # (`start_baseline`). Every rank gets the same packed blocks and reads only its shard of them.
    with timeline.phase("data"):
        tokenizer = run_tokenizer(loop_config)
    with timeline.phase("resume"):
        resume_from, skipped = find_resume_point(cfg, run_dir)
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
        run_record.update_record(run_dir, record, dataset=dataset.fingerprint, tokenizer_sha256=tokenizer_sha)

    # ---- FSDP2 shards the model across the ranks.
    with timeline.phase("model"):
        mesh = device_mesh(device.type, world, cfg.parallel.shard_group_size)
        model = parallelize(unsharded, cfg.parallel, mesh, bf16)
        optimizer = build_optimizer(model, cfg.train)
        identity = checkpoints.run_identity(cfg, world, dataset.fingerprint)
        if adapted:
            identity.update(lora_preflight(cfg, run_dir, weights, n_params - n_trainable, bf16))
        checkpointer = Checkpointer(cfg, run_dir, device, identity)
        faults = FaultInjection(cfg, rank, run_dir, checkpointer)
        # DPO's reference: the model as it starts, so before a checkpoint's weights replace it.
        reference = compute_reference(model, dataset, cfg, run_dir, data_lib.data_key(cfg.data, cfg.train, tokenizer),
                                      rank, world, device) if dpo else None

    # ---- Resume: the run's latest complete checkpoint (or checkpoint.resume's), resharded onto this world size.
    start_step, start_micro, resumed, data_exact = 0, 0, None, True
    with timeline.phase("resume"):
        if resume_from is not None:
            resumed = restore(resume_from, model, optimizer, cfg, identity)
            start_step = resumed["step"]
            start_micro, data_exact = data_start(resumed, cfg, world,
                                                 len(dataset.train) if dataset.train is not None else None)

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
    worker = Worker(cfg, run_dir, device, rank, world, bf16, timeline, logger)
    worker.log({"kind": "start", "start_step": start_step, "params": n_params, "trainable_params": n_trainable,
                "method": method(cfg.model.lora) if adapted else "full", "lora_rank": cfg.model.lora.rank,
                "lora_layers": len(adapted), **base_memory(model, cfg.model.lora),
                "flops_per_token": flops_tok, "world_size": world,
                "mesh": list(mesh.shape), "sharded": isinstance(model, FSDPModule), "device": str(device), "bf16": bf16,
                **setup_peak(device),
                "data": dataset.fingerprint, "data_cache": data_cache, "compile_cache": cache_state})
    if reference is not None:
        worker.log({**reference, "step": start_step})
    if resumed is not None or skipped:
        resume_record = {"step": start_step, "checkpoint": resume_from, "skipped": skipped}
        if resumed is not None:
            resume_record.update(saved_world_size=resumed["world_size"], micro_batch_index=start_micro,
                                 data_exact=data_exact,
                                 lr_schedule_changes=schedule.changes(resumed, cfg.train))
        worker.log({"kind": "resume", **resume_record})
        if record:
            run_record.update_record(run_dir, record, resumed_from=resume_record)
    items = task_items(dataset.validation_examples, cfg.data, tokenizer) if cfg.eval.task else []
    return Trainer(
        worker=worker, tokenizer=tokenizer, dataset=dataset, model=model, optimizer=optimizer,
        objective=DirectPreference(cfg.train.dpo) if dpo else NextTokenPrediction(), batches=batches, start_step=start_step, resumed_from=resume_from,
        checkpointer=checkpointer, faults=faults,
        log_step=LogStep(worker, checkpointer, launcher.preempted, launcher.stop_requested, flops_tok,
                         peak_flops(device, cfg.logging.peak_flops)),
        checkpointing=Checkpointing(worker, checkpointer, model, optimizer, start_step),
        heldout=(PreferenceEvaluation if dpo else HeldoutEvaluation)(worker, model, dataset.validation, start_step),
        task=TaskEvaluation(worker, model, checkpointer, tokenizer, items, start_step, baseline),
        weights=weights,
        compile_cache=cache_uri if cache_state and not cache_state["loaded"] else None,
        watchdog=start_watchdog(worker, record, start_step),  # last: nothing after it can fail and leave it running
    )


def run_tokenizer(loop_config: LoopConfig):
    """The tokenizer the driver trained (`model.train_tokenizer_vocab`), else the configured one."""
    json_text = loop_config.tokenizer_json
    return tokenizer_from_json(json_text) if json_text else load_tokenizer(loop_config.cfg.model)


def start_watchdog(worker: Worker, record: dict | None, start_step: int) -> Watchdog:
    """This attempt's hang watchdog (collective: the attempt's number, as rank 0's record counts it, names the
    stack files); on rank 0 it closes the record before the process ends."""
    attempt = torch.tensor(len(record["previous_attempts"]) + 1 if record else 0, device=worker.device)
    dist.broadcast(attempt, src=0)

    def close_record(error) -> None:
        run_record.finish_record(worker.run_dir, record, status="failed", error=error, rank=error.rank,
                                 time=worker.timeline.summary())

    watchdog = Watchdog(worker.cfg.train.hang_timeout_s, worker.run_dir, worker.rank, int(attempt.item()), start_step,
                        close_record if record else None, worker.world, dist.get_backend() == "gloo")
    worker.timeline.on_phase = watchdog.phase
    return watchdog


def method(lora: config_lib.LoraConfig) -> str:
    return "qlora" if lora.quantize_base else "lora"


def setup_peak(device: torch.device) -> dict:
    """The start record's peak of the device's memory so far (the model's build, sharding and reference pass), which
    the loop's own peak (reset as it begins) does not include: a QLoRA base must fit while it is built too."""
    if device.type != "cuda":
        return {}
    return {"setup_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30}


def base_memory(model: CausalLMWithLoss, lora: config_lib.LoraConfig) -> dict:
    """The start record's account of the frozen base on this rank's device (after sharding and casting): its GiB,
    and with QLoRA the quantization, its library and how many weights are NF4 (and kept whole outside FSDP2)."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    out = {"base_gib": sum(nf4.nbytes(p) for p in frozen) / 2**30, "quantize_base": lora.quantize_base}
    if lora.quantize_base:
        quantized = [p for p in frozen if nf4.is_nf4(p)]
        out.update(quantization={**nf4.recipe(lora), "library": nf4.library()}, nf4_weights=len(quantized))
        if isinstance(model, FSDPModule):
            out["nf4_whole_on_every_rank"] = sum(1 for p in quantized if not hasattr(p, "_local_tensor"))
    return out


def lora_preflight(cfg: config_lib.RunConfig, run_dir: str, weights: Callable[[], dict], n_frozen: int,
                   bf16: bool) -> dict:
    """A LoRA run's identity keys (from rank 0's fingerprint of the base weights) and, with
    `model.lora.merged_export`, rank 0's check of room for the merged weights; before the first step (collective)."""
    problem = None
    if dist.get_rank() == 0:
        identity = checkpoints.adapter_identity(cfg, weights(), nf4.recipe(cfg.model.lora))
        if cfg.model.lora.merged_export:
            problem = merged_room_problem(run_dir, n_frozen * (2 if bf16 else 4))
    box = [identity if dist.get_rank() == 0 else None, problem]
    dist.broadcast_object_list(box, src=0)
    if box[1]:
        raise config_lib.ConfigError(box[1])
    return box[0]
