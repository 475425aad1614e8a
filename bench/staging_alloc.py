#!/usr/bin/env python3
"""Where a host-staged save's time goes, and what preparing its buffers beside running steps costs the steps.

The state is the 1.5B's as a save stages it (Qwen2.5-1.5B's fp32 parameters and AdamW's two moments, 339 x 3
tensors, 18.5 GB), on the GPU. Each row runs in a fresh process (CUDA's host allocations never carry over):

- `fault`: buffers created in shared memory and their pages faulted in (`_new_shared` + `zero_`, as
  `job.worker.checkpoint.staging.HostStager` does), with 1 and with 8 torch threads;
- `populate`: the same pages faulted in by `madvise(MADV_POPULATE_WRITE)` (what `HostStager.reserve` does);
- `fallocate`: the shared memory's pages allocated by `posix_fallocate` on its file (in the page cache, mapped by
  nobody yet);
- `register`: page-locking faulted buffers with `cudaHostRegister`, whole tensors or in 64 MiB pieces (a copy into
  a tensor spanning separately locked pieces fails: `cudaErrorInvalidValue`);
- `pin_memory`: `torch.empty(pin_memory=True)` (cudaHostAlloc through the caching host allocator);
- `copy`: the device-to-host copy of the state into pinned, into faulted pageable, into fresh pageable buffers;
- `beside steps`: a training thread's speed (a launch-bound and a GPU-bound model) while another thread or process
  prepares the buffers, relative to the steps alone.

    python bench/staging_alloc.py [--scale 1.0] [--only ROW,...] > table.txt

`--scale 0.01` is a CPU-free smoke test of the script's paths on a small GPU.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the job package, also in the spawned rows
from checkpoint_write import training_thread_rate  # noqa: E402  (bench/, the script's own folder)

HIDDEN, INTER, LAYERS, KV, VOCAB = 1536, 8960, 28, 256, 151936
CHUNK = 64 << 20


def state_shapes(scale: float) -> list[tuple[int, ...]]:
    """Qwen2.5-1.5B's parameter shapes (tied embedding), three times (parameter, exp_avg, exp_avg_sq)."""
    layer = [(HIDDEN, HIDDEN), (HIDDEN,), (KV, HIDDEN), (KV,), (KV, HIDDEN), (KV,), (HIDDEN, HIDDEN),
             (INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER), (HIDDEN,), (HIDDEN,)]
    shapes = [(VOCAB, HIDDEN)] + layer * LAYERS + [(HIDDEN,)]
    shapes = [tuple(max(1, int(d * scale)) if i == 0 else d for i, d in enumerate(s)) for s in shapes]
    return shapes * 3


def shared_buffer(shape: tuple[int, ...]) -> torch.Tensor:
    nbytes = torch.Size(shape).numel() * 4
    buffer = torch.empty(0).set_(torch.UntypedStorage._new_shared(nbytes), 0, shape)
    return buffer.zero_()


def register(buffer: torch.Tensor, chunk: int | None) -> None:
    nbytes = buffer.numel() * buffer.element_size()
    step = chunk or nbytes
    for offset in range(0, nbytes, step):
        error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr() + offset, min(step, nbytes - offset), 1))
        assert error == 0, f"cudaHostRegister: CUDA error {error}"


def populate(buffers: list[torch.Tensor]) -> None:
    from job.worker.checkpoint.staging import populate as job_populate

    job_populate(buffers)


def prepare(shapes, how: str) -> list[torch.Tensor]:
    """The host buffers, made as `how` says: fault | populate | fault+register | fault+register-chunks | pin_memory."""
    if how == "pin_memory":
        return [torch.empty(s, pin_memory=True) for s in shapes]
    if how == "fallocate":
        buffers = [torch.empty(0).set_(torch.UntypedStorage._new_shared(torch.Size(s).numel() * 4), 0, s) for s in shapes]
        for b in buffers:
            fd, size = b.untyped_storage()._share_fd_cpu_()
            os.posix_fallocate(fd, 0, size)
        return buffers
    if how == "populate":
        buffers = [torch.empty(0).set_(torch.UntypedStorage._new_shared(torch.Size(s).numel() * 4), 0, s) for s in shapes]
        populate(buffers)
        return buffers
    buffers = [shared_buffer(s) for s in shapes]
    if how != "fault":
        for b in buffers:
            register(b, CHUNK if how.endswith("chunks") else None)
    return buffers


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def steps_rate(kind: str, seconds: float | None = None, until=None) -> float:
    """Training-like iterations per second (`checkpoint_write.training_thread_rate`, bf16) for `seconds` or while
    `until` (a thread or process) is alive: `launch` (28 small layers, host-bound like a step's launches) or `gpu`
    (large GEMMs, the device busy)."""
    width, batch = (256, 8) if kind == "launch" else (4096, 8192)
    model = steps_rate.models.get(kind)
    if model is None:
        model = steps_rate.models[kind] = torch.nn.Sequential(
            *[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(28 if kind == "launch" else 4)]
        ).cuda().to(torch.bfloat16)
    return training_thread_rate(model, torch.randn(batch, width, device="cuda", dtype=torch.bfloat16), seconds, until)


