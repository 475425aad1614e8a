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


def _token_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    x = logits.float()
    valid = labels != IGNORE_INDEX
    target = x.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1)
    return torch.where(valid, target - torch.logsumexp(x, dim=-1), 0.0)


def _logprob_grad(logits: Tensor, labels: Tensor, scale: Tensor) -> Tensor:
    """scale · (onehot - softmax), the gradient of `_token_logprobs` per row, in the logits' dtype."""
    x = logits.float()
    valid = (labels != IGNORE_INDEX).unsqueeze(1)
    target = labels.clamp(min=0).unsqueeze(1)
    s = torch.where(valid, scale.unsqueeze(1), 0.0)
    grad = -s * (x - torch.logsumexp(x, dim=-1, keepdim=True)).exp()
    return grad.scatter_add(1, target, s).to(logits.dtype)


_token_logprobs_cuda = torch.compile(_token_logprobs, dynamic=False)
_logprob_grad_cuda = torch.compile(_logprob_grad, dynamic=False)


class ChunkedTokenLogProbs(torch.autograd.Function):
    """Per-token log-probabilities, chunk by chunk. Their upstream gradient differs per token (DPO weighs each
    completion by its pair's loss), so backward computes each chunk's logits again (one more lm-head matmul); with a
    frozen head (LoRA), forward keeps each token's hidden-state gradient at unit weight, and backward scales it."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int) -> Tensor:
        cuda = hidden.is_cuda
        logprobs_of, grad_of = (_token_logprobs_cuda, _logprob_grad_cuda) if cuda else (_token_logprobs, _logprob_grad)
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        unit = torch.empty_like(hidden) if ctx.needs_input_grad[0] and not ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], chunk_size):
            logits, y = hidden[s : s + chunk_size] @ weight.t(), labels[s : s + chunk_size]
            out[s : s + chunk_size] = logprobs_of(logits, y)
            if unit is not None:
                unit[s : s + chunk_size] = grad_of(logits, y, torch.ones_like(y, dtype=torch.float32)) @ weight
        ctx.save_for_backward(hidden, weight, labels, unit)
        ctx.chunk_size, ctx.cuda = chunk_size, cuda
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        hidden, weight, labels, unit = ctx.saved_tensors
        if unit is not None:
            return unit * grad_out.unsqueeze(1).to(unit.dtype), None, None, None
        grad_of = _logprob_grad_cuda if ctx.cuda else _logprob_grad
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], ctx.chunk_size):
            h, y = hidden[s : s + ctx.chunk_size], labels[s : s + ctx.chunk_size]
            g = grad_of(h @ weight.t(), y, grad_out[s : s + ctx.chunk_size].float())
            if grad_h is not None:
                grad_h[s : s + ctx.chunk_size] = g @ weight
            if grad_w is not None:
                grad_w = _add_weight_grad(grad_w, g, h)
        return grad_h, grad_w.to(weight.dtype) if grad_w is not None else None, None, None


def token_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int = 0) -> Tensor:
    """log softmax(hidden @ weight.T)[labels] per token, fp32 ([N]; 0 where ignored): chunked with a `chunk_size`."""
    if chunk_size:
        return ChunkedTokenLogProbs.apply(hidden, weight, labels, int(chunk_size))
    return _token_logprobs(hidden @ weight.t(), labels)
