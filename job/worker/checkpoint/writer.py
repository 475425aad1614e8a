"""Saving checkpoints while training goes on: the asynchronous writer (`Checkpointer`, DCP in a writer process or a
thread), where a save first copies the state (on the device, or host buffers: `staging.py`) and which writer runs
(`choose_writer`). What a checkpoint holds and how it is verified is `common/checkpoints.py`'s; this module writes
that layout.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from ... import config as config_lib
from ... import storage
from ...common.checkpoints import COMPLETE, STATE, CheckpointError, architecture, prune, step_dir, write_checksums
from ..model.causal_lm import CausalLMWithLoss
from ..model.parallelize import plain_name
from .resume import failure_causes, train_state, trained_only, trained_state_dicts, without_frozen
from .staging import HostStager, choose_staging, layout_bytes, map_tensors, tensor_layout


class Checkpointer:
    """Saves checkpoints while training goes on (collective: every rank makes the same calls in the same order).

    `save(step)` copies this rank's shards of the model and optimizer state where training cannot change them,
    which is all training waits for: on the GPU itself when it has room for the copy beside training's peak
    (`choose_staging`), the write then copying it to host memory beside the steps; else into host memory
    (`HostStager`: page-locked on GPU, prepared beside the steps before the first save, reused).
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
        self.injected_write_error: Callable[[int], None] | None = None
        """Called with the step in each write, once its shards are written: a fault a drill arms (`faults.FaultInjection`)."""

    def due(self, step: int) -> bool:
        """Whether the loop saves at `step`: every `checkpoint.every_steps`, and the run's last step."""
        every = self.cfg.checkpoint.every_steps
        return step == self.cfg.train.max_steps or bool(every and step % every == 0)

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
        self._decide_staging(model, optimizer)
        model_sd, optim_sd = trained_state_dicts(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        rng = _torch_bytes(_rng_state())
        self.arch = architecture(model.lm.config)
        staged = copied = None
        if self.staging["on"] == "device":
            self.device_copy = state if last else map_tensors(state, lambda _, tensor: tensor.detach().clone())
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

    def prepare_staging(self, model: CausalLMWithLoss, optimizer: torch.optim.Optimizer) -> None:
        """Decides where this rank's saves stage (`choose_staging`), once training's peak memory is known: the loop
        calls it after the attempt's second step, the first that holds the optimizer's state from start to end (a
        save before that decides itself; after the first step alone the peak lacked AdamW's 12 GB of the 1.5B, and
        staging on an H100's device then ran the held-out evaluation out of memory). The decision is kept: later
        saves would count the copy itself in that peak. The host buffers, which every save fills (host staging)
        or the write does (device staging), are created now and faulted in by the write thread while the steps run
        (`HostStager.reserve`), so that the first save does not wait for ~10 s of page faults."""
        if self.cfg.checkpoint.async_save:  # a synchronous save waits for its write anyway: it prepares them then
            self._decide_staging(model, optimizer)

    def _decide_staging(self, model: CausalLMWithLoss, optimizer: torch.optim.Optimizer) -> None:
        if self.staging is not None:
            return
        if not self.writer:
            self.prepare(model)
        model_sd, optim_sd = trained_state_dicts(model, optimizer)
        layout = tensor_layout({"model": model_sd, "optim": optim_sd})
        self.staging = choose_staging(self.device, layout_bytes(layout))
        self.stager = HostStager(pin=self.device.type == "cuda" and self.staging["on"] == "host",
                                 shared=self.writer["writer"] == "process")
        self.stager.reserve(layout, self.executor)

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
            write_in_process(staged, _writer(uri), self.group)
        else:
            dcp.save(staged, storage_writer=_writer(uri), process_group=self.group)
        if self.injected_write_error is not None:  # after DCP's collectives: no rank hangs
            self.injected_write_error(step)
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
            state = train_state(cfg, step, dist.get_world_size(), self.arch, self.identity)
            storage.write_atomic(storage.join(uri, STATE), json.dumps(state, indent=1).encode())
            storage.write_atomic(storage.join(uri, COMPLETE), b"")  # last: the checkpoint is complete from here on
        dist.barrier()
        if dist.get_rank() == 0:
            prune(self.run_dir, cfg.checkpoint.keep_last, keep_before=step)
        return {"step": step, "uri": uri, "write_s": write_s, "checksum_s": checksum_s,
                "staging": {**self.staging, **self.stager.timings}}

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
        if self.stager is not None:
            self.stager.release()
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


def write_in_process(staged: dict, storage_writer, group: dist.ProcessGroup | None = None) -> None:
    """Writes `staged` (already in host memory: `HostStager`, shared for this) with DCP's writer process, which reads
    it from shared memory; returns once it is written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    dcp.async_save(staged, storage_writer=storage_writer, process_group=group,
                   async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=_AlreadyStaged()).result()


SHARED_MEMORY = "/dev/shm"


def first_save_layout(model: CausalLMWithLoss) -> dict[tuple, tuple[torch.Size, torch.dtype]]:
    """What a save stages (`tensor_layout` of the model's and the optimizer's state dicts), known before the first
    step: the model's state dict, and per parameter the state AdamW keeps once it has stepped (`step`, and
    `exp_avg` and `exp_avg_sq` shaped as the parameter's local shard). The optimizer's own state dict cannot be
    read before then: DCP's `get_state_dict` would initialise it with a zero-gradient step, one step early for
    Adam's bias correction. A tensor missing here is allocated when first staged; tests/test_checkpoint.py holds
    the prediction equal to what is staged after a step."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    layout = tensor_layout({"model": without_frozen(model, get_model_state_dict(model, options=trained_only(model)))})
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


def _writer(uri: str):
    from torch.distributed.checkpoint import FileSystemWriter

    if storage.is_remote(uri):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(uri)
    # Several files per rank, written in parallel: one stream does not fill a fast disk. On a GPU machine's NVMe
    # disk (bench/dcp_write.py, 8.4 GB fsynced) 4 threads wrote 1.49 GB/s, 8 1.71, 16 1.73.
    return FileSystemWriter(storage.local_path(uri), thread_count=8)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _failed_save(uri: str, error: BaseException) -> CheckpointError:
    """The error of a save that failed (a full disk, read-only or lost storage), naming the checkpoint and each
    rank's cause, once what was written is removed (by each rank that sees the failure)."""
    return CheckpointError(f"checkpoint {uri}: save failed ({failure_causes(error)}){_remove_partial(uri)}"
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
