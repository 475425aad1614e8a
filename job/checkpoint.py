"""Checkpoints on shared storage, exact resume, fault injection, and the checked Hugging Face export.

Layout of a run (`<storage_path>/<name>/`, a local directory, a mounted PVC/NFS path or an `s3://` URI):

    config.yaml                      resolved config of the latest start (launch.prepare)
    metrics.jsonl                    rank 0's metric records (lines past a resumed step are dropped)
    checkpoint_00000040/             one checkpoint per saved step, written in place by every rank:
        .metadata, __<rank>_0.distcp     torch.distributed.checkpoint (model + optimizer, sharded; reshardable)
        rng/rank00000.pt ...             per-rank RNG states (torch CPU/CUDA, python, numpy)
        train_state.json                 step, data position, LR schedule, world size, architecture, config
        _COMPLETE                        written last, by rank 0, after every rank finished: only a directory
                                         with this marker is a checkpoint (a crash mid-save leaves none)
    checkpoint_manager_snapshot.json Ray Train's list of reported checkpoints (Ray launcher only)
    export/                          model.safetensors, config.json, tokenizer files, reference.json,
                                     acceptance.json and the `_VALID` marker once the reload check passed
    faults/                          markers of injected faults (debug.fail_at_step), so each fires once
    workers/rank<r>.pid              worker process ids (local storage only; for failure drills)

Both launchers run the same code: every rank writes its DCP shards straight to the checkpoint directory, then
rank 0 writes `train_state.json` and `_COMPLETE`. Under Ray Train, the complete directory is then reported
with `ray.train.report(metrics, checkpoint=..., checkpoint_upload_mode=NO_UPLOAD)`: Ray records it in its
snapshot (so `ray.train.get_checkpoint()` returns it after a worker-group restart or a driver restart with the
same run name) and deletes all but the last `keep_last`. Under torchrun, rank 0 prunes old checkpoints itself
and resume scans the run directory for the newest complete checkpoint.
"""

from __future__ import annotations

import io
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

from . import config as config_lib
from . import data as data_lib
from . import storage

COMPLETE = "_COMPLETE"
"""Marker file written last into a checkpoint directory: its presence makes the checkpoint complete."""
STATE = "train_state.json"
PREFIX = "checkpoint_"
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"
ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
             "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be used (unreadable, incomplete, another model); names the path."""


