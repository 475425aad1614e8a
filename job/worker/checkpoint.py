"""Checkpoints on shared storage, exact resume, fault injection, and the checked Hugging Face export.

Layout of a run (`<storage_path>/<name>/`, a local directory, a mounted PVC/NFS path or an `s3://` URI):

    config.yaml                      resolved config that trained the checkpoints (evidence.config_file)
    lease.json, heartbeat.json       the driver writing the run, while it runs (job/records/lease.py)
    attempts/<n>/                    config.yaml and run.json of attempts that ran beside a finished record
    metrics.jsonl                    rank 0's metric records (lines past a resumed step are dropped)
    checkpoint_00000040/             one checkpoint per saved step, written in place by every rank:
        .metadata, __<rank>_0.distcp     torch.distributed.checkpoint (model + optimizer, sharded; reshardable)
        rng/rank00000.pt ...             per-rank RNG states (torch CPU/CUDA, python, numpy)
        checksums/rank00000.json ...     sha256 and size of each file that rank wrote
        train_state.json                 step, data position, LR schedule, world size, architecture, run
                                         identity (tokenizer, data, seq_len, seed, global batch), config
        _COMPLETE                        written last, by rank 0, after every rank finished: only a directory
                                         with this marker is a checkpoint (a crash mid-save leaves none)
        _UNUSABLE                        (only) a complete checkpoint that failed verification on resume
    export/                          model.safetensors, config.json, tokenizer files, reference.json,
                                     acceptance.json and the `_VALID` marker once the reload check passed
    data_cache/<key>.pt              the run's tokenized, packed data, built once (data.build_once)
    faults/                          markers of injected faults (debug.fail_at_step), so each fires once
    workers/rank<r>.pid              worker process ids (local storage only; for failure drills)

Beside the runs, `<storage_path>/.compile_cache/<key>.bin` keeps what `torch.compile` built (job/worker/compile_cache.py).

Both launchers run the same code (`Checkpointer`): every rank writes its DCP shards straight to the checkpoint
directory and lists their checksums, then rank 0 writes `train_state.json` and `_COMPLETE` and prunes old
checkpoints. A
resume (worker-group restart, retried job, re-run) scans the run directory, newest first, for a checkpoint
whose files all match their checksums. Checkpoints are not reported to Ray Train: its own bookkeeping would
refuse a restart when a listed checkpoint is gone, and prune without knowing which ones are verified.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import random
import shutil
import signal
import threading
import time
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
import torch.distributed as dist

from .. import config as config_lib
from .. import storage

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from .model import CausalLMWithLoss

COMPLETE = "_COMPLETE"
"""Marker file written last into a checkpoint directory: its presence makes the checkpoint complete."""
UNUSABLE = "_UNUSABLE"
"""Marker written into a complete checkpoint that failed verification on resume, with the reason: never used again."""
CHECKSUMS = "checksums"
"""Directory of a checkpoint holding `rank<r>.json`: sha256 and size of each file rank r wrote."""
STATE = "train_state.json"
PREFIX = "checkpoint_"
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"
ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
             "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be used (unreadable, incomplete, another model); names the path."""


class ResumeRefused(CheckpointError):
    """The config asks for what the run's checkpoints forbid (`checkpoint.resume`, another model, settings that
    would not continue the same run): a `config` error (`failures.classify`), not a broken checkpoint."""


def step_dir(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def list_checkpoints(run_dir: str) -> list[tuple[int, str, bool]]:
    """(step, uri, usable) of every `checkpoint_<step>` directory of a run, oldest first; usable: complete
    (`_COMPLETE`) and not found bad on an earlier resume (`_UNUSABLE`)."""
    fs, path = storage.filesystem(run_dir)
    if not fs.exists(path):
        return []
    found = []
    for entry in fs.ls(path, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith(PREFIX) and name[len(PREFIX):].isdigit():
            uri = storage.join(run_dir, name)
            usable = storage.exists(storage.join(uri, COMPLETE)) and not storage.exists(storage.join(uri, UNUSABLE))
            found.append((int(name[len(PREFIX):]), uri, usable))
    return sorted(found)


def latest_complete(run_dir: str) -> str | None:
    complete = [uri for _, uri, ok in list_checkpoints(run_dir) if ok]
    return complete[-1] if complete else None


# --------------------------------------------------------------------------------------------------------------------
# Integrity: content checksums written with every checkpoint, verified before it is loaded
# --------------------------------------------------------------------------------------------------------------------


def write_checksums(uri: str, rank: int) -> None:
    """Writes `checksums/rank<r>.json` into checkpoint `uri`: sha256 and size of every file this rank wrote
    (its DCP shards `__<rank>_*.distcp`, rank 0 also `.metadata`, and its RNG file), read back from storage,
    so the list describes what a resume will read. Call once this rank's files are written, before `_COMPLETE`."""
    fs, path = storage.filesystem(uri)
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.glob(f"{path}/__{rank}_*.distcp"))
    if rank == 0:
        names.append(".metadata")
    names.append(f"rng/rank{rank:05d}.pt")
    files = dict(zip(names, storage.digest_all([storage.join(uri, name) for name in names])))
    missing = [name for name, found in files.items() if found is None]
    if missing:
        raise FileNotFoundError(f"checkpoint {uri}: {', '.join(missing)} missing right after the write")
    storage.write_atomic(storage.join(uri, CHECKSUMS, f"rank{rank:05d}.json"),
                         json.dumps({"rank": rank, "files": files}, indent=1))


def verify(uri: str, rank: int = 0, world: int = 1) -> list[str]:
    """Checks checkpoint `uri`'s files against the checksums their writers listed; returns the problems found,
    one per file ("<file> (written by rank <r>): ..."). The lists of writer ranks `rank`, `rank + world`, ...
    are this caller's share, so `world` ranks verify a checkpoint together, each reading a part of it.
    Checkpoints of train-state format 1 (before checksums) have nothing to verify."""
    state = _read_state(uri)
    if state.get("format", 1) < 2:
        return []
    problems = []
    for writer in range(rank, int(state["world_size"]), world):
        listing = storage.join(uri, CHECKSUMS, f"rank{writer:05d}.json")
        try:
            files = json.loads(storage.read_bytes(listing))["files"]
        except Exception as e:
            problems.append(f"{CHECKSUMS}/rank{writer:05d}.json (written by rank {writer}): cannot be read "
                            f"({type(e).__name__}: {e})")
            continue
        found_all = storage.digest_all([storage.join(uri, name) for name in files])
        for (name, expected), found in zip(files.items(), found_all):
            if found is None:
                problems.append(f"{name} (written by rank {writer}): missing")
            elif found != expected:
                problems.append(f"{name} (written by rank {writer}): content differs from its checksum "
                                f"({found['bytes']} bytes, sha256 {found['sha256'][:12]}…; saved "
                                f"{expected['bytes']} bytes, sha256 {expected['sha256'][:12]}…)")
    return problems


def _read_state(uri: str) -> dict:
    try:
        state = json.loads(storage.read_bytes(storage.join(uri, STATE)))
        state["step"] = int(state["step"])
        return state
    except Exception as e:
        raise CheckpointError(f"checkpoint {uri}: cannot read {STATE}: {type(e).__name__}: {e}") from e


def _unusable_reason(uri: str) -> str | None:
    """Why checkpoint `uri` cannot be resumed from, or None (collective: the checksum verification is shared
    among the ranks and every rank gets the same answer)."""
    problems = []
    if not storage.exists(storage.join(uri, COMPLETE)):
        problems.append(f"incomplete (no {COMPLETE} marker: the save was interrupted)")
    elif storage.exists(storage.join(uri, UNUSABLE)):
        marker = json.loads(storage.read_bytes(storage.join(uri, UNUSABLE)))
        problems.append(f"found unusable by an earlier resume: {marker['reason']}")
    else:
        try:
            problems += verify(uri, dist.get_rank(), dist.get_world_size())
        except CheckpointError as e:
            problems.append(str(e).removeprefix(f"checkpoint {uri}: "))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)
    unique = list(dict.fromkeys(p for rank_problems in gathered for p in rank_problems))
    return "; ".join(unique) or None


