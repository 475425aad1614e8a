#!/usr/bin/env python3
"""Throughput benchmark: our FSDP2 loop's variants against the Hugging Face Trainer baseline and torchtitan, one table.

Every variant is a separate process (a fresh GPU, no memory left over from the last one) running the real
job (`python -m job` under torchrun or Ray Train) on synthetic tokens; figures are read from the run's
metrics.jsonl: the median over logging intervals after the first `--skip` ones (warm-up, compilation). The peers
(`SCRIPTS`: the HF Trainer, torchtitan) are scripts under torchrun that print one JSON line of the same figures.

    # GPU (the reference workload: Qwen2.5-1.5B, T=4096, bf16), variants on 1 GPU, then 2 GPUs:
    python bench/benchmark.py --preset qwen2.5-1.5b --seq-len 4096 --gpus 1
    python bench/benchmark.py --preset qwen2.5-1.5b --seq-len 4096 --gpus 2 --only best,best-ray,hf
    # torchtitan's rows need .titan installed (docs/device.md, "torchtitan baseline"):
    python bench/benchmark.py --gpus 1 --only hf,titan,best-cudnn,hf-liger-b8,titan-b8
    # CPU smoke (CI): tiny model, 2 processes, gloo
    python bench/benchmark.py --preset qwen2-tiny --seq-len 64 --cpu --steps 6 --only default,chunked-ce,hf

Columns: tokens/s per device, MFU (6N + 12·L·H·T FLOPs per token over the device's peak bf16 FLOP/s), step
time, peak memory, and the ratio of tokens/s to each of the two baselines of the same global batch and GPU
count: `vs hf`, the plain Trainer (`hf`, `hf-accum2`), and `vs liger`, the Trainer with Liger's kernels
(`hf-liger`, `hf-liger-b8`). torchtitan's rows (`titan`, `titan-b8`: bench/torchtitan_baseline.py, which needs
torchtitan, carried as .titan/) are variants, with ratios to both. `--budget` bounds the whole run (variants in
order; the rest are skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import yaml

REPO = Path(__file__).resolve().parents[1]


class Variant(NamedTuple):
    launcher: str  # "hf" or "titan" (a peer's script, `SCRIPTS`), "torchrun" or "ray" (our job)
    batch: int  # micro-batch (sequences per device)
    overrides: dict = {}  # config overrides (`--set key=value`) of our job; options of a peer's script
    accum: int = 1  # micro-batches per optimizer step: global batch = batch × accum × GPUs
    env: dict = {}  # extra environment, e.g. inductor settings
    tree: str = ""  # our job from another commit's export, `TREES`/<tree> (git archive), for before/after rows


# One lever at a time against `default`, then `best`: every lever that helps together, and its twins.
BEST = {"parallel.reshard_after_forward": False, "train.loss_chunk_size": 4096, "parallel.compile": True}
CUDNN = {**BEST, "model.sdpa_backend": "cudnn"}
BF16_REDUCE = {**CUDNN, "parallel.reduce_dtype": "bf16"}
AUTOTUNE = {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"}
LIGER = {"liger": True}  # TrainingArguments(use_liger_kernel=True): the strongest peer with one flag (issue 19)
FP8 = {**CUDNN, "parallel.float8": "rowwise"}  # on top of best-cudnn, our current best bf16 settings
LORA = {**CUDNN, "model.lora.rank": 16, "model.lora.alpha": 32, "checkpoint.every_steps": 6,  # a save mid-run,
        "checkpoint.async_save": True}  # blocking only while staged
HF_PEFT = {"lora-rank": 16, "fsdp": "off"}  # the Trainer with peft at the same rank, on one GPU as its users run it
QWEN_7B = {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
           "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False}
"""Qwen2.5-7B's shape (its config.json), over the 1.5B preset: the 7B-class LoRA rows, random init."""
QWEN_32B = {"hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
            "intermediate_size": 27648, "vocab_size": 152064, "tie_word_embeddings": False}
"""Qwen2.5-32B's shape (its config.json): the QLoRA row that fits one 80 GB GPU, random init."""
QLORA = {**LORA, "model.lora.quantize_base": "nf4", "parallel.activation_checkpointing": True}
"""QLoRA (issue 52) as its users run it, every decoder layer's activations recomputed (what keeps the 7B shape at
T = 4096 within a 24 GB card)."""
HF_QLORA = {**HF_PEFT, "load-in-4bit": True, "grad-ckpt": True}
"""The Trainer + peft + bitsandbytes 4-bit, gradient checkpointing on, as peft's QLoRA recipe sets it."""


