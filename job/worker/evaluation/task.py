"""Task evaluation: greedy generation on held-out rows scored by exact match (`task_decode`, `task_record`), and the
loop's part that runs it (`TaskEvaluation`).

Each rank decodes its share of the prompts independently, on an unsharded copy of the model, in large left-padded
batches (`generate.greedy_generate`); only the final counts are summed.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from ...config import DataConfig, EvalConfig, RunConfig
from .. import data as data_lib
from ..checkpoint.writer import Checkpointer
from ..data import pad_id
from ..model.causal_lm import CausalLMWithLoss
from ..model.parallelize import gathered_copy
from ..parts import LoopState, Part, Worker, in_background
from .generate import decode_continuation, generated_lengths, greedy_generate, left_pad

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# --------------------------------------------------------------------------------------------------------------------
# Exact-match scoring
# --------------------------------------------------------------------------------------------------------------------

_NUMBER = re.compile(r"-?[$]?\d[\d,]*(?:\.\d+)?|-?[$]?\.\d+")


def normalize_number(text: str) -> str | None:
    """A number in canonical form (`1,000.50` → `1000.5`, `$7` → `7`, `3.0` → `3`), or None if not one."""
    text = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def gsm8k_reference(answer: str) -> str | None:
    """The final answer of a GSM8K reference solution: the number after `####`."""
    if "####" not in answer:
        return None
    tail = answer.rsplit("####", 1)[1].split()
    return normalize_number(tail[0]) if tail else None


def gsm8k_prediction(text: str) -> str | None:
    """The final answer of a generation: the first number after the last `####`, else the last number (a model
    that has not learned `####` still gets credit for a right number)."""
    if "####" in text:
        tail = _NUMBER.findall(text.rsplit("####", 1)[1])
        if tail:
            return normalize_number(tail[0])
    numbers = _NUMBER.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


TASKS = {"gsm8k": (gsm8k_reference, gsm8k_prediction)}
"""Task name → (reference final answer from a completion, predicted final answer from a generation)."""


def score(task: str, generated: str, reference: str) -> tuple[str | None, bool]:
    """(expected final answer, whether the generation's final answer equals it) for one item of `task`."""
    reference_of, prediction_of = TASKS[task]
    expected = reference_of(reference)
    return expected, expected is not None and prediction_of(generated) == expected


def task_items(examples: list[dict], data_cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> list[dict]:
    """`{question, prompt, reference}` for held-out examples, the prompt exactly as training renders it (for chat:
    up to the last assistant turn, with the generation prompt)."""
    items = []
    for x in examples:
        if "prompt" in x:
            items.append({"question": x["prompt"], "prompt": x["prompt"], "reference": x["completion"]})
        elif "messages" in x:
            msgs = x["messages"]
            last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
            prompt = data_lib.render_chat(msgs[:last], tokenizer, data_cfg.chat_template, generation_prompt=True)
            user = [m["content"] for m in msgs[:last] if m["role"] == "user"]
            items.append({"question": user[-1] if user else prompt, "prompt": prompt, "reference": msgs[last]["content"]})
    return items


@dataclass
class TaskShare:
    """One rank's share of a task evaluation, decoded and scored (`task_decode`); `task_record` sums the ranks'."""

    correct: int
    n: int
    examples: list[dict]
    """The first `eval.task_log_examples` of this rank's items: question, expected and generated answer."""
    lengths: list[int]
    """Tokens each generation took, up to and including its EOS."""
    decode_steps: int
    decodes: list[str]
    """Each distinct `Generated.decode` of its batches, in order: a failed capture in any batch shows."""
    seconds: float = 0.0


def task_evaluate(lm: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, items: list[dict], eval_cfg: EvalConfig,
                  rank: int, world: int, device: torch.device, step: int) -> dict:
    """`task_decode`, then `task_record` (collective): the `task_eval` metrics record."""
    return task_record(task_decode(lm, tokenizer, items, eval_cfg, rank, world, device), eval_cfg, device, step)


def rank_items(items: list[dict], eval_cfg: EvalConfig, rank: int, world: int) -> list[dict]:
    """Rank `rank`'s share of the first `eval.task_max_examples` items (all with 0), dealt out round-robin."""
    if eval_cfg.task_max_examples:
        items = items[: eval_cfg.task_max_examples]
    if not items:
        raise data_lib.DataError("eval.task: no held-out rows to evaluate on")
    return items[rank::world]


def kv_cache_bytes(config, batch: int, length: int, dtype: torch.dtype) -> int:
    """Bytes of a static KV cache of `batch` rows x `length` positions for the LM with `config`."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * batch * length * kv_heads * head_dim * dtype.itemsize


@torch.no_grad()
def task_decode(lm: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, items: list[dict], eval_cfg: EvalConfig,
                rank: int, world: int, device: torch.device,
                capture_allowed: threading.Event | None = None) -> TaskShare:
    """This rank's share of a task evaluation, decoded and scored; no collectives (it may run in a thread, then
    with `capture_allowed`: `greedy_generate`).

    The share is `rank_items`'s, decoded in batches of `eval.task_batch_size`.
    """
    start = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the current device is per thread
    mine = rank_items(items, eval_cfg, rank, world)
    share = TaskShare(correct=0, n=len(mine), examples=[], lengths=[], decode_steps=0, decodes=[])
    for first in range(0, len(mine), eval_cfg.task_batch_size):
        batch = mine[first : first + eval_cfg.task_batch_size]
        prompts = tokenizer([x["prompt"] for x in batch], add_special_tokens=False)["input_ids"]
        ids, mask = left_pad(prompts, pad_id(tokenizer))
        generated = greedy_generate(lm, ids.to(device), mask.to(device), eval_cfg.task_max_new_tokens,
                                    tokenizer.eos_token_id, pad_id(tokenizer), capture_allowed=capture_allowed)
        out = generated.ids
        if generated.decode not in share.decodes:
            share.decodes.append(generated.decode)
        share.decode_steps += out.shape[1] - ids.shape[1]
        share.lengths += generated_lengths(out[:, ids.shape[1]:], tokenizer.eos_token_id)
        for row, x in zip(out, batch):
            got = decode_continuation(tokenizer, row, ids.shape[1])
            expected, ok = score(eval_cfg.task, got, x["reference"])
            share.correct += ok
            if len(share.examples) < eval_cfg.task_log_examples:
                share.examples.append({"question": x["question"], "expected": expected, "got": got, "correct": bool(ok)})
    share.seconds = time.perf_counter() - start
    return share


def task_record(share: TaskShare, eval_cfg: EvalConfig, device: torch.device, step: int) -> dict:
    """The `task_eval` record of every rank's `share` (collective: counts summed); examples and lengths are this
    rank's."""
    totals = torch.tensor([share.correct, share.n], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    n = int(totals[1].item())
    return {"kind": "task_eval", "step": step, "task": eval_cfg.task, "exact_match": totals[0].item() / max(n, 1),
            "n": n, "examples": share.examples, "decode_steps": share.decode_steps,
            "new_tokens": length_quantiles(share.lengths), "decode": "; ".join(share.decodes)}


def length_quantiles(lengths: list[int]) -> dict:
    """p50, p90, p99 and max of this rank's generation lengths: how much decoding only the longest rows needed."""
    if not lengths:
        return {}
    ordered = sorted(lengths)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1]}


