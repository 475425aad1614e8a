#!/usr/bin/env python3
"""Throughput benchmark: our FSDP2 loop's variants against the Hugging Face Trainer baseline, one table.

Every variant is a separate process (a fresh GPU, no memory left over from the last one) running the real
job (`python -m job` under torchrun or Ray Train) on synthetic tokens; figures are read from the run's
metrics.jsonl: the median over logging intervals after the first `--skip` ones (warm-up, compilation).

    # GPU (the reference workload: Qwen2.5-1.5B, T=4096, bf16), variants on 1 GPU, then 2 GPUs:
    python scripts/benchmark.py --preset qwen2.5-1.5b --seq-len 4096 --gpus 1
    python scripts/benchmark.py --preset qwen2.5-1.5b --seq-len 4096 --gpus 2 --only best,best-ray,hf
    # CPU smoke (CI): tiny model, 2 processes, gloo
    python scripts/benchmark.py --preset qwen2-tiny --seq-len 64 --cpu --steps 6 --only default,chunked-ce,hf

Columns: tokens/s per device, MFU (6N + 12·L·H·T FLOPs per token over the device's peak bf16 FLOP/s), step
time, peak memory, and the ratio of tokens/s to the baseline's (the first row named `hf`).
"""

from __future__ import annotations

import argparse
import json
import os
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
    launcher: str  # "hf" (the baseline script), "torchrun" or "ray" (our job)
    batch: int  # micro-batch (sequences per device)
    overrides: dict = {}  # config overrides (`--set key=value`) of our job; options of the baseline script
    accum: int = 1  # micro-batches per optimizer step: global batch = batch × accum × GPUs
    env: dict = {}  # extra environment, e.g. inductor settings


# One lever at a time against `default`, then `best`: every lever that helps together, and its twins.
BEST = {"parallel.reshard_after_forward": False, "train.loss_chunk_size": 4096, "parallel.compile": True}
CUDNN = {**BEST, "model.sdpa_backend": "cudnn"}
BF16_REDUCE = {**CUDNN, "parallel.reduce_dtype": "bf16"}
AUTOTUNE = {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"}
VARIANTS = {
    "hf": Variant("hf", 4),
    "hf-accum2": Variant("hf", 4, accum=2),  # global batch 8 (micro-batch 8 runs out of memory)
    "hf-cudnn": Variant("hf", 4, {"sdpa-backend": "cudnn"}),  # fairness check: our attention kernel in HF's loop
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
}


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
        "checkpoint": {"export": False},  # throughput only: no export and acceptance check after the steps
        "debug": {"profile_step": args.profile_step},
    }


def run_variant(args, name: str, nproc: int, workdir: Path) -> dict:
    variant = VARIANTS[name]
    launcher, tokens_per_step = variant.launcher, variant.batch * variant.accum * args.seq_len
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0", **variant.env}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    log = workdir / f"{name}-{nproc}.log"
    if launcher == "hf":
        cmd = [*torchrun, str(REPO / "scripts/hf_trainer_baseline.py"), "--preset",
               args.preset, "--seq-len", str(args.seq_len),
               "--batch", str(variant.batch), "--grad-accum", str(variant.accum), "--steps", str(args.steps),
               "--warmup", str(args.skip * args.log_every),
               *(f"--{option}={value}" for option, value in variant.overrides.items())]
    else:
        config = workdir / f"{name}-{nproc}.yaml"
        config.write_text(yaml.safe_dump(run_config(args, name, variant, nproc, str(workdir / "runs"))))
        sets = [f"--set={key}={json.dumps(value)}" for key, value in variant.overrides.items()]
        job = ["-m", "job", "--config", str(config), *sets]
        cmd = [*torchrun, *job] if launcher == "torchrun" else [sys.executable, *job]
    started = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    row = {"variant": name, "launcher": launcher, "gpus": nproc, "batch": variant.batch, "accum": variant.accum,
           "wall_s": round(time.time() - started)}
    if rc != 0:
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        causes = [line for line in lines if "Error" in line or "error:" in line][-3:]  # the launcher's summary hides them
        return {**row, "error": f"exit {rc}: {' | '.join(causes + lines[-8:])[-2000:]}"}
    if launcher == "hf":
        result = json.loads([line for line in log.read_text().splitlines() if line.startswith("{")][-1])
        return {**row, "tokens_per_s_per_device": result["tokens_per_s_per_device"], "mfu": result.get("mfu"),
                "step_time_s": result["step_time_s"], "peak_mem_gib": result.get("peak_mem_alloc_gib")}
    records = [json.loads(line) for line in (workdir / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in records if r["kind"] == "train"][args.skip:]
    tps = statistics.median(r["tokens_per_s_per_device"] for r in rows)
    mfu = [r["mfu"] for r in rows if r["mfu"] is not None]
    row.update(tokens_per_s_per_device=tps, mfu=statistics.median(mfu) if mfu else None,
               step_time_s=tokens_per_step / tps, peak_mem_gib=max((r["peak_mem_gib"] or 0) for r in rows))
    for profile in (r for r in records if r["kind"] == "profile"):
        row["profile"] = {k: profile[k] for k in ("wall_ms", "busy_ms", "idle_gaps_ms", "by_category_ms") if k in profile}
        if args.out:  # the profile's kernel table beside the rows
            text = (workdir / "runs" / name / f"profile-step{profile['step']}.txt").read_text()
            Path(args.out).with_name(f"{Path(args.out).stem}-{name}-{nproc}.profile.txt").write_text(text)
    return row


def print_table(rows: list[dict]) -> None:
    """One line per variant; `vs hf`: tokens/s over the baseline's (as specified: no options) at the same global
    batch and GPU count."""
    baselines = {(r["batch"] * r["accum"], r["gpus"]): r["tokens_per_s_per_device"]
                 for r in rows if r["launcher"] == "hf" and not VARIANTS[r["variant"]].overrides and "error" not in r}
    print(f"{'variant':<27}{'launcher':<10}{'GPUs':>5}{'mb x acc':>9}{'tok/s/dev':>11}{'MFU':>7}{'step s':>8}"
          f"{'mem GiB':>9}{'vs hf':>7}")
    for r in rows:
        head = f"{r['variant']:<27}{r['launcher']:<10}{r['gpus']:>5}{str(r['batch']) + ' x ' + str(r['accum']):>9}"
        if "error" in r:
            print(f"{head}  FAILED {r['error']}")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] else "-"
        base = baselines.get((r["batch"] * r["accum"], r["gpus"]))
        ratio = f"{r['tokens_per_s_per_device'] / base:.2f}" if base else "-"
        print(f"{head}{r['tokens_per_s_per_device']:>11.0f}{mfu:>7}{r['step_time_s']:>8.3f}{mem:>9}{ratio:>7}")


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
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--profile-step", type=int, help="profile this step of each of our variants (debug.profile_step); "
                   "categories go into the rows, kernel tables beside --out")
    args = p.parse_args()
    names = args.only.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        for name in names:
            rows.append(run_variant(args, name, args.gpus, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    print_table(rows)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