def shaped(options: dict, shape: dict, ours: bool) -> dict:
    """`options` of a variant with the model's dimensions `shape`: our job's override, or a peer script's option."""
    return {**options, "model.overrides": shape} if ours else {**options, "overrides": json.dumps(shape, separators=(",", ":"))}
VARIANTS = {
    "hf": Variant("hf", 4),
    "hf-accum2": Variant("hf", 4, accum=2),  # global batch 8 (micro-batch 8 runs out of memory)
    "hf-cudnn": Variant("hf", 4, {"sdpa-backend": "cudnn"}),  # fairness check: our attention kernel in HF's loop
    "hf-liger": Variant("hf", 4, LIGER),
    "hf-liger-b8": Variant("hf", 8, LIGER),  # fits: Liger's fused linear cross-entropy has no fp32 logits
    "titan": Variant("titan", 4),  # torchtitan's own Trainer, compiled, no activation checkpointing (issue 19)
    "titan-b8": Variant("titan", 8),
    "default": Variant("torchrun", 4),
    "no-reshard": Variant("torchrun", 4, {"parallel.reshard_after_forward": False}),
    "chunked-ce": Variant("torchrun", 4, {"train.loss_chunk_size": 4096}),
    "compile": Variant("torchrun", 4, {"parallel.compile": True}),
    "compile-no-reshard": Variant("torchrun", 4, {"parallel.reshard_after_forward": False, "parallel.compile": True}),
    "best": Variant("torchrun", 4, BEST),
    "best-b8": Variant("torchrun", 8, BEST),
    "best-cudnn": Variant("torchrun", 4, CUDNN),
    "best-b8-cudnn": Variant("torchrun", 8, CUDNN),
    "best-cudnn-autotune": Variant("torchrun", 4, CUDNN, env=AUTOTUNE),
    "best-b8-cudnn-autotune": Variant("torchrun", 8, CUDNN, env=AUTOTUNE),
    "best-cudnn-bf16-reduce": Variant("torchrun", 4, BF16_REDUCE),
    "best-b8-cudnn-bf16-reduce": Variant("torchrun", 8, BF16_REDUCE),
    "best-ray": Variant("ray", 4, BEST),
    "best-cudnn-ray": Variant("ray", 4, CUDNN),
    "best-cudnn-hsdp": Variant("torchrun", 4, {**CUDNN, "parallel.shard_group_size": 1}),
    "best-fp8": Variant("torchrun", 4, FP8),
    "best-b8-fp8": Variant("torchrun", 8, FP8),
    "hf-peft": Variant("hf", 4, HF_PEFT),
    "hf-peft-liger": Variant("hf", 4, {**HF_PEFT, **LIGER}),
    "hf-peft-liger-b8": Variant("hf", 8, {**HF_PEFT, **LIGER}),
    "hf-peft-b2": Variant("hf", 2, HF_PEFT),  # micro-batch 4 runs out of memory on an H100 (fp32 logits)
    "best-b2-cudnn-lora": Variant("torchrun", 2, LORA),
    "best-cudnn-lora": Variant("torchrun", 4, LORA),
    "best-b8-cudnn-lora": Variant("torchrun", 8, LORA),
    "lora-7b": Variant("torchrun", 1, {**LORA, "model.overrides": QWEN_7B}),
    "lora-7b-b2": Variant("torchrun", 2, {**LORA, "model.overrides": QWEN_7B}),
    # Issue 52: QLoRA at the 7B shape against the Trainer + peft + bitsandbytes (and with Liger), beside both sides'
    # bf16 LoRA, and the 32B shape on one 80 GB GPU.
    "qlora-7b": Variant("torchrun", 1, shaped(QLORA, QWEN_7B, ours=True)),
    "hf-qlora-7b": Variant("hf", 1, shaped(HF_QLORA, QWEN_7B, ours=False)),
    "hf-qlora-liger-7b": Variant("hf", 1, shaped({**HF_QLORA, **LIGER}, QWEN_7B, ours=False)),
    "hf-peft-7b": Variant("hf", 1, shaped(HF_PEFT, QWEN_7B, ours=False)),
    "qlora-32b": Variant("torchrun", 1, shaped(QLORA, QWEN_32B, ours=True)),
    "qlora-7b-eager": Variant("torchrun", 1, shaped({**QLORA, "parallel.compile": False}, QWEN_7B, ours=True)),
    # The full fine-tune of the 7B shape on one H200 (122 GB of fp32 weights, gradients and AdamW state), both with
    # every block's activations recomputed: torchtitan's `full` activation checkpointing and ours.
    "best-7b-ac": Variant("torchrun", 1, {**CUDNN, "model.overrides": QWEN_7B, "parallel.activation_checkpointing": True}),
    "best-7b-ac-b2": Variant("torchrun", 2, {**CUDNN, "model.overrides": QWEN_7B, "parallel.activation_checkpointing": True}),
    "titan-7b-ac": Variant("titan", 1, {"overrides": json.dumps(QWEN_7B, separators=(",", ":")), "ac": "full"}),
    "titan-7b-ac-b2": Variant("titan", 2, {"overrides": json.dumps(QWEN_7B, separators=(",", ":")), "ac": "full"}),
    # Where the 7B rows' gap to torchtitan comes from, at the 1.5B shape: activation checkpointing on both sides, and
    # FSDP2 on a one-GPU mesh (what activation checkpointing implies in `parallelize`) without it.
    "best-cudnn-fsdp": Variant("torchrun", 4, {**CUDNN, "parallel.fsdp": "always"}),
    "best-cudnn-ac": Variant("torchrun", 4, {**CUDNN, "parallel.activation_checkpointing": True}),
    "titan-ac": Variant("titan", 4, {"ac": "full"}),
}
# Issue 31's levers, each alone and together, on one GPU: the code before them (`main`), with only the one-GPU
# path without FSDP2 (`unwrapped`), and the current code with FSDP2 forced (only the clipping in the fused step).
for suffix, batch in (("", 4), ("-b8", 8)):
    VARIANTS[f"best{suffix}-cudnn-main"] = Variant("torchrun", batch, CUDNN, tree="main")
    VARIANTS[f"best{suffix}-cudnn-unwrapped"] = Variant("torchrun", batch, CUDNN, tree="unwrapped")
    VARIANTS[f"best{suffix}-cudnn-fsdp"] = Variant("torchrun", batch, {**CUDNN, "parallel.fsdp": "always"})
