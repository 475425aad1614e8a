#!/usr/bin/env python3
"""Summarise a fine-tune with a failure drill: before/after scores, the resume, and whether it was exact.

    python bench/finetune_summary.py DRIVER_LOG RUN_DIR

DRIVER_LOG is the driver's output (every attempt's metric lines, also those of a killed worker, which
metrics.jsonl drops when the run resumes); RUN_DIR holds metrics.jsonl and run.json. A step trained by two
attempts (after the last checkpoint the killed attempt reached, before it died) must show the same loss in
both: that is an exact resume.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def metric_lines(path: str) -> list[dict]:
    rows = []
    with open(path, errors="replace") as f:
        for line in f:
            start = line.find('{"time"')
            if start < 0:
                continue
            try:
                rows.append(json.loads(line[start:]))
            except json.JSONDecodeError:
                continue
    return rows


def main(log_path: str, run_dir: str) -> int:
    log = metric_lines(log_path)
    with open(f"{run_dir}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    record = json.load(open(f"{run_dir}/run.json"))
    evals = [r for r in rows if r["kind"] == "eval"]
    tasks = [r for r in rows if r["kind"] == "task_eval"]
    print(f"status: {record['status']}  error: {record['error']}")
    if evals:
        print(f"held-out loss: step {evals[0]['step']} {evals[0]['eval_loss']:.4f} -> step {evals[-1]['step']} "
              f"{evals[-1]['eval_loss']:.4f} (x{evals[-1]['eval_loss'] / evals[0]['eval_loss']:.2f})")
    for t in tasks:
        print(f"exact match at step {t['step']}: {t['exact_match']:.4f} on {t['n']} ({t.get('seconds', 0):.1f} s, "
              f"{t.get('decode_steps')} decode steps ({t.get('decode')}), new tokens {t.get('new_tokens')})")
    by_step = defaultdict(list)
    for r in log:
        if r.get("kind") == "train":
            by_step[r["step"]].append(r["loss"])
    twice = {s: v for s, v in sorted(by_step.items()) if len(v) > 1}
    for r in rows:
        if r["kind"] == "start":
            print(f"start: data {r.get('data_cache')}, compile cache {r.get('compile_cache')}")
        if r["kind"] == "resume":
            print(f"resumed at step {r['step']} from {r['checkpoint']} (data_exact {r['data_exact']})")
    if twice:
        same = all(len(set(v)) == 1 for v in twice.values())
        print(f"steps trained by both attempts: {sorted(twice)}; losses {'identical' if same else 'DIFFER'}: "
              + ", ".join(f"{s}: {v}" for s, v in list(twice.items())[:4]))
    for r in rows:
        if r["kind"] == "checkpoint":
            staging = r.get("staging") or {"on": "host"}  # records from before staging on the device
            buffers = "".join(f", {label} {staging[key]:.2f} s" for key, label in (
                ("allocate_s", "host buffers allocated"), ("populate_s", "buffers faulted in beside the steps"),
                ("waited_s", "waited for them"), ("lock_s", "page-locked")) if key in staging)
            print(f"checkpoint {r['step']}: training blocked {r['blocking_s']:.2f} s, write {r['write_s']:.1f} s "
                  f"(checksums {r.get('checksum_s', 0):.1f} s), staged on {staging['on']}{buffers}")
        if r["kind"] == "export":
            timings = ", ".join(f"{k} {v:.1f}" for k, v in (r.get("timings") or {}).items())
            print(f"export: reloaded loss {r['eval_loss']:.5f} vs {r['reference_eval_loss']:.5f} "
                  f"(|d| {r['abs_diff']:.2g}); seconds: {timings}")
    t = record.get("time") or {}
    if t:
        phases = ", ".join(f"{k} {v:.1f}" for k, v in t["phases_s"].items())
        print(f"wall {t['wall_s']:.1f} s, goodput {t['goodput']:.1%}: {phases}")
        if t.get("startup_s"):
            print("startup: " + ", ".join(f"{k} {v:.1f}" for k, v in t["startup_s"].items()))
    train = [r for r in rows if r["kind"] == "train"]
    if train:
        steady = train[len(train) // 2:]
        print(f"tokens/s/device (median, 2nd half): {sorted(r['tokens_per_s_per_device'] for r in steady)[len(steady) // 2]:.0f}, "
              f"peak memory {max(r['peak_mem_gib'] or 0 for r in train):.1f} GiB")
    for t in tasks[:1] + tasks[-1:]:
        for ex in t["examples"][:2]:
            print(f"  step {t['step']} | {ex['question'][:60]!r} -> {ex['got'][-80:]!r} ({ex['correct']})")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