# --------------------------------------------------------------------------------------------------------------------
# The loop's part
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class PendingTaskEval:
    """A task decoding begun: in a thread (`background`; `wait` joins it) or already done."""

    wait: Callable[[], TaskShare]
    background: bool


DECODE_HEADROOM = 0.25
"""Share of the device's memory kept free beside a background decoding's KV cache, for what runs meanwhile
(sharding the model, the first held-out forward: one micro-batch's activations, and the compiler's scratch)."""


def room_to_decode_beside(device: torch.device, lm: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                          items: list[dict], eval_cfg: EvalConfig, rank: int, world: int) -> bool:
    """Whether this rank's decoding fits beside other work: on CPU always; on a GPU when twice its largest batch's
    KV cache (cache plus the prefill's activations) leaves `DECODE_HEADROOM` free. (Tokenizing here, before the
    thread starts, also leaves the tokenizer in the state both threads then use.)"""
    mine = rank_items(items, eval_cfg, rank, world)
    longest = max(len(ids) for ids in tokenizer([x["prompt"] for x in mine], add_special_tokens=False)["input_ids"])
    if device.type != "cuda":
        return True
    cache = kv_cache_bytes(lm.config, min(eval_cfg.task_batch_size, len(mine)), longest + eval_cfg.task_max_new_tokens,
                           lm.dtype)
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free - 2 * cache >= DECODE_HEADROOM * total


