"""Chunked linear + cross-entropy that never materializes the full [N, V] logits.

With V ~ 152k, the fp32 logits of 4 x 4096 tokens are ~10 GB, plus as much for their gradient. Here the lm-head
matmul and the loss run over chunks of `chunk_size` tokens, each chunk's gradients computed right away in forward,
so no logits are kept or recomputed: the extra memory is one chunk's logits, the hidden-state gradient and an fp32
weight gradient. Matches F.cross_entropy(hidden.float() @ weight.float().T, labels, ignore_index=-100,
reduction="sum") up to the input dtype's matmul precision.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..data import IGNORE_INDEX


def _loss_and_logit_grad(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Summed cross-entropy of one chunk and its gradient w.r.t. the logits (softmax - onehot), both from one
    read of the logits. Softmax math in fp32; the gradient is returned in the logits' dtype for the matmuls.

    Written so that, compiled, one kernel reads each row twice (log-sum-exp, then softmax written straight in
    the logits' dtype) and a second, tiny one writes the target column (softmax - 1, computed in fp32)."""
    x = logits.float()
    valid = (labels != IGNORE_INDEX).unsqueeze(1)
    target = labels.clamp(min=0).unsqueeze(1)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    target_logit = x.gather(1, target)
    loss = torch.where(valid, lse - target_logit, 0.0).sum()
    grad = torch.where(valid, (x - lse).exp(), 0.0).to(logits.dtype)
    target_grad = torch.where(valid, (target_logit - lse).exp() - 1.0, 0.0).to(logits.dtype)
    return loss, grad.scatter(1, target, target_grad)


# On GPU, one fused kernel per chunk instead of ~8 passes over the [chunk, V] logits in eager mode.
_loss_and_logit_grad_cuda = torch.compile(_loss_and_logit_grad, dynamic=False)


def _add_weight_grad(grad_w: Tensor, g: Tensor, h: Tensor) -> Tensor:
    """grad_w + g.T @ h, accumulated in fp32 by the GEMM itself: with bf16 inputs one cuBLAS call writes fp32
    (no bf16 product rounded, cast and added in separate passes over the [V, H] matrix)."""
    if h.is_cuda and h.dtype != torch.float32:
        return torch.addmm(grad_w, g.t(), h, out_dtype=torch.float32)
    return grad_w.addmm_(g.t().float(), h.float())  # CPU: no mixed-dtype GEMM; fp32 runs need no casts


class ChunkedCrossEntropy(torch.autograd.Function):
    """Gradients computed in forward, chunk by chunk, while its logits exist (as Liger-Kernel's fused linear
    cross-entropy does); linear in the scalar upstream gradient, so backward only scales them."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int, with_grad: bool) -> Tensor:
        loss_and_grad = _loss_and_logit_grad_cuda if hidden.is_cuda else _loss_and_logit_grad
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if with_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if with_grad else None
        for s in range(0, hidden.shape[0], chunk_size):
            h, y = hidden[s : s + chunk_size], labels[s : s + chunk_size]
            chunk_loss, g = loss_and_grad(h @ weight.t(), y)  # matmul in the input dtype (bf16 on GPU)
            loss_sum += chunk_loss
            if with_grad:
                grad_h[s : s + chunk_size] = g @ weight
                grad_w = _add_weight_grad(grad_w, g, h)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss_sum

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss.to(grad_h.dtype), (grad_w * grad_loss).to(ctx.weight_dtype), None, None, None


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int = 4096) -> tuple[Tensor, Tensor]:
    """Sum of token cross-entropies of `hidden @ weight.T` against `labels`, chunked over tokens.

    hidden [N, H] (bf16 or fp32), weight [V, H] (same dtype, unsharded), labels [N] int64 already shifted
    (IGNORE_INDEX: ignored). Returns (fp32 loss sum, int64 count of non-ignored labels); gradients flow to hidden
    and weight.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden [N,H], weight [V,H], labels [N]; got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(labels.shape)}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss_sum = ChunkedCrossEntropy.apply(hidden, weight, labels, int(chunk_size), with_grad)
    return loss_sum, (labels != IGNORE_INDEX).sum()