def step_dir(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def list_checkpoints(run_dir: str) -> list[tuple[int, str, bool]]:
    """(step, uri, complete) of every `checkpoint_<step>` directory of a run, oldest first."""
    fs, path = storage.filesystem(run_dir)
    if not fs.exists(path):
        return []
    found = []
    for entry in fs.ls(path, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith(PREFIX) and name[len(PREFIX):].isdigit():
            uri = storage.join(run_dir, name)
            found.append((int(name[len(PREFIX):]), uri, storage.exists(storage.join(uri, COMPLETE))))
    return sorted(found)


def latest_complete(run_dir: str) -> str | None:
    complete = [uri for _, uri, ok in list_checkpoints(run_dir) if ok]
    return complete[-1] if complete else None


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
            raise CheckpointError(
                f"checkpoint.resume: never, but run {run_dir} already has checkpoints "
                f"({', '.join(existing) or RAY_SNAPSHOT}); choose a new run name, delete the run directory, "
                "or set checkpoint.resume: auto to continue it"
            )
    elif policy != "auto" and latest_complete(run_dir) is None:
        # An explicit start point matters only while the run has no checkpoint of its own.
        _require_complete(policy)


def _require_complete(uri: str) -> None:
    if not storage.exists(uri):
        raise CheckpointError(f"checkpoint.resume: no checkpoint at {uri}")
    if not storage.exists(storage.join(uri, COMPLETE)):
        raise CheckpointError(f"checkpoint {uri}: incomplete (no {COMPLETE} marker; the save was interrupted)")


def find_resume_point(cfg: config_lib.RunConfig, run_dir: str, launcher: str) -> str | None:
    """The checkpoint this worker group starts from, or None to start fresh (collective under Ray).

    The run's own latest checkpoint always wins (a worker-group restart, a retried job, a driver restart, a
    re-run of the same name): the newer of the one `ray.train.get_checkpoint()` returns and the newest complete
    directory of the run. The latter can be newer when a worker died after the checkpoint was complete but
    before Ray registered its report, or when torchrun wrote it; Ray is then told about it (reported again), so
    that it counts towards `keep_last`. Only a run without checkpoints of its own starts from an explicit
    `resume` URI. (`resume: never` was checked by the driver before the run started, so anything found here is
    this run's.)
    """
    reported = None
    if launcher == "ray":
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is not None:
            reported = storage.join(run_dir, checkpoint.path.rstrip("/").rsplit("/", 1)[-1])
    on_disk = latest_complete(run_dir)
    own = max((u for u in (reported, on_disk) if u), key=lambda u: int(u.rsplit(PREFIX, 1)[-1]), default=None)
    if own is not None:
        _require_complete(own)
        if launcher == "ray" and own != reported:
            _ray_report(own.rsplit("/", 1)[-1], {"step": int(own.rsplit(PREFIX, 1)[-1]), "adopted": True})
        return own
    policy = cfg.checkpoint.resume
    if policy in ("auto", "never"):
        return None
    _require_complete(policy)
    return policy


# --------------------------------------------------------------------------------------------------------------------
# Save and restore
# --------------------------------------------------------------------------------------------------------------------


def _writer(uri: str):
    from torch.distributed.checkpoint import FileSystemWriter

    if storage.is_remote(uri):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(uri)
    # Several files per rank, written in parallel: one stream does not fill a fast disk.
    return FileSystemWriter(uri.removeprefix("file://"), thread_count=4)


def _reader(uri: str):
    from torch.distributed.checkpoint import FileSystemReader

    if storage.is_remote(uri):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(uri)
    return FileSystemReader(uri.removeprefix("file://"))


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


def _arch(lm_config) -> dict:
    return {k: getattr(lm_config, k, None) for k in ARCH_KEYS}


def due(step: int, cfg: config_lib.RunConfig) -> bool:
    every = cfg.checkpoint.every_steps
    return step == cfg.train.max_steps or bool(every and step % every == 0)


class Checkpointer:
    """Saves checkpoints while training goes on (collective: every rank makes the same calls in the same order).

    `save(step)` copies this rank's shards of the model and optimizer state into host memory (`HostStager`:
    pinned on GPU, allocated in the background after the first step, reused), which is all training waits for,
    and hands the
    write to a background thread: DCP shards and this rank's RNG state, over a gloo group of its own so that
    the training's collectives keep the default group to themselves. A checkpoint becomes complete only in
    `finish()`, once every rank's write has returned: rank 0 then writes `train_state.json` and, last,
    `_COMPLETE`, and the launcher is told. A save cut short (a worker died mid-write) has no marker and is never
    resumed from; the previous complete checkpoint is.

    At most one save is in flight: `save` finishes the previous one first. The loop calls `finish()` at a log
    step once every rank reports its write done (`write_done`, summed with the loss), and at the end of the run,
    before the job reports success.
    """

    def __init__(self, cfg: config_lib.RunConfig, run_dir: str, launcher: str, device: torch.device):
        from concurrent.futures import ThreadPoolExecutor

        self.cfg, self.run_dir, self.launcher = cfg, run_dir, launcher
        self.group = dist.new_group(backend="gloo")
        self.stager = HostStager(pin=device.type == "cuda")
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-write")
        self.pending = None  # (step, uri, future of the write, returning its seconds)
        self.arch: dict = {}

    def prepare(self, model, optimizer) -> None:
        """Allocates the host buffers of the first save in the background (pinning gigabytes of host memory
        takes seconds); call once the optimizer has its state, i.e. after the first step."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        self.stager.allocate_in_background({"model": model_sd, "optim": optim_sd})

    def save(self, step: int, model, optimizer) -> None:
        """Starts saving `step`; returns once the state is staged in host memory."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.finish()
        rank = dist.get_rank()
        uri = storage.join(self.run_dir, step_dir(step))
        if rank == 0:
            storage.remove(uri)  # leftovers of an interrupted save of this step (never a complete checkpoint)
        dist.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        staged = self.stager.stage({"model": model_sd, "optim": optim_sd})
        rng = _torch_bytes(_rng_state())
        self.arch = _arch(model.lm.config)
        self.pending = (step, uri, self.executor.submit(self._write, staged, uri, rng, rank))
        if not self.cfg.checkpoint.async_save:
            self.finish()

    def _write(self, staged: dict, uri: str, rng: bytes, rank: int) -> float:
        import torch.distributed.checkpoint as dcp

        start = time.perf_counter()
        dcp.save(staged, storage_writer=_writer(uri), process_group=self.group)
        storage.write_atomic(storage.join(uri, "rng", f"rank{rank:05d}.pt"), rng)
        return time.perf_counter() - start

    def write_done(self) -> bool:
        """Whether this rank has no write in flight (the loop sums it over ranks before calling `finish`)."""
        return self.pending is None or self.pending[2].done()

    def finish(self, metrics: dict | None = None) -> dict | None:
        """Completes the save in flight, if any (waiting for its writes); returns `{step, uri, write_s}`."""
        if self.pending is None:
            return None
        step, uri, future = self.pending
        self.pending = None
        write_s = future.result()  # a failed write raises here, on its rank
        dist.barrier()  # every rank's shards and RNG state are written
        cfg = self.cfg
        if dist.get_rank() == 0:
            accum, mb = cfg.train.grad_accum_steps, cfg.train.micro_batch_size
            state = {
                "format": 1,
                "step": step,
                "world_size": dist.get_world_size(),
                "data": {"micro_batch_index": step * accum, "micro_batch_size": mb, "grad_accum_steps": accum,
                         "samples_seen": step * accum * mb * dist.get_world_size()},
                "lr_schedule": {"kind": "warmup_cosine", "step": step, "lr": cfg.train.lr,
                                "warmup_steps": cfg.train.warmup_steps, "max_steps": cfg.train.max_steps,
                                "min_lr_ratio": cfg.train.min_lr_ratio},
                "arch": self.arch,
                "config": config_lib.to_dict(cfg),
                "saved_at": time.time(),
            }
            storage.write_atomic(storage.join(uri, STATE), json.dumps(state, indent=1).encode())
            storage.write_atomic(storage.join(uri, COMPLETE), b"")  # last: the checkpoint is complete from here on
        if self.launcher == "ray":
            _ray_report(step_dir(step), {**(metrics or {}), "step": step})
            if dist.get_rank() == 0:
                _prune(self.run_dir, None, keep_before=step)
        else:
            dist.barrier()
            if dist.get_rank() == 0:
                _prune(self.run_dir, cfg.checkpoint.keep_last, keep_before=step)
        return {"step": step, "uri": uri, "write_s": write_s}

    def close(self) -> None:
        self.executor.shutdown(wait=True)


class HostStager:
    """Copies a state dict's tensors (DTensors: their local shards) into host buffers kept from save to save, so
    training may go on changing the originals while a background thread writes the copy.

    Buffers are keyed by their place in the state dict and pinned on GPU runs (fast, asynchronous device-to-host
    copies, waited for once at the end). Everything that is not a tensor is deep-copied.
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self.buffers: dict[tuple, torch.Tensor] = {}
        self._allocating = None

    def allocate_in_background(self, state_dict: dict) -> None:
        import threading

        shapes = {path: (t.shape, t.dtype) for path, t in _tensors(state_dict)}
        self._allocating = threading.Thread(target=lambda: self.buffers.update(
            {path: torch.empty(shape, dtype=dtype, pin_memory=self.pin) for path, (shape, dtype) in shapes.items()}),
            daemon=True)
        self._allocating.start()

    def stage(self, state_dict: dict) -> dict:
        if self._allocating is not None:
            self._allocating.join()
            self._allocating = None
        staged = self._copy(state_dict, ())
        if self.pin:
            torch.cuda.synchronize()
        return staged

    def _copy(self, obj, path: tuple):
        import copy

        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):
            local = self._buffer(obj.to_local(), path)
            return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape,
                                      stride=obj.stride())
        if isinstance(obj, torch.Tensor):
            return self._buffer(obj, path)
        if isinstance(obj, dict):
            return {k: self._copy(v, (*path, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, (*path, i)) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _buffer(self, tensor: torch.Tensor, path: tuple) -> torch.Tensor:
        buffer = self.buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self.buffers[path] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pin)
        return buffer.copy_(tensor.detach(), non_blocking=self.pin)


def _tensors(obj, path: tuple = ()):
    """(path, tensor) of every tensor in a nested state dict; a DTensor's local shard stands for it."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        yield path, obj.to_local()
    elif isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, (*path, i))


def _ray_report(name: str, metrics: dict) -> None:
    """Reports the complete checkpoint directory `name` of the run to Ray Train, in place (no upload): every
    rank calls it (it is a barrier); rank 0 passes the checkpoint."""
    import ray.train
    from ray.train import Checkpoint, CheckpointUploadMode

    checkpoint = None
    if dist.get_rank() == 0:
        ray_storage = ray.train.get_context().get_storage()
        checkpoint = Checkpoint(path=f"{ray_storage.experiment_fs_path}/{name}",
                                filesystem=ray_storage.storage_filesystem)
    ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name,
                     checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _prune(run_dir: str, keep_last: int | None, keep_before: int) -> None:
    """Deletes interrupted saves older than `keep_before`, and (torchrun; Ray prunes what it reported) all but
    the newest `keep_last` complete checkpoints."""
    entries = list_checkpoints(run_dir)
    complete = [uri for _, uri, ok in entries if ok]
    doomed = [uri for step, uri, ok in entries if not ok and step < keep_before]
    if keep_last is not None:
        doomed += complete[:-keep_last]
    for uri in doomed:
        storage.remove(uri)


def restore(uri: str, model, optimizer, cfg: config_lib.RunConfig) -> dict:
    """Loads a checkpoint into the sharded model and optimizer (any world size: DCP reshards) and this rank's
    RNG states; returns its train state. Any problem raises `CheckpointError` naming the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    try:
        state = json.loads(storage.read_bytes(storage.join(uri, STATE)))
        step = int(state["step"])
    except Exception as e:
        raise CheckpointError(f"checkpoint {uri}: cannot read {STATE}: {type(e).__name__}: {e}") from e
    saved, current = state.get("arch", {}), _arch(model.lm.config)
    differ = {k: (saved.get(k), v) for k, v in current.items() if saved.get(k) != v}
    if differ:
        detail = ", ".join(f"{k}: checkpoint {a} vs model {b}" for k, (a, b) in differ.items())
        raise CheckpointError(f"checkpoint {uri}: saved for another model architecture ({detail})")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        dcp.load({"model": model_sd, "optim": optim_sd}, storage_reader=_reader(uri))
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException derives from BaseException
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"checkpoint {uri}: cannot be read ({type(e).__name__}: {first[:500]})") from e
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    rng = storage.join(uri, "rng", f"rank{dist.get_rank():05d}.pt")
    if storage.exists(rng):  # a rank that did not exist before (more workers now) keeps its seeded state
        try:
            _set_rng_state(torch.load(io.BytesIO(storage.read_bytes(rng)), weights_only=False))
        except Exception as e:
            raise CheckpointError(f"checkpoint {uri}: cannot read {rng}: {type(e).__name__}: {e}") from e
    state["step"] = step
    return state


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


# --------------------------------------------------------------------------------------------------------------------
# Fault injection and worker pids (tests and failure drills)
# --------------------------------------------------------------------------------------------------------------------


def write_pid(run_dir: str, rank: int) -> None:
    """`<run>/workers/rank<r>.pid` (local storage only), so a drill can kill a chosen worker process."""
    if not storage.is_remote(run_dir):
        storage.write_atomic(storage.join(run_dir, "workers", f"rank{rank}.pid"), str(os.getpid()).encode())


def maybe_fail(cfg: config_lib.RunConfig, step: int, rank: int, run_dir: str) -> None:
    """`debug.fail_at_step`: the chosen rank SIGKILLs itself on reaching the step, once per run name."""
    d = cfg.debug
    if d.fail_at_step != step or d.fail_rank != rank:
        return
    marker = storage.join(run_dir, "faults", f"step{step}-rank{rank}")
    if storage.exists(marker):
        return
    storage.write_atomic(marker, f"{time.time()}\n".encode())
    print(f"debug.fail_at_step: rank {rank} (pid {os.getpid()}) kills itself at step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