TREES = REPO / ".devdata" / "trees"
"""Where `Variant.tree`s are: `git archive COMMIT job | tar -x -C .devdata/trees/NAME` (bench/device-bench.sh issue31)."""
BASELINES = {"vs hf": {}, "vs liger": LIGER}
"""The ratio columns: each divides by the baseline script's (launcher "hf") row with exactly these options (at the
same global batch and GPU count, from the same run) besides the row's `peer_options`."""


def peer_options(variant: Variant) -> dict:
    """What the Trainer row a variant is compared with has besides a ratio column's options: peft at the same rank
    for LoRA (`HF_PEFT`), bitsandbytes' 4-bit base for QLoRA (`HF_QLORA`), the same model shape."""
    options = variant.overrides
    if variant.launcher == "hf":
        return {k: v for k, v in options.items() if k in {*HF_QLORA, "overrides"}}
    peer = dict(HF_QLORA if "model.lora.quantize_base" in options else HF_PEFT if "model.lora.rank" in options else {})
    return shaped(peer, options["model.overrides"], ours=False) if "model.overrides" in options else peer
SCRIPTS = {"hf": "bench/hf_trainer_baseline.py", "titan": "bench/torchtitan_baseline.py"}
"""The peers' scripts, by launcher: run under torchrun with the same options, each prints one JSON line."""


def peer_parser(description: str, steps: int, warmup: int, warmup_help: str) -> argparse.ArgumentParser:
    """The command line every peer's script (`SCRIPTS`) starts from: the options `run_variant` passes to each
    (`--preset`, `--seq-len`, `--batch`, `--grad-accum`, `--steps`, `--warmup`), and the training settings they
    share. The scripts import it (the repository's root is on their path)."""
    from job.common.presets import PRESETS

    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-1.5b")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4, help="per-device batch size (sequences)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=warmup, help=warmup_help)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    return p


def run_config(args, name: str, variant: Variant, nproc: int, storage: str) -> dict:
    return {
        "name": name,
        "storage_path": storage,
        "model": {"preset": args.preset, "init": "random"},
        "data": {"format": "synthetic"},
        "train": {"max_steps": args.steps, "micro_batch_size": variant.batch, "grad_accum_steps": variant.accum,
                  "seq_len": args.seq_len, "lr": 1e-4, "warmup_steps": 1},
        "scaling": {"num_workers": nproc, "use_gpu": not args.cpu},
        "logging": {"every_steps": args.log_every},
        # Throughput only: no export and acceptance check after the steps, and synchronous saves, whose host buffers
        # are not prepared beside the measured steps (`Checkpointer.prepare_staging`); `--stop-after-steps` runs
        # end before their one save.
        "checkpoint": {"export": False, "async_save": False},
        "debug": {"profile_step": args.profile_step},
    }


