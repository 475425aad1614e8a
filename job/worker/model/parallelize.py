"""Sharding (FSDP2's `fully_shard` per decoder layer and on the root, or none on one worker), float8 GEMMs,
activation checkpointing and `torch.compile`, applied in one place (`parallelize`); and the way back, a plain
unsharded copy (`gathered_copy`) for generation and the export."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from ... import packages
from ...config import ParallelConfig
from .causal_lm import CausalLMWithLoss, full, plain_name
from .lora import LoraLinear, is_adapter
from .nf4 import cast_unquantized, fsdp_can_shard, is_nf4

if TYPE_CHECKING:
    from transformers import PreTrainedModel

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@torch.no_grad()
def gathered_copy(model: CausalLMWithLoss, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    """A plain (unsharded) copy of the sharded LM on `device`, in `dtype`: for generation and the export.

    Collective: every rank all-gathers each parameter in turn (peak: one full parameter beyond the copy). Each
    rank then generates on its own, without FSDP's hooks and collectives, so ranks need not stay in lockstep. The
    copy has its own config, or an attention switch on it (`use_grouped_decode`) would switch the training
    model's too. LoRA layers are merged into plain ones; QLoRA's keep their NF4 weight (gathered, 4-bit: never the
    base in 16 bits) with the adapters beside it (`LoraLinear.unsharded`), so on one GPU, where it shares the
    training model's NF4 weights, the copy costs only the unquantized parameters.
    """
    from copy import deepcopy

    from transformers import AutoModelForCausalLM

    lm = model.lm
    adapted = {plain_name(name): module for name, module in lm.named_modules() if isinstance(module, LoraLinear)}
    quantized = {name: module for name, module in adapted.items() if is_nf4(module.weight)}
    with torch.device("meta"):
        copy = AutoModelForCausalLM.from_config(deepcopy(lm.config), dtype=dtype,
                                                attn_implementation=lm.config._attn_implementation)
    for name in quantized:  # set below, so that no 16-bit weight is allocated for them
        parent, _, child = name.rpartition(".")
        copy.get_submodule(parent).register_module(child, None)
    copy.to_empty(device=device)
    for name, module in quantized.items():  # QLoRA: kept in 4 bits (merged, a weight would take 4x the memory)
        parent, _, child = name.rpartition(".")
        copy.get_submodule(parent).register_module(child, module.unsharded(dtype, device))
    targets = dict(copy.named_parameters())
    for name, param in lm.named_parameters():
        module_name = plain_name(name).rpartition(".")[0]
        if is_adapter(name) or module_name in quantized:
            continue
        module = adapted.get(module_name) if name.endswith(".weight") else None
        targets[plain_name(name)].copy_(module.merged_weight() if module else full(param))
    for name, buffer in lm.named_buffers():  # e.g. rotary frequencies, which FSDP leaves unsharded
        copy.get_buffer(plain_name(name)).copy_(buffer)
    copy.tie_weights()
    copy.generation_config = lm.generation_config
    return copy.eval().requires_grad_(False)


def decoder_layers(lm: nn.Module) -> nn.ModuleList:
    layers = getattr(lm.base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"model: {type(lm).__name__} has no base_model.layers; parallelize() needs decoder layers")
    return layers


def device_mesh(device_type: str, world: int, shard_group_size: int) -> DeviceMesh:
    """FSDP's mesh: 1-D (shard across all workers), or 2-D (replicate, shard) for hybrid sharding, where each
    group of `shard_group_size` consecutive ranks (Ray and torchrun number a node's workers consecutively)
    holds one sharded copy and gradients are all-reduced across the copies."""
    from torch.distributed.device_mesh import init_device_mesh

    if shard_group_size in (0, world):
        return init_device_mesh(device_type, (world,))
    return init_device_mesh(
        device_type, (world // shard_group_size, shard_group_size), mesh_dim_names=("replicate", "shard")
    )


FLOAT8_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first GPUs with float8 tensor cores (Ada; Hopper is 9.0)."""


def check_float8_device(recipe: str, device_type: str) -> None:
    """Raises a `RuntimeError` naming `parallel.float8` unless this process's device can run float8 GEMMs."""
    if device_type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"parallel.float8: {recipe} needs a CUDA GPU (compute capability >= 8.9), and this "
                           f"worker has none (device type {device_type}); set parallel.float8: none")
    capability = torch.cuda.get_device_capability()
    if capability < FLOAT8_MIN_CAPABILITY:
        raise RuntimeError(f"parallel.float8: {recipe} needs compute capability >= 8.9 (Ada, Hopper or newer); "
                           f"{torch.cuda.get_device_name()} has {capability[0]}.{capability[1]}; set parallel.float8: none")


