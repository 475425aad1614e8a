"""`model.attn_implementation: flash_attention_4` (job/attention.py) without its GPU kernels.

FlashAttention-4 runs only on Hopper/Blackwell GPUs, so these tests put a reference in place of `flash_attn.cute`
(SDPA, one document at a time) and check everything around the kernel: packed rows become one row whose
documents are exactly those the position ids give, the model's loss and gradients equal SDPA's with transformers'
packed-document mask, varying documents do not recompile the compiled layers, and the plain copy for generation
uses SDPA without switching the training model. The kernels themselves against cuDNN: scripts/bench_layers.py
(max |difference| of outputs and input gradients, run 32), end to end: scripts/benchmark.py `best-fa4`.
"""

import sys
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from job import attention, packages
from job import config as config_lib
from job.config import ModelConfig
from job.model import CausalLMWithLoss, build_causal_lm, gathered_copy

ROWS, LENGTH = 3, 24


def reference_flash_attn() -> ModuleType:
    """`flash_attn.cute`'s two functions as SDPA, (batch, tokens, heads, dim) layout, grouped-query heads as given."""

    def attend(q, k, v, scale):  # (tokens, heads, dim) -> (tokens, heads, dim), causal
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), is_causal=True,
                                             scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False):
        assert causal
        return torch.stack([attend(q[b], k[b], v[b], softmax_scale) for b in range(len(q))]), None

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                               causal=False):
        assert causal and cu_seqlens_q is cu_seqlens_k and cu_seqlens_q.dtype == torch.int32
        bounds = cu_seqlens_q.tolist()
        assert bounds[0] == 0 and bounds[-1] == len(q) and max(b - a for a, b in zip(bounds, bounds[1:])) <= max_seqlen_q
        return torch.cat([attend(q[a:b], k[a:b], v[a:b], softmax_scale) for a, b in zip(bounds, bounds[1:])]), None

    module = ModuleType("flash_attn.cute")
    module.flash_attn_func, module.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    return module


@pytest.fixture
def fake_kernels(monkeypatch):
    # Only the submodule: imports of a dotted name already in sys.modules skip its parent (and a fake parent
    # would break transformers' probe for FlashAttention-2, which reads `flash_attn.__spec__`).
    monkeypatch.setitem(sys.modules, "flash_attn.cute", reference_flash_attn())


def packed_positions() -> torch.Tensor:
    """Rows of documents as `data.pack` makes them: positions restart at each document and at each row start."""
    lengths = [[5, 11, 8], [12, 12], [3, 3, 9, 9]]
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


def tiny(attn: str) -> CausalLMWithLoss:
    cfg = ModelConfig(preset="qwen2-tiny", init="random", attn_implementation=attn, overrides={"num_hidden_layers": 2})
    return CausalLMWithLoss(build_causal_lm(cfg, None, seed=0))


def test_documents_are_where_positions_restart_and_every_row_starts():
    positions = packed_positions()
    positions[2, :3] = torch.arange(7, 10)  # a row that starts mid-document still starts a document
    bounds = attention.documents(positions)
    assert bounds["cu_seq_lens_q"].tolist() == [0, 5, 16, 24, 36, 48, 51, 54, 63, 72]
    assert bounds["cu_seq_lens_q"].dtype == torch.int32 and bounds["cu_seq_lens_k"] is bounds["cu_seq_lens_q"]
    assert bounds["max_length_q"] == bounds["max_length_k"] == 12  # the longest document, not the row


@pytest.mark.parametrize("packed", [True, False])
def test_loss_and_gradients_equal_sdpa_with_the_packed_mask(fake_kernels, packed):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4096, (ROWS, LENGTH), generator=g)
    batch = dict(input_ids=ids, labels=torch.roll(ids, -1, 1), position_ids=packed_positions() if packed else None)
    results = []
    for attn in ("sdpa", attention.NAME):
        model = tiny(attn)
        loss, n = model(**batch)
        loss.backward()
        results.append((loss.detach(), n, {k: p.grad for k, p in model.named_parameters()}))
    (sdpa_loss, sdpa_n, sdpa_grads), (fa_loss, fa_n, fa_grads) = results
    assert model.lm.config._attn_implementation == attention.REGISTERED
    assert fa_n == sdpa_n == ROWS * LENGTH
    torch.testing.assert_close(fa_loss, sdpa_loss, rtol=1e-5, atol=1e-5)
    for name, grad in sdpa_grads.items():
        torch.testing.assert_close(fa_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_documents_change_the_loss(fake_kernels):
    """The boundaries reach the kernel: the same tokens as one document per row give another loss."""
    ids = torch.randint(0, 4096, (ROWS, LENGTH), generator=torch.Generator().manual_seed(0))
    model = tiny(attention.NAME)
    packed, _ = model(ids, ids, packed_positions())
    whole, _ = model(ids, ids, torch.arange(LENGTH).expand(ROWS, LENGTH))
    assert not torch.allclose(packed, whole)


def test_new_documents_do_not_recompile_the_compiled_layers(fake_kernels, monkeypatch):
    """After the first batch (whose compiling includes the frames around the attention's graph break), batches
    with other documents (another number of them, another longest) run on the same compiled code."""
    torch._dynamo.reset()
    model = tiny(attention.NAME)
    layers = model.lm.base_model.layers
    for i, layer in enumerate(layers):
        layers[i] = torch.compile(layer, backend="eager")  # Dynamo's guards are what recompiles; no codegen needed
    g = torch.Generator().manual_seed(1)
    for k, documents in enumerate(([[5, 11, 8], [12, 12], [3, 3, 9, 9]], [[24], [12, 12], [24]], [[2] * 12, [1, 23], [20, 4]])):
        monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", k > 0)
        positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in documents])
        ids = torch.randint(0, 4096, (ROWS, LENGTH), generator=g)
        loss, _ = model(ids, ids, positions)
        loss.backward()
    torch._dynamo.reset()


def test_the_generation_copy_uses_sdpa_and_leaves_the_training_model_as_it_was(fake_kernels):
    model = tiny(attention.NAME)
    copy = gathered_copy(model, torch.float32, torch.device("cpu"))
    assert copy.config._attn_implementation == "sdpa"
    assert model.lm.config._attn_implementation == attention.REGISTERED


def test_needs_a_gpu_and_bf16():
    base = {"name": "r", "model": {"preset": "qwen2-tiny", "init": "random", "attn_implementation": attention.NAME}}
    for overrides in ({}, {"scaling": {"use_gpu": True}, "parallel": {"mixed_precision": "fp32"}}):
        with pytest.raises(config_lib.ConfigError, match=r"model\.attn_implementation: flash_attention_4 needs "
                                                         r"scaling\.use_gpu: true and bf16 compute"):
            config_lib.load_dict({**base, **overrides})
    config_lib.load_dict({**base, "scaling": {"use_gpu": True}})


def test_without_the_package_the_driver_and_the_worker_name_it_and_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    cfg = config_lib.load_dict({"name": "r", "model": {"preset": "qwen2-tiny", "init": "random",
                                                       "attn_implementation": attention.NAME},
                                "scaling": {"use_gpu": True}})
    fix = f"flash-attn-4=={packages.FLASH_ATTN_4_VERSION}"
    with pytest.raises(packages.MissingPackage, match=rf"^model\.attn_implementation: flash_attention_4 needs the "
                                                      rf"Python package 'flash_attn\.cute'.*{fix}"):
        packages.check_config(cfg)
    with pytest.raises(packages.MissingPackage, match=r"^model\.attn_implementation: flash_attention_4 needs"):
        build_causal_lm(cfg.model, None, seed=0)