def run_variant(args, name: str, nproc: int, workdir: Path, timeout: float) -> dict:
    variant = VARIANTS[name]
    launcher, tokens_per_step = variant.launcher, variant.batch * variant.accum * args.seq_len
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0", **variant.env}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    log = workdir / f"{name}-{nproc}.log"
    if launcher in SCRIPTS:
        cmd = [*torchrun, str(REPO / SCRIPTS[launcher]), "--preset",
               args.preset, "--seq-len", str(args.seq_len),
               "--batch", str(variant.batch), "--grad-accum", str(variant.accum), "--steps", str(args.steps),
               "--warmup", str(args.skip * args.log_every),
               *(f"--{option}" if value is True else f"--{option}={value}" for option, value in variant.overrides.items())]
    else:
        config = workdir / f"{name}-{nproc}.yaml"
        config.write_text(yaml.safe_dump(run_config(args, name, variant, nproc, str(workdir / "runs"))))
        sets = [f"--set={key}={json.dumps(value)}" for key, value in variant.overrides.items()]
        job = ["-m", "job", "--config", str(config), *sets]
        cmd = [*torchrun, *job] if launcher == "torchrun" else [sys.executable, *job]
    metrics = workdir / "runs" / name / "metrics.jsonl"
    started = time.time()
    with open(log, "w") as f:
        # Its own process group, which `stop` ends with the workers (they hold the GPU). `-m job` imports the
        # package from the working directory first: a tree's, or the repository's.
        proc = subprocess.Popen(cmd, cwd=TREES / variant.tree if variant.tree else REPO, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        rc = None
        while rc is None:
            try:
                rc = proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                if launcher == "torchrun" and args.stop_after_steps and last_step_logged(metrics, args.steps):
                    rc = 0  # the figures are in; the final checkpoint (18 GB for 1.5B) and the rest measure nothing
                elif time.time() - started > timeout:
                    rc = f"timeout after {timeout:.0f} s"
                else:
                    continue
                stop(proc)
    row = {"variant": name, "launcher": launcher, "gpus": nproc, "batch": variant.batch, "accum": variant.accum,
           "wall_s": round(time.time() - started)}
    if args.out:  # the variant's whole log beside the rows (the work directory goes at the end)
        shutil.copy(log, Path(args.out).with_name(f"{Path(args.out).stem}-{name}-{nproc}.log"))
    if rc != 0:
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        causes = [line for line in lines if "Error" in line or "error:" in line][-3:]  # the launcher's summary hides them
        return {**row, "error": f"exit {rc}: {' | '.join(causes + lines[-8:])[-2000:]}"}
    if launcher in SCRIPTS:
        result = json.loads([line for line in log.read_text().splitlines() if line.startswith("{")][-1])
        return {**row, "tokens_per_s_per_device": result["tokens_per_s_per_device"], "mfu": result.get("mfu"),
                "trainable_params": result.get("trainable_params"),
                "step_time_s": result["step_time_s"], "peak_mem_gib": result.get("peak_mem_alloc_gib")}
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    rows = [r for r in records if r["kind"] == "train"][args.skip:]
    tps = statistics.median(r["tokens_per_s_per_device"] for r in rows)
    mfu = [r["mfu"] for r in rows if r["mfu"] is not None]
    row.update(tokens_per_s_per_device=tps, mfu=statistics.median(mfu) if mfu else None,
               step_time_s=tokens_per_step / tps, peak_mem_gib=max((r["peak_mem_gib"] or 0) for r in rows),
               trainable_params=next(r for r in records if r["kind"] == "start").get("trainable_params"),
               checkpoint_blocking_s=[r["blocking_s"] for r in records if r["kind"] == "checkpoint"])
    for profile in (r for r in records if r["kind"] == "profile"):
        row["profile"] = {k: profile[k] for k in ("wall_ms", "busy_ms", "idle_gaps_ms", "by_category_ms") if k in profile}
        if args.out:  # the profile's kernel table beside the rows
            text = (workdir / "runs" / name / f"profile-step{profile['step']}.txt").read_text()
            Path(args.out).with_name(f"{Path(args.out).stem}-{name}-{nproc}.profile.txt").write_text(text)
    return row


def stop(proc: subprocess.Popen) -> None:
    """Stops a variant's launcher and its workers. torchrun starts each worker in a session of its own, which a
    kill of the launcher's process group misses (run 40: a stopped variant's worker went on to its final save,
    holding 60 GiB of the GPU, and the next variant ran out of memory): SIGTERM makes torchrun stop them first."""
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):  # whatever of the group is left
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def last_step_logged(metrics: Path, steps: int) -> bool:
    """Whether a run's metrics.jsonl holds the training record of its last step."""
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line still being written
            continue
        if record.get("kind") == "train" and record.get("step") == steps:
            return True
    return False