# --------------------------------------------------------------------------------------------------------------------
# Resume policy
# --------------------------------------------------------------------------------------------------------------------


def check_before_start(cfg: config_lib.RunConfig, run_dir: str) -> None:
    """Driver-side check of `checkpoint.resume` before anything is written: `never` refuses a run name that
    already has checkpoints; an explicit checkpoint must exist and be complete."""
    policy = cfg.checkpoint.resume
    if policy == "never":
        existing = [uri for _, uri, _ in list_checkpoints(run_dir)]
        if existing or storage.exists(storage.join(run_dir, RAY_SNAPSHOT)):
            raise ResumeRefused(
                f"checkpoint.resume: never, but run {run_dir} already has checkpoints "
                f"({', '.join(existing) or RAY_SNAPSHOT}); choose a new run name, delete the run directory, "
                "or set checkpoint.resume: auto to continue it"
            )
    elif policy != "auto" and latest_complete(run_dir) is None:
        # An explicit start point matters only while the run has no checkpoint of its own.
        if not storage.exists(policy):
            raise ResumeRefused(f"checkpoint.resume: no checkpoint at {policy}")
        if not storage.exists(storage.join(policy, COMPLETE)):
            raise ResumeRefused(f"checkpoint {policy}: incomplete (no {COMPLETE} marker; the save was interrupted)")


def retire_ray_snapshot(run_dir: str) -> bool:
    """Deletes Ray Train's checkpoint list left by an earlier version of this job, which reported checkpoints
    to Ray: Ray would refuse to start when a checkpoint it lists is gone, and would prune by its own list.
    Checkpoints are now found, verified and pruned here alone, from the run directory. True if there was one."""
    snapshot = storage.join(run_dir, RAY_SNAPSHOT)
    if not storage.exists(snapshot):
        return False
    storage.remove(snapshot)
    return True


def find_resume_point(cfg: config_lib.RunConfig, run_dir: str) -> tuple[str | None, list[dict]]:
    """The checkpoint this worker group starts from (None: from scratch) and the checkpoints skipped as
    unusable, newest first, each `{"checkpoint", "step", "reason"}` (collective: every rank calls it).

    One rule for every launcher and every restart (a worker-group restart, a retried job, a re-run of the same
    name): the run's checkpoint directories are tried newest first, and the first usable one wins: complete,
    its train state readable and every file matching its checksum (each rank verifies a share). A newer one
    that is not usable is skipped, and the caller records it and why (`metrics.jsonl` resume record,
    `run.json` `resumed_from`); a complete one found corrupt is also marked `_UNUSABLE`, so later prunes
    delete it and later resumes skip it without reading it again. When the run has complete checkpoints but
    none is usable, `CheckpointError` lists each and why: a run that saved progress never starts from scratch
    silently. Only a run without a complete checkpoint of its own starts from an explicit `resume` URI.
    """
    skipped = []
    entries = list_checkpoints(run_dir)
    for step, uri, _ in reversed(entries):
        reason = _unusable_reason(uri)
        if reason is None:
            return uri, skipped
        skipped.append({"checkpoint": uri, "step": step, "reason": reason})
        complete = storage.exists(storage.join(uri, COMPLETE))
        if complete and not storage.exists(storage.join(uri, UNUSABLE)) and dist.get_rank() == 0:
            storage.write_atomic(storage.join(uri, UNUSABLE), json.dumps({"reason": reason, "time": time.time()}))
    if any(storage.exists(storage.join(s["checkpoint"], COMPLETE)) for s in skipped):
        listing = "; ".join(f"{s['checkpoint']}: {s['reason']}" for s in skipped)
        raise CheckpointError(
            f"run {run_dir} has checkpoints, but none can be resumed from ({listing}). To start this run over, "
            f"delete its checkpoints (rm -r {storage.join(run_dir, PREFIX)}*) or choose a new run name")
    policy = cfg.checkpoint.resume
    if policy in ("auto", "never"):
        return None, skipped
    reason = _unusable_reason(policy) if storage.exists(policy) else "no checkpoint there"
    if reason is not None:
        raise CheckpointError(f"checkpoint.resume: {policy}: {reason}")
    return policy, skipped


