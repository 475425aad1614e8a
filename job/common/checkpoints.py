"""What a checkpoint is: its place in the run directory, how it is verified (checksums) and which runs it may
continue (the run's identity), without torch: the driver checks a resume here before any worker starts. Resuming
is `worker/checkpoint/resume.py`'s, saving `worker/checkpoint/writer.py`'s.

The run directory's layout is docs/checkpoints.md's ("Where things go"): `checkpoint_<step>/` holds DCP's sharded
model and optimizer, `rng/`, `checksums/`, `train_state.json`, `_COMPLETE` (written last by rank 0: only a
directory with it is a checkpoint) and perhaps `_UNUSABLE`. Besides: `data_cache/<key>.pt` (worker/data.py
`build_once`) and, beside the runs, `<storage_path>/.compile_cache/` (worker/compile_cache.py).

Both launchers run the same code. Checkpoints are not reported to Ray Train: its bookkeeping would refuse a
restart when a listed checkpoint is gone, and prune without knowing which ones verify.
"""

from __future__ import annotations

import json

from .. import config as config_lib
from .. import storage
from .presets import config_fields

COMPLETE = "_COMPLETE"
"""Marker file written last into a checkpoint directory: its presence makes the checkpoint complete."""


UNUSABLE = "_UNUSABLE"
"""Marker of a complete checkpoint that failed verification on resume, with the reason: never used again."""


CHECKSUMS = "checksums"
"""Directory of a checkpoint holding `rank<r>.json`: sha256 and size of each file rank r wrote."""


STATE = "train_state.json"


PREFIX = "checkpoint_"


RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"


ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
             "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be used (unreadable, incomplete, another model); names the path."""


class ResumeRefused(CheckpointError):
    """The config asks for what the run's checkpoints forbid (`checkpoint.resume`, another model, settings that
    would not continue the same run): a `config` error (`failures.classify`), not a broken checkpoint."""


