#!/usr/bin/env python3
"""Issue 19's kernel levers, measured on the decoder layers alone before any is wired into the model.

    python bench/layers.py [--layers 4] [--variants sdpa-cudnn,fa4,quack-mlp,...] [--shapes synthetic,gsm8k]

The model is Qwen2.5-1.5B's decoder stack (transformers' Qwen2Model, `--layers` of its 28 layers, bf16
weights, each layer `torch.compile`d as `parallelize` does), fed embeddings directly (the embedding, head and
loss do not change between variants). Per variant and shape it times forward + backward with CUDA events and
reports ms per layer, what that makes of the 28 layers, and the benchmark step it predicts: `--step-ms` (our
`best-cudnn` step at micro-batch 4, run 16) minus 28 × the per-layer saving. It also reports the largest
difference of the output and of the input gradient from the first variant's, so a fast wrong kernel shows.

Variants (one part swapped each):
  sdpa-cudnn   PyTorch SDPA restricted to cuDNN's kernels (the `synthetic` profile's `sdpa_backend: cudnn`)
  sdpa         PyTorch SDPA, the backend chosen per call (values/gsm8k.yaml)
  fa4          FlashAttention-4's CuTe-DSL kernels (their Hopper path) through `flash_attention_4` below: outside
               the compiled graph (transformers' own `flash_attention_4` fails under torch.compile), packed rows
               as variable-length documents. Wrong on packed rows here (docs/performance.md)
  quack-mlp    the MLP as quack's fused GEMMs: gate/up projection with SiLU·mul in its epilogue, and in
               backward the SiLU·mul gradient in the epilogue of the down projection's input-gradient GEMM
               (quack's default tile configuration; `quack-mlp-tuned` autotunes each GEMM first: minutes)
  liger-mlp    the MLP's SiLU·mul as Liger's Triton kernel (GEMMs stay cuBLAS)
  fa4+quack-mlp
Shapes: `synthetic` (4 × 4096 tokens, one causal sequence per row: the issue-19 benchmark) and `gsm8k`
(16 × 1024 tokens, documents of 100–400 tokens packed into each row: values/gsm8k.yaml). FlashAttention
takes packed documents as one flattened row with their boundaries (`documents`);
SDPA gets the same documents as a block-causal mask, which transformers derives from the position ids.

Needs a CUDA GPU; FlashAttention-4 and quack need the CuTe-DSL bundle (`bash bench/device-wheels.sh cute`,
installed there by `device_cute_install`, docs/device.md), Liger the `.whl` bundle.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from job.common.presets import PRESETS  # noqa: E402

FA4 = "fa4"  # the name flash_attention_4 below is registered under (none with "flash": transformers takes those for its own)


@torch.compiler.disable
def flash_attention_4(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """A transformers attention function: causal FlashAttention-4 on (batch, heads, tokens, head dim) inputs, over
    the documents `cu_seq_lens_q` delimits in one flattened row if given; returns (batch, tokens, heads, head dim)."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if cu_seq_lens_q is None:
        out, _ = flash_attn_func(q, k, v, softmax_scale=scaling, causal=True)
        return out, None
    out, _ = flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu_seq_lens_q, cu_seqlens_k=cu_seq_lens_q,
                                    max_seqlen_q=max_length_q, max_seqlen_k=max_length_q, softmax_scale=scaling,
                                    causal=True)
    return out[None], None


def documents(position_ids: torch.Tensor) -> dict:
    """The bounds of packed rows' documents once the rows are flattened into one (a start at every position 0
    and every row start)."""
    rows, length = position_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True
    cu = torch.nonzero(starts.flatten()).flatten().to(torch.int32)
    cu = torch.cat([cu, cu.new_tensor([rows * length])])
    longest = int(cu.diff().max())
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)


VARIANTS = {  # name: (attention implementation, SDPA backend, MLP kernel)
    "sdpa-cudnn": ("sdpa", "cudnn", None),
    "sdpa": ("sdpa", None, None),
    "fa4": (FA4, None, None),
    "quack-mlp": ("sdpa", "cudnn", "quack"),
    "liger-mlp": ("sdpa", "cudnn", "liger"),
    "fa4+quack-mlp": (FA4, None, "quack"),
    "quack-mlp-tuned": ("sdpa", "cudnn", "quack-tuned"),
}
SHAPES = {"synthetic": (4, 4096, None), "gsm8k": (16, 1024, (100, 400))}  # rows, tokens per row, document lengths
FULL_LAYERS = PRESETS["qwen2.5-1.5b"]["num_hidden_layers"]


class SwiGLU(nn.Module):
    """Qwen2MLP's projections (same names and weights), for a subclass's kernels to compute the MLP with."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj


class QuackSwiGLU(SwiGLU):
    """The MLP by quack's `mlp_func`, with the gate and up weights side by side."""

    def __init__(self, mlp: nn.Module, tuned: bool = False):
        super().__init__(mlp)
        self.tuned = tuned

    def forward(self, x):
        from quack.mlp import mlp_func

        gate_up = torch.cat([self.gate_proj.weight, self.up_proj.weight])  # quack's concat layout: [gate; up]
        return mlp_func(x, gate_up, self.down_proj.weight, activation="swiglu", concat_layout=True, tuned=self.tuned)


class LigerSwiGLU(SwiGLU):
    """The MLP's SiLU·mul by Liger's Triton kernel, its projections as they are."""

    def forward(self, x):
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))


MLP_KERNELS = {"quack": QuackSwiGLU, "quack-tuned": lambda mlp: QuackSwiGLU(mlp, tuned=True), "liger": LigerSwiGLU}