def run_identity(cfg: config_lib.RunConfig, world: int, fingerprint: dict) -> dict:
    """What makes a resumed run the same run as the one that saved the checkpoint (see `check_identity`):
    the tokenizer and the data read (source hashes, revisions and row counts; paths left out, so a moved copy
    of the same files matches), and the settings that decide which tokens each step trains on."""
    def content(value):
        if isinstance(value, dict):
            return {k: content(v) for k, v in value.items() if k not in ("source", "path")}
        return [content(v) for v in value] if isinstance(value, list) else value

    data = {k: content(fingerprint.get(k)) for k in ("format", "train", "validation", "packing")}
    return {
        "tokenizer": storage.json_sha256(fingerprint.get("tokenizer")),
        "data": storage.json_sha256(data),
        "seq_len": cfg.train.seq_len,
        "seed": cfg.train.seed,
        "global_batch": cfg.train.micro_batch_size * cfg.train.grad_accum_steps * world,
    }


IDENTITY_FIELDS = {"tokenizer": "tokenizer", "data": "data", "seq_len": "train.seq_len", "seed": "train.seed",
                   "global_batch": "global batch (train.micro_batch_size x train.grad_accum_steps x workers)"}
"""Each `run_identity` key and the setting it is named by in a refusal."""
ADAPTER_FIELDS = {"lora": "model.lora (rank, alpha, targets)", "base": "the frozen base weights (model.path)"}
"""`adapter_identity`'s keys: a LoRA checkpoint holds adapters of one base, never resumed onto another, nor by
a full fine-tune (or the other way round); no `allow_changes` lifts these."""


def adapter_identity(cfg: config_lib.RunConfig, base_fingerprint: dict) -> dict:
    """The identity keys of a LoRA run (`run_identity`'s, added): the adapters' shape and the sha256 of the base
    weights' fingerprint (`model.weights_fingerprint`: each weight file's sha256, or the random init's source,
    whose seed `run_identity` holds)."""
    lora = cfg.model.lora
    return {"lora": {"rank": lora.rank, "alpha": lora.alpha, "targets": sorted(lora.targets)},
            "base": storage.json_sha256(base_fingerprint)}


def check_identity(uri: str, state: dict, identity: dict, allowed: list[str]) -> None:
    """Refuses (`CheckpointError`, naming each field) to resume a checkpoint whose run differs from this one
    in anything of `run_identity` not listed in `checkpoint.allow_changes`. For a checkpoint saved without an
    identity (train-state format 1) the settings come from its config; tokenizer and data cannot be compared."""
    saved = dict(state.get("identity") or {})
    if not saved:
        c = state["config"]["train"]
        saved = {"seq_len": c["seq_len"], "seed": c["seed"],
                 "global_batch": c["micro_batch_size"] * c["grad_accum_steps"] * state["world_size"]}
    adapters = [key for key in ADAPTER_FIELDS if saved.get(key) != identity.get(key)]
    if adapters:
        detail = "; ".join(f"{ADAPTER_FIELDS[k]}: checkpoint {_identity_value(saved.get(k))}, now "
                           f"{_identity_value(identity.get(k))}" for k in adapters)
        raise ResumeRefused(f"checkpoint {uri}: holds what another model trains ({detail}). Restore model.path "
                            "and model.lora, or start a new run name")
    differ = [key for key in IDENTITY_FIELDS if key in saved and saved[key] != identity[key] and key not in allowed]
    if differ:
        detail = "; ".join(
            f"{IDENTITY_FIELDS[k]}: checkpoint {saved[k]}, now {identity[k]}" if k not in ("tokenizer", "data")
            else f"{k}: differs (sha256 {saved[k][:12]}… in the checkpoint, {identity[k][:12]}… now)" for k in differ)
        raise ResumeRefused(
            f"checkpoint {uri}: would not continue the same run ({detail}). Restore the settings, start a new run "
            f"name, or, if the change is intended, set checkpoint.allow_changes: [{', '.join(differ)}]")


def _identity_value(value) -> str:
    if value is None:
        return "none (full fine-tune)"
    return f"sha256 {value[:12]}…" if isinstance(value, str) else json.dumps(value)


# --------------------------------------------------------------------------------------------------------------------
# Save and restore
# --------------------------------------------------------------------------------------------------------------------


def _writer(uri: str):
    from torch.distributed.checkpoint import FileSystemWriter

    if storage.is_remote(uri):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(uri)
    # Several files per rank, written in parallel: one stream does not fill a fast disk. On a GPU machine's NVMe
    # disk (bench/dcp_write.py, 8.4 GB fsynced) 4 threads wrote 1.49 GB/s, 8 1.71, 16 1.73.
    return FileSystemWriter(storage.local_path(uri), thread_count=8)


def _reader(uri: str):
    from torch.distributed.checkpoint import FileSystemReader

    if storage.is_remote(uri):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(uri)
    return FileSystemReader(storage.local_path(uri))


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _arch(lm_config: PretrainedConfig) -> dict:
    return {k: getattr(lm_config, k, None) for k in ARCH_KEYS}


def due(step: int, cfg: config_lib.RunConfig) -> bool:
    every = cfg.checkpoint.every_steps
    return step == cfg.train.max_steps or bool(every and step % every == 0)


