#!/usr/bin/env python3
"""The preference-tuning recipe end to end, one table: SFT (`values/gsm8k.yaml`), pairs from its export
(`values/gsm8k-pairs.yaml`), DPO(+NLL) from its export on them (`values/gsm8k-dpo.yaml`), GSM8K exact match at each
stage on the whole test split and the held-out preference accuracy before and after DPO.

    # GPU (bench/device-dpo.sh learn runs it): the pretrained weights and GSM8K's JSONL files
    python bench/dpo_learning.py --model /tmp/models/qwen2.5-coder-1.5b --data .devdata/gsm8k \
        --questions 2000 --samples 4 --dpo-steps 100 [--set-sft K=V ...] [--set-pairs K=V ...] [--set-dpo K=V ...]
    # CPU smoke: a tiny random model (`TINY`), a few steps, a few questions (~2 minutes on 2 cores)
    python bench/dpo_learning.py --cpu --data ../shared/data/gsm8k --questions 8 --samples 2 --dpo-steps 2

Each stage's run config is what `helm install` renders for it: values/gsm8k.yaml's `run:` block, the stage's profile
merged over it as Helm merges values, then the paths (`--model`, `--data`, the earlier stage's export or pairs) and
the `--set-*` overrides; each runs as `python -m job` under torchrun (`--gpus` processes) in `--workdir`. Defaults
that keep the whole recipe near 8 minutes of one H100: every stage's intermediate checkpoints off (each stage still
saves at its end; the SFT's is deleted once its export is written), pairs for `--questions` training questions, the
DPO run's export off (its task evaluation still decodes the final model).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from job import config as config_lib  # noqa: E402
from job.common.exports import EXPORT_DIR, PAIRS_FILE, PAIRS_RECORD  # noqa: E402

TINY = {"model": {"init": "random", "path": None, "preset": "qwen2-tiny", "train_tokenizer_vocab": 512,
                  "overrides": {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}},
        "data": {"max_rows": 64},
        "train": {"max_steps": 4, "warmup_steps": 0, "seq_len": 256, "micro_batch_size": 2, "loss_chunk_size": 0},
        "parallel": {"compile": False, "reshard_after_forward": True},
        "eval": {"task_max_new_tokens": 16, "task_batch_size": 64, "task_max_examples": 16, "max_batches": 2}}
"""The CPU smoke's model (the SFT stage's; the later stages load its export) and sizes."""


def helm_merged(base: dict, override: dict) -> dict:
    """`override` coalesced into `base` as Helm merges values: maps merge, null deletes, the rest replaces."""
    merged = dict(base)
    for key, value in override.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = helm_merged(merged[key], value)
        else:
            merged[key] = value
    return merged


def profile(name: str) -> dict:
    return yaml.safe_load((REPO / "values" / name).read_text())["run"]


def stage_config(name: str, profiles: list[str], paths: dict, sets: list[str], args) -> config_lib.RunConfig:
    run = {}
    for p in profiles:
        run = helm_merged(run, profile(p))
    run = helm_merged(run, {"name": name, "storage_path": str(args.workdir),
                            "scaling": {"num_workers": args.gpus, "use_gpu": not args.cpu}, **paths})
    return config_lib.load_dict(config_lib.apply_overrides(run, sets))


def run_stage(cfg: config_lib.RunConfig, args) -> dict:
    """Runs one stage; returns its metrics records by kind."""
    config = Path(args.workdir) / f"{cfg.name}.yaml"
    config.write_text(config_lib.to_yaml(cfg))
    log = Path(args.workdir) / f"{cfg.name}.log"
    started = time.time()
    with open(log, "w") as f:
        rc = subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                              str(args.gpus), "-m", "job", "--config", str(config)], cwd=REPO, stdout=f,
                             stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if rc:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise SystemExit(f"stage {cfg.name} failed (exit {rc}), the end of {log}:\n{tail}")
    if cfg.name == "sft":  # only its export is read from here on
        for checkpoint in (Path(args.workdir) / "sft").glob("checkpoint_*"):
            shutil.rmtree(checkpoint)
    records = read_stage(cfg.name, args)
    records["wall_s"] = round(time.time() - started)
    print(json.dumps({"stage": cfg.name, "wall_s": records["wall_s"],
                      "task_eval": [(r["step"], r["exact_match"], r["n"]) for r in records.get("task_eval", [])]}),
          flush=True)
    return records


def read_stage(name: str, args) -> dict:
    """A stage's metrics records by kind (`wall_s`: its wall time, when run here)."""
    records: dict = {"wall_s": ""}
    for line in (Path(args.workdir) / name / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        records.setdefault(record["kind"], []).append(record)
    return records


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="the pretrained model's directory (not with --cpu)")
    p.add_argument("--data", required=True, help="directory of GSM8K's train.jsonl and test.jsonl")
    p.add_argument("--workdir", default="/tmp/dpo-runs", help="where the runs go (emptied first)")
    p.add_argument("--questions", type=int, default=2000, help="training questions the pairs are sampled for (0: all)")
    p.add_argument("--samples", type=int, default=4, help="answers sampled per question")
    p.add_argument("--dpo-steps", type=int, default=100)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--cpu", action="store_true", help="a tiny random model on CPU (a smoke test of this script)")
    p.add_argument("--stages", default="sft,pairs,dpo", help="the stages to run; the others' runs are read from "
                   "--workdir (e.g. sft in one call, pairs,dpo in the next on the same machine)")
    for stage in ("sft", "pairs", "dpo"):
        p.add_argument(f"--set-{stage}", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", help="write the table's figures as JSON here")
    args = p.parse_args()
    if not args.cpu and not args.model:
        p.error("--model is required on GPU")
    stages = args.stages.split(",")
    data, work = Path(args.data).resolve(), Path(args.workdir)
    if "sft" in stages:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    tiny = {k: v for k, v in TINY.items() if k != "model"} if args.cpu else {}
    model = TINY["model"] if args.cpu else {"path": str(Path(args.model).resolve())}
    quiet = ["checkpoint.every_steps=0", "checkpoint.keep_last=1"]
    exported = {"model": {"path": str(work / "sft" / EXPORT_DIR)}}  # gsm8k.yaml's model otherwise
    sft = stage_config("sft", ["gsm8k.yaml"], helm_merged(tiny, {
        "model": model, "data": {"train": str(data / "train.jsonl"), "validation": str(data / "test.jsonl")}}),
        quiet + args.set_sft, args)
    pairs = stage_config("pairs", ["gsm8k.yaml", "gsm8k-pairs.yaml"], helm_merged(tiny, {
        **exported, "data": {"train": str(data / "train.jsonl"), "max_rows": args.questions},
        "pairs": {"samples": args.samples}}), quiet + args.set_pairs, args)
    dpo = stage_config("dpo", ["gsm8k.yaml", "gsm8k-dpo.yaml"], helm_merged(tiny, {
        **exported, "data": {"train": str(work / "pairs" / PAIRS_FILE), "task_source": str(data / "test.jsonl"),
                             "max_rows": 0}, "train": {"max_steps": args.dpo_steps}}),
        quiet + ["checkpoint.export=false"] + args.set_dpo, args)
    runs = {cfg.name: run_stage(cfg, args) if cfg.name in stages else read_stage(cfg.name, args)
            for cfg in (sft, pairs, dpo)}
    sft_runs, dpo_runs = runs["sft"], runs["dpo"]
    made = json.loads((work / "pairs" / PAIRS_RECORD).read_text())

    def em(records, first):
        r = records["task_eval"][0 if first else -1]
        return f"{r['exact_match']:.1%} ({r['n']})", r["exact_match"]

    evals = dpo_runs.get("eval", [])
    before, after = (evals[0], evals[-1]) if evals else ({}, {})
    rows = [("pretrained (SFT step 0)", *em(sft_runs, True), "", sft_runs["wall_s"]),
            ("SFT (values/gsm8k.yaml)", *em(sft_runs, False), "", ""),
            ("pairs from the SFT export", "", None, f"{made['pairs']} pairs from {made['questions']} questions, "
             f"{made['samples']} samples, {made['sample_accuracy']:.1%} correct, {made['all_correct']} all correct",
             runs["pairs"]["wall_s"]),
            ("DPO step 0 (the SFT export)", *em(dpo_runs, True),
             f"preference accuracy {before.get('eval_preference_accuracy', float('nan')):.1%}", dpo_runs["wall_s"]),
            (f"DPO(+NLL) step {dpo.train.max_steps}", *em(dpo_runs, False),
             f"preference accuracy {after.get('eval_preference_accuracy', float('nan')):.1%}, reward accuracy "
             f"{after.get('eval_rewards/accuracies', float('nan')):.1%}, margin "
             f"{after.get('eval_rewards/margins', float('nan')):.3g} ({after.get('eval_pairs')} held-out pairs)", "")]
    print(f"\n{'stage':<30}{'GSM8K exact match':>20}  {'wall s':>7}  held-out preference / pairs")
    for stage, shown, _, note, wall in rows:
        print(f"{stage:<30}{shown:>20}  {wall!s:>7}  {note}")
    gain = (em(dpo_runs, False)[1] - em(sft_runs, False)[1]) * 100
    print(f"DPO - SFT: {gain:+.1f} points (target: +3)")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": [r[:2] + r[3:] for r in rows], "gain_points": gain,
                                              "pairs": made, "dpo_evals": evals}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
