"""Chunked linear + cross-entropy that never materializes the full [N, V] logits.

For a causal LM with vocab V ~ 152k, the logits of N = B*T tokens are N*V*4 bytes in fp32
(4 x 4096 tokens -> ~10 GB, plus as much again for their gradient). Here the lm-head
matmul and the loss run over chunks of `chunk_size` tokens: peak extra memory is
~chunk_size*V*(2+4+4) bytes, at the cost of recomputing each chunk's logits in backward.

    loss_sum, n_tokens = chunked_cross_entropy(hidden, weight, labels, chunk_size=4096)
    loss = loss_sum / n_tokens.clamp(min=1)

Labels are already shifted (label i is the target of hidden i); -100 marks ignored tokens.
Matches F.cross_entropy(hidden.float() @ weight.float().T, labels, ignore_index=-100,
reduction="sum") up to the input dtype's matmul precision.
"""

from __future__ import annotations

import torch
from torch import Tensor

IGNORE_INDEX = -100


def _chunk_lse_and_target(h: Tensor, weight: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 logits, logsumexp and target logit for one chunk; ignored targets read index 0."""
    logits = (h @ weight.t()).float()  # matmul in the input dtype, softmax math in fp32
    lse = torch.logsumexp(logits, dim=-1)
    tgt = logits.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)
    return logits, lse, tgt


class ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int) -> Tensor:
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk_size):
            y = labels[s : s + chunk_size]
            _, lse, tgt = _chunk_lse_and_target(hidden[s : s + chunk_size], weight, y)
            loss_sum += torch.where(y != IGNORE_INDEX, lse - tgt, 0.0).sum()
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk_size = chunk_size
        return loss_sum

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        hidden, weight, labels = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], ctx.chunk_size):
            h, y = hidden[s : s + ctx.chunk_size], labels[s : s + ctx.chunk_size]
            logits, lse, _ = _chunk_lse_and_target(h, weight, y)
            # d(lse - logit_y)/d logits = softmax - onehot(y); zero rows of ignored tokens.
            g = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place: one [C,V] fp32 buffer
            valid = y != IGNORE_INDEX
            g.scatter_add_(1, y.clamp(min=0).unsqueeze(1), torch.full_like(lse, -1.0).unsqueeze(1))
            g *= (valid.float() * grad_loss).unsqueeze(1)
            g = g.to(hidden.dtype)  # matmuls back in the input dtype (bf16 on GPU)
            if need_h:
                grad_h[s : s + ctx.chunk_size] = g @ weight
            if need_w:
                grad_w += (g.t() @ h).float()  # accumulate the weight grad in fp32
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int = 4096) -> tuple[Tensor, Tensor]:
    """Sum of token cross-entropies of `hidden @ weight.T` against `labels`, chunked over tokens.

    hidden [N, H] (bf16 or fp32), weight [V, H] (same dtype; e.g. the tied embedding weight,
    unsharded), labels [N] int64 with -100 = ignore. Returns (loss_sum fp32 scalar,
    n_tokens = number of non-ignored labels, int64 scalar). Gradients flow to hidden and weight.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden [N,H], weight [V,H], labels [N]; got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(labels.shape)}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    loss_sum = ChunkedCrossEntropy.apply(hidden, weight, labels, int(chunk_size))
    return loss_sum, (labels != IGNORE_INDEX).sum()
