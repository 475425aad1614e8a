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
EXPORT_DIR = "export"
VALID = "_VALID"
"""Marker written into the export directory once the fresh-process acceptance check passed."""
PREFIX = "checkpoint_"
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"
ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
             "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be used (unreadable, incomplete, another model); names the path."""


class ExportError(RuntimeError):
    """The exported model failed its fresh-process acceptance check."""


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
    return FileSystemWriter(uri.removeprefix("file://"))


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


def save(step: int, model, optimizer, cfg: config_lib.RunConfig, run_dir: str, launcher: str,
         metrics: dict | None = None) -> str:
    """Saves a complete checkpoint of `step` (collective: every rank calls it) and returns its URI."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    name = step_dir(step)
    uri = storage.join(run_dir, name)
    if rank == 0:
        storage.remove(uri)  # leftovers of an interrupted save of this step (never a complete checkpoint we resumed from)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=_writer(uri))
    buf = _torch_bytes(_rng_state())
    storage.write_atomic(storage.join(uri, "rng", f"rank{rank:05d}.pt"), buf)
    dist.barrier()  # every rank's shards and RNG state are written
    if rank == 0:
        accum, mb = cfg.train.grad_accum_steps, cfg.train.micro_batch_size
        state = {
            "format": 1,
            "step": step,
            "world_size": world,
            "data": {"micro_batch_index": step * accum, "micro_batch_size": mb, "grad_accum_steps": accum,
                     "samples_seen": step * accum * mb * world},
            "lr_schedule": {"kind": "warmup_cosine", "step": step, "lr": cfg.train.lr,
                            "warmup_steps": cfg.train.warmup_steps, "max_steps": cfg.train.max_steps,
                            "min_lr_ratio": cfg.train.min_lr_ratio},
            "arch": _arch(model.lm.config),
            "config": config_lib.to_dict(cfg),
            "saved_at": time.time(),
        }
        storage.write_atomic(storage.join(uri, STATE), json.dumps(state, indent=1).encode())
        storage.write_atomic(storage.join(uri, COMPLETE), b"")  # last: the checkpoint is complete from here on
    if launcher == "ray":
        _ray_report(name, {**(metrics or {}), "step": step})
        if rank == 0:
            _prune(run_dir, None, keep_before=step)
    else:
        dist.barrier()
        if rank == 0:
            _prune(run_dir, cfg.checkpoint.keep_last, keep_before=step)
    return uri


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


# --------------------------------------------------------------------------------------------------------------------
# Held-out reference (what the final in-training evaluation and the acceptance check both measure)
# --------------------------------------------------------------------------------------------------------------------


def synthetic_heldout(vocab: int, cfg: config_lib.RunConfig, world: int) -> data_lib.Blocks:
    """Seeded random blocks, disjoint in seed from the training stream, for runs without a held-out split."""
    n, seq = 2 * world * cfg.train.micro_batch_size, cfg.train.seq_len
    g = torch.Generator().manual_seed(cfg.train.seed * 7919 + 104729)
    tokens = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return data_lib.Blocks(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(),
                           torch.arange(seq).expand(n, seq).contiguous())


def eval_indices(n_blocks: int, world: int, micro_batch_size: int, max_batches: int) -> list[list[int]]:
    """The held-out blocks `evaluate.evaluate` reads on `world` ranks (weight-0 repeats left out), as
    micro-batches: the acceptance check measures the same blocks as the final in-training evaluation."""
    from .evaluate import eval_batches

    batches = []
    for rank in range(world):
        for index, real in eval_batches(n_blocks, rank, world, micro_batch_size, max_batches):
            chunk = [j for j, ok in zip(index, real) if ok]
            if chunk:
                batches.append(chunk)
    return batches


# --------------------------------------------------------------------------------------------------------------------
# Export and acceptance
# --------------------------------------------------------------------------------------------------------------------


def export(model, tokenizer, cfg: config_lib.RunConfig, run_dir: str, reference: dict) -> dict:
    """Gathers the full weights on rank 0 only (CPU), writes `<run>/export/` as Hugging Face safetensors with the
    config and tokenizer, and checks it in a fresh process (collective; returns the acceptance result).

    `reference` holds the final in-training held-out loss and how it was measured. Raises `ExportError` on
    every rank when the acceptance check fails.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    rank = dist.get_rank()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    result = None
    if torch.cuda.is_available():
        # The acceptance process shares this GPU: hand back the allocator's cached blocks (the training
        # activations' memory), or it runs out of memory after a run that filled the GPU.
        torch.cuda.empty_cache()
    if rank == 0:
        try:
            result = _write_and_accept(state, model.lm, tokenizer, cfg, run_dir, reference)
        except Exception as e:  # reported on every rank below, so no rank waits forever
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    del state
    box = [result]
    dist.broadcast_object_list(box, src=0)
    result = box[0]
    if not result.get("ok"):
        raise ExportError(f"export {storage.join(run_dir, EXPORT_DIR)} failed its acceptance check: "
                          f"{result.get('error') or json.dumps(result)}")
    return result