def print_table(rows: list[dict]) -> None:
    """One line per variant; each `BASELINES` column: tokens/s over that baseline's (the baseline script with
    exactly its options) at the same global batch and GPU count, `-` where the run has no such baseline."""
    def key(r: dict) -> tuple:
        return r["batch"] * r["accum"], r["gpus"], json.dumps(peer_options(VARIANTS[r["variant"]]), sort_keys=True)

    baselines = {column: {key(r): r["tokens_per_s_per_device"] for r in rows
                          if r["launcher"] == "hf" and "error" not in r and "skipped" not in r
                          and VARIANTS[r["variant"]].overrides == {**options, **peer_options(VARIANTS[r["variant"]])}}
                 for column, options in BASELINES.items()}
    print(f"{'variant':<27}{'launcher':<10}{'GPUs':>5}{'mb x acc':>9}{'tok/s/dev':>11}{'MFU':>7}{'step s':>8}"
          f"{'mem GiB':>9}" + "".join(f"{column:>10}" for column in BASELINES))
    for r in rows:
        head = f"{r['variant']:<27}{r['launcher']:<10}{r['gpus']:>5}{str(r['batch']) + ' x ' + str(r['accum']):>9}"
        if "error" in r or "skipped" in r:
            print(f"{head}  " + (f"FAILED {r['error']}" if "error" in r else f"SKIPPED {r['skipped']}"))
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] else "-"
        ratios = ""
        for by_batch in baselines.values():
            base = by_batch.get(key(r))
            ratios += f"{r['tokens_per_s_per_device'] / base:>10.2f}" if base else f"{'-':>10}"
        print(f"{head}{r['tokens_per_s_per_device']:>11.0f}{mfu:>7}{r['step_time_s']:>8.3f}{mem:>9}{ratios}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-1.5b", choices=["qwen2.5-1.5b", "qwen2-tiny"])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--log-every", type=int, default=2, help="logging interval (steps); each is one sample")
    p.add_argument("--skip", type=int, default=2, help="first intervals left out (warm-up, compilation)")
    p.add_argument("--gpus", type=int, default=1, help="processes (GPUs) per variant")
    p.add_argument("--cpu", action="store_true", help="CPU processes with gloo (smoke test of this script)")
    p.add_argument("--only", default=",".join(VARIANTS), help="comma-separated variants, in order")
    p.add_argument("--timeout", type=int, default=600, help="seconds per variant")
    p.add_argument("--budget", type=int, help="seconds for the whole run: each variant's timeout is cut to what is "
                   "left, and variants not started in time are reported as skipped")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--workdir", help="where the runs (logs, metrics, each run's final checkpoint until it is deleted) "
                   "go; default: the system's temporary directory. On a GPU machine, a tmpfs (/dev/shm) saves the "
                   "~20 s a 1.5B model's 18 GB checkpoint takes to write to disk")
    p.add_argument("--stop-after-steps", action="store_true", help="stop each of our torchrun variants once its "
                   "last step is logged (its final checkpoint and what follows are not waited for)")
    p.add_argument("--profile-step", type=int, help="profile this step of each of our variants (debug.profile_step); "
                   "categories go into the rows, kernel tables beside --out")
    args = p.parse_args()
    names = args.only.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    rows, started = [], time.time()
    with tempfile.TemporaryDirectory(prefix="bench-", dir=args.workdir) as tmp:
        for name in names:
            left = args.budget - (time.time() - started) if args.budget else float("inf")
            if left < 30:  # not even the model build would fit
                rows.append({"variant": name, "launcher": VARIANTS[name].launcher, "gpus": args.gpus,
                             "batch": VARIANTS[name].batch, "accum": VARIANTS[name].accum,
                             "skipped": f"--budget {args.budget} s used up"})
            else:
                rows.append(run_variant(args, name, args.gpus, Path(tmp), min(args.timeout, left)))
                # Its final checkpoint (18 GB for a 1.5B model with AdamW state) would fill the disk a few
                # variants later: only the metrics were needed, and they are read.
                shutil.rmtree(Path(tmp) / "runs" / name, ignore_errors=True)
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    print_table(rows)
    print("wall s: " + ", ".join(f"{r['variant']} {r['wall_s']}" for r in rows if "wall_s" in r), flush=True)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
