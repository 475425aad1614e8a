"""Saving checkpoints while training goes on (`Checkpointer`; docs/checkpoints.md): DCP in a writer process or a
thread (`choose_writer`), from a copy on the device or in host buffers (`staging.py`). The layout written is
`common/checkpoints.py`'s.
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
    which is all training waits for: on the device when it has room beside training's peak, else into host
    buffers (`choose_staging`). The write (DCP shards over a gloo group of its own, so that training's
    collectives keep the default group to themselves) runs in a writer process or a thread (`choose_writer`),
    then this rank's RNG state and checksums. A checkpoint is complete only in `finish()`, once every rank's write
    returned: rank 0 writes `train_state.json` and, last, `_COMPLETE`, then prunes; a save cut short has no
    marker and is never resumed from.

    At most one save is in flight: `save` finishes the previous one first. The loop calls `finish()` at a log
    step once every rank's `write_done` (summed with the loss), and at the end of the run, before success.
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
        """Called with the step once a write's shards are written: a drill's fault (`faults.FaultInjection`)."""

    def due(self, step: int) -> bool:
        """Whether the loop saves at `step`: every `checkpoint.every_steps`, and the run's last step."""
        every = self.cfg.checkpoint.every_steps
        return step == self.cfg.train.max_steps or bool(every and step % every == 0)

    def prepare(self, model: CausalLMWithLoss) -> dict:
        """Choose the writer (collective) and start the writer process, before the first step; returns
        `self.writer`."""
        self.writer = choose_writer(self.cfg.checkpoint.async_writer, first_save_layout(model), self.group)
        if self.writer["writer"] == "process":
            self._start_writer_process()
        return self.writer

    def _start_writer_process(self) -> None:
        """Start DCP's writer process in the write thread while the first steps run, not in the first save's write,
        which its start (an interpreter importing torch, then its gloo group) would lengthen, widening the window
        in which a crash loses that save. The first `save` waits for it. Collective: the ranks agree on the
        writers' rendezvous here. Skipped where DCP's internals differ (the first save starts it then)."""
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
        """Start saving `step`; returns once the state is copied. `last`: the run's last step, whose state no
        longer changes, so device staging needs no copy."""
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
        """Decide where this rank's saves stage (`choose_staging`) once training's peak memory is known: the loop
        calls it after the attempt's second step, the first that holds the optimizer's state throughout (after
        the first alone the peak lacks AdamW's state, and device staging can then run the evaluation out of
        memory); a save before that decides itself. Kept: later saves would count the copy in the peak. The host
        buffers are created now and faulted in by the write thread beside the steps (`HostStager.reserve`), so
        that the first save does not wait for the page faults."""
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
        """Wait until the save in flight releases its device copy: before work that may need more device memory
        than training's peak (task evaluation, export)."""
        self.device_copy_released.wait()

    def _write(self, staged: dict | None, copied: torch.cuda.Event | None, step: int, uri: str, rng: bytes,
               rank: int, start: float) -> tuple[float, float]:
        """Write this rank's part of checkpoint `uri`: `staged`, or the device copy, first copied into host memory
        once `copied` says it is made. Returns (seconds since `start`, of them checksumming)."""
        import torch.distributed.checkpoint as dcp

        if staged is None:
            try:  # on this worker's device: a thread's current CUDA device is the first one
                with torch.cuda.device(self.device) if copied is not None else contextlib.nullcontext():
                    staged = self.stager.stage(self.device_copy, after=copied)
            finally:
                self.device_copy = None
                self.device_copy_released.set()
        # The process even for the last save: the evaluations and the export after it would suffer a writer
        # thread's hold on the interpreter (the 1.5B's final held-out pass: 21.8 s beside a thread, 3.1 s beside
        # the process).
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
        """Complete the save in flight, if any (waiting for its writes); returns `{step, uri, write_s,
        checksum_s, staging}` (this rank's seconds writing, checksums included, and checksumming)."""
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
        """On a failed attempt (any rank, not collective): wait for this rank's write in flight, then remove that
        never-complete save, whose space the run record needs to say the run failed (a full disk often fails
        the loop's next write before the save's own error is collected)."""
        if self.pending is None:
            return
        _, uri, future = self.pending
        self.pending = None
        with contextlib.suppress(BaseException):  # the loop's own error is the one reported
            future.result()
        _remove_partial(uri)

    def close(self) -> None:
        """Wait for the write in flight, then end the writer process, if any."""
        from torch.distributed.checkpoint import _async_process_executor as process_executor

        self.executor.shutdown(wait=True)
        if self.stager is not None:
            self.stager.release()
        # DCP keeps its writer for the interpreter's life; dropping it ends it, so a later run here starts its own.
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
    """Write `staged` (in shared host memory: `HostStager`) with DCP's writer process; returns once written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    dcp.async_save(staged, storage_writer=storage_writer, process_group=group,
                   async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=_AlreadyStaged()).result()


SHARED_MEMORY = "/dev/shm"


def first_save_layout(model: CausalLMWithLoss) -> dict[tuple, tuple[torch.Size, torch.dtype]]:
    """What a save stages (`tensor_layout`), known before the first step: the model's state dict, and per parameter
    AdamW's state once stepped (`step`, `exp_avg`, `exp_avg_sq` shaped as the local shard). The optimizer's own
    state dict cannot be read yet: `get_state_dict` would initialise it with a zero-gradient step, one step early
    for Adam's bias correction. A tensor missing here is allocated when first staged (tests/test_checkpoint.py)."""
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
    """`{"writer", "reason", ...}` for `checkpoint.async_writer` = `setting` (collective over `group`: one choice).

    The writer process reads the staged state from `/dev/shm`, so each node needs room there for its workers'
    shares together (a full `/dev/shm` is no error but a SIGBUS when touched) and a file descriptor per tensor.
    `process` without that room raises `CheckpointError` naming the numbers; `auto` takes the thread."""
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
    # Several files per rank in parallel: one stream does not fill a fast disk (8: docs/checkpoints.md).
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
    """The error of a failed save, naming the checkpoint and each rank's cause, once its partial write is removed."""
    return CheckpointError(f"checkpoint {uri}: save failed ({failure_causes(error)}){_remove_partial(uri)}"
                           f"{_free_space(uri)}")


def _remove_partial(uri: str) -> str:
    """Remove a save that will never be complete (see `abandon`); returns what happened, to end an error message."""
    try:
        storage.remove(uri)
        return "; the partial checkpoint was removed"
    except Exception as cleanup:
        return f"; removing the partial checkpoint failed too ({type(cleanup).__name__}: {cleanup})"


def _free_space(uri: str) -> str:
    """Local storage's free room at a failed save: a full disk often surfaces as another error
    (`[enforce fail at inline_container.cc] unexpected pos`), its OSError lost."""
    if storage.is_remote(uri):
        return ""
    path = storage.local_path(uri)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return f"; {path} has {shutil.disk_usage(path).free / 1e9:.1f} GB free"
    except OSError:
        return ""
