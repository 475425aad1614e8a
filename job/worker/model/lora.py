"""LoRA: low-rank adapters beside the frozen linear layers (`add_adapters`), trained alone, under PEFT's names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ConfigError, LoraConfig
from .causal_lm import full, plain_name

class LoraLinear(nn.Linear):
    """A frozen linear layer plus a trainable low-rank update, `W·x + b + (alpha / r)·B·A·dropout(x)` as PEFT's
    layer computes it. It keeps its parameters' names, so the base reads, gathers and exports as before; the
    adapters are `lora_A.weight` (r x in, Kaiming-uniform) and `lora_B.weight` (out x r, zeros: training starts
    from the base exactly), PEFT's key names."""

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
        """`W + (alpha / r)·B·A` in fp32 (an NF4 `W` dequantized), gathered when sharded."""
        weight, a, b = (full(p).to(torch.float32) for p in (self.weight, self.lora_A.weight, self.lora_B.weight))
        return weight + self.scaling * (b @ a)

    def unsharded(self, dtype: torch.dtype, device: torch.device) -> LoraLinear:
        """A plain copy of this layer on `device` (gathered when sharded), for generation and the export: its
        weight as it is (an NF4 weight stays 4-bit), the bias and adapters in `dtype`. Drawing nothing from the
        random generators, it leaves training's streams where they were."""
        with torch.device("meta"):
            shape = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        copy = LoraLinear(shape, self.lora_A.out_features, 1.0, 0.0)  # on the meta device: nothing drawn
        copy.scaling = self.scaling
        copy.weight = nn.Parameter(full(self.weight).to(device), requires_grad=False)
        if self.bias is not None:
            copy.bias = nn.Parameter(full(self.bias).to(device, dtype), requires_grad=False)
        for name in ("lora_A", "lora_B"):
            adapter = getattr(copy, name).to_empty(device=device).to(dtype).requires_grad_(False)
            adapter.weight.copy_(full(getattr(self, name).weight))
        return copy.eval()


def add_adapters(lm: nn.Module, cfg: LoraConfig) -> list[str]:
    """Freeze `lm` and put a `LoraLinear` in place of each linear layer whose name ends in one of `cfg.targets`;
    returns their names. `ConfigError` for a target matching none. Seeded: every rank draws the same adapters."""
    if problem := targets_problem(lm, cfg):
        raise ConfigError(problem)
    linear = {name: module for name, module in lm.named_modules() if isinstance(module, nn.Linear)}
    chosen = [name for name in linear if cfg.adapts(name)]
    lm.requires_grad_(False)
    for name in chosen:
        parent, _, child = name.rpartition(".")
        lm.get_submodule(parent).register_module(child, LoraLinear(linear[name], cfg.rank, cfg.alpha, cfg.dropout))
    return chosen


def targets_problem(lm: nn.Module, cfg: LoraConfig) -> str | None:
    """What is wrong with `cfg.targets` for `lm` (a target naming no linear layer), or None; `lm` may be on the meta
    device (the driver checks before any worker starts: `causal_lm.skeleton`)."""
    names = {name.rsplit(".", 1)[-1] for name, module in lm.named_modules() if isinstance(module, nn.Linear)}
    if unmatched := [t for t in cfg.targets if t not in names]:
        return (f"model.lora.targets: {', '.join(unmatched)} match(es) no linear layer of {type(lm).__name__} "
                f"(its linear layers: {', '.join(sorted(names))})")
    return None


def adapter_state_dict(lm: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights under PEFT's key names (`base_model.model.<module>.lora_A.weight`, ...), gathered
    when sharded (collective then), on the CPU."""
    return {f"base_model.model.{plain_name(name)}": full(param).detach().cpu()
            for name, param in lm.named_parameters() if is_adapter(name)}


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def merged_state_dict(lm: nn.Module) -> dict[str, torch.Tensor]:
    """`lm`'s weights as a plain model's, under its own names: each `LoraLinear` of a QLoRA copy
    (`LoraLinear.unsharded`) merged, its NF4 weight dequantized, in its adapters' dtype on the CPU (one layer on the
    device at a time); every other tensor as it is."""
    adapted = {f"{name}.weight": module for name, module in lm.named_modules() if isinstance(module, LoraLinear)}
    return {name: (adapted[name].merged_weight().to(adapted[name].lora_A.weight.dtype).cpu() if name in adapted
                   else tensor) for name, tensor in lm.state_dict().items() if not is_adapter(name)}
