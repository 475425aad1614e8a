#!/usr/bin/env python3
"""Where the export check's held-out loss spends its time: the plain (eager, unsharded) model's forward over
packed held-out blocks, as `export.accept` runs it in a fresh process, per variant, one table.

    python bench/heldout_forward.py [--preset qwen2.5-1.5b] [--blocks 240] [--seq-len 1024]

Random init (the time does not depend on the weights) in bf16 on the GPU, documents of ~200 tokens packed
into each block (position ids restart per document, so the attention is block-causal as for GSM8K). Each
variant runs the whole pass twice in the same process: the first pass pays what a fresh process pays once
(kernel loading, cuBLAS and attention set-up), the second is the steady state. Variants: the micro-batch
(training's, and larger) and the SDPA backend. Then the greedy sample (`eval.sample_tokens`), twice.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from job import config as config_lib  # noqa: E402
from job.worker.evaluation.generate import greedy_generate  # noqa: E402
from job.worker.model.causal_lm import (
    CausalLMWithLoss,
    build_causal_lm,  # noqa: E402
)


def packed_blocks(n: int, seq_len: int, vocab: int, doc_len: int = 200) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, seq_len), generator=g)
    positions = (torch.arange(seq_len) % doc_len).expand(n, seq_len).contiguous()
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions}


def timed_pass(model, blocks: dict, batch: int, device) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        for s in range(0, len(blocks["input_ids"]), batch):
            model(**{k: v[s : s + batch].to(device) for k, v in blocks.items()})
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-1.5b")
    parser.add_argument("--blocks", type=int, default=240)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--backends", default="default,efficient,cudnn")
    parser.add_argument("--sample-tokens", type=int, default=48)
    args = parser.parse_args()
    device = torch.device("cuda")
    model_cfg = config_lib.ModelConfig(init="random", preset=args.preset, path=None)
    with torch.device(device):
        lm = build_causal_lm(model_cfg, None, 0).to(torch.bfloat16).eval()
    blocks = packed_blocks(args.blocks, args.seq_len, lm.config.vocab_size)
    tokens = args.blocks * args.seq_len
    print(f"{args.preset}, {args.blocks} blocks x {args.seq_len} tokens, bf16, eager", flush=True)
    print(f"{'variant':<22} {'first s':>8} {'second s':>9} {'tokens/s (2nd)':>15}")
    for backend in args.backends.split(","):
        for batch in map(int, args.batches.split(",")):
            model = CausalLMWithLoss(lm, 4096, None if backend == "default" else backend).eval()
            try:
                first, second = timed_pass(model, blocks, batch, device), timed_pass(model, blocks, batch, device)
            except RuntimeError as e:
                print(f"{backend + ' b' + str(batch):<22} failed: {str(e).splitlines()[0][:80]}", flush=True)
                continue
            print(f"{backend + ' b' + str(batch):<22} {first:8.2f} {second:9.2f} {tokens / second:15,.0f}", flush=True)
    prompt = blocks["input_ids"][:1, :8].to(device)
    for attempt in ("first", "second"):
        torch.cuda.synchronize()
        start = time.perf_counter()
        greedy_generate(lm, prompt, torch.ones_like(prompt), args.sample_tokens, eos_token_id=None, pad_token_id=0)
        torch.cuda.synchronize()
        print(f"sample of {args.sample_tokens} tokens, {attempt}: {time.perf_counter() - start:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
