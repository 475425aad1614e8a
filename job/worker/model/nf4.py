"""QLoRA's frozen base in 4-bit NormalFloat (`model.lora.quantize_base: nf4`), through torchao's `NF4Tensor`.

A weight becomes a 4-bit code per value (the index of the nearest of NF4's 16 levels) and one absmax scale per block
of 64 values, the scales themselves quantized to 8 bits per block of 256 around their mean (double quantization):
~0.52 bytes a weight against 2 in bf16. `F.linear` on it dequantizes to the input's dtype in forward and again for
the input's gradient in backward (torchao's `LinearNF4`, no weight gradient); a compiled layer fuses each
dequantization into its kernels. It shards under FSDP2 (its all-gather moves the codes and scales, never a
dequantized weight) and is plain PyTorch: no compiled kernels, so it runs on CPU as on the GPU.

torchao, not bitsandbytes: its tensor is the one torchtune's QLoRA shards with FSDP2, it runs (and so is tested) on
CPU, and its 3.4 MB wheel needs nothing but torch; bitsandbytes' 4-bit layers are CUDA kernels in a 43 MB wheel
and do not shard under FSDP2. docs/lora.md has the two measured side by side (bench/nf4_candidates.py).
"""

from __future__ import annotations

import importlib.metadata
from typing import Iterable

import torch
from torch import nn

from ... import packages
from ...config import LoraConfig

BLOCK = 64
"""Weights per NF4 block (one absmax scale each): the QLoRA paper's."""
SCALER_BLOCK = 256
"""Scales per block of the double quantization (one 8-bit quantization factor each): the QLoRA paper's. A weight
with fewer or an odd number of them (the tiny demo model's) takes the largest power of two that divides its count."""


def recipe(lora: LoraConfig) -> dict | None:
    """The quantization of the frozen base as checkpoints and the record name it; None for a base in bf16."""
    if not lora.quantize_base:
        return None
    return {"method": lora.quantize_base, "block_size": BLOCK, "scaler_block_size": SCALER_BLOCK,
            "double_quantized_scales": True}


def library() -> str:
    """What quantizes, as the record names it."""
    return f"torchao {importlib.metadata.version('torchao')}"


def quantizable(weight: torch.Tensor) -> bool:
    """Whether `weight` splits into whole blocks and an even number of them (else it stays as it is)."""
    return weight.dim() == 2 and weight.numel() % (2 * BLOCK) == 0


def quantize(weight: torch.Tensor) -> nn.Parameter:
    """`weight` in NF4, from its bf16 values (as QLoRA quantizes a 16-bit checkpoint), as a frozen parameter."""
    packages.require("torchao", "model.lora.quantize_base: nf4")
    from torchao.quantization import to_nf4

    blocks = weight.numel() // BLOCK
    scaler_block = min(SCALER_BLOCK, blocks & -blocks)  # the largest power of two dividing the block count
    return nn.Parameter(to_nf4(weight.detach().to(torch.bfloat16).contiguous(), BLOCK, scaler_block),
                        requires_grad=False)


def is_nf4(tensor: torch.Tensor) -> bool:
    """Whether `tensor` (or a DTensor's local shard) is a 4-bit NF4 weight (without importing torchao)."""
    local = getattr(tensor, "_local_tensor", tensor)
    return type(local).__name__ == "NF4Tensor"


def fsdp_can_shard(weight: torch.Tensor, shards: int) -> bool:
    """Whether FSDP2 can split the NF4 `weight` into `shards` row blocks: NF4 splits its codes, scales and
    quantization factors alike, so each must divide evenly (a weight with fewer scale blocks than shards is kept
    whole on every rank instead). Never into one: there is nothing to split, and FSDP2's one-rank shortcut (torch
    2.13) copies a single all-gather input per parameter where NF4 has three."""
    return shards > 1 and weight.shape[0] % shards == 0 and weight.quantization_factor.numel() % shards == 0


def nbytes(tensor: torch.Tensor) -> int:
    """Device bytes this rank holds of `tensor`: a DTensor's local shard; an NF4 weight's codes, scales and factors."""
    local = getattr(tensor, "_local_tensor", tensor)
    if is_nf4(local):
        inner, _ = local.__tensor_flatten__()
        return sum(getattr(local, name).nbytes for name in inner)
    return local.numel() * local.element_size()


def cast_unquantized(params: Iterable[torch.Tensor], dtype: torch.dtype) -> None:
    """Cast `params` to `dtype` in place, except NF4 weights (a cast would dequantize them)."""
    for param in params:
        if not is_nf4(param):
            param.data = param.data.to(dtype)
