"""Resuming a worker group: the checkpoint it starts from, every rank verifying a share of its files
(`find_resume_point`), and reading it into the sharded model and optimizer (`restore`). The layout and which runs
a checkpoint may continue are `common/checkpoints.py`'s."""

from __future__ import annotations

import io
import json
import random
import time
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from ... import config as config_lib
from ... import storage
from ...common.checkpoints import (COMPLETE, PREFIX, UNUSABLE, CheckpointError, architecture,
                                   check_architecture, check_identity, list_checkpoints, read_state, verify)
from .. import schedule
from ..model.parallelize import plain_name

if TYPE_CHECKING:
    from ..model.causal_lm import CausalLMWithLoss

def _unusable_reason(uri: str) -> str | None:
    """Why checkpoint `uri` cannot be resumed from, or None (collective: the ranks share the verification and
    get the same answer)."""
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


def find_resume_point(cfg: config_lib.RunConfig, run_dir: str) -> tuple[str | None, list[dict]]:
    """The checkpoint this worker group starts from (None: from scratch) and those skipped as unusable, newest
    first, each `{"checkpoint", "step", "reason"}` (collective).

    One rule for every launcher and restart: the run's checkpoints are tried newest first and the first usable
    one wins (complete, train state readable, every file matching its checksum). One skipped is returned for the
    caller to record; a complete one found corrupt is also marked `_UNUSABLE`, so later prunes delete it and
    resumes skip it unread. Complete checkpoints but none usable raise `CheckpointError` listing each and why: a
    run that saved progress never starts over silently. Only a run without a complete checkpoint of its own
    starts from an explicit `resume` URI.
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


def _reader(uri: str):
    from torch.distributed.checkpoint import FileSystemReader

    if storage.is_remote(uri):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(uri)
    return FileSystemReader(storage.local_path(uri))


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def trained_state_dicts(model: CausalLMWithLoss, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """DCP's model and optimizer state dicts of what trains: every parameter in a full fine-tune; with LoRA the
    adapters alone (megabytes), the frozen base being what `model.path` and the seed give back on resume."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=trained_only(model))
    return without_frozen(model, model_sd), optim_sd


def trained_only(model: CausalLMWithLoss):
    """DCP's state dict options that leave out frozen parameters (and accept their absence on load)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=True, strict=not frozen)


def without_frozen(model: CausalLMWithLoss, model_sd: dict) -> dict:
    """`model_sd` without what is frozen: DCP's `ignore_frozen_params` keeps a tied weight under its second name
    (the frozen embedding as `lm_head.weight`)."""
    if all(p.requires_grad for p in model.parameters()):
        return model_sd
    trained = {plain_name(name) for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model_sd.items() if k in trained}


def restore(uri: str, model: CausalLMWithLoss, optimizer: torch.optim.Optimizer, cfg: config_lib.RunConfig,
            identity: dict) -> dict:
    """Load a checkpoint verified by `find_resume_point` into the sharded model and optimizer (any world size: DCP
    reshards) and this rank's RNG states; returns its train state. Another architecture or, per `check_identity`,
    another run's is refused; any problem raises `CheckpointError` naming the checkpoint (and each rank's cause)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = read_state(uri)
    check_architecture(uri, state, architecture(model.lm.config))
    check_identity(uri, state, identity, cfg.checkpoint.allow_changes)
    model_sd, optim_sd = trained_state_dicts(model, optimizer)
    try:
        dcp.load({"model": model_sd, "optim": optim_sd}, storage_reader=_reader(uri))
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException derives from BaseException
        raise CheckpointError(f"checkpoint {uri}: cannot be read ({failure_causes(e)})") from e
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=trained_only(model))
    rng = storage.join(uri, "rng", f"rank{dist.get_rank():05d}.pt")
    if storage.exists(rng):  # a rank that did not exist before (more workers now) keeps its seeded state
        try:
            _set_rng_state(torch.load(io.BytesIO(storage.read_bytes(rng)), weights_only=False))
        except Exception as e:
            raise CheckpointError(f"checkpoint {uri}: cannot read {rng}: {type(e).__name__}: {e}") from e
    return state


def failure_causes(error: BaseException) -> str:
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

    Same world size and micro-batch size: the saved index. Otherwise the samples consumed in the current epoch are
    divided among the new ranks (`micro_batches` shards each epoch's permutation `rank::world`, so every rank's
    first k micro-batches are its first k x world x batch positions): exact when it divides evenly; each epoch's
    dropped remainder depends on the world size, so a later epoch boundary may differ by a few blocks.
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


def train_state(cfg: config_lib.RunConfig, step: int, world: int, arch: dict, identity: dict) -> dict:
    """`train_state.json` of the checkpoint of `step`, for the resume: data and LR schedule positions, world size,
    architecture, the run's identity and config."""
    accum, mb = cfg.train.grad_accum_steps, cfg.train.micro_batch_size
    return {
        "format": 2,
        "step": step,
        "world_size": world,
        "data": {"micro_batch_index": step * accum, "micro_batch_size": mb, "grad_accum_steps": accum,
                 "samples_seen": step * accum * mb * world},
        "lr_schedule": {"kind": schedule.KIND, "step": step, **schedule.settings(cfg.train)},
        "arch": arch,
        "identity": identity,
        "config": config_lib.to_dict(cfg),
        "saved_at": time.time(),
    }
