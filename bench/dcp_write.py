#!/usr/bin/env python3
"""How fast DCP writes a checkpoint's staged state to a directory, per writer setting: the write that sets the
end of a run (its last save completes before the job reports success, docs/checkpoints.md).

A state dict of `--gib` GiB of random values in host memory, shaped like Qwen2.5-1.5B's fp32 parameters and
AdamW moments (one 233M-element embedding, the rest per layer), is saved with `FileSystemWriter` once per
variant `[process:]THREADSxSYNC` (writer threads; whether each file is fsynced; `process:` as a run's writer
process does it, from staged shared memory through DCP's writer process, which the first such row starts),
then checksummed as `job.worker.checkpoint.writer` does (`storage.digest_all`). One row per variant: seconds writing, GB/s,
seconds checksumming.

    python bench/dcp_write.py [--gib 8] [--dir /tmp/dcpbench] [--variants 4xsync,8xsync,process:8xsync]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from job import storage  # noqa: E402


def staged_state(gib: float) -> dict[str, torch.Tensor]:
    """fp32 tensors of `gib` GiB in all: an embedding-sized one, then per-layer matrices and vectors."""
    budget = int(gib * 2**30 / 4)
    sizes = [min(budget // 3, 151936 * 1536)]
    layer = [1536 * 1536, 256 * 1536, 256 * 1536, 1536 * 1536, 8960 * 1536, 8960 * 1536, 1536 * 8960, 1536, 1536]
    while sum(sizes) + sum(layer) <= budget:
        sizes += layer
    return {f"t{i}": torch.randn(n) for i, n in enumerate(sizes)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--dir", default="/tmp/dcpbench")
    parser.add_argument("--variants", default="4xsync,8xsync,16xsync,8xnosync")
    args = parser.parse_args()

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from job.worker.checkpoint.staging import HostStager
    from job.worker.checkpoint.writer import write_in_process

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tempfile.mktemp()}")
    state = staged_state(args.gib)
    total = sum(t.numel() * t.element_size() for t in state.values())
    shared = None  # the state staged into shared memory for the writer process, once a row needs it
    print(f"{len(state)} tensors, {total / 1e9:.1f} GB, to {args.dir}")
    print(f"{'variant':<16}{'write s':>9}{'GB/s':>7}{'checksum s':>12}")
    for variant in args.variants.split(","):
        writer, _, setting = variant.rpartition(":")
        threads, sync = setting.split("x")
        storage_writer = FileSystemWriter(args.dir, thread_count=int(threads), sync_files=sync == "sync")
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
        start = time.perf_counter()
        if writer == "process":
            shared = shared or HostStager(pin=torch.cuda.is_available(), shared=True).stage(state)
            start = time.perf_counter()
            write_in_process(shared, storage_writer)
        else:
            dcp.save(state, storage_writer=storage_writer)
        written = time.perf_counter()
        storage.digest_all([os.path.join(args.dir, name) for name in sorted(os.listdir(args.dir))])
        checked = time.perf_counter()
        print(f"{variant:<16}{written - start:>9.1f}{total / 1e9 / (written - start):>7.2f}{checked - written:>12.1f}",
              flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
