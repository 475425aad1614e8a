"""The causal LM: tokenizer, weights (pretrained or seeded random init) and the wrapper that computes its loss.

`CausalLMWithLoss` is the module FSDP2 shards as its root (`parallelize.py`). Computing the loss inside the root's
forward lets the (tied) output embedding stay sharded outside forward/backward and lets the loss use a chunked
linear cross-entropy that never materialises the full fp32 logits (151,936 wide for Qwen2.5). With one worker it is
not sharded, and computes on bf16 copies of its weights itself (`computing_on_copies`).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager, nullcontext, suppress
from typing import TYPE_CHECKING, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ... import storage
from ...common.presets import hf_config
from ...config import ConfigError, ModelConfig
from ..data import IGNORE_INDEX
from . import nf4
from .loss import chunked_cross_entropy, token_logprobs

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase | None:
    """The configured tokenizer, or None when there is none to load (synthetic data, trained tokenizers)."""
    from transformers import AutoTokenizer

    source = cfg.tokenizer or cfg.path
    if source is None:
        return None
    return AutoTokenizer.from_pretrained(source, revision=cfg.revision, token=os.environ.get("HF_TOKEN"))


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def weights_fingerprint(cfg: ModelConfig) -> dict:
    """What the weights were: a local directory's sha256 of every weight file, `config.json` and
    `PROVENANCE.json`; a hub id and revision; or a random init's architecture source (its seed is in the record)."""
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


def build_causal_lm(cfg: ModelConfig, vocab_size: int | None, seed: int, quantized: bool = True) -> PreTrainedModel:
    """The causal LM in fp32 on the current default device: loaded, or seeded random init (same on all ranks). A
    loaded base leaves the random generators seeded by `seed`: what is drawn next (LoRA's adapters) is the same on
    every rank, in every run, and with the base quantized or not.

    `vocab_size` (from a trained tokenizer) resizes a preset's vocabulary. With `model.lora.quantize_base` (QLoRA)
    it is built module by module (`build_module_by_module`), the adapters' target weights in NF4 unless
    `quantized` is False (the same base in fp32: what the adapter is served on).
    """
    from transformers import AutoModelForCausalLM

    common = dict(attn_implementation=cfg.attn_implementation, dtype=torch.float32)
    if cfg.lora.quantize_base:
        lm = build_module_by_module(cfg, vocab_size, seed, quantized)
    elif cfg.init == "pretrained":
        lm = AutoModelForCausalLM.from_pretrained(
            cfg.path, revision=cfg.revision, token=os.environ.get("HF_TOKEN"), **cfg.overrides, **common
        )
    else:
        torch.manual_seed(seed)
        lm = AutoModelForCausalLM.from_config(hf_config(cfg, vocab_size), **common)
    if cfg.init == "pretrained":  # loaded weights: what the build drew (if anything) was replaced
        torch.manual_seed(seed)
    return lm


def skeleton(cfg: ModelConfig) -> PreTrainedModel:
    """The model's modules without weights (on the meta device), from its config alone: what its layers are."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(cfg))


def build_module_by_module(cfg: ModelConfig, vocab_size: int | None, seed: int, quantize: bool) -> PreTrainedModel:
    """The LM on the current default device, one module at a time: each module's parameters made in fp32 (seeded
    random values from the model's own `_init_weights`, or `model.path`'s safetensors tensors, read one at a time),
    then, with `quantize`, each LoRA target's weight quantized to NF4, before the next module is made. The device
    holds the model so far plus one module in fp32: Qwen2.5-32B's shape needs ~25 GB (NF4 layers, fp32 embeddings
    and head), never the 128 GB of the whole model in fp32 nor 64 GB in bf16; the host, one tensor. A random
    init draws its own stream, module after module, not `from_config`'s (a random QLoRA base is not the random
    LoRA base of the same seed; a pretrained one is the same weights)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    device = torch.get_default_device()
    if device.type == "cuda" and device.index is None:  # safetensors reads onto a numbered device
        device = torch.device("cuda", torch.cuda.current_device())
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(hf_config(cfg, vocab_size), attn_implementation=cfg.attn_implementation,
                                              dtype=torch.float32)
    files = None if cfg.init == "random" else SafetensorsFiles(cfg, device)
    torch.manual_seed(seed)
    made: dict[nn.Parameter, nn.Parameter] = {}  # meta parameter -> its tensor: tied weights stay one tensor
    for name, module in lm.named_modules():
        metas = dict(module._parameters)
        fresh = [key for key, param in metas.items() if param is not None and param not in made]
        for key, param in module._parameters.items():
            if param is not None:
                if param not in made:
                    made[param] = nn.Parameter(torch.empty_like(param, device=device), param.requires_grad)
                module._parameters[key] = made[param]
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = torch.empty_like(buffer, device=device)
        if fresh or module._buffers:
            lm._init_weights(module)  # random values, and the buffers' (rotary frequencies)
        if files is not None:
            with torch.no_grad():
                for key in fresh:
                    module._parameters[key].copy_(files.tensor(f"{name}.{key}" if name else key))
        if quantize and "weight" in fresh and isinstance(module, nn.Linear) and cfg.lora.adapts(name) \
                and nf4.quantizable(module.weight):
            # `made` keeps the NF4 weight, not the fp32 one: that is freed now, before the next module is made
            module.weight = made[metas["weight"]] = nf4.quantize(module.weight)
    if files is not None:
        lm.eval()  # as `from_pretrained` returns it
        with suppress(OSError):
            lm.generation_config = GenerationConfig.from_pretrained(files.directory)
    return lm


