"""Model: build a Hugging Face causal LM (pretrained or random init), wrap it with its loss, shard it with FSDP2.

`CausalLMWithLoss` is the module FSDP2 shards as its root. Computing the loss inside the root's forward lets
the (tied) output embedding stay sharded outside forward/backward and lets the loss use a chunked linear
cross-entropy that never materialises the full fp32 logits (151,936 wide for Qwen2.5). With one worker it is
not sharded (`parallelize`), and computes on bf16 copies of its weights itself.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import packages, storage
from ..config import ConfigError, LoraConfig, ModelConfig, ParallelConfig
from .architecture import hf_config
from .data import IGNORE_INDEX
from .loss import chunked_cross_entropy

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase | None:
    """The configured tokenizer, or None when there is none to load (synthetic data, trained tokenizers)."""
    from transformers import AutoTokenizer

    source = cfg.tokenizer or cfg.path
    if source is None:
        return None
    return AutoTokenizer.from_pretrained(source, revision=cfg.revision, token=os.environ.get("HF_TOKEN"))


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def weights_fingerprint(cfg: ModelConfig) -> dict:
    """What the model's weights were: for pretrained weights in a local directory, the sha256 of every weight
    file and of `config.json` (and the directory's `PROVENANCE.json`, as written by scripts/prepare_model.py);
    for a hub id, the id and revision; for a random init, the architecture source (the seed is in the record)."""
    import json

    if cfg.init == "random":
        return {"init": "random", "preset": cfg.preset, "path": cfg.path, "overrides": cfg.overrides}
    out: dict = {"init": "pretrained", "path": cfg.path}
    if not os.path.isdir(cfg.path):
        return {**out, "revision": cfg.revision, "source": "hub"}

    names = sorted(n for n in os.listdir(cfg.path) if n.endswith(WEIGHT_SUFFIXES) or n == "config.json")
    out["files"] = {n: storage.digest(os.path.join(cfg.path, n))["sha256"] for n in names}
    provenance = os.path.join(cfg.path, "PROVENANCE.json")
    if os.path.exists(provenance):
        with open(provenance) as f:
            out["provenance"] = json.load(f)
    return out


def build_causal_lm(cfg: ModelConfig, vocab_size: int | None, seed: int) -> PreTrainedModel:
    """The causal LM in fp32 on the current default device: loaded, or seeded random init (same on all ranks).

    `vocab_size` (from a trained tokenizer) resizes a preset's vocabulary.
    """
    from transformers import AutoModelForCausalLM

    common = dict(attn_implementation=cfg.attn_implementation, dtype=torch.float32)
    if cfg.init == "pretrained":
        return AutoModelForCausalLM.from_pretrained(
            cfg.path, revision=cfg.revision, token=os.environ.get("HF_TOKEN"), **cfg.overrides, **common
        )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf_config(cfg, vocab_size), **common)


class CausalLMWithLoss(nn.Module):
    """A causal LM whose forward returns (sum of token losses, number of target tokens).

    Returning the sum lets the caller normalise by the token count of the whole global batch, so every token
    weighs the same however tokens fall across micro-batches and ranks.
    """

    def __init__(self, lm: nn.Module, loss_chunk_size: int = 0, sdpa_backend: str | None = None):
        super().__init__()
        self.lm = lm
        self.loss_chunk_size = loss_chunk_size
        self.sdpa_backend = SDPA_BACKENDS[sdpa_backend] if sdpa_backend else None
        self.compute_dtype: torch.dtype | None = None
        """Set by `parallelize` when it leaves the model unsharded and computes in bf16: each forward then runs on
        copies of the fp32 weights in this dtype (`computing_on_copies`)."""

    def forward(self, *args, **kwargs):
        if self.sdpa_backend is None:
            return self._forward(*args, **kwargs)
        with sdpa_kernel(self.sdpa_backend):
            return self._forward(*args, **kwargs)

    def _forward(self, input_ids, labels, position_ids=None):
        """`(loss_sum, n_targets)` of the next-token targets `labels`."""
        # No KV cache: with one, transformers skips the packed-sequence mask derived from position_ids and
        # attention would cross document boundaries.
        with computing_on_copies(self.lm, self.compute_dtype) if self.compute_dtype else nullcontext():
            hidden = self.lm.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
            head_weight = self.lm.get_output_embeddings().weight
        hidden, labels = hidden.flatten(0, 1), labels.flatten()
        if self.loss_chunk_size:
            return chunked_cross_entropy(hidden, head_weight, labels, self.loss_chunk_size)
        logits = F.linear(hidden, head_weight).float()
        loss_sum = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        return loss_sum, (labels != IGNORE_INDEX).sum()


class LoraLinear(nn.Linear):
    """A frozen linear layer plus a trainable low-rank update: `W·x + b + (alpha / r)·B·A·dropout(x)`, as PEFT's
    LoRA layer computes it. The layer keeps its own parameters' names (`weight`, `bias`), so the frozen base
    reads, gathers and exports as before, and the adapters are `lora_A.weight` (r x in, Kaiming-uniform) and
    `lora_B.weight` (out x r, zeros: training starts from the base model exactly): PEFT's key names under
    `base_model.model.` (`adapter_state_dict`)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        with torch.device("meta"):  # the base's parameters are taken over below, not allocated
            super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
        self.weight, self.bias = base.weight, base.bias
        self.requires_grad_(False)
        device = base.weight.device
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=device)  # Kaiming-uniform, as PEFT's
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=device)
        nn.init.zeros_(self.lora_B.weight)
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def merged_weight(self) -> torch.Tensor:
        """`W + (alpha / r)·B·A` in fp32, gathered when sharded."""
        weight, a, b = (_full(p).float() for p in (self.weight, self.lora_A.weight, self.lora_B.weight))
        return weight + self.scaling * (b @ a)


