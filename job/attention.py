"""FlashAttention-4 for training: a transformers attention function, and packed rows as variable-length documents.

`model.attn_implementation: flash_attention_4` runs attention on FlashAttention-4's CuTe-DSL kernels (package
`flash-attn-4`; Hopper and Blackwell GPUs). transformers ships an implementation of that name, but it fails under
`torch.compile` (Dynamo cannot trace its keyword-building partial) and finds packed documents only in a batch of
one row. `register()` adds `flash_attention_4` below to transformers' attention functions instead:

* it runs outside the compiled graph (`torch.compiler.disable`): each compiled decoder layer becomes two graphs
  around it (measured in scripts/bench_layers.py, which includes that cost);
* packed rows (`data.packing`: documents cut into rows, position ids restarting at each document) go to the
  kernel as one flattened row with the documents' boundaries (`documents`), so no work is spent on pairs of
  tokens from different documents. SDPA instead masks a whole causal row (cuDNN computes the masked blocks):
  on GSM8K's 16 × 1024-token rows FlashAttention-4 took 8.5 ms per layer against cuDNN's 9.9 (run 32).

Generation and the export's check do not use it: they need attention masks and a KV cache, and run on SDPA
(`model.gathered_copy`).
"""

from __future__ import annotations

import torch

NAME = "flash_attention_4"
"""The `model.attn_implementation` value."""
REGISTERED = "fa4_packed"
"""The name `register()` gives `flash_attention_4` in transformers (the models' `config._attn_implementation`).
Not transformers' own name, nor any with "flash" in it: transformers takes those for its own flash kernels and
checks for their packages (and, for its own name, makes its own implementation the one to run)."""


@torch.compiler.disable
def flash_attention_4(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                      cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """Causal attention of (batch, heads, tokens, head dim) inputs, returning (batch, tokens, heads, head dim)
    as transformers' attention functions do. With `cu_seq_lens_q` (from `documents`) the batch is one flattened
    row and each document attends only within itself. Grouped-query heads go to the kernel as they are."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    if dropout or sliding_window or attention_mask is not None:
        what = "attention dropout" if dropout else "a sliding window" if sliding_window else "a padding mask"
        raise NotImplementedError(f"model.attn_implementation: {NAME} does not support {what} here; use sdpa")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if cu_seq_lens_q is None:
        out, _ = flash_attn_func(q, k, v, softmax_scale=scaling, causal=True)
        return out, None
    out, _ = flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu_seq_lens_q, cu_seqlens_k=cu_seq_lens_q,
                                    max_seqlen_q=max_length_q, max_seqlen_k=max_length_q, softmax_scale=scaling,
                                    causal=True)
    return out[None], None


def documents(position_ids: torch.Tensor) -> dict:
    """The keyword arguments that delimit the documents of packed rows once the rows are flattened into one.

    A document starts wherever the position id is 0 and at every row start (so rows never merge, whatever their
    positions). `max_length_q` is the longest document's length, exactly: with the row length as a bound instead,
    FlashAttention-4 (4.0.0b36 on an H200, CuTe DSL 4.7.1) gave wrong outputs and gradients (run 33). The document
    count is marked dynamic, so the compiled layers do not recompile for other batches (tests/test_attention.py).
    Finding the starts and the longest reads them on the host: two syncs per micro-batch.
    """
    rows, length = position_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True
    cu = torch.nonzero(starts.flatten()).flatten().to(torch.int32)
    cu = torch.cat([cu, cu.new_tensor([rows * length])])
    torch._dynamo.maybe_mark_dynamic(cu, 0)
    longest = int(cu.diff().max())
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)


def register() -> str:
    """Registers `flash_attention_4` with transformers as `REGISTERED`, with flash attention's mask function (no
    mask is built without padding), and returns the name to build a model with."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(REGISTERED, flash_attention_4)
    AttentionMaskInterface.register(REGISTERED, flash_attention_mask)
    return REGISTERED
