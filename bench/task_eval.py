#!/usr/bin/env python3
"""Task-evaluation speed: the run's held-out task items decoded greedily by the unsharded model exactly as
`task.task_evaluate` runs them at the start and the end of a fine-tune, once per decode path, one table.

    python bench/task_eval.py --config run.yaml [--set KEY=VALUE ...] [--paths generate,graph]
        [--limit N] [--profile-steps K] [--out DIR]

`--config` is a run config with a pretrained `model.path` and a task (`eval.task`), e.g. the ConfigMap of
`values/gsm8k.yaml` as rendered (bench/device-finetune.sh writes it to /tmp/run.yaml). Decode paths
(`DECODE_PATHS`): `stock` is Transformers' `generate` on its SDPA (before 5.24 it repeats every key/value head
per query head when a mask is given), `generate` the same with `generate.sdpa_grouped_decode`, `eager` and
`graph` job/worker/evaluation/generate.py's loop without and with CUDA graphs, `graph-all-rows` the latter with every row
decoded to the end (before rows that ended left the steps). Columns: seconds, exact match, items, decode
steps, and how many generations differ from the first path's. `--profile-steps K` then profiles K decode steps of the full batch
and prints the kernels that take the time, and the prefill and per-step time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from job import config as config_lib  # noqa: E402
from job.common import sources  # noqa: E402
from job.worker import data as data_lib  # noqa: E402
from job.worker.evaluation import generate, task  # noqa: E402
from job.worker.model.causal_lm import load_tokenizer  # noqa: E402


def synchronized_seconds(fn, device) -> tuple[float, object]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def transformers_generate(grouped: bool):
    """Transformers' `generate` with a static cache, as task evaluation ran before job/worker/evaluation/generate.py's loop."""
    def run(lm, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id):
        if grouped:
            generate.use_grouped_decode(lm)
        ids = generate.hf_generate(lm, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id)
        return generate.Generated(ids, "generate")
    return run


DECODE_PATHS = {
    "stock": transformers_generate(grouped=False),  # Transformers' SDPA (before 5.24: key/value heads repeated)
    "generate": transformers_generate(grouped=True),  # with `sdpa_grouped_decode` (runs 15-18)
    "eager": lambda *args: generate.greedy_generate(*args, cuda_graph=False),  # job/worker/evaluation/generate.py, no CUDA graph
    "graph": generate.greedy_generate,  # job/worker/evaluation/generate.py as task evaluation runs it
    "graph-all-rows": lambda *args: generate.greedy_generate(*args, drop_ended_below=0),  # every row to the end
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--paths", default="generate,graph", help=f"decode paths, in order: {', '.join(DECODE_PATHS)}")
    parser.add_argument("--limit", type=int, default=0, help="first N task items only (0: as the config says)")
    parser.add_argument("--profile-steps", type=int, default=0)
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()

    cfg = config_lib.load(args.config, args.set)
    if not cfg.eval.task or cfg.model.init != "pretrained":
        parser.error("the config needs eval.task and model.init: pretrained")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            init_method=f"file://{tempfile.mktemp()}")
    tokenizer = load_tokenizer(cfg.model)
    _, heldout, _ = sources.read_examples(cfg.data, cfg.train.seed)
    items = task.task_items(heldout.items, cfg.data, tokenizer)
    if args.limit:
        items = items[: args.limit]
    eval_cfg = dataclasses.replace(cfg.eval, task_max_examples=0, task_log_examples=len(items))

    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lm = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    warm_up = dataclasses.replace(eval_cfg, task_max_new_tokens=2)  # kernels' first-call costs out of the first row
    task.task_evaluate(lm, tokenizer, items[:8], warm_up, 0, 1, device, step=0)
    rows, first = [], None
    for path in args.paths.split(","):
        lm.set_attn_implementation("sdpa")
        generate.greedy_generate = DECODE_PATHS[path]
        seconds, result = synchronized_seconds(
            lambda: task.task_evaluate(lm, tokenizer, items, eval_cfg, 0, 1, device, step=0), device)
        generations = [x["got"] for x in result["examples"]]
        first = first or generations
        rows.append({"path": path, "seconds": seconds, "exact_match": result["exact_match"], "n": result["n"],
                     "decode_steps": result["decode_steps"], "decode": result["decode"],
                     "differ_from_first": sum(a != b for a, b in zip(generations, first))})
        print(json.dumps(rows[-1]), flush=True)
    generate.greedy_generate = generate.greedy_generate

    print(f"\n{'path':<10}{'seconds':>9}{'exact match':>13}{'items':>7}{'steps':>7}{'differ':>8}  decode")
    for r in rows:
        print(f"{r['path']:<10}{r['seconds']:>9.1f}{r['exact_match']:>13.4f}{r['n']:>7}{r['decode_steps']:>7}"
              f"{r['differ_from_first']:>8}  {r['decode']}")

    if args.profile_steps:
        rows.append(profile(lm, tokenizer, items, eval_cfg, device, args.profile_steps))
    if args.out:
        Path(args.out, "bench_task_eval.json").write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()
    return 0


def profile(lm, tokenizer, items, eval_cfg, device, steps: int) -> dict:
    """Prefill and per-step time of the full batch as task evaluation decodes, and the top kernels of `steps`
    eager decode steps (the prefill left out)."""
    prompts = tokenizer([x["prompt"] for x in items[: eval_cfg.task_batch_size]], add_special_tokens=False)["input_ids"]
    ids, mask = generate.left_pad(prompts, data_lib.pad_id(tokenizer))
    ids, mask = ids.to(device), mask.to(device)

    def decode(n):
        return generate.greedy_generate(lm, ids, mask, n, eos_token_id=None, pad_token_id=data_lib.pad_id(tokenizer))

    prefill, _ = synchronized_seconds(lambda: decode(1), device)
    # Two calls with the same warm-up steps and capture, `steps` replays apart (one call less its prefill also
    # counted the warm-up and the capture: run 22's "32 ms", run 51).
    shorter, _ = synchronized_seconds(lambda: decode(1 + steps), device)
    longer, _ = synchronized_seconds(lambda: decode(1 + 2 * steps), device)
    per_step = (longer - shorter) / steps
    print(f"\nbatch {ids.shape[0]} x prompt width {ids.shape[1]}: prefill {prefill:.2f} s, "
          f"decode step {1000 * per_step:.1f} ms")
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    # The decode steps alone, eagerly (a replayed graph hides which operation each kernel belongs to).
    generate.use_grouped_decode(lm)
    decoder = generate.StaticDecoder(lm, ids, mask, 1 + steps, eos_token_id=None, pad_token_id=data_lib.pad_id(tokenizer))
    with torch.profiler.profile(activities=activities) as prof:
        decoder.run(cuda_graph=False)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=60))
    return {"profile": {"batch": ids.shape[0], "prompt_width": ids.shape[1], "prefill_s": prefill,
                        "decode_step_s": per_step}}


if __name__ == "__main__":
    sys.exit(main())