def build(layers: int, attn: str, mlp: str | None):
    from transformers import AttentionInterface, Qwen2Config, Qwen2Model
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(FA4, flash_attention_4)
    AttentionMaskInterface.register(FA4, flash_attention_mask)
    cfg = Qwen2Config(**{**PRESETS["qwen2.5-1.5b"], "num_hidden_layers": layers, "vocab_size": 256})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2Model._from_config(cfg, attn_implementation=attn, dtype=torch.bfloat16)
    for i, layer in enumerate(model.layers):
        if mlp:
            layer.mlp = MLP_KERNELS[mlp](layer.mlp)
        model.layers[i] = torch.compile(layer)
    return model


def inputs(shape: str, flash: bool):
    """Embeddings, the output gradient, position ids and (flash attention on packed rows) the documents' bounds."""
    rows, tokens, doc_lengths = SHAPES[shape]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, tokens, PRESETS["qwen2.5-1.5b"]["hidden_size"], generator=g).to("cuda", torch.bfloat16)
    grad = torch.randn(x.shape, generator=g).to("cuda", torch.bfloat16)
    positions = torch.arange(tokens).expand(rows, tokens).clone()
    if doc_lengths:
        for row in positions:
            start = 0
            while start < tokens:
                n = int(torch.randint(doc_lengths[0], doc_lengths[1] + 1, (1,), generator=g))
                row[start : start + n] = torch.arange(min(n, tokens - start))
                start += n
    positions = positions.cuda()
    if not (flash and doc_lengths):
        return x, grad, positions, {}
    bounds = documents(positions)  # one flattened row of the rows' documents
    return x.reshape(1, -1, x.shape[-1]), grad.reshape(1, -1, x.shape[-1]), positions.reshape(1, -1), bounds


def measure(model, x, grad, positions, boundaries: dict, backend: str | None, iters: int, warmup: int):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def step():
        x.grad = None
        model.zero_grad(set_to_none=True)
        out = model(inputs_embeds=x, position_ids=positions, use_cache=False, **boundaries).last_hidden_state
        out.backward(grad)
        return out

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if backend == "cudnn" else contextlib.nullcontext():
        first = time.perf_counter()
        for _ in range(warmup):
            out = step()
        torch.cuda.synchronize()
        warmup_s = time.perf_counter() - first
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.reset_peak_memory_stats()
        start.record()
        for _ in range(iters):
            out = step()
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, warmup_s, out.detach().float(), x.grad.detach().float()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--variants", default="sdpa-cudnn,fa4,liger-mlp,quack-mlp,fa4+quack-mlp")
    parser.add_argument("--shapes", default="synthetic,gsm8k")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=344.8, help="benchmark step the saving is taken from")
    parser.add_argument("--out", help="JSON rows")
    args = parser.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        reference = None
        for name in args.variants.split(","):
            attn, backend, mlp = VARIANTS[name]
            row = {"shape": shape, "variant": name}
            try:
                torch._dynamo.reset()
                model = build(args.layers, attn, mlp)
                x, grad, positions, boundaries = inputs(shape, flash=attn == FA4)
                x.requires_grad_(True)
                ms, warmup_s, out, dx = measure(model, x, grad, positions, boundaries, backend, args.iters, args.warmup)
                out, dx = out.reshape(-1, out.shape[-1]), dx.reshape(-1, dx.shape[-1])
                row.update(ms_per_layer=round(ms / args.layers, 3), warmup_s=round(warmup_s, 1),
                           peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
                if reference is None:
                    reference = (row["ms_per_layer"], out, dx)
                else:
                    saving = FULL_LAYERS * (reference[0] - row["ms_per_layer"])
                    row.update(saving_ms_28_layers=round(saving, 1),
                               max_abs_diff_out=float((out - reference[1]).abs().max()),
                               max_abs_diff_dx=float((dx - reference[2]).abs().max()),
                               ref_abs_max_dx=float(reference[2].abs().max()))
                    if shape == "synthetic":
                        row["predicted_step_ms"] = round(args.step_ms - saving, 1)
                del model, x, grad, out, dx
            except Exception as error:  # one variant's failure (a kernel that does not build) is a row, not the end
                row["error"] = f"{type(error).__name__}: {error}"[:600]
            torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'shape':<10} {'variant':<15} {'ms/layer':>9} {'x28 saving':>11} {'step ms':>8} {'max|d out|':>11} "
          f"{'max|d dx|':>10} {'GiB':>6} {'warmup s':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:<10} {r['variant']:<15} ERROR {r['error'][:150]}")
            continue
        print(f"{r['shape']:<10} {r['variant']:<15} {r['ms_per_layer']:>9.3f} {r.get('saving_ms_28_layers', 0):>11.1f} "
              f"{r.get('predicted_step_ms', ''):>8} {r.get('max_abs_diff_out', 0):>11.4f} {r.get('max_abs_diff_dx', 0):>10.4f} "
              f"{r['peak_gib']:>6.1f} {r['warmup_s']:>9.1f}")
    if args.out:
        Path(args.out).write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    # Exit 1 when a variant failed or its input gradient is off by more than 5% of the reference's largest (bf16
    # kernels that agree differ by ~1%: run 32).
    wrong = [r for r in rows if "error" in r or r.get("max_abs_diff_dx", 0) > 0.05 * r.get("ref_abs_max_dx", 1)]
    print(f"\n{len(wrong)} variant(s) failed or disagree with the reference: {[r['variant'] for r in wrong]}" if wrong
          else "\nevery variant ran and agrees with the reference")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