class SafetensorsFiles:
    """`model.path`'s safetensors tensors by name, each read onto `device` when asked for (a hub id: its snapshot)."""

    def __init__(self, cfg: ModelConfig, device: torch.device):
        from safetensors import safe_open

        self.path = cfg.path
        self.directory = cfg.path
        if not os.path.isdir(cfg.path):
            from huggingface_hub import snapshot_download

            self.directory = snapshot_download(cfg.path, revision=cfg.revision, token=os.environ.get("HF_TOKEN"),
                                               allow_patterns=["*.safetensors", "*.json"])
        names = sorted(n for n in os.listdir(self.directory) if n.endswith(".safetensors"))
        if not names:
            found = sorted(n for n in os.listdir(self.directory) if n.endswith(WEIGHT_SUFFIXES))
            raise ConfigError(f"model.lora.quantize_base: {cfg.lora.quantize_base} reads the base one tensor at a time "
                              f"from safetensors files, and {cfg.path} has none (weights: {', '.join(found) or 'none'});"
                              " save the model with save_pretrained(safe_serialization=True)")
        self.where = {}
        for name in names:
            handle = safe_open(os.path.join(self.directory, name), framework="pt", device=str(device))
            self.where.update(dict.fromkeys(handle.keys(), handle))

    def tensor(self, key: str) -> torch.Tensor:
        if key not in self.where:
            raise ConfigError(f"model.path: {self.path} has no tensor {key} (model.lora.quantize_base builds the model "
                              "from the safetensors tensors of its parameters' names)")
        return self.where[key].get_tensor(key)


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

    def _forward(self, input_ids, labels, position_ids=None, per_token=False):
        """`(loss_sum, n_targets)` of the next-token targets `labels`; with `per_token`, each label's log-probability
        instead (flat, fp32, 0 where ignored: what a preference objective sums per completion)."""
        # No KV cache: with one, transformers skips the packed-sequence mask derived from position_ids and
        # attention would cross document boundaries.
        with computing_on_copies(self.lm, self.compute_dtype) if self.compute_dtype else nullcontext():
            hidden = self.lm.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
            head_weight = self.lm.get_output_embeddings().weight
        hidden, labels = hidden.flatten(0, 1), labels.flatten()
        if per_token:
            return token_logprobs(hidden, head_weight, labels, self.loss_chunk_size)
        if self.loss_chunk_size:
            return chunked_cross_entropy(hidden, head_weight, labels, self.loss_chunk_size)
        logits = F.linear(hidden, head_weight).float()
        loss_sum = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        return loss_sum, (labels != IGNORE_INDEX).sum()


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (collective: FSDP2's parameters, and the gradient norm of sharded gradients); any other
    tensor as is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class CastCopies(torch.autograd.Function):
    """Copies of the parameters in another dtype, their gradients cast back in backward: one foreach copy each way
    (per-parameter casts cost ~16 ms of host time per forward for Qwen2.5-1.5B)."""

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
    """Within it, each parameter of `lm` is its copy in `dtype` (`CastCopies`): FSDP2's mixed precision without
    FSDP2. One copy per parameter, so a tied embedding and head share theirs and their gradients add up in `dtype`
    before reaching the fp32 weight, as under FSDP2. The copies go straight into the modules' parameter slots
    (`functional_call`'s per-name lookups cost ~7 ms a forward). Frozen parameters already in `dtype` are used as
    they are."""
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
