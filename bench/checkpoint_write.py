#!/usr/bin/env python3
"""How much a checkpoint write in a background thread slows the training thread, per way of writing.

The training thread launches many small CUDA kernels (a launch-bound forward and backward through 28 small
layers, like a compiled FSDP2 step's host side); a background thread writes pinned host buffers of `--gib` GiB
(staged optimizer state) with DCP as `job.worker.checkpoint.writer` does, and variants. Printed per variant: the write's
seconds and the training thread's speed during the write, relative to alone.

    python bench/checkpoint_write.py [--gib 6] [--dir /tmp/ckbench]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist


def training_thread_rate(model, x, seconds: float | None = None, until: threading.Thread | None = None) -> float:
    """Iterations per second of forward + backward + an optimizer-like update, for `seconds` or while `until`."""
    n, start = 0, time.perf_counter()
    while (until is not None and until.is_alive()) or (seconds is not None and time.perf_counter() - start < seconds):
        for _ in range(5):
            model(x).sum().backward()
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-1e-6)
                p.grad = None
        torch.cuda.synchronize()
        n += 5
    return n / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=6)
    parser.add_argument("--dir", default="/tmp/ckbench")
    args = parser.parse_args()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.utils.serialization import config as serialization

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tempfile.mktemp()}")
    group = dist.new_group(backend="gloo")
    n = int(args.gib * 2**30 / (64 << 20))
    start = time.perf_counter()
    state = {f"t{i}": torch.empty(16 << 20, pin_memory=True).fill_(i) for i in range(n)}
    print(f"pinned {n} x 64 MiB in {time.perf_counter() - start:.1f} s", flush=True)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(28)]).cuda()
    x = torch.randn(8, 256, device="cuda")
    training_thread_rate(model, x, seconds=2)
    alone = training_thread_rate(model, x, seconds=4)

    def raw(path):
        with open(os.path.join(path, "raw"), "wb") as f:
            for v in state.values():
                f.write(v.numpy().data)

    variants = {
        "dcp, 4 threads, crc (as job.worker.checkpoint.writer)": (lambda p: dcp.save(state, storage_writer=FileSystemWriter(p, thread_count=4), process_group=group), True),
        "dcp, 1 thread, crc": (lambda p: dcp.save(state, storage_writer=FileSystemWriter(p, thread_count=1), process_group=group), True),
        "dcp, 4 threads, no crc": (lambda p: dcp.save(state, storage_writer=FileSystemWriter(p, thread_count=4), process_group=group), False),
        "dcp, 1 thread, no crc": (lambda p: dcp.save(state, storage_writer=FileSystemWriter(p, thread_count=1), process_group=group), False),
        "raw file writes": (raw, True),
    }
    print(f"training thread alone: {alone:.0f} it/s", flush=True)
    print(f"{'writer':<42}{'write s':>9}{'training thread':>17}")
    for name, (write, crc) in variants.items():
        path = os.path.join(args.dir, "v")
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        serialization.save.compute_crc32 = crc
        took = {}

        def target():
            t = time.perf_counter()
            write(path)
            took["s"] = time.perf_counter() - t

        thread = threading.Thread(target=target)
        thread.start()
        rate = training_thread_rate(model, x, until=thread)
        thread.join()
        print(f"{name:<42}{took['s']:>9.1f}{rate / alone:>16.0%}", flush=True)
        shutil.rmtree(path, ignore_errors=True)
    serialization.save.compute_crc32 = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