def add_adapters(lm: nn.Module, cfg: LoraConfig) -> list[str]:
    """Freezes every parameter of `lm` and puts a `LoraLinear` in place of each linear layer whose name ends in
    one of `cfg.targets`; returns their module names. Raises a `ConfigError` naming `model.lora.targets` for a
    target that matches no linear layer. Seeded like the model: every rank draws the same adapters."""
    linear = {name: module for name, module in lm.named_modules() if isinstance(module, nn.Linear)}
    chosen = [name for name in linear if name.rsplit(".", 1)[-1] in cfg.targets]
    unmatched = [t for t in cfg.targets if not any(name.rsplit(".", 1)[-1] == t for name in chosen)]
    if unmatched:
        known = sorted({name.rsplit(".", 1)[-1] for name in linear})
        raise ConfigError(f"model.lora.targets: {', '.join(unmatched)} match(es) no linear layer of "
                         f"{type(lm).__name__} (its linear layers: {', '.join(known)})")
    lm.requires_grad_(False)
    for name in chosen:
        parent, _, child = name.rpartition(".")
        lm.get_submodule(parent).register_module(child, LoraLinear(linear[name], cfg.rank, cfg.alpha, cfg.dropout))
    return chosen


def adapter_state_dict(lm: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights under PEFT's key names (`base_model.model.<module>.lora_A.weight`, ...), gathered
    when sharded (collective then), on the CPU."""
    return {f"base_model.model.{plain_name(name)}": _full(param).detach().cpu()
            for name, param in lm.named_parameters() if is_adapter(name)}


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (collective); any other tensor as is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class CastCopies(torch.autograd.Function):
    """Copies of the parameters in another dtype, and in backward their gradients cast back: one foreach copy
    each way (per-parameter casts cost ~16 ms of host time per forward for Qwen2.5-1.5B's 338 parameters,
    while the device waited)."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.dtypes = [p.dtype for p in params]
        copies = [torch.empty_like(p, dtype=dtype) for p in params]
        torch._foreach_copy_(copies, list(params))
        return tuple(copies)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        present = [i for i, g in enumerate(grads) if g is not None]
        out = [torch.empty_like(grads[i], dtype=ctx.dtypes[i]) for i in present]
        torch._foreach_copy_(out, [grads[i] for i in present])
        full: list[torch.Tensor | None] = [None] * len(grads)
        for i, g in zip(present, out):
            full[i] = g
        return None, *full


@contextmanager
def computing_on_copies(lm: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Within it, each parameter of `lm` is its copy in `dtype` (`CastCopies`), the fp32 parameter again after:
    what FSDP2's mixed precision gathers, without FSDP2. One copy per parameter, so a tied embedding and head
    share theirs and their gradients add up in `dtype` before reaching the fp32 weight, as under FSDP2. The
    copies are put straight into the modules' parameter slots, as `torch.func.functional_call` does, whose
    per-name lookups cost ~7 ms of host time per forward here. Autograd keeps a copy while a saved
    activation needs it. Frozen parameters already in `dtype` (LoRA's base) are used as they are."""
    slots = [(module, name, param) for module in lm.modules() for name, param in module._parameters.items()
             if param is not None and (param.requires_grad or param.dtype != dtype)]
    params = list(dict.fromkeys(param for _, _, param in slots))
    copies = dict(zip(params, CastCopies.apply(dtype, *params)))
    for module, name, param in slots:
        module._parameters[name] = copies[param]
    try:
        yield
    finally:
        for module, name, param in slots:
            module._parameters[name] = param


def plain_name(name: str) -> str:
    """A parameter's or buffer's name without the wrappers `parallelize` may add (torch.compile, activation
    checkpointing): its name in the unsharded model and in state dicts (DCP's fully qualified name)."""
    return name.replace("._orig_mod", "").replace("._checkpoint_wrapped_module", "")


@torch.no_grad()
def gathered_copy(model: CausalLMWithLoss, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    """A plain (unsharded) copy of the sharded LM on `device`, in `dtype`: for generation and the export.

    Collective: every rank all-gathers each parameter in turn (so the peak is one full parameter on top of the
    copy) and gets the whole model. Generation then runs on each rank on its own, without FSDP's per-layer hooks
    and collectives, so ranks need not stay in lockstep and can stop as soon as their sequences have ended.
    The copy has its own config: `from_config` would share the LM's, and an attention switch on the copy
    (`generate.use_grouped_decode`) would switch the training model's too. LoRA layers are merged into plain
    ones (`LoraLinear.merged_weight`).
    """
    from copy import deepcopy

    from transformers import AutoModelForCausalLM

    lm = model.lm
    adapted = {f"{name}.weight": module for name, module in lm.named_modules() if isinstance(module, LoraLinear)}
    with torch.device("meta"):
        copy = AutoModelForCausalLM.from_config(deepcopy(lm.config), dtype=dtype,
                                                attn_implementation=lm.config._attn_implementation)
    copy.to_empty(device=device)
    targets = dict(copy.named_parameters())
    for name, param in lm.named_parameters():
        if is_adapter(name):
            continue
        module = adapted.get(name)
        targets[plain_name(name)].copy_(module.merged_weight() if module else _full(param))
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
    """Swaps the LM's eligible linear layers (`float8_eligible`) for torchao's `Float8Linear` with the `recipe`'s
    scaling (`rowwise` or `tensorwise`), in place; returns their names. Parameters keep their names, dtypes
    and values (checkpoints, the export and `gathered_copy` see plain linear weights). Call before
    `torch.compile` and sharding: `parallelize` does. Needs `torchao`."""
    packages.require("torchao", f"parallel.float8: {recipe}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = [fqn for fqn, module in lm.named_modules() if float8_eligible(module, fqn)]
    convert_to_float8_training(lm, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=float8_eligible)
    return names


def parallelize(model: CausalLMWithLoss, cfg: ParallelConfig, mesh: DeviceMesh, bf16: bool) -> CausalLMWithLoss:
    """Applies FSDP2: `fully_shard` on each decoder layer, then on the root (embeddings, final norm, head); on a
    one-worker mesh (with `cfg.fsdp: auto`, no CPU offload, no activation checkpointing) nothing is sharded, and with bf16 the model
    computes on bf16 copies of its fp32 weights itself (`CausalLMWithLoss.compute_dtype`), made once per
    micro-batch's forward and kept for its backward, as `reshard_after_forward: false` keeps FSDP2's.

    First, with `cfg.float8` other than `none`, the linear layers become float8 ones (`convert_to_float8`: all
    but the head and those whose widths are not multiples of 16; a clear error without torchao or a GPU of
    compute capability >= 8.9). Then per layer, in order: activation checkpointing (recompute in backward),
    `torch.compile` (one compiled graph per layer: the layers are identical, so it compiles once), then
    sharding. With bf16, parameters are gathered and computed in bf16 while the sharded master weights and
    optimizer state stay fp32; gradients are reduced in `cfg.reduce_dtype`. With LoRA (`add_adapters`) the
    adapters are trained so; the frozen base is sharded and gathered the same way, or, unsharded with bf16, kept
    in bf16 (nothing updates it: no fp32 master needed).
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
    layers = decoder_layers(model.lm)
    for i, layer in enumerate(layers):
        if cfg.activation_checkpointing:
            layer = checkpoint_wrapper(layer)
        if cfg.compile:
            layer = torch.compile(layer)
        if shard:
            fully_shard(layer, **shard_args)
        layers[i] = layer
    if shard:
        fully_shard(model, **shard_args)
    elif bf16:
        model.compute_dtype = torch.bfloat16
        for param in model.parameters():  # LoRA's frozen base: in bf16 once, not copied into it every forward
            if not param.requires_grad:
                param.data = param.data.to(torch.bfloat16)
    return model
