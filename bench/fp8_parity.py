#!/usr/bin/env python3
"""FP8 loss parity (issue 19): the same fine-tune with bf16 linear layers and with `parallel.float8`, one table.

Runs the job (`python -m job` under torchrun, one process per GPU) once per recipe on the same run config, with
only `parallel.float8` differing, for `--steps` steps: held-out loss every `--eval-every` steps and at the end
(the whole held-out split), no task evaluation, no export, no intermediate checkpoints (the job always saves the
last step; it is deleted once read). Prints per recipe the held-out loss at step 0 and at the end, the final
loss's difference from bf16, tokens/s per GPU (median of the logging intervals after the first `--skip`), MFU,
peak memory and the speed ratio to bf16, then the verdict: PASS when every float8 run's final held-out loss is
within `--tolerance` (relative) of bf16's. Exit 0 on PASS, 1 on FAIL or a failed run.

    # on the GPU machine (bench/device-finetune.sh parity does this with the rendered values/gsm8k.yaml):
    python3 bench/fp8_parity.py --config /tmp/run.yaml --steps 200 --storage /tmp/parity
    python3 bench/fp8_parity.py --config /tmp/run.yaml --recipes rowwise   # one per call; the table shows both

A recipe whose run already finished under `--storage` (e.g. in an earlier call on the same machine) is not run
again unless `--rerun`; its figures come from its metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def overrides(args, recipe: str) -> list[str]:
    sets = {
        "name": f"parity-{recipe}", "storage_path": args.storage, "parallel.float8": recipe,
        "scaling.num_workers": args.gpus, "train.max_steps": args.steps, "logging.every_steps": args.log_every,
        "eval.every_steps": args.eval_every, "eval.max_batches": 0, "eval.task": None,
        "checkpoint.export": False, "checkpoint.every_steps": 0, "checkpoint.keep_last": 1, "preflight.enabled": False,
    }
    return [f"--set={key}={json.dumps(value)}" for key, value in sets.items()] + [f"--set={s}" for s in args.set]


def run(args, recipe: str) -> None:
    run_dir = Path(args.storage) / f"parity-{recipe}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.gpus),
           "-m", "job", "--config", args.config, *overrides(args, recipe)]
    log = Path(args.storage) / f"parity-{recipe}.log"
    started = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=f,
                            stderr=subprocess.STDOUT).returncode
    print(f"{recipe}: exit {rc} after {time.time() - started:.0f} s (log {log})", flush=True)
    if rc != 0:  # the job's own error comes first; the launcher's traceback after it says little
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        print("\n".join(f"  {line[:300]}" for line in [l for l in lines if "rror" in l][:3] + lines[-4:]), flush=True)
    for checkpoint in run_dir.glob("checkpoint_*"):  # 18 GB for a 1.5B model with AdamW state; not needed
        shutil.rmtree(checkpoint, ignore_errors=True)


def result(args, recipe: str) -> dict | None:
    """The run's figures from its metrics.jsonl, or None if it has not finished all `--steps` steps."""
    path = Path(args.storage) / f"parity-{recipe}" / "metrics.jsonl"
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines()]
    evals = {r["step"]: r["eval_loss"] for r in records if r["kind"] == "eval"}
    train = [r for r in records if r["kind"] == "train"]
    if args.steps not in evals or not train:
        return None
    timed = train[args.skip:] or train
    mfu = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {"recipe": recipe, "eval_loss": evals, "final": evals[args.steps], "first": evals.get(0),
            "train_loss": train[-1]["loss"], "tokens_per_s": statistics.median(r["tokens_per_s_per_device"] for r in timed),
            "mfu": statistics.median(mfu) if mfu else None, "peak_mem_gib": max(r.get("peak_mem_gib") or 0 for r in timed)}


def print_table(rows: list[dict], tolerance: float) -> bool:
    """The table; True when every float8 row's final held-out loss is within `tolerance` of bf16's."""
    base = next((r for r in rows if r["recipe"] == "none"), None)
    print(f"{'parallel.float8':<17}{'held-out@0':>11}{'held-out@end':>13}{'vs bf16':>9}{'train loss':>11}"
          f"{'tok/s/GPU':>11}{'MFU':>7}{'peak GiB':>9}{'speed':>7}")
    ok = base is not None and len(rows) > 1
    for r in rows:
        first = f"{r['first']:.4f}" if r["first"] is not None else "-"
        delta = (r["final"] - base["final"]) / base["final"] if base else None
        speed = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        if r is not base and (delta is None or abs(delta) > tolerance):
            ok = False
        print(f"{r['recipe']:<17}{first:>11}{r['final']:>13.4f}" + (f"{delta:>+9.2%}" if delta is not None else f"{'-':>9}")
              + f"{r['train_loss']:>11.4f}{r['tokens_per_s']:>11.0f}" + (f"{r['mfu']:>7.1%}" if r["mfu"] else f"{'-':>7}")
              + f"{r['peak_mem_gib']:>9.1f}" + (f"{speed:>7.2f}" if speed else f"{'-':>7}"))
    curve = "; ".join(f"{r['recipe']}: " + " ".join(f"{s}:{v:.4f}" for s, v in sorted(r["eval_loss"].items())) for r in rows)
    print(f"held-out loss by step: {curve}")
    print(f"{'PASS' if ok else 'FAIL'}: final held-out loss of float8 within {tolerance:.0%} of bf16's"
          + ("" if base else " (no bf16 run)") + ("" if len(rows) > 1 else " (no float8 run)"))
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the run config (e.g. values/gsm8k.yaml as the chart renders it)")
    p.add_argument("--recipes", default="none,rowwise", help="parallel.float8 values to run, bf16 (`none`) first")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--skip", type=int, default=2, help="first logging intervals left out of tokens/s (compilation)")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--tolerance", type=float, default=0.01, help="largest relative difference of the final loss")
    p.add_argument("--storage", default="/tmp/parity", help="the runs' storage_path")
    p.add_argument("--rerun", action="store_true", help="run every recipe again, even one that has finished")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more run config overrides")
    args = p.parse_args()
    recipes = args.recipes.split(",")
    Path(args.storage).mkdir(parents=True, exist_ok=True)
    for recipe in recipes:
        if args.rerun or result(args, recipe) is None:
            run(args, recipe)
    rows = [r for r in (result(args, recipe) for recipe in dict.fromkeys(["none", *recipes, "rowwise", "tensorwise"]))
            if r is not None]
    missing = [recipe for recipe in recipes if result(args, recipe) is None]
    for recipe in missing:
        print(f"{recipe}: FAILED (no final held-out loss; see {args.storage}/parity-{recipe}.log)")
    if not rows:
        return 1
    return 0 if print_table(rows, args.tolerance) and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