def start_baseline(model: CausalLMWithLoss, tokenizer: PreTrainedTokenizerBase, items: list[dict],
                   cfg: RunConfig, rank: int, world: int, device: torch.device,
                   bf16: bool) -> PendingTaskEval | None:
    """The task baseline (the model before any step) decoding in a thread on a plain copy of the not yet sharded
    `model` when the device has room (`room_to_decode_beside`); None without (then decoded at step 0).

    Beside the data's tokenizing (host work) it has the device to itself; beside the first held-out evaluation,
    which compiles, each slows the other (20 s together, 23 s apart): the compiler's benchmarks wait for the device.
    The thread makes no collective call, so the ranks' collectives stay in one order. Its decode steps stay eager
    until this thread waits for it: a CUDA graph's capture fails any device-wide synchronize made meanwhile, and
    the work beside it makes them (a DPO run's compiled reference pass died so)."""
    lm = gathered_copy(model, torch.bfloat16 if bf16 else torch.float32, device)
    if not room_to_decode_beside(device, lm, tokenizer, items, cfg.eval, rank, world):
        return None
    capture_allowed = threading.Event()
    decoded = in_background(task_decode, lm, tokenizer, items, cfg.eval, rank, world, device, capture_allowed)

    def wait() -> TaskShare:
        capture_allowed.set()
        return decoded()

    return PendingTaskEval(wait, background=True)


class TaskEvaluation(Part):
    """The task score (`eval.task`) on the held-out rows, each on an unsharded copy of the model: before a fresh
    run's first step (`eval.task_at_start`; `baseline` if begun beside the data), every `eval.task_every_steps`,
    and after the last step on the export's copy (`finish`). Results are kept in `LoopState.task_results`."""

    def __init__(self, worker: Worker, model: CausalLMWithLoss, checkpointer: Checkpointer,
                 tokenizer: PreTrainedTokenizerBase | None, items: list[dict], start_step: int,
                 baseline: PendingTaskEval | None):
        self.worker, self.model, self.checkpointer, self.tokenizer = worker, model, checkpointer, tokenizer
        self.items, self.start_step, self.baseline = items, start_step, baseline
        self.cfg = worker.cfg.eval

    def start(self, state: LoopState) -> None:
        if self.cfg.task and self.cfg.task_at_start and self.start_step == 0:
            self.finish_pending(state, 0, self.baseline_at_step_0())

    def due(self, state: LoopState) -> bool:
        every = self.cfg.task_every_steps
        return bool(self.cfg.task and every and state.step % every == 0
                    and state.step != self.worker.cfg.train.max_steps)

    def run(self, state: LoopState) -> None:
        self.evaluate(state, state.step)

    def finish(self, state: LoopState, copy: Callable[[], PreTrainedModel]) -> None:
        if self.cfg.task and self.start_step < self.worker.cfg.train.max_steps:  # a re-run of a finished run has it
            self.evaluate(state, self.worker.cfg.train.max_steps, copy())

    def copy(self) -> PreTrainedModel:
        worker = self.worker
        return gathered_copy(self.model, torch.bfloat16 if worker.bf16 else torch.float32, worker.device)

    def baseline_at_step_0(self) -> PendingTaskEval:
        """The baseline's decoding begun beside the data, or, when any rank had no room for it, one decoded now on
        a gathered copy (collective: all ranks gather if any needs it, so they stay in step)."""
        worker = self.worker
        missing = torch.tensor(float(self.baseline is None), device=worker.device)
        dist.all_reduce(missing, op=dist.ReduceOp.MAX)
        if not missing.item():
            return self.baseline
        with worker.timeline.phase("task_eval"):
            lm = self.copy()
            if self.baseline is not None:
                return self.baseline
            share = task_decode(lm, self.tokenizer, self.items, self.cfg, worker.rank, worker.world, worker.device)
        return PendingTaskEval(lambda: share, background=False)

    def finish_pending(self, state: LoopState, step: int, pending: PendingTaskEval) -> None:
        """Wait for `pending` and log the task evaluation at `step` (collective). A background decoding charges
        `task_eval` only the wait; the record's `seconds` is its own, `overlapped_s` the part beside other phases."""
        with self.worker.timeline.phase("task_eval"):
            start = time.perf_counter()
            share = pending.wait()
            result = task_record(share, self.cfg, self.worker.device, step)
        waited = time.perf_counter() - start
        overlapped = max(0.0, share.seconds - waited) if pending.background else 0.0
        self.log(state, {**result, "seconds": share.seconds, "overlapped_s": overlapped})

    def evaluate(self, state: LoopState, step: int, lm: PreTrainedModel | None = None) -> None:
        """Task evaluation at `step` on an unsharded copy of the model (`lm`, or gathered here)."""
        worker = self.worker
        with worker.timeline.phase("checkpoint"):
            self.checkpointer.wait_device_copy()  # the decoding's cache may need the room a save's copy holds
        with worker.timeline.phase("task_eval"):
            start = time.perf_counter()
            lm = lm if lm is not None else self.copy()
            result = task_evaluate(lm, self.tokenizer, self.items, self.cfg, worker.rank, worker.world,
                                   worker.device, step)
            result["seconds"] = time.perf_counter() - start
        self.log(state, result)

    def log(self, state: LoopState, result: dict) -> None:
        state.task_results.append(result)
        self.worker.log(result)
