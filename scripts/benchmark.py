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

import yaml

REPO = Path(__file__).resolve().parents[1]

# name -> (launcher, micro-batch, parallel/train overrides). One lever at a time against `default`,
# then `best`: every lever that helps together, and its twin under Ray Train.
BEST = {"parallel.reshard_after_forward": False, "train.loss_chunk_size": 4096, "parallel.compile": True}
VARIANTS = {
    "hf": ("hf", 4, {}),
    "default": ("torchrun", 4, {}),
    "no-reshard": ("torchrun", 4, {"parallel.reshard_after_forward": False}),
    "chunked-ce": ("torchrun", 4, {"train.loss_chunk_size": 4096}),
    "compile": ("torchrun", 4, {"parallel.compile": True}),
    "compile-no-reshard": ("torchrun", 4, {"parallel.reshard_after_forward": False, "parallel.compile": True}),
    "best": ("torchrun", 4, BEST),
    "best-b8": ("torchrun", 8, BEST),
    "best-cudnn": ("torchrun", 4, {**BEST, "model.sdpa_backend": "cudnn"}),
    "best-b8-cudnn": ("torchrun", 8, {**BEST, "model.sdpa_backend": "cudnn"}),
    "best-ray": ("ray", 4, BEST),
    "best-cudnn-hsdp": ("torchrun", 4, {**BEST, "model.sdpa_backend": "cudnn", "parallel.shard_group_size": 1}),
}


def run_config(args, name: str, batch: int, nproc: int, storage: str) -> dict:
    return {
        "name": name,
        "storage_path": storage,
        "model": {"preset": args.preset, "init": "random"},
        "data": {"format": "synthetic"},
        "train": {"max_steps": args.steps, "micro_batch_size": batch, "seq_len": args.seq_len, "lr": 1e-4,
                  "warmup_steps": 1},
        "scaling": {"num_workers": nproc, "use_gpu": not args.cpu},
        "logging": {"every_steps": args.log_every},
    }


def run_variant(args, name: str, nproc: int, workdir: Path) -> dict:
    launcher, batch, overrides = VARIANTS[name]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    log = workdir / f"{name}-{nproc}.log"
    if launcher == "hf":
        cmd = [*torchrun, str(REPO / "scripts/hf_trainer_baseline.py"), "--preset",
               args.preset, "--seq-len", str(args.seq_len),
               "--batch", str(batch), "--steps", str(args.steps), "--warmup", str(args.skip * args.log_every)]
    else:
        config = workdir / f"{name}-{nproc}.yaml"
        config.write_text(yaml.safe_dump(run_config(args, name, batch, nproc, str(workdir / "runs"))))
        sets = [f"--set={key}={json.dumps(value)}" for key, value in overrides.items()]
        job = ["-m", "job", "--config", str(config), *sets]
        cmd = [*torchrun, *job] if launcher == "torchrun" else [sys.executable, *job]
    started = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    row = {"variant": name, "launcher": launcher, "gpus": nproc, "batch": batch, "wall_s": round(time.time() - started)}
    if rc != 0:
        tail = [line for line in log.read_text().splitlines() if line.strip()][-12:]
        return {**row, "error": f"exit {rc}: {' | '.join(tail)[-1500:]}"}
    if launcher == "hf":
        result = json.loads([line for line in log.read_text().splitlines() if line.startswith("{")][-1])
        return {**row, "tokens_per_s_per_device": result["tokens_per_s_per_device"], "mfu": result.get("mfu"),
                "step_time_s": result["step_time_s"], "peak_mem_gib": result.get("peak_mem_alloc_gib")}
    lines = (workdir / "runs" / name / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if r["kind"] == "train"][args.skip:]
    tps = statistics.median(r["tokens_per_s_per_device"] for r in rows)
    mfu = [r["mfu"] for r in rows if r["mfu"] is not None]
    return {**row, "tokens_per_s_per_device": tps, "mfu": statistics.median(mfu) if mfu else None,
            "step_time_s": batch * args.seq_len / tps, "peak_mem_gib": max((r["peak_mem_gib"] or 0) for r in rows)}


def print_table(rows: list[dict]) -> None:
    base = next((r["tokens_per_s_per_device"] for r in rows if r["variant"] == "hf" and "error" not in r), None)
    print(f"{'variant':<20}{'launcher':<10}{'GPUs':>5}{'batch':>6}{'tok/s/dev':>11}{'MFU':>7}{'step s':>8}"
          f"{'mem GiB':>9}{'vs hf':>7}")
    for r in rows:
        head = f"{r['variant']:<20}{r['launcher']:<10}{r['gpus']:>5}{r['batch']:>6}"
        if "error" in r:
            print(f"{head}  FAILED {r['error']}")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] else "-"
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