def float8_eligible(module: nn.Module, fqn: str) -> bool:
    """Which linear layers `convert_to_float8` swaps: every `nn.Linear` but the output head, with both widths
    multiples of 16 (what float8 GEMMs accept)."""
    return (isinstance(module, nn.Linear) and fqn.split(".")[-1] != "lm_head"
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert_to_float8(lm: nn.Module, recipe: str) -> list[str]:
    """Swap the eligible linear layers for torchao's `Float8Linear` with `recipe`'s scaling, in place; returns
    their names. Parameters keep names, dtypes and values (checkpoints and the export see plain weights). Call
    before `torch.compile` and sharding, as `parallelize` does."""
    packages.require("torchao", f"parallel.float8: {recipe}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = [fqn for fqn, module in lm.named_modules() if float8_eligible(module, fqn)]
    convert_to_float8_training(lm, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=float8_eligible)
    return names


def parallelize(model: CausalLMWithLoss, cfg: ParallelConfig, mesh: DeviceMesh, bf16: bool) -> CausalLMWithLoss:
    """Apply FSDP2: `fully_shard` on each decoder layer, then on the root (embeddings, final norm, head). On one
    worker (`cfg.fsdp: auto`, no CPU offload or activation checkpointing) nothing is sharded, and with bf16 the
    model computes on bf16 copies of its fp32 weights itself (`CausalLMWithLoss.compute_dtype`), made once per
    forward and kept for its backward, as `reshard_after_forward: false` keeps FSDP2's.

    First the linear layers may become float8 ones (`convert_to_float8`). Then per layer: activation checkpointing,
    `torch.compile` (one graph per layer: the layers are identical, so it compiles once), sharding. With bf16,
    parameters are gathered and computed in bf16 while master weights and optimizer state stay fp32; gradients
    are reduced in `cfg.reduce_dtype`. With bf16, LoRA's frozen base is cast to bf16 once (nothing updates it, and
    it is computed in bf16 either way), then sharded like the rest. QLoRA's NF4 weights shard as 4-bit codes and
    scales; on a one-rank shard group, or when its scale blocks do not divide among the group (a tiny model's),
    one stays whole on every rank, outside FSDP2 (`ignored_params`).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if cfg.float8 != "none":
        check_float8_device(cfg.float8, mesh.device_type)
        convert_to_float8(model.lm, cfg.float8)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=REDUCE_DTYPES[cfg.reduce_dtype])
    shard_args = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
    if cfg.cpu_offload:
        shard_args["offload_policy"] = CPUOffloadPolicy()
    # Activation checkpointing recomputes a layer in backward, outside the forward that swapped the copies in.
    shard = mesh.size() > 1 or cfg.fsdp == "always" or cfg.cpu_offload or cfg.activation_checkpointing
    if bf16:  # LoRA's frozen base: in bf16 once, as FSDP2 or the copies would cast it every step (NF4: as it is)
        cast_unquantized([p for p in model.parameters() if not p.requires_grad], torch.bfloat16)
    whole = {p for p in model.parameters() if is_nf4(p) and not fsdp_can_shard(p, mesh.size(-1))} if shard else set()
    layers = decoder_layers(model.lm)
    for i, layer in enumerate(layers):
        if cfg.activation_checkpointing:
            layer = checkpoint_wrapper(layer)
        if cfg.compile:
            layer = torch.compile(layer)
        if shard:
            fully_shard(layer, **shard_args, ignored_params=whole & set(layer.parameters()))
        layers[i] = layer
    if shard:
        fully_shard(model, **shard_args, ignored_params=whole)
    elif bf16:
        model.compute_dtype = torch.bfloat16
    return model