steps_rate.models = {}


def fault_in_process(shapes) -> None:
    """A separate process faults shared buffers in (what a writer process could do for the worker)."""
    [shared_buffer(s) for s in shapes]


def row(name: str, shapes, scale: float) -> dict:
    gb = sum(torch.Size(s).numel() for s in shapes) * 4 / 1e9
    out = {"row": name, "gb": round(gb, 2)}
    if name.startswith("fault-threads"):
        torch.set_num_threads(int(name.rsplit("-", 1)[1]))
        out["s"] = timed(lambda: prepare(shapes, "fault"))
    elif name in ("populate", "fallocate"):
        out["s"] = timed(lambda: prepare(shapes, name))
    elif name in ("register", "register-chunks", "register-after-populate", "register-after-fallocate"):
        buffers = prepare(shapes, name.rsplit("-", 1)[1] if "after" in name else "fault")
        out["s"] = timed(lambda: [register(b, CHUNK if name.endswith("chunks") else None) for b in buffers])
    elif name == "pin_memory":
        out["s"] = timed(lambda: prepare(shapes, "pin_memory"))
    elif name.startswith("copy-"):
        source = [torch.randn(s, device="cuda") for s in shapes]
        how = {"copy-pinned": "fault+register", "copy-chunk-registered": "fault+register-chunks",
               "copy-pageable": "fault"}.get(name)
        buffers = prepare(shapes, how) if how else [torch.empty(s) for s in shapes]
        torch.cuda.synchronize()

        def copy():
            for b, t in zip(buffers, source):
                b.copy_(t, non_blocking=True)
            torch.cuda.synchronize()

        out["s"] = timed(copy)
        out["gb_per_s"] = round(gb / out["s"], 1)
        out["equal"] = all(torch.equal(b, t.cpu()) for b, t in list(zip(buffers, source))[:3])
    elif name.startswith("beside-"):
        how = name.removeprefix("beside-")
        for kind in ("launch", "gpu"):
            steps_rate(kind, seconds=1)
            alone = steps_rate(kind, seconds=2)
            if how == "process":
                worker = mp.get_context("spawn").Process(target=fault_in_process, args=(shapes,))
                start = time.perf_counter()
                worker.start()
                rate = steps_rate(kind, until=worker)
                took = time.perf_counter() - start
            else:
                thread = threading.Thread(target=prepare, args=(shapes, how))
                start = time.perf_counter()
                thread.start()
                rate = steps_rate(kind, until=thread)
                took = time.perf_counter() - start
            out[f"{kind}_s"] = round(took, 2)
            out[f"{kind}_rate_vs_alone"] = round(rate / alone, 3)
    out["s"] = round(out.get("s", 0), 3)
    return out


ROWS = ["fault-threads-1", "fault-threads-8", "populate", "register", "register-after-populate", "pin_memory",
        "copy-pinned", "copy-pageable", "copy-fresh", "beside-fault", "beside-populate", "beside-process", "fallocate",
        "register-after-fallocate", "beside-fallocate"]


def child(name: str, scale: float, queue) -> None:
    if torch.cuda.is_available():
        torch.cuda.init()
    queue.put(row(name, state_shapes(scale), scale))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=float, default=1.0, help="the embedding's share of rows kept (1.0: the 1.5B)")
    parser.add_argument("--only", default=",".join(ROWS))
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU", "torch", torch.__version__, flush=True)
    for name in args.only.split(","):
        queue = ctx.Queue()
        process = ctx.Process(target=child, args=(name, args.scale, queue))
        process.start()
        process.join(timeout=240)
        result = queue.get() if process.exitcode == 0 else {"row": name, "error": f"exit {process.exitcode}"}
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
