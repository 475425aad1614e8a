#!/usr/bin/env python3
"""The two NF4 libraries QLoRA could use, on one decoder layer's projections: what a frozen 4-bit weight costs per
token in forward and in the input's gradient (QLoRA's backward through the base), against the bf16 weight.

Rows: `bf16` (F.linear on the 16-bit weight), `torchao` (its NF4Tensor through F.linear, eager), `torchao-compiled`
(the same under torch.compile, as our compiled decoder layers run it), `bitsandbytes` (Linear4bit, NF4 with
double-quantized scales: what the Trainer + peft runs). Columns: milliseconds per forward + input-gradient pass
over the layer's 7 projections (median of `--iters` after warm-up), and bytes per weight held.

    python bench/nf4_candidates.py                         # GPU: Qwen2.5-7B's projections, 4,096 tokens, bf16
    python bench/nf4_candidates.py --shape tiny --tokens 64  # CPU smoke (fp32; bitsandbytes when installed)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {
    # (out, in) of q, k, v, o, gate, up, down
    "7b": [(3584, 3584), (512, 3584), (512, 3584), (3584, 3584), (18944, 3584), (18944, 3584), (3584, 18944)],
    "tiny": [(256, 256), (128, 256), (128, 256), (256, 256), (512, 256), (512, 256), (256, 512)],
}


def weights(shape: str, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator(device).manual_seed(0)
    return [torch.randn(out, inp, generator=g, device=device).mul_(0.02).to(dtype) for out, inp in SHAPES[shape]]


def torchao_nf4(ws: list[torch.Tensor]) -> list[torch.Tensor]:
    from torchao.quantization import to_nf4

    return [to_nf4(w.to(torch.bfloat16), 64, 256) for w in ws]


def bnb_nf4(ws: list[torch.Tensor], dtype: torch.dtype) -> list[torch.nn.Module]:
    import bitsandbytes as bnb

    layers = []
    for w in ws:
        layer = bnb.nn.Linear4bit(w.shape[1], w.shape[0], bias=False, compute_dtype=dtype, compress_statistics=True,
                                  quant_type="nf4", device="meta")
        layer.weight = bnb.nn.Params4bit(w.detach(), requires_grad=False, compress_statistics=True,
                                         quant_type="nf4").to(w.device)
        layers.append(layer)
    return layers


def held_bytes(weight) -> int:
    """Bytes of what a layer keeps on the device for its weight."""
    if type(weight).__name__ == "NF4Tensor":
        inner, _ = weight.__tensor_flatten__()
        return sum(getattr(weight, n).nbytes for n in inner)
    state = getattr(weight, "quant_state", None)  # bitsandbytes' Params4bit: packed codes + its (nested) state
    if state is not None:
        nested = state.state2
        return weight.nbytes + sum(t.nbytes for t in (state.absmax, state.code, getattr(nested, "absmax", None),
                                                       getattr(nested, "code", None)) if t is not None)
    return weight.nbytes


def timed(step, iters: int, device: torch.device) -> float:
    for _ in range(3):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ws = weights(args.shape, dtype, device)
    inputs = [torch.randn(args.tokens, w.shape[1], device=device, dtype=dtype, requires_grad=True) for w in ws]

    def through(linears, linear=F.linear):
        def step():
            for layer, inp in zip(linears, inputs):
                out = layer(inp) if isinstance(layer, torch.nn.Module) else linear(inp, layer)
                out.backward(torch.ones_like(out))
        return step

    rows = {"bf16" if device.type == "cuda" else "fp32": (through(ws), ws)}
    if importlib.util.find_spec("torchao"):
        nf4 = torchao_nf4(ws)
        rows["torchao"] = (through(nf4), nf4)
        rows["torchao-compiled"] = (through(nf4, torch.compile(F.linear)), nf4)
    if importlib.util.find_spec("bitsandbytes"):
        layers = bnb_nf4(ws, dtype)
        rows["bitsandbytes"] = (through(layers), [layer.weight for layer in layers])
    results, logical = [], sum(out * inp for out, inp in SHAPES[args.shape])
    for name, (step, held) in rows.items():
        ms = timed(step, args.iters, device)
        results.append({"candidate": name, "ms": round(ms, 3),
                        "bytes_per_weight": round(sum(held_bytes(w) for w in held) / logical, 4)})
        print(json.dumps(results[-1]), flush=True)
    base = results[0]["ms"]
    print(f"{'candidate':<18}{'ms fwd+dgrad':>14}{'x ' + results[0]['candidate']:>10}{'bytes/weight':>14}")
    for r in results:
        print(f"{r['candidate']:<18}{r['ms']:>14.2f}{r['ms'] / base:>10.2f}{r['bytes_per_weight']:>14.3f}")
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, {args.tokens} tokens, "
          f"shape {args.shape}")


if __name__ == "__main__":
    main()
