"""Staging: where a save first copies the state it writes (device or host memory), and the host buffers, prepared
beside the steps. The write reads the staged copy while training goes on changing the original (`Checkpointer`)."""

from __future__ import annotations

import copy
import ctypes
import mmap
import time
from concurrent.futures import Executor, Future
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

def tensor_layout(state_dict: dict) -> dict[tuple, tuple[torch.Size, torch.dtype]]:
    """Shape and dtype of each tensor of a state dict (a DTensor's local shard), by its place in it."""
    layout = {}

    def note(path: tuple, tensor: torch.Tensor) -> torch.Tensor:
        layout[path] = (tensor.shape, tensor.dtype)
        return tensor

    map_tensors(state_dict, note)
    return layout


def layout_bytes(layout: dict[tuple, tuple[torch.Size, torch.dtype]]) -> int:
    """How many bytes the tensors of `layout` (`tensor_layout`) hold."""
    return sum(shape.numel() * dtype.itemsize for shape, dtype in layout.values())


STAGING_HEADROOM = 0.05
"""Share of the device's memory a save's copy on the device leaves free beside training's peak."""


def choose_staging(device: torch.device, need: int) -> dict:
    """`{"on": "device" | "host", "bytes", ...}`: where a save first copies this rank's `need` bytes of state.

    On the device when it has room beside training's peak (`max_memory_reserved`), the other processes on it and
    `STAGING_HEADROOM`: a faster copy than into host memory (docs/checkpoints.md), which the write then copies to
    host memory beside the steps, on a stream of its own. Else in host memory, as on CPU."""
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

    Buffers, keyed by their place in the state dict, are page-aligned mappings: shared memory for the writer
    process, else anonymous. `reserve` creates them and has a thread fault their pages in beside the steps
    (`MADV_POPULATE_WRITE`: one system call per buffer, without the interpreter lock or a CUDA call); copying from
    a GPU, the first `stage` page-locks them in place (`cudaHostRegister`, much faster than allocating pinned;
    docs/checkpoints.md), so that copies are asynchronous and waited for once. Non-tensors are deep-copied.
    """

    def __init__(self, pin: bool, shared: bool = False):
        self.pin, self.shared = pin, shared
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.populated: Future | None = None  # the thread faulting the reserved buffers in: its seconds
        self.locked: list[torch.Tensor] = []
        self.timings: dict[str, float] = {}  # populate_s, waited_s, lock_s: how the first save's buffers came to be

    def reserve(self, layout: dict[tuple, tuple[torch.Size, torch.dtype]], executor: Executor) -> None:
        """Create the buffers of `layout` and have `executor` fault their pages in."""
        self.buffers.update({path: host_buffer(shape, dtype, self.shared) for path, (shape, dtype) in layout.items()})
        self.populated = executor.submit(populate, list(self.buffers.values()))

    def stage(self, state_dict: dict, after: torch.cuda.Event | None = None) -> dict:
        """The staged copy of `state_dict`. `after`: the state is a device copy, made once that event has passed,
        copied on a stream of its own (in the write thread, beside training's stream)."""
        if self.populated is not None:
            start = time.perf_counter()
            self.timings["populate_s"] = round(self.populated.result(), 3)
            self.timings["waited_s"] = round(time.perf_counter() - start, 3)
            self.populated = None
        if self.pin and not self.locked:
            start = time.perf_counter()
            for buffer in self.buffers.values():
                self._lock(buffer)
            self.timings["lock_s"] = round(time.perf_counter() - start, 3)
        if after is None:
            staged = map_tensors(state_dict, self._buffer)
            if self.pin:
                torch.cuda.synchronize()
            return staged
        stream = torch.cuda.Stream()
        stream.wait_event(after)
        with torch.cuda.stream(stream):
            staged = map_tensors(state_dict, self._buffer)
        stream.synchronize()
        return staged

    def release(self) -> None:
        """Unlock the page-locked buffers: dropped, they are unmapped, and CUDA would refuse to lock a later mapping
        at the same address."""
        for buffer in self.locked:
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
        self.locked.clear()

    def _buffer(self, path: tuple, tensor: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self.buffers[path] = host_buffer(tensor.shape, tensor.dtype, self.shared)
            if self.pin:
                self._lock(buffer)
        return buffer.copy_(tensor.detach(), non_blocking=self.pin)

    def _lock(self, buffer: torch.Tensor) -> None:
        nbytes = buffer.numel() * buffer.element_size()
        if nbytes:  # cudaHostRegisterPortable: page-locked for every CUDA context of the process
            error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 1))
            if error:
                raise RuntimeError(f"checkpoint staging: cudaHostRegister of {nbytes} bytes failed (CUDA error {error})")
            self.locked.append(buffer)


MADV_POPULATE_WRITE = 23
"""madvise(2) advice (Linux 5.14+): fault the range's pages in, writable, as touching each one would."""


def host_buffer(shape: torch.Size, dtype: torch.dtype, shared: bool) -> torch.Tensor:
    """An empty tensor in a page-aligned mapping of its own: shared memory, which the writer process maps too
    (created there: `share_memory_()` would copy it in holding the interpreter lock, ~10 ms per 55 MB), or anonymous
    memory."""
    nbytes = shape.numel() * dtype.itemsize
    if not nbytes:
        return torch.empty(shape, dtype=dtype)
    if shared:
        return torch.empty(0, dtype=dtype).set_(torch.UntypedStorage._new_shared(nbytes), 0, shape)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


def populate(buffers: list[torch.Tensor]) -> float:
    """Fault the buffers' pages in; returns the seconds. Without `MADV_POPULATE_WRITE` the first copy does."""
    start = time.perf_counter()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for buffer in buffers:
        nbytes = buffer.numel() * buffer.element_size()
        if nbytes and libc.madvise(buffer.data_ptr(), nbytes, MADV_POPULATE_WRITE) != 0:
            break
    return time.perf_counter() - start


def map_tensors(obj, fn: Callable[[tuple, torch.Tensor], torch.Tensor], path: tuple = ()):
    """A nested state dict (dicts, lists, tuples) rebuilt with `fn(path, tensor)` for each tensor at `path`; a
    DTensor's local shard goes to `fn`, the result the shard of a DTensor like it. The rest is deep-copied."""
    if isinstance(obj, DTensor):
        local = fn(path, obj.to_local())
        return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape,
                                  stride=obj.stride())
    if isinstance(obj, torch.Tensor):
        return fn(path, obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn, (*path, k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn, (*path, i)) for i, v in enumerate(obj))
    return copy.deepcopy(obj)
