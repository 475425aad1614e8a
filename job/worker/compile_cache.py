"""The compilation cache kept on the runs' storage: what `torch.compile` built (graphs and kernels, as
`torch.compiler` cache artifacts), so that a resumed attempt or a repeated run on a fresh pod, whose local caches
are empty, loads it instead of compiling again.

    <storage_path>/.compile_cache/<key>.bin

The key is what decides the compiled code: the torch version, the device, the model and parallel settings, the
sequence length and micro-batch. The artifacts carry their own keys inside (torch checks them on use), so a file
that does not fit only means a cache miss; a file that cannot be read is reported and the run compiles as usual.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from .. import storage
from ..config import RunConfig

CACHE_DIR = ".compile_cache"


def cache_uri(cfg: RunConfig, device: torch.device) -> str:
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    key = storage.json_sha256({
        "torch": torch.__version__, "device": device_name, "model": asdict(cfg.model), "parallel": asdict(cfg.parallel),
        "seq_len": cfg.train.seq_len, "micro_batch_size": cfg.train.micro_batch_size,
        "loss_chunk_size": cfg.train.loss_chunk_size,
    })[:16]
    return storage.join(cfg.storage_path, CACHE_DIR, f"{key}.bin")


def load(uri: str) -> dict:
    """Loads the artifacts at `uri` into this process's compiler caches; what happened, for the run's log."""
    if not storage.exists(uri):
        return {"uri": uri, "loaded": False}
    try:
        info = torch.compiler.load_cache_artifacts(storage.read_bytes(uri))
    except Exception as e:  # a damaged or foreign file costs a compilation, never the run
        return {"uri": uri, "loaded": False, "error": f"{type(e).__name__}: {e}"}
    artifacts = sum(len(v) for v in info.artifacts.values()) if info else 0
    if not artifacts:
        return {"uri": uri, "loaded": False, "error": "no compiled artifacts could be read from the file"}
    return {"uri": uri, "loaded": True, "artifacts": artifacts}


def save(uri: str) -> int:
    """Writes what this process compiled so far to `uri` (replacing an older file); bytes written."""
    artifacts = torch.compiler.save_cache_artifacts()
    if artifacts is None:
        return 0
    blob, _ = artifacts
    storage.write_atomic(uri, blob)
    return len(blob)
