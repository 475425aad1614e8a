"""Throughput accounting (FLOPs per token, MFU) and rank 0's metrics log (stdout JSON lines + metrics.jsonl)."""

from __future__ import annotations

import json
import sys
import time

import torch

from . import storage

# Dense (no sparsity) bf16 tensor-core peak per device, FLOP/s, from the vendors' datasheets. Matched by
# substring of `torch.cuda.get_device_name()`, first match wins (so "H100 PCIe" precedes "H100").
PEAK_BF16_FLOPS = [
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100", 989.4e12),
    ("A100", 312.0e12),
    ("L40S", 362.05e12),
    ("L4", 121.0e12),
]


def peak_flops(device: torch.device, override: float | None) -> float | None:
    """Peak bf16 FLOP/s of one device: the config override, the table entry for its name, or None (unknown)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6·N for the matmuls of forward (2·N) and backward (4·N), plus attention scores
    and weighted values, 12·layers·hidden·seq_len (forward 4·L·H·T: QK^T and AV, each 2·H·T per token; ×3 with
    backward). N counts every parameter once, the tied LM head included (the head is a real matmul), as in the
    PaLM appendix B formula. Causal masking is not discounted, as is conventional."""
    return 6 * n_params + 12 * n_layers * hidden * seq_len


class MetricsLogger:
    """Writes metric records as JSON lines to stdout and to `<run_dir>/metrics.jsonl` (rank 0 only).

    The file is rewritten whole (atomically) at each record, so the same code writes local paths and object
    storage (which cannot append); metric logs are small. Existing lines are kept, so a resumed run continues
    the file; records of steps past `keep_until_step` (the step the run resumed from, 0 when starting fresh)
    are dropped, so steps recomputed after a resume appear once.
    """

    def __init__(self, run_dir: str, max_steps: int, progress_bar: str, keep_until_step: int | None = None):
        self.path = storage.join(run_dir, "metrics.jsonl")
        self.lines = storage.read_text(self.path).splitlines() if storage.exists(self.path) else []
        if keep_until_step is not None:
            self.lines = [line for line in self.lines if json.loads(line).get("step", 0) <= keep_until_step]
        show = progress_bar == "on" or (progress_bar == "auto" and sys.stderr.isatty())
        self.bar = None
        if show:
            from tqdm import tqdm

            self.bar = tqdm(total=max_steps, file=sys.stderr, dynamic_ncols=True)

    def log(self, record: dict) -> None:
        record = {"time": round(time.time(), 3), **record}
        line = json.dumps(record)
        print(line, flush=True)
        self.lines.append(line)
        storage.write_atomic(self.path, "\n".join(self.lines) + "\n")
        if self.bar is not None and record.get("kind") == "train":
            self.bar.n = record["step"]
            self.bar.set_postfix(loss=f"{record['loss']:.3f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
