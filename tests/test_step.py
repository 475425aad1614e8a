"""The training step's pieces on one CPU process: the one-worker model without FSDP2 against the sharded one,
and the gradient clipping folded into the fused AdamW step against `clip_grad_norm_`."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from conftest import tiny_run_config
from job import config as config_lib
from job.worker.model.causal_lm import CausalLMWithLoss, build_causal_lm, full
from job.worker.model.parallelize import parallelize
from job.worker.optimizer import build_optimizer, clip_in_step


def _model(tmp_path, fsdp: str, bf16: bool = False, loss_chunk_size: int = 0, **parallel):
    cfg = config_lib.load_dict(tiny_run_config(tmp_path, parallel={"fsdp": fsdp, **parallel},
                                               train={"loss_chunk_size": loss_chunk_size}))
    lm = build_causal_lm(cfg.model, 512, cfg.train.seed)
    model = parallelize(CausalLMWithLoss(lm, cfg.train.loss_chunk_size), cfg.parallel, init_device_mesh("cpu", (1,)),
                        bf16)
    return model, build_optimizer(model, cfg.train)


def _batches(n: int):
    """Seeded micro-batches of two packed documents per row (positions restart: the packed-sequence mask)."""
    generator = torch.Generator().manual_seed(0)
    positions = torch.cat([torch.arange(10), torch.arange(6)]).expand(2, 16)
    for _ in range(n):
        ids = torch.randint(0, 512, (2, 16), generator=generator)
        yield {"input_ids": ids, "labels": ids, "position_ids": positions}


def _train(model, optimizer, steps: int, max_norm: float = 1.0) -> list[tuple[float, float]]:
    out = []
    for batch in _batches(steps):
        loss_sum, targets = model(**batch)
        (loss_sum / targets).backward()
        grad_norm = clip_in_step(optimizer, max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append(((loss_sum / targets).item(), grad_norm.item()))
    return out


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("loss_chunk_size", [0, 8])
def test_one_worker_without_fsdp_trains_exactly_as_fsdp(tmp_path, single_process, bf16, loss_chunk_size):
    """One worker is not sharded (`fsdp: auto`) and gives FSDP2's losses and gradient norms, to the last bit: in
    bf16 it computes on bf16 copies of the fp32 weights as FSDP2's mixed precision gathers them (the tied
    embedding and head share one copy), and the fp32 gradients and weights end the same."""
    unwrapped, optimizer = _model(tmp_path, "auto", bf16, loss_chunk_size)
    sharded, sharded_optimizer = _model(tmp_path, "always", bf16, loss_chunk_size)
    assert not isinstance(unwrapped, FSDPModule) and isinstance(sharded, FSDPModule)
    assert unwrapped.compute_dtype == (torch.bfloat16 if bf16 else None)
    assert _train(unwrapped, optimizer, 4) == _train(sharded, sharded_optimizer, 4)
    for (name, param), expected in zip(unwrapped.named_parameters(), sharded.parameters()):
        torch.testing.assert_close(param, expected.full_tensor(), rtol=0, atol=0, msg=name)


def test_activation_checkpointing_keeps_fsdp_on_one_worker(tmp_path, single_process):
    """The recompute in backward would not see the forward's bf16 copies, so one worker is sharded then."""
    assert isinstance(_model(tmp_path, "auto", activation_checkpointing=True)[0], FSDPModule)


@pytest.mark.parametrize("fsdp", ["auto", "always"])
@pytest.mark.parametrize("max_norm", [0.5, 1e3, 0.0])
def test_clipping_in_the_fused_step_matches_clip_grad_norm(tmp_path, single_process, fsdp, max_norm):
    """`clip_in_step` + the fused AdamW step against `clip_grad_norm_` + the same step, on plain tensors and on
    FSDP2's DTensors, clipping (0.5), not clipping (1e3: the factor is 1) and disabled (0): the same gradient norm,
    and the same weights up to rounding (a division by the inverse factor instead of a multiplication by it).
    One step: after it, Adam turns rounding-level gradients into whole updates (the key biases, whose gradient is
    zero but for rounding: softmax ignores them), so later steps compare noise."""
    (model, optimizer), (reference, reference_optimizer) = _model(tmp_path, fsdp), _model(tmp_path, fsdp)
    batch = next(_batches(1))
    for m in (model, reference):
        loss_sum, targets = m(**batch)
        (loss_sum / targets).backward()
    norm = clip_in_step(optimizer, max_norm)
    expected = full(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm or float("inf")))
    assert norm.item() == expected.item() and (norm.item() > 0.5 or max_norm != 0.5)  # 0.5 clips
    optimizer.step(), reference_optimizer.step()
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(full(param), full(expected), rtol=0, atol=1e-8, msg=name)
