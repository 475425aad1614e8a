"""Task evaluation during a run: the baseline (the model before any step) decoded in a thread beside the data's
tokenizing when the device has room (`start_baseline`), else at step 0 (`baseline_at_step_0`); the periodic ones
(`run_task_eval`), each on an unsharded copy of the model."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .. import config as config_lib
from .evaluate import kv_cache_bytes, rank_items, task_decode, task_evaluate, task_record
from .model import CausalLMWithLoss, gathered_copy
from .run import PendingTaskEval, Run, in_background, unsharded_copy

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def start_baseline(model: CausalLMWithLoss, tokenizer: PreTrainedTokenizerBase, items: list[dict],
                   cfg: config_lib.RunConfig, rank: int, world: int, device: torch.device,
                   bf16: bool) -> PendingTaskEval | None:
    """The task baseline (the model before any step) decoding in a thread on a plain copy of `model`, which is
    not sharded yet (no collective), when the device has room for it beside the work that goes on meanwhile
    (`room_to_decode_beside`); None without room (then `baseline_at_step_0` decodes it).

    Beside the data's tokenizing (host work) the decoding has the device to itself. Beside the first held-out
    evaluation, which compiles the forward, each slowed the other: 20 s together against 23 s one after the
    other; the compiler's kernel benchmarks wait for the device, which the decoding keeps busy. The thread makes no
    collective call, so the ranks' collectives stay in one order."""
    lm = gathered_copy(model, torch.bfloat16 if bf16 else torch.float32, device)
    if not room_to_decode_beside(device, lm, tokenizer, items, cfg.eval, rank, world):
        return None
    return PendingTaskEval(in_background(task_decode, lm, tokenizer, items, cfg.eval, rank, world, device),
                           background=True)


def baseline_at_step_0(run: Run) -> PendingTaskEval:
    """The task baseline's decoding: the one `build` began on this rank, or, when any rank had no room for it
    there, decoded now, on a copy of the model that every rank gathers (collective: all ranks take part in the
    gather if any rank needs it, so they stay in step)."""
    missing = torch.tensor(float(run.baseline is None), device=run.device)
    dist.all_reduce(missing, op=dist.ReduceOp.MAX)
    if not missing.item():
        return run.baseline
    with run.timeline.phase("task_eval"):
        lm = unsharded_copy(run)
        if run.baseline is not None:
            return run.baseline
        share = task_decode(lm, run.tokenizer, run.task_items, run.cfg.eval, run.rank, run.world, run.device)
    return PendingTaskEval(lambda: share, background=False)


def finish_task_eval(run: Run, step: int, pending: PendingTaskEval) -> None:
    """Waits for the decoding `pending` and logs the task evaluation at `step` (collective). A background
    decoding is charged to the `task_eval` phase only for the wait: the record's `seconds` is the decoding's own,
    `overlapped_s` the part of it that overlapped other phases."""
    with run.timeline.phase("task_eval"):
        start = time.perf_counter()
        share = pending.wait()
        result = task_record(share, run.cfg.eval, run.device, step)
    waited = time.perf_counter() - start
    overlapped = max(0.0, share.seconds - waited) if pending.background else 0.0
    log_task_eval(run, {**result, "seconds": share.seconds, "overlapped_s": overlapped})


def run_task_eval(run: Run, step: int, lm: PreTrainedModel | None = None) -> None:
    """Task evaluation at `step` on an unsharded copy of the model (`lm`, or gathered here)."""
    with run.timeline.phase("checkpoint"):
        run.checkpointer.wait_device_copy()  # the decoding's cache may need the room a save's copy holds
    with run.timeline.phase("task_eval"):
        start = time.perf_counter()
        lm = lm if lm is not None else unsharded_copy(run)
        result = task_evaluate(lm, run.tokenizer, run.task_items, run.cfg.eval, run.rank, run.world, run.device, step)
        result["seconds"] = time.perf_counter() - start
    log_task_eval(run, result)


def log_task_eval(run: Run, result: dict) -> None:
    run.task_results.append(result)
    run.log(result)


DECODE_HEADROOM = 0.25
"""Share of the device's memory kept free beside a background decoding's KV cache, for what runs meanwhile
(sharding the model, the first held-out forward: one micro-batch's activations, and the compiler's scratch)."""


def room_to_decode_beside(device: torch.device, lm: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                          items: list[dict], eval_cfg: config_lib.EvalConfig, rank: int, world: int) -> bool:
    """Whether this rank's task decoding by `lm` fits beside other work: on CPU always; on a GPU when twice its
    largest batch's KV cache (the cache and the prefill's passing activations) leaves `DECODE_HEADROOM` of the
    device free. (Tokenizing the prompts here, on every device before the thread starts, also leaves the
    tokenizer in the state both threads then use it in.)"""
    mine = rank_items(items, eval_cfg, rank, world)
    longest = max(len(ids) for ids in tokenizer([x["prompt"] for x in mine], add_special_tokens=False)["input_ids"])
    if device.type != "cuda":
        return True
    cache = kv_cache_bytes(lm.config, min(eval_cfg.task_batch_size, len(mine)), longest + eval_cfg.task_max_new_tokens,
                           lm.dtype)
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free - 2 * cache >= DECODE_HEADROOM * total