def step_dir(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def list_checkpoints(run_dir: str) -> list[tuple[int, str, bool]]:
    """(step, uri, usable) of every `checkpoint_<step>` of a run, oldest first; usable: complete, not `_UNUSABLE`."""
    fs, path = storage.filesystem(run_dir)
    if not fs.exists(path):
        return []
    found = []
    for entry in fs.ls(path, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith(PREFIX) and name[len(PREFIX):].isdigit():
            uri = storage.join(run_dir, name)
            usable = storage.exists(storage.join(uri, COMPLETE)) and not storage.exists(storage.join(uri, UNUSABLE))
            found.append((int(name[len(PREFIX):]), uri, usable))
    return sorted(found)


def latest_complete(run_dir: str) -> str | None:
    complete = [uri for _, uri, ok in list_checkpoints(run_dir) if ok]
    return complete[-1] if complete else None


def write_checksums(uri: str, rank: int) -> None:
    """Write `checksums/rank<r>.json` into checkpoint `uri`: sha256 and size of every file this rank wrote, read
    back from storage, so that it describes what a resume will read. Call once they are written, before `_COMPLETE`."""
    fs, path = storage.filesystem(uri)
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.glob(f"{path}/__{rank}_*.distcp"))
    if rank == 0:
        names.append(".metadata")
    names.append(f"rng/rank{rank:05d}.pt")
    files = dict(zip(names, storage.digest_all([storage.join(uri, name) for name in names])))
    missing = [name for name, found in files.items() if found is None]
    if missing:
        raise FileNotFoundError(f"checkpoint {uri}: {', '.join(missing)} missing right after the write")
    storage.write_atomic(storage.join(uri, CHECKSUMS, f"rank{rank:05d}.json"),
                         json.dumps({"rank": rank, "files": files}, indent=1))


def verify(uri: str, rank: int = 0, world: int = 1) -> list[str]:
    """Check checkpoint `uri`'s files against their writers' checksums; returns the problems, one per file. This
    caller checks writer ranks `rank`, `rank + world`, ..., so `world` ranks share the reading. Train-state format
    1 (before checksums) has nothing to verify."""
    state = read_state(uri)
    if state.get("format", 1) < 2:
        return []
    problems = []
    for writer in range(rank, int(state["world_size"]), world):
        listing = storage.join(uri, CHECKSUMS, f"rank{writer:05d}.json")
        try:
            files = json.loads(storage.read_bytes(listing))["files"]
        except Exception as e:
            problems.append(f"{CHECKSUMS}/rank{writer:05d}.json (written by rank {writer}): cannot be read "
                            f"({type(e).__name__}: {e})")
            continue
        found_all = storage.digest_all([storage.join(uri, name) for name in files])
        for (name, expected), found in zip(files.items(), found_all):
            if found is None:
                problems.append(f"{name} (written by rank {writer}): missing")
            elif found != expected:
                problems.append(f"{name} (written by rank {writer}): content differs from its checksum "
                                f"({found['bytes']} bytes, sha256 {found['sha256'][:12]}…; saved "
                                f"{expected['bytes']} bytes, sha256 {expected['sha256'][:12]}…)")
    return problems


def read_state(uri: str) -> dict:
    try:
        state = json.loads(storage.read_bytes(storage.join(uri, STATE)))
        state["step"] = int(state["step"])
        return state
    except Exception as e:
        raise CheckpointError(f"checkpoint {uri}: cannot read {STATE}: {type(e).__name__}: {e}") from e


def check_before_start(cfg: config_lib.RunConfig, run_dir: str) -> None:
    """Driver-side check of the resume before anything is written: `checkpoint.resume: never` refuses a run name
    that already has checkpoints; an explicit checkpoint must exist and be complete; the one a resume would start
    from must suit this config (`check_settings`)."""
    policy = cfg.checkpoint.resume
    if policy == "never":
        existing = [uri for _, uri, _ in list_checkpoints(run_dir)]
        if existing or storage.exists(storage.join(run_dir, RAY_SNAPSHOT)):
            raise ResumeRefused(
                f"checkpoint.resume: never, but run {run_dir} already has checkpoints "
                f"({', '.join(existing) or RAY_SNAPSHOT}); choose a new run name, delete the run directory, "
                "or set checkpoint.resume: auto to continue it"
            )
        return
    start = latest_complete(run_dir)
    if policy != "auto" and start is None:
        # An explicit start point matters only while the run has no checkpoint of its own.
        if not storage.exists(policy):
            raise ResumeRefused(f"checkpoint.resume: no checkpoint at {policy}")
        if not storage.exists(storage.join(policy, COMPLETE)):
            raise ResumeRefused(f"checkpoint {policy}: incomplete (no {COMPLETE} marker; the save was interrupted)")
        if cfg.train.objective == "dpo":  # its reference would be model.path's weights, not the checkpoint's
            raise ResumeRefused(f"checkpoint.resume: a DPO run's reference policy is the model it starts from, "
                                f"model.path; start it from that run's export (model.path), not from {policy}")
        start = policy
    if start is not None:
        check_settings(cfg, start)


def check_settings(cfg: config_lib.RunConfig, uri: str) -> None:
    """What the driver can tell of a resume from checkpoint `uri` before any worker starts, from its train state and
    the model's config alone: the same refusal (`ResumeRefused`) the workers would give after loading the model and
    the data, for another architecture, method (full or LoRA) or LoRA shape, `train.seq_len`, `train.seed` or
    global batch. The workers still check everything (the data, tokenizer and base weights too). A train state that
    cannot be read is left to the workers, which verify and name the checkpoint."""
    try:
        state = read_state(uri)
        fields = config_fields(cfg.model)
    except (CheckpointError, OSError, ValueError):
        return
    skip = {"vocab_size"} if cfg.model.train_tokenizer_vocab else set()  # the trained tokenizer's size decides it
    check_architecture(uri, state, {k: fields[k] for k in ARCH_KEYS if k in fields and k not in skip})
    lora, train = cfg.model.lora, cfg.train
    identity = {"seq_len": train.seq_len, "seed": train.seed,
                "global_batch": train.micro_batch_size * train.grad_accum_steps * cfg.scaling.num_workers,
                "lora": adapter_identity(cfg, {})["lora"] if lora.rank else None}
    check_identity(uri, state, identity, cfg.checkpoint.allow_changes, keys=identity)


def retire_ray_snapshot(run_dir: str) -> bool:
    """Delete the Ray Train checkpoint list an earlier version left (see the module docstring); True if there was
    one."""
    snapshot = storage.join(run_dir, RAY_SNAPSHOT)
    if not storage.exists(snapshot):
        return False
    storage.remove(snapshot)
    return True


IDENTITY_FIELDS = {"tokenizer": "tokenizer", "data": "data", "seq_len": "train.seq_len", "seed": "train.seed",
                   "global_batch": "global batch (train.micro_batch_size x train.grad_accum_steps x workers)"}
"""Each `run_identity` key and the setting it is named by in a refusal."""


ADAPTER_FIELDS = {"lora": "model.lora (rank, alpha, targets)", "base": "the frozen base weights (model.path)",
                  "quantization": "the frozen base's quantization (model.lora.quantize_base)"}
"""`adapter_identity`'s keys: a LoRA checkpoint holds adapters of one base as quantized (QLoRA) or not, never
resumed onto another, nor by a full fine-tune (or the other way round); no `allow_changes` lifts these."""


def run_identity(cfg: config_lib.RunConfig, world: int, fingerprint: dict) -> dict:
    """What makes a resumed run the one that saved the checkpoint (`check_identity`): the tokenizer and data read
    (hashes, revisions, row counts; not paths, so a moved copy matches) and the settings that decide which tokens
    each step trains on."""
    def content(value):
        if isinstance(value, dict):
            return {k: content(v) for k, v in value.items() if k not in ("source", "path")}
        return [content(v) for v in value] if isinstance(value, list) else value

    data = {k: content(fingerprint.get(k)) for k in ("format", "train", "validation", "packing")}
    return {
        "tokenizer": storage.json_sha256(fingerprint.get("tokenizer")),
        "data": storage.json_sha256(data),
        "seq_len": cfg.train.seq_len,
        "seed": cfg.train.seed,
        "global_batch": cfg.train.micro_batch_size * cfg.train.grad_accum_steps * world,
    }


def adapter_identity(cfg: config_lib.RunConfig, base_fingerprint: dict, quantization: dict | None = None) -> dict:
    """A LoRA run's identity keys beyond `run_identity`'s: the adapters' shape, the sha256 of the base weights'
    fingerprint (`model.weights_fingerprint`) and the base's quantization (QLoRA's recipe; None: 16 bits)."""
    lora = cfg.model.lora
    return {"lora": {"rank": lora.rank, "alpha": lora.alpha, "targets": sorted(lora.targets)},
            "base": storage.json_sha256(base_fingerprint), "quantization": quantization}


def check_identity(uri: str, state: dict, identity: dict, allowed: list[str], keys=None) -> None:
    """Refuse (`ResumeRefused`, naming each field) a checkpoint whose run differs from this one in anything of
    `run_identity` not in `checkpoint.allow_changes`, or in `ADAPTER_FIELDS`; only `keys` of them when given (what
    the driver knows before the data and weights are read: `check_settings`). Without a saved identity (format 1)
    the settings come from its config; tokenizer and data cannot be compared."""
    saved = dict(state.get("identity") or {})
    if not saved:
        c = state["config"]["train"]
        saved = {"seq_len": c["seq_len"], "seed": c["seed"],
                 "global_batch": c["micro_batch_size"] * c["grad_accum_steps"] * state["world_size"]}
    if keys is not None:
        saved = {k: v for k, v in saved.items() if k in keys}
    adapters = [key for key in ADAPTER_FIELDS if (keys is None or key in keys) and saved.get(key) != identity.get(key)]
    if adapters:
        detail = "; ".join(f"{ADAPTER_FIELDS[k]}: checkpoint {_identity_value(k, saved.get(k))}, now "
                           f"{_identity_value(k, identity.get(k))}" for k in adapters)
        raise ResumeRefused(f"checkpoint {uri}: holds what another model trains ({detail}). Restore model.path "
                            "and model.lora, or start a new run name")
    differ = [key for key in IDENTITY_FIELDS if key in saved and saved[key] != identity[key] and key not in allowed]
    if differ:
        detail = "; ".join(
            f"{IDENTITY_FIELDS[k]}: checkpoint {saved[k]}, now {identity[k]}" if k not in ("tokenizer", "data")
            else f"{k}: differs (sha256 {saved[k][:12]}… in the checkpoint, {identity[k][:12]}… now)" for k in differ)
        raise ResumeRefused(
            f"checkpoint {uri}: would not continue the same run ({detail}). Restore the settings, start a new run "
            f"name, or, if the change is intended, set checkpoint.allow_changes: [{', '.join(differ)}]")


def _identity_value(key: str, value) -> str:
    if value is None:
        return "none (not quantized)" if key == "quantization" else "none (full fine-tune)"
    return f"sha256 {value[:12]}…" if isinstance(value, str) else json.dumps(value)


def architecture(lm_config) -> dict:
    """The model's shape as a checkpoint records it (`ARCH_KEYS`, read from a transformers config)."""
    return {k: getattr(lm_config, k, None) for k in ARCH_KEYS}


def check_architecture(uri: str, state: dict, current: dict) -> None:
    """Refuses (`ResumeRefused`) a checkpoint saved for another shape than `current` (`architecture`)."""
    saved = state.get("arch", {})
    differ = {k: (saved.get(k), v) for k, v in current.items() if saved.get(k) != v}
    if differ:
        detail = ", ".join(f"{k}: checkpoint {a} vs model {b}" for k, (a, b) in differ.items())
        raise ResumeRefused(f"checkpoint {uri}: saved for another model architecture ({detail})")


def prune(run_dir: str, keep_last: int, keep_before: int) -> None:
    """Delete what no resume will use: interrupted or unusable saves older than `keep_before` (the step just saved)
    and all but the newest `keep_last` usable checkpoints up to it; the one just saved is never deleted."""
    entries = [(step, uri, ok) for step, uri, ok in list_checkpoints(run_dir) if step <= keep_before]
    usable = [uri for _, uri, ok in entries if ok]
    doomed = [uri for step, uri, ok in entries if not ok and step < keep_before] + usable[:-keep_last]
    for uri in doomed:
        storage.remove(uri)