class Checkpointer:
    """Saves checkpoints while training goes on (collective: every rank makes the same calls in the same order).

    `save(step)` copies this rank's shards of the model and optimizer state where training cannot change them,
    which is all training waits for: on the GPU itself when it has room for the copy beside training's peak
    (`choose_staging`), the write then copying it to host memory beside the steps; else into host memory
    (`HostStager`: pinned on GPU, allocated at the first save, reused).
    The write (DCP shards, over a gloo group of its own so that the training's collectives keep the default
    group to themselves) runs in a writer process per worker that reads the staged state from shared memory,
    or in a thread (`checkpoint.async_writer`, chosen in `prepare`); a background thread then writes this
    rank's RNG state and checksums. A checkpoint becomes complete only in `finish()`, once every rank's write
    has returned: rank 0 then writes `train_state.json` and, last, `_COMPLETE`, and prunes. A save cut short
    (a worker died mid-write) has no marker and is never resumed from; the previous complete checkpoint is.
    (A writer process whose worker died finishes or fails the write it is in, then exits: its pipe is closed.)

    At most one save is in flight: `save` finishes the previous one first. The loop calls `finish()` at a log
    step once every rank reports its write done (`write_done`, summed with the loss), and at the end of the run,
    before the job reports success.
    """

    def __init__(self, cfg: config_lib.RunConfig, run_dir: str, device: torch.device, identity: dict):
        """`identity` (`run_identity`) is kept in each checkpoint's train state, for the resume check."""
        from concurrent.futures import ThreadPoolExecutor

        self.cfg, self.run_dir, self.device, self.identity = cfg, run_dir, device, identity
        self.group = dist.new_group(backend="gloo")
        self.stager: HostStager | None = None
        self.writer: dict = {}  # {"writer": "process" | "thread", "reason": ...}, chosen by `prepare`
        self.staging: dict | None = None  # {"on": "device" | "host", ...}, chosen by the first save
        self.device_copy = None  # the save's copy on the device, until the write has it in host memory
        self.device_copy_released = threading.Event()
        self.device_copy_released.set()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-write")
        self.pending = None  # (step, uri, future of the write, returning its seconds)
        self.writer_start = None  # future of the writer process's start (`prepare`), until the first save
        self.arch: dict = {}

    def prepare(self, model: CausalLMWithLoss) -> dict:
        """Chooses the writer (collective) and starts the writer process, before the first step; returns the
        choice, `self.writer`."""
        self.writer = choose_writer(self.cfg.checkpoint.async_writer, first_save_layout(model), self.group)
        if self.writer["writer"] == "process":
            self._start_writer_process()
        return self.writer

    def _start_writer_process(self) -> None:
        """Starts DCP's writer process now, in the write thread, while the first steps run, instead of in the
        first save's write: its start (a spawned interpreter importing torch, then its gloo group) took 6.1 s of a
        2-core machine's first write, in which a crash lost that save too. The first `save` waits for
        it, so that no write is slower than the write itself. Collective: the ranks agree on the writers'
        rendezvous here. Skipped where DCP's internals differ (then the first save starts it)."""
        try:
            from torch.distributed.checkpoint import _async_process_executor as process_executor

            if process_executor._CHECKPOINT_PROCESS is not None:
                return
            init_info = process_executor._ProcessGroupInitInfo(self.group)
        except (ImportError, AttributeError):
            return

        def start() -> None:
            if process_executor._CHECKPOINT_PROCESS is None:
                process_executor._CHECKPOINT_PROCESS = process_executor._AsyncCheckpointProcess(init_info)

        self.writer_start = self.executor.submit(start)

    def save(self, step: int, model: CausalLMWithLoss, optimizer: torch.optim.Optimizer, last: bool = False) -> None:
        """Starts saving `step`; returns once the state is copied, on the device or into host memory. `last`: the
        state will not change any more (the run's last step), so staging on the device needs no copy: the write
        copies the state into host memory from where it is."""
        self.finish()
        if not self.writer:
            self.prepare(model)
        if self.writer_start is not None:  # training waits here, at most once, rather than the first write
            self.writer_start.exception()  # a failed start is retried, and raises, in the write
            self.writer_start = None
        rank = dist.get_rank()
        uri = storage.join(self.run_dir, step_dir(step))
        if rank == 0:
            storage.remove(uri)  # leftovers of an interrupted save of this step (never a complete checkpoint)
        dist.barrier()
        model_sd, optim_sd = trained_state_dicts(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if self.staging is None:
            self.staging = self._choose_staging(state)
        rng = _torch_bytes(_rng_state())
        self.arch = _arch(model.lm.config)
        staged = copied = None
        if self.staging["on"] == "device":
            self.device_copy = state if last else _map_tensors(state, lambda _, tensor: tensor.detach().clone())
            if self.device.type == "cuda":
                copied = torch.cuda.Event()
                copied.record()
            if not last:  # set again by the write, once the copy is in host memory
                self.device_copy_released.clear()
        else:
            staged = self.stager.stage(state)
        self.pending = (step, uri, self.executor.submit(self._write, staged, copied, step, uri, rng, rank,
                                                        time.perf_counter()))
        if not self.cfg.checkpoint.async_save:
            self.finish()

    def _choose_staging(self, state: dict) -> dict:
        """Where this rank's saves copy the state first (`choose_staging`), decided at the first save, when
        training's peak memory is known, and kept: later saves would count the copy itself in that peak. Pinned
        host buffers, when the saves copy into them, are allocated here, with training waiting (~10 s for 19 GB;
        page-locking beside running steps holds the interpreter lock and slows them); unpinned ones, for a copy on
        the device, by the write that fills them."""
        layout = tensor_layout(state)
        staging = choose_staging(self.device, layout_bytes(layout))
        on_device = staging["on"] == "device"
        self.stager = HostStager(pin=self.device.type == "cuda" and not on_device,
                                 shared=self.writer["writer"] == "process")
        if not on_device:
            start = time.perf_counter()
            self.stager.allocate(layout)
            staging["allocate_s"] = round(time.perf_counter() - start, 3)
        return staging

    def wait_device_copy(self) -> None:
        """Waits until the save in flight no longer holds its copy on the device: before work that may need
        more device memory than training's peak (the task evaluations, the export)."""
        self.device_copy_released.wait()

    def _write(self, staged: dict | None, copied: torch.cuda.Event | None, step: int, uri: str, rng: bytes,
               rank: int, start: float) -> tuple[float, float]:
        """Writes this rank's part of checkpoint `uri` (`staged`, or the save's copy on the device, which is first
        copied into host memory here, once `copied` says it is made); returns (seconds since the save was staged at
        `start`, a wait for the writer process's start included; of them checksumming)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if staged is None:
            try:  # on this worker's device: a thread's current CUDA device is the first one
                with torch.cuda.device(self.device) if copied is not None else contextlib.nullcontext():
                    staged = self.stager.stage(self.device_copy, after=copied)
            finally:
                self.device_copy = None
                self.device_copy_released.set()
        # The writer process, even for the last save, after which no step would suffer a writer thread's hold on
        # the interpreter: the evaluations and the export would (the final held-out pass of the 1.5B took 21.8 s
        # beside a writer thread, 3.1 s beside the process).
        if self.writer["writer"] == "process":  # DCP's writer process, started by `prepare`
            dcp.async_save(staged, storage_writer=_writer(uri), process_group=self.group,
                           async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=ALREADY_STAGED).result()
        else:
            dcp.save(staged, storage_writer=_writer(uri), process_group=self.group)
        maybe_fail(self.cfg, step, rank, self.run_dir, in_write=True)  # after DCP's collectives: no rank hangs
        storage.write_atomic(storage.join(uri, "rng", f"rank{rank:05d}.pt"), rng)
        written = time.perf_counter()
        write_checksums(uri, rank)
        return time.perf_counter() - start, time.perf_counter() - written

    def write_done(self) -> bool:
        """Whether this rank has no write in flight (the loop sums it over ranks before calling `finish`)."""
        return self.pending is None or self.pending[2].done()

    def finish(self) -> dict | None:
        """Completes the save in flight, if any (waiting for its writes); returns `{step, uri, write_s,
        checksum_s, staging}` (this rank's seconds writing, checksums included, and checksumming; where its
        saves stage, `choose_staging`)."""
        if self.pending is None:
            return None
        step, uri, future = self.pending
        self.pending = None
        try:
            write_s, checksum_s = future.result()  # a failed write raises here, on its rank
        except BaseException as e:  # DCP's CheckpointException derives from BaseException
            raise _failed_save(uri, e) from e
        dist.barrier()  # every rank's shards, RNG state and checksums are written
        cfg = self.cfg
        if dist.get_rank() == 0:
            accum, mb = cfg.train.grad_accum_steps, cfg.train.micro_batch_size
            state = {
                "format": 2,
                "step": step,
                "world_size": dist.get_world_size(),
                "data": {"micro_batch_index": step * accum, "micro_batch_size": mb, "grad_accum_steps": accum,
                         "samples_seen": step * accum * mb * dist.get_world_size()},
                "lr_schedule": {"kind": "warmup_cosine", "step": step, **schedule_settings(cfg)},
                "arch": self.arch,
                "identity": self.identity,
                "config": config_lib.to_dict(cfg),
                "saved_at": time.time(),
            }
            storage.write_atomic(storage.join(uri, STATE), json.dumps(state, indent=1).encode())
            storage.write_atomic(storage.join(uri, COMPLETE), b"")  # last: the checkpoint is complete from here on
        dist.barrier()
        if dist.get_rank() == 0:
            _prune(self.run_dir, cfg.checkpoint.keep_last, keep_before=step)
        return {"step": step, "uri": uri, "write_s": write_s, "checksum_s": checksum_s, "staging": self.staging}

    def abandon(self) -> None:
        """On a failed attempt (any rank, not collective): waits for this rank's write in flight, if any, then
        removes that save's directory, which will never be complete. A full disk often fails the loop's next
        write (its metrics) before the save's own error is collected (drills.sh disk-full); the partial save
        would keep the space that the run record needs to say the run failed."""
        if self.pending is None:
            return
        _, uri, future = self.pending
        self.pending = None
        with contextlib.suppress(BaseException):  # the loop's own error is the one reported
            future.result()
        _remove_partial(uri)

    def close(self) -> None:
        """Waits for the write in flight, then ends the writer process, if one was started."""
        from torch.distributed.checkpoint import _async_process_executor as process_executor

        self.executor.shutdown(wait=True)
        # DCP keeps its writer process for the life of the interpreter; dropping it ends it (`__del__`), so a
        # later run in this interpreter starts a writer of its own, for its own process group.
        process_executor._CHECKPOINT_PROCESS = None


class _AlreadyStaged:
    """DCP's stager protocol (`AsyncStager`) for a state dict that `HostStager` has already put in host memory."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: dict) -> dict:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


ALREADY_STAGED = _AlreadyStaged()

SHARED_MEMORY = "/dev/shm"


def tensor_layout(state_dict: dict) -> dict[tuple, tuple[torch.Size, torch.dtype]]:
    """Shape and dtype of each tensor of a state dict (a DTensor's local shard), by its place in it."""
    layout = {}

    def note(path: tuple, tensor: torch.Tensor) -> torch.Tensor:
        layout[path] = (tensor.shape, tensor.dtype)
        return tensor

    _map_tensors(state_dict, note)
    return layout


def layout_bytes(layout: dict[tuple, tuple[torch.Size, torch.dtype]]) -> int:
    """How many bytes the tensors of `layout` (`tensor_layout`) hold."""
    return sum(shape.numel() * dtype.itemsize for shape, dtype in layout.values())


def trained_state_dicts(model: CausalLMWithLoss, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """DCP's model and optimizer state dicts of what trains: every parameter in a full fine-tune; with LoRA the
    adapters alone (megabytes), the frozen base being what `model.path` and the seed give back on resume."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_trained_only(model))
    return _without_frozen(model, model_sd), optim_sd


def _trained_only(model: CausalLMWithLoss):
    """DCP's state dict options that leave out frozen parameters (and accept their absence on load)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=True, strict=not frozen)


def _without_frozen(model: CausalLMWithLoss, model_sd: dict) -> dict:
    """`model_sd` without what is frozen: DCP's `ignore_frozen_params` keeps a tied weight under its second name
    (the frozen embedding as `lm_head.weight`)."""
    from .model import plain_name  # the driver imports this module, the model only a worker

    if all(p.requires_grad for p in model.parameters()):
        return model_sd
    trained = {plain_name(name) for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model_sd.items() if k in trained}


def first_save_layout(model: CausalLMWithLoss) -> dict[tuple, tuple[torch.Size, torch.dtype]]:
    """What a save stages (`tensor_layout` of the model's and the optimizer's state dicts), known before the first
    step: the model's state dict, and per parameter the state AdamW keeps once it has stepped (`step`, and
    `exp_avg` and `exp_avg_sq` shaped as the parameter's local shard). The optimizer's own state dict cannot be
    read before then: DCP's `get_state_dict` would initialise it with a zero-gradient step, one step early for
    Adam's bias correction. A tensor missing here is allocated when first staged; tests/test_checkpoint.py holds
    the prediction equal to what is staged after a step."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    from .model import plain_name  # the driver imports this module, the model only a worker

    layout = tensor_layout({"model": _without_frozen(model, get_model_state_dict(model, options=_trained_only(model)))})
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        shard = param.to_local() if isinstance(param, DTensor) else param
        state = ("optim", "state", plain_name(name))
        layout[(*state, "step")] = (torch.Size([]), torch.float32)
        for moment in ("exp_avg", "exp_avg_sq"):
            layout[(*state, moment)] = (shard.shape, shard.dtype)
    return layout


def choose_writer(setting: str, layout: dict, group: dist.ProcessGroup) -> dict:
    """`{"writer", "reason", ...}` for `checkpoint.async_writer` = `setting` (collective over `group`).

    The writer process reads the staged state from `/dev/shm`, so every node needs room there for its workers'
    staged shares together (a full `/dev/shm` is not an error but a SIGBUS when the memory is touched), and
    a file descriptor per tensor. `process` without that room raises `CheckpointError` naming the numbers;
    `auto` then takes the writer thread."""
    import resource
    import socket

    need = layout_bytes(layout)
    if setting == "thread":
        return {"writer": "thread", "reason": "checkpoint.async_writer: thread", "bytes": need}
    try:
        st = os.statvfs(SHARED_MEMORY)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = 0
    host = socket.gethostname()
    ranks = [None] * dist.get_world_size(group)
    dist.all_gather_object(ranks, (host, need), group=group)
    node_need = sum(n for h, n in ranks if h == host)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    files = len(layout) + 1024  # a descriptor per staged tensor, beside what the worker already has open
    problem = None
    if node_need > free:
        problem = (f"this node's {sum(h == host for h, _ in ranks)} worker(s) stage {node_need / 1e9:.2f} GB of "
                   f"checkpoint state, and {SHARED_MEMORY} has {free / 1e9:.2f} GB free")
    elif hard != resource.RLIM_INFINITY and files > hard:
        problem = f"its {len(layout)} staged tensors need ~{files} open files, over the limit of {hard}"
    verdicts = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, problem, group=group)  # one choice for all ranks: their writers work together
    problems = sorted({p for p in verdicts if p})
    if not problems:
        if soft != resource.RLIM_INFINITY and soft < files:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return {"writer": "process", "reason": f"checkpoint.async_writer: {setting}", "bytes": need,
                "node_bytes": node_need, "shm_free_bytes": free}
    if setting == "process":
        raise CheckpointError(
            f"checkpoint.async_writer: process: {'; '.join(problems)}. Give the pods more shared memory (the "
            f"chart's shm.sizeLimit, within the pods' memory limit) or set checkpoint.async_writer: thread")
    return {"writer": "thread", "reason": f"checkpoint.async_writer: auto, and {'; '.join(problems)}", "bytes": need}


STAGING_HEADROOM = 0.05
"""Share of the device's memory a save's copy on the device leaves free beside training's peak."""


def choose_staging(device: torch.device, need: int) -> dict:
    """`{"on": "device" | "host", "bytes", ...}`: where a save first copies this rank's `need` bytes of state.

    On the device when it has room beside training's peak (`max_memory_reserved`), the other processes on it
    and `STAGING_HEADROOM`: a copy there should take ~10 ms at the device's bandwidth (not yet measured) where
    one into pinned host memory took 0.45 s, and the pinned buffers' allocation ~10 s per 19 GB (docs/performance.md,
    "Where the time goes"); the write then copies it to host memory beside the steps, on a stream of its own. Else
    in host memory, as on CPU."""
    if device.type != "cuda":
        return {"on": "host", "bytes": need, "reason": "not a GPU"}
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    elsewhere = total - free - reserved  # other processes on the device, and the CUDA context
    spare = int(total * (1 - STAGING_HEADROOM)) - elsewhere - torch.cuda.max_memory_reserved(device)
    return {"on": "device" if need <= spare else "host", "bytes": need, "spare_bytes": spare}


class HostStager:
    """Copies a state dict's tensors (DTensors: their local shards) into host buffers kept from save to save, so
    training may go on changing the originals while the writer writes the copy.

    Buffers are keyed by their place in the state dict, pinned when the saves copy into them from the GPU (fast,
    asynchronous device-to-host copies, waited for once at the end) and, for the writer process, in shared
    memory. Everything that is not a tensor is deep-copied.
    """

    def __init__(self, pin: bool, shared: bool = False):
        self.pin, self.shared = pin, shared
        self.buffers: dict[tuple, torch.Tensor] = {}

    def allocate(self, layout: dict[tuple, tuple[torch.Size, torch.dtype]]) -> None:
        """Allocates the buffers of `layout` (`tensor_layout`) ahead of the first `stage`."""
        self.buffers.update({path: self._allocate(shape, dtype) for path, (shape, dtype) in layout.items()})

    def stage(self, state_dict: dict, after: torch.cuda.Event | None = None) -> dict:
        """The staged copy of `state_dict`. `after`: the state is a save's copy on the GPU, made once that event
        has passed; it is copied on a stream of its own (in the write thread, beside the training's stream)."""
        if after is None:
            staged = _map_tensors(state_dict, self._buffer)
            if self.pin:
                torch.cuda.synchronize()
            return staged
        stream = torch.cuda.Stream()
        stream.wait_event(after)
        with torch.cuda.stream(stream):
            staged = _map_tensors(state_dict, self._buffer)
        stream.synchronize()
        return staged

    def _buffer(self, path: tuple, tensor: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self.buffers[path] = self._allocate(tensor.shape, tensor.dtype)
        return buffer.copy_(tensor.detach(), non_blocking=self.pin)

    def _allocate(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if not self.shared:
            return torch.empty(shape, dtype=dtype, pin_memory=self.pin)
        # Created in shared memory, not moved there: `share_memory_()` copies the tensor in while holding the
        # interpreter lock (~10 ms per 55 MB projection).
        nbytes = shape.numel() * dtype.itemsize
        buffer = torch.empty(0, dtype=dtype).set_(torch.UntypedStorage._new_shared(nbytes), 0, shape)
        buffer.zero_()  # faults the pages in here, so that cudaHostRegister only pins resident ones
        if self.pin and nbytes:  # page-locks the shared pages in place (cudaHostRegisterPortable)
            error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 1))
            if error:
                raise RuntimeError(f"checkpoint staging: cudaHostRegister of {nbytes} bytes failed (CUDA error {error})")
        return buffer


def _map_tensors(obj, fn: Callable[[tuple, torch.Tensor], torch.Tensor], path: tuple = ()):
    """A nested state dict (dicts, lists, tuples) rebuilt with `fn(path, tensor)` in place of each tensor, `path`
    being the tensor's place in it. A DTensor's local shard goes to `fn`, and the result becomes the shard of a
    DTensor like it. Everything else is deep-copied."""
    import copy

    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        local = fn(path, obj.to_local())
        return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape,
                                  stride=obj.stride())
    if isinstance(obj, torch.Tensor):
        return fn(path, obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn, (*path, k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn, (*path, i)) for i, v in enumerate(obj))
    return copy.deepcopy(obj)


def _failed_save(uri: str, error: BaseException) -> CheckpointError:
    """The error of a save that failed (a full disk, read-only or lost storage), naming the checkpoint and each
    rank's cause, once what was written is removed (by each rank that sees the failure)."""
    return CheckpointError(f"checkpoint {uri}: save failed ({_failure_causes(error)}){_remove_partial(uri)}"
                           f"{_free_space(uri)}")


def _remove_partial(uri: str) -> str:
    """Removes a save that will never be complete: a partial checkpoint neither looks like one nor keeps the space
    the run record needs to say the run failed. Returns what happened, as the end of an error message."""
    try:
        storage.remove(uri)
        return "; the partial checkpoint was removed"
    except Exception as cleanup:
        return f"; removing the partial checkpoint failed too ({type(cleanup).__name__}: {cleanup})"


def _free_space(uri: str) -> str:
    """How much room local storage had when a save failed: a full disk often surfaces from the writer as another
    error (`RuntimeError: [enforce fail at inline_container.cc] unexpected pos`), its OSError lost on the way."""
    if storage.is_remote(uri):
        return ""
    path = storage.local_path(uri)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return f"; {path} has {shutil.disk_usage(path).free / 1e9:.1f} GB free"
    except OSError:
        return ""


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _prune(run_dir: str, keep_last: int, keep_before: int) -> None:
    """Deletes what no resume will use: interrupted or unusable saves older than `keep_before` (the step just
    saved), and all but the newest `keep_last` usable checkpoints up to it. The newest usable one, the
    checkpoint just saved (its checksums taken from what storage holds), is never deleted."""
    entries = [(step, uri, ok) for step, uri, ok in list_checkpoints(run_dir) if step <= keep_before]
    usable = [uri for _, uri, ok in entries if ok]
    doomed = [uri for step, uri, ok in entries if not ok and step < keep_before] + usable[:-keep_last]
    for uri in doomed:
        storage.remove(uri)


def restore(uri: str, model: CausalLMWithLoss, optimizer: torch.optim.Optimizer, cfg: config_lib.RunConfig,
            identity: dict) -> dict:
    """Loads a checkpoint (verified by `find_resume_point`) into the sharded model and optimizer (any world
    size: DCP reshards) and this rank's RNG states; returns its train state. Refuses a checkpoint of another
    architecture or, per `check_identity`, of another run. Any problem raises `CheckpointError` naming the
    checkpoint (a failed read names each rank's cause)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _read_state(uri)
    saved, current = state.get("arch", {}), _arch(model.lm.config)
    differ = {k: (saved.get(k), v) for k, v in current.items() if saved.get(k) != v}
    if differ:
        detail = ", ".join(f"{k}: checkpoint {a} vs model {b}" for k, (a, b) in differ.items())
        raise ResumeRefused(f"checkpoint {uri}: saved for another model architecture ({detail})")
    check_identity(uri, state, identity, cfg.checkpoint.allow_changes)
    model_sd, optim_sd = trained_state_dicts(model, optimizer)
    try:
        dcp.load({"model": model_sd, "optim": optim_sd}, storage_reader=_reader(uri))
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException derives from BaseException
        raise CheckpointError(f"checkpoint {uri}: cannot be read ({_failure_causes(e)})") from e
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=_trained_only(model))
    rng = storage.join(uri, "rng", f"rank{dist.get_rank():05d}.pt")
    if storage.exists(rng):  # a rank that did not exist before (more workers now) keeps its seeded state
        try:
            _set_rng_state(torch.load(io.BytesIO(storage.read_bytes(rng)), weights_only=False))
        except Exception as e:
            raise CheckpointError(f"checkpoint {uri}: cannot read {rng}: {type(e).__name__}: {e}") from e
    return state


def _failure_causes(error: BaseException) -> str:
    """Each failed rank's own exception, one line each: DCP's `CheckpointException` prints only the ranks."""
    def line(exc: BaseException) -> str:
        text = " ".join(str(exc).split())
        return f"{type(exc).__name__}: {text[:300]}"

    failures = getattr(error, "failures", None)
    if not failures:
        return line(error)
    return "; ".join(f"rank {rank}: {line(exc)}" for rank, (exc, _trace) in sorted(failures.items()))


def data_start(state: dict, cfg: config_lib.RunConfig, world: int, n_train_blocks: int | None) -> tuple[int, bool]:
    """This run's per-rank micro-batch index to resume at, and whether it continues the data order exactly.

    Same world size and micro-batch size: the saved index (step x accum). Otherwise the global number of
    samples consumed in the current epoch is divided among the new ranks (`micro_batches` shards each epoch's
    permutation `rank::world`, so the first k micro-batches of every rank are the permutation's first
    k x world x batch positions): exact when it divides evenly; each epoch's dropped remainder depends on the
    world size, so a later epoch boundary may differ by a few blocks.
    """
    d, mb = state["data"], cfg.train.micro_batch_size
    k, w0, mb0 = d["micro_batch_index"], state["world_size"], d["micro_batch_size"]
    if w0 == world and mb0 == mb:
        return k, True
    if n_train_blocks is None:  # synthetic: per-rank random streams, no epochs
        samples = k * w0 * mb0
        return samples // (world * mb), samples % (world * mb) == 0
    per_rank_old, per_rank_new = n_train_blocks // w0 // mb0, n_train_blocks // world // mb
    epoch, offset = divmod(k, per_rank_old)
    position = offset * w0 * mb0
    start = min(position // (world * mb), per_rank_new)
    return epoch * per_rank_new + start, position % (world * mb) == 0



def schedule_settings(cfg: config_lib.RunConfig) -> dict:
    """The settings the learning rate at a step is computed from (`train.build_optimizer`'s schedule)."""
    return {"lr": cfg.train.lr, "warmup_steps": cfg.train.warmup_steps, "max_steps": cfg.train.max_steps,
            "min_lr_ratio": cfg.train.min_lr_ratio}


def schedule_changes(state: dict, cfg: config_lib.RunConfig) -> dict[str, list]:
    """The learning-rate schedule's settings that differ from the checkpoint's, `{field: [saved, now]}`. The rate
    is a pure function of the step and these settings, so a change (e.g. a nearer `train.max_steps`, which
    recomputes the cosine) changes every update from the resumed step on: the losses after the first resumed step
    then differ from those an attempt with the saved settings logged."""
    saved = state.get("lr_schedule", {})
    return {field: [saved[field], value] for field, value in schedule_settings(cfg).items()
            if saved.get(field, value) != value}

# --------------------------------------------------------------------------------------------------------------------
# Fault injection and worker pids (tests and failure drills)
# --------------------------------------------------------------------------------------------------------------------


def write_pid(run_dir: str, rank: int) -> None:
    """`<run>/workers/rank<r>.pid` (local storage only), so a drill can kill a chosen worker process."""
    if not storage.is_remote(run_dir):
        storage.write_atomic(storage.join(run_dir, "workers", f"rank{rank}.pid"), str(os.getpid()).encode())


LOGGED_LOSS_FACTOR = {"loss_spike": 10.0, "nan": float("nan")}
"""The `debug.fail_mode`s that change the rank's logged loss from their step on, by this factor."""


def maybe_fail(cfg: config_lib.RunConfig, step: int, rank: int, run_dir: str, in_write: bool = False) -> float | None:
    """`debug.fail_at_step`: the chosen rank fails on reaching the step as `debug.fail_mode` says, once per run
    name: `kill`, `exception` and `hang` at the step's start, `disk_full` in the step's checkpoint write
    (`in_write`). Returns the factor of `loss_spike` and `nan` when they fire (the loop then scales this rank's
    logged loss by it), else None."""
    d = cfg.debug
    if d.fail_at_step != step or d.fail_rank != rank or in_write != (d.fail_mode == "disk_full"):
        return None
    marker = storage.join(run_dir, "faults", f"step{step}-rank{rank}")
    if storage.exists(marker):
        return None
    storage.write_atomic(marker, f"{time.time()}\n".encode())
    print(f"debug.fail_at_step: rank {rank} (pid {os.getpid()}) fails at step {step} ({d.fail_mode})", flush=True)
    if d.fail_mode in LOGGED_LOSS_FACTOR:
        return LOGGED_LOSS_FACTOR[d.fail_mode]
    if d.fail_mode == "exception":
        raise RuntimeError(f"debug.fail_at_step: injected failure at step {step} on rank {rank}")
    if d.fail_mode == "disk_full":
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (debug.fail_mode: disk_full)")
    while d.fail_mode == "hang":  # before the step's first collective, in which the other ranks then wait
        time.sleep(60)
    os.kill(os.getpid(), signal.SIGKILL)
