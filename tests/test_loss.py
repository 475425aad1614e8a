"""job.worker.model.loss.chunked_cross_entropy against the full-logits fp64 reference (small sizes; CPU, and the compiled
CUDA path where a GPU is present: `python -m pytest tests/test_loss.py` on the GPU machine)."""

import pytest
import torch
import torch.nn.functional as F

from job.worker.model.loss import chunked_cross_entropy

N, H, V = 37, 16, 50  # N not divisible by the chunk sizes below


def _inputs(dtype, ignore_frac=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    labels[torch.rand(N, generator=g) < ignore_frac] = -100
    return hidden, weight, labels


def _reference(hidden, weight, labels):
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    loss = F.cross_entropy(h @ w.T, labels, ignore_index=-100, reduction="sum")
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("chunk_size", [1, 8, 37, 64])
def test_fp32_matches_reference(chunk_size):
    hidden, weight, labels = _inputs(torch.float32)
    loss, n = chunked_cross_entropy(hidden, weight, labels, chunk_size)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert n.item() == (labels != -100).sum().item() > 0
    loss.backward()
    ref_loss, ref_gh, ref_gw = _reference(hidden, weight, labels)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden.grad.double(), ref_gh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad.double(), ref_gw, rtol=1e-5, atol=1e-6)
    assert not hidden.grad[labels == -100].any()  # ignored tokens get no gradient


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))])
def test_bf16_matches_reference(device):
    """On CUDA: the compiled softmax-gradient kernel and the fp32-output weight-gradient GEMM."""
    hidden, weight, labels = (t.detach().to(device) for t in _inputs(torch.bfloat16, seed=1))
    hidden.requires_grad_(), weight.requires_grad_()
    loss, n = chunked_cross_entropy(hidden, weight, labels, chunk_size=8)
    assert loss.dtype == torch.float32
    (loss * 0.5).backward()  # a non-unit upstream gradient
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    ref_loss, ref_gh, ref_gw = _reference(hidden, weight, labels)
    assert _rel(loss, ref_loss) < 1e-2
    assert _rel(hidden.grad, 0.5 * ref_gh) < 1e-2
    assert _rel(weight.grad, 0.5 * ref_gw) < 1e-2


def test_all_ignored():
    hidden, weight, labels = _inputs(torch.float32)
    labels.fill_(-100)
    loss, n = chunked_cross_entropy(hidden, weight, labels, chunk_size=8)
    assert loss.item() == 0.0 and n.item() == 0
    loss.backward()
    assert torch.isfinite(hidden.grad).all() and not hidden.grad.any() and not weight.grad.any()
    # the usual normalization stays finite
    assert (loss / n.clamp(min=1)).item() == 0.0


def test_mean_loss_and_grad_only_hidden():
    """Frozen weight (no grad) and mean-normalized loss, as a training step would use it."""
    hidden, weight, labels = _inputs(torch.float32, seed=2)
    weight = weight.detach()
    loss_sum, n = chunked_cross_entropy(hidden, weight, labels, chunk_size=5)
    (loss_sum / n).backward()
    ref = F.cross_entropy(hidden.detach() @ weight.T, labels, ignore_index=-100)
    torch.testing.assert_close((loss_sum / n), ref, rtol=1e-5, atol=1e-6)
    h = hidden.detach().requires_grad_()
    F.cross_entropy(h @ weight.T, labels, ignore_index=-100).backward()
    torch.testing.assert_close(hidden.grad, h.grad, rtol=1e-5, atol=1e-6)


def test_bad_shapes():
    hidden, weight, labels = _inputs(torch.float32)
    with pytest.raises(ValueError):
        chunked_cross_entropy(hidden, weight, labels[:-1], chunk_size=8)
    with pytest.raises(ValueError):
        chunked_cross_entropy(hidden, weight, labels, chunk_size=0)