def _write_and_accept(state: dict, lm, tokenizer, cfg, run_dir: str, reference: dict) -> dict:
    from huggingface_hub import save_torch_state_dict

    final = storage.join(run_dir, EXPORT_DIR)
    stage = tempfile.mkdtemp(prefix="export-") if storage.is_remote(run_dir) else f"{final}.partial"
    shutil.rmtree(stage, ignore_errors=True)
    os.makedirs(stage)
    weights = {k.removeprefix("lm."): v for k, v in state.items()}
    if getattr(lm.config, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)  # tied to model.embed_tokens.weight; from_pretrained re-ties it
    save_torch_state_dict(weights, stage)
    del weights
    lm.config.save_pretrained(stage)
    if getattr(lm, "generation_config", None) is not None:
        lm.generation_config.save_pretrained(stage)
    if tokenizer is not None:
        tokenizer.save_pretrained(stage)
    with open(os.path.join(stage, "reference.json"), "w") as f:
        json.dump({**reference, "config": config_lib.to_dict(cfg)}, f, indent=1)
    # A fresh interpreter: nothing of the training process (FSDP, hooks, in-memory weights) can leak into it.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "job", "accept", stage], env=env, capture_output=True, text=True)
    try:
        with open(os.path.join(stage, "acceptance.json")) as f:
            result = json.load(f)
    except FileNotFoundError:
        result = {"ok": False, "error": f"acceptance process exited {proc.returncode}: {proc.stderr[-2000:]}"}
    result["export_dir"] = final
    with open(os.path.join(stage, "acceptance.json"), "w") as f:
        json.dump(result, f, indent=1)
    if result.get("ok"):
        with open(os.path.join(stage, VALID), "w") as f:
            f.write(json.dumps({"step": reference["step"], "eval_loss": result["eval_loss"], "time": time.time()}) + "\n")
    _publish(stage, final)
    return result


def _publish(stage: str, final: str) -> None:
    """Moves the staged export into place; the `_VALID` marker (if any) lands last."""
    if not storage.is_remote(final):
        shutil.rmtree(final, ignore_errors=True)
        os.replace(stage, final)
        return
    storage.remove(final)
    names = sorted(os.listdir(stage), key=lambda n: n == VALID)
    for name in names:
        with open(os.path.join(stage, name), "rb") as f:
            storage.write_atomic(storage.join(final, name), f.read())
    shutil.rmtree(stage, ignore_errors=True)


def export_is_valid(run_dir: str, step: int) -> bool:
    """Whether `<run>/export/` holds an accepted export of `step` (a finished run re-run skips the export)."""
    marker = storage.join(run_dir, EXPORT_DIR, VALID)
    try:
        return storage.exists(marker) and json.loads(storage.read_bytes(marker)).get("step") == step
    except (OSError, ValueError):
        return False


def accept(export_dir: str) -> dict:
    """The acceptance check, run in a fresh process: reload the export with `from_pretrained`, compute the
    held-out loss on the blocks the final in-training evaluation used, and generate greedily. Writes
    `acceptance.json` beside the export; `ok` is whether the loss matches within `checkpoint.export_tolerance`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .model import CausalLMWithLoss

    with open(os.path.join(export_dir, "reference.json")) as f:
        ref = json.load(f)
    cfg = config_lib.load_dict(ref["config"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if ref.get("bf16") else torch.float32
    result: dict = {"ok": False, "export_dir": export_dir, "reference_eval_loss": ref["eval_loss"],
                    "tolerance": cfg.checkpoint.export_tolerance, "device": str(device), "dtype": str(dtype)}
    try:
        tokenizer = (AutoTokenizer.from_pretrained(export_dir)
                     if os.path.exists(os.path.join(export_dir, "tokenizer_config.json")) else None)
        lm = AutoModelForCausalLM.from_pretrained(export_dir, dtype=dtype).to(device)
        model = CausalLMWithLoss(lm, cfg.train.loss_chunk_size).eval()  # as lean on memory as the training eval
        if ref["heldout"] == "synthetic":
            blocks = synthetic_heldout(ref["vocab"], cfg, ref["world_size"])
        else:
            blocks = data_lib.build(cfg.data, cfg.train, tokenizer).validation
        totals = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for idx in eval_indices(len(blocks), ref["world_size"], cfg.train.micro_batch_size, cfg.eval.max_batches):
                b = blocks.select(torch.tensor(idx))
                loss_sum, n = model(input_ids=b.input_ids.to(device), labels=b.labels.to(device),
                                    position_ids=b.position_ids.to(device))
                totals += torch.stack([loss_sum.double().cpu(), n.double().cpu()])
            loss = (totals[0] / totals[1]).item()
            if tokenizer is not None and cfg.eval.sample_prompt is not None:
                prompt = tokenizer(cfg.eval.sample_prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
            else:
                prompt = blocks.input_ids[:1, :8]
            # Greedy, EOS ignored: the generation settings of training's sample (CausalLMWithLoss.forward).
            out = model(input_ids=prompt.to(device), attention_mask=torch.ones_like(prompt).to(device),
                        max_new_tokens=cfg.eval.sample_tokens)
        new = out[0, prompt.shape[1]:].tolist()
        diff = abs(loss - ref["eval_loss"])
        result.update({
            "eval_loss": loss,
            "eval_ppl": math.exp(min(loss, 50)),
            "abs_diff": diff,
            "target_tokens": int(totals[1].item()),
            "generation": {"prompt_ids": prompt[0].tolist(), "token_ids": new,
                           "text": tokenizer.decode(new) if tokenizer is not None else None},
            "ok": bool(math.isfinite(loss) and diff <= cfg.checkpoint.export_tolerance and len(new) > 0),
        })
        if not result["ok"]:
            result["error"] = (f"held-out loss of the reloaded export {loss:.6f} differs from the final "
                               f"in-training evaluation {ref['eval_loss']:.6f} by {diff:.3g} "
                               f"(> checkpoint.export_tolerance {cfg.checkpoint.export_tolerance})")
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(export_dir, "acceptance.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result
