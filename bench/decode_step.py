#!/usr/bin/env python3
"""Where a task-evaluation decode's time goes: job/worker/evaluation/generate.py's `StaticDecoder` on random Qwen2.5-1.5B weights
(no pretrained weights or tokenizer needed), left-padded prompts of the given lengths, one table.

    python bench/decode_step.py [--lengths PROMPTS.json] [--ends ANSWERS.json] [--batch 1319] [--steps 64]
        [--max-new 256] [--profile-steps 8] [--compiled]

`--lengths`: a JSON list of prompt lengths in tokens (e.g. the GSM8K test questions as task evaluation formats
them: bench/task_lengths.py writes it and `--ends`'s file; without it every prompt is 193 tokens). Rows, all in one process: ms per decode step (replayed as a CUDA
graph) for the batch as given, half of it (does a step's time follow the rows?), the prompts cut to the median
(does it follow the cache's length?) and the full batch on each of SDPA's backends. `--ends`: a JSON list of
generation lengths (e.g. the reference answers' tokens); random weights never produce EOS, so each row is ended
after its length instead, and a whole decode of `--max-new` tokens is timed with every row decoded to the end and
with ended rows dropped (job/worker/evaluation/generate.py `DROP_ENDED_BELOW`). Then the kernels of `--profile-steps` eager steps.
`--compiled`: last, the batch as given with its steps run by the model compiled whole (`torch.compile`, one graph
for the 28 layers; the prefill eager), the first call's compiling time beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from job.common.presets import PRESETS  # noqa: E402
from job.worker.evaluation import generate  # noqa: E402


def prompts(lengths: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts of `lengths` tokens and their attention mask."""
    width = max(lengths)
    ids = torch.randint(100, 150000, (len(lengths), width), device=device)
    mask = torch.arange(width, device=device)[None, :] >= width - torch.tensor(lengths, device=device)[:, None]
    return ids.masked_fill(~mask, 0), mask.long()


class EndingAfter(generate.StaticDecoder):
    """A decoder whose rows end after the given numbers of new tokens, as if they had produced EOS there."""

    def __init__(self, *args, ends: list[int], **kwargs):
        super().__init__(*args, **kwargs)
        self.ends = torch.tensor(ends, device=self.token.device)

    def step(self) -> None:
        super().step()
        self.ended.logical_or_(self.ends[self.rows] <= self.column)


def timed(make, backend: SDPBackend | None = None) -> tuple[float, float, int]:
    """(prefill s, decode s, steps) of the decoder `make()` builds (its prefill) and runs with CUDA graphs."""
    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
        torch.cuda.synchronize()
        start = time.perf_counter()
        decoder = make()
        torch.cuda.synchronize()
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        how = decoder.run(cuda_graph=True)
        torch.cuda.synchronize()
    assert how == "cuda_graph", how
    return prefill, time.perf_counter() - start, decoder.produced - 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths")
    parser.add_argument("--ends")
    parser.add_argument("--batch", type=int, default=1319)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--max-new", type=int, default=256)
    parser.add_argument("--profile-steps", type=int, default=8)
    parser.add_argument("--compiled", action="store_true")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, Qwen2Config

    device = torch.device("cuda")
    torch.manual_seed(0)
    cycle = lambda xs: (xs * (args.batch // len(xs) + 1))[: args.batch]  # noqa: E731
    lengths = cycle(json.loads(Path(args.lengths).read_text())) if args.lengths else [193] * args.batch
    config = Qwen2Config(**PRESETS["qwen2.5-1.5b"], attn_implementation="sdpa")
    with device:  # initialised there: seconds, not a minute on the host
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    generate.use_grouped_decode(lm)
    eos = config.vocab_size - 1

    def steps_of(ns: list[int], backend: SDPBackend | None = None, step_lm=None) -> tuple[float, float, int]:
        ids, mask = prompts(ns, device)

        def make():
            decoder = generate.StaticDecoder(lm, ids, mask, 1 + args.steps, None, 0)
            decoder.lm = lm if step_lm is None else step_lm  # the prefill ran eagerly; the decode steps run `step_lm`
            return decoder
        return timed(make, backend)

    median = sorted(lengths)[len(lengths) // 2]
    variants = [("as given", lengths, None), ("half the rows", lengths[: len(lengths) // 2], None),
                ("prompts cut to the median", [min(n, median) for n in lengths], None)]
    variants += [(f"as given, SDPA {b.name}", lengths, b)
                 for b in (SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION)]
    with torch.no_grad():
        steps_of(lengths[:64])  # first-call setup out of the rows
        print(f"{'variant':<40}{'rows':>6}{'width':>7}{'prefill s':>11}{'ms/step':>9}  (the graph's steps)")
        for name, ns, backend in variants:
            try:
                prefill, seconds, steps = steps_of(ns, backend)
                print(f"{name:<40}{len(ns):>6}{max(ns):>7}{prefill:>11.2f}{1000 * seconds / steps:>9.1f}", flush=True)
            except Exception as e:  # a backend that does not take this shape or mask
                print(f"{name:<40} failed: {type(e).__name__}: {' '.join(str(e).split())[:120]}", flush=True)
        if args.ends:
            ends = cycle(json.loads(Path(args.ends).read_text()))
            ids, mask = prompts(lengths, device)
            print(f"\nwhole decodes, {args.max_new} new tokens at most, rows ending as --ends says "
                  f"(mean {sum(min(n, args.max_new) for n in ends) / len(ends):.0f} tokens)")
            for name, below in (("every row to the end", 0.0), (f"ended rows dropped ({generate.DROP_ENDED_BELOW})",
                                                                generate.DROP_ENDED_BELOW)):
                prefill, seconds, steps = timed(lambda: EndingAfter(lm, ids, mask, args.max_new, eos, 0, below,
                                                                    ends=ends))
                print(f"{name:<40} decode {seconds:6.2f} s, {steps} steps, prefill {prefill:.2f} s", flush=True)
        decoder = generate.StaticDecoder(lm, *prompts(lengths, device), 1 + args.profile_steps, None, 0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            decoder.run(cuda_graph=False)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90), flush=True)
    if args.compiled:
        compiled = torch.compile(lm, dynamic=False)
        with torch.no_grad():
            start = time.perf_counter()
            steps_of(lengths, step_lm=compiled)  # compiles in the eager warm-up steps
            first = time.perf_counter() - start
            prefill, seconds, steps = steps_of(lengths, step_lm=compiled)
        print(f"{'as given, the step compiled':<40}{len(lengths):>6}{max(lengths):>7}{prefill:>11.2f}"
              f"{1000 * seconds / steps:>9.1f}  (first call, compiling: {first:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
