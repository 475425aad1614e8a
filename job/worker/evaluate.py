"""Evaluation: held-out loss and perplexity, and task evaluation by greedy generation scored by exact match.

The held-out loss runs on every rank with FSDP2-sharded parameters, so every rank makes the same calls in the
same order: each gets the same number of micro-batches, ranks with fewer blocks filling in with weight-0
repeats, so the result is exact and no rank waits on a collective that another never starts.

Generation (task evaluation, the sample) runs on an unsharded copy of the model (`model.gathered_copy`) on
each rank independently: a rank decodes its share of the prompts in large left-padded batches
(`generate.greedy_generate`: static KV cache, CUDA-graph decode steps) and stops a batch as soon as every
sequence in it has produced EOS; only the final counts are summed.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import data as data_lib
from .data import pad_id
from .generate import generated_lengths, greedy_generate

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ..config import DataConfig, EvalConfig, RunConfig
    from .model import CausalLMWithLoss

# --------------------------------------------------------------------------------------------------------------------
# Held-out loss
# --------------------------------------------------------------------------------------------------------------------


def _rank_slots(n: int, rank: int, world: int) -> tuple[list[int], list[bool]]:
    """Rank `rank`'s item indices (rank, rank + world, …), padded to ceil(n / world) with weight-0 repeats."""
    per_rank = -(-n // world)
    index = [rank + k * world for k in range(per_rank)]
    return [i if i < n else 0 for i in index], [i < n for i in index]


def eval_batches(n_blocks: int, rank: int, world: int, micro_batch_size: int, max_batches: int):
    """Rank `rank`'s held-out micro-batches as (block indices, real?) pairs: ceil(n / world) blocks per rank, in
    the same number of full micro-batches on every rank (the last one filled up with weight-0 repeats, so every
    forward has the training's shape), capped by `max_batches` when > 0."""
    index, real = _rank_slots(n_blocks, rank, world)
    n_batches = math.ceil(len(index) / micro_batch_size)
    if max_batches:
        n_batches = min(n_batches, max_batches)
    fill = n_batches * micro_batch_size - len(index)
    index, real = index + [0] * max(fill, 0), real + [False] * max(fill, 0)
    starts = range(0, n_batches * micro_batch_size, micro_batch_size)
    return [(index[s : s + micro_batch_size], real[s : s + micro_batch_size]) for s in starts]


def heldout_batches(n_blocks: int, world: int, micro_batch_size: int, max_batches: int) -> list[list[int]]:
    """Every held-out block `evaluate` reads on `world` ranks (weight-0 repeats left out), as micro-batches: the
    export's acceptance check measures exactly the blocks of the final in-training evaluation."""
    batches = []
    for rank in range(world):
        for index, real in eval_batches(n_blocks, rank, world, micro_batch_size, max_batches):
            chunk = [j for j, ok in zip(index, real) if ok]
            if chunk:
                batches.append(chunk)
    return batches


def synthetic_heldout(vocab: int, n: int, seq_len: int, seed: int) -> data_lib.Blocks:
    """`n` seeded random blocks, disjoint in seed from the training stream, for runs without a held-out split."""
    g = torch.Generator().manual_seed(seed * 7919 + 104729)
    tokens = torch.randint(0, vocab, (n, seq_len + 1), generator=g)
    return data_lib.Blocks(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(),
                           torch.arange(seq_len).expand(n, seq_len).contiguous())


def evaluate(model: CausalLMWithLoss, blocks: data_lib.Blocks, cfg: RunConfig, rank: int, world: int,
             device: torch.device) -> float:
    """Mean held-out loss per target token over all ranks (`cfg` is the RunConfig).

    Each rank runs the same number of micro-batches: ceil(blocks / world) blocks each, the ranks that run out
    repeating a block with weight 0. `eval.max_batches` caps the micro-batches per rank.

    With `parallel.compile` the forward runs as a training forward does (train mode, autograd on, the results
    detached at once), so it is the graph the training step compiles: an evaluation compiles no graph of its own
    (an inference graph of Qwen2.5-1.5B took ~20 s to compile at step 0). That needs a model without dropout;
    one with dropout is evaluated in eval mode, under `no_grad`.
    """
    as_training = cfg.parallel.compile and not has_dropout(model)
    if not as_training:
        model.eval()
    totals = torch.zeros(2, device=device)
    with torch.set_grad_enabled(as_training):
        for index, real in eval_batches(len(blocks), rank, world, cfg.train.micro_batch_size, cfg.eval.max_batches):
            b = blocks.select(torch.tensor(index))
            labels = b.labels.clone()
            labels[~torch.tensor(real)] = data_lib.IGNORE_INDEX  # weight-0 repeats
            # Detached at once and never named: a batch's autograd graph (its activations) is gone before the next.
            totals += torch.stack([t.detach().float() for t in model(input_ids=b.input_ids.to(device),
                                                                     labels=labels.to(device),
                                                                     position_ids=b.position_ids.to(device))])
    model.train()
    dist.all_reduce(totals)
    return (totals[0] / totals[1].clamp(min=1)).item()


def has_dropout(model: CausalLMWithLoss) -> bool:
    """Whether the model drops anything out in train mode (a dropout module, or a dropout rate in its config)."""
    rates = [v for k, v in vars(model.lm.config).items() if k.endswith("dropout") and isinstance(v, (int, float))]
    rates += [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    return any(rate > 0 for rate in rates)


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
    """The final answer of a generated solution: the first number after the last `####`, else the last number
    in the text (models that have not learned the `####` convention still get credit for a right number)."""
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


def decode_continuation(tokenizer: PreTrainedTokenizerBase, output_row: torch.Tensor, prompt_len: int) -> str:
    """The generated text after the prompt, cut at the first EOS."""
    new = output_row[prompt_len:].tolist()
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id in new:
        new = new[: new.index(tokenizer.eos_token_id)]
    return tokenizer.decode(new, skip_special_tokens=True)


def generate_sample(lm: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt: str, n_tokens: int,
                    device: torch.device) -> str:
    """Greedy continuation of `prompt` by the unsharded `lm`."""
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
    out = greedy_generate(lm, ids, torch.ones_like(ids), n_tokens, tokenizer.eos_token_id, pad_id(tokenizer))
    return decode_continuation(tokenizer, out.ids[0], ids.shape[1])


# --------------------------------------------------------------------------------------------------------------------
# Task evaluation by generation
# --------------------------------------------------------------------------------------------------------------------


def task_items(examples: list[dict], data_cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> list[dict]:
    """`{question, prompt, reference}` for held-out examples: the prompt exactly as training renders it (the
    completion's prompt, or the conversation up to the last assistant turn with the generation prompt)."""
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


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded `input_ids` and `attention_mask` (generation continues every row from the same column)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids, mask


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
    """How each batch decoded (`Generated.decode`), once each, in order: a failed capture in any batch shows."""
    seconds: float = 0.0


def task_evaluate(lm: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, items: list[dict], eval_cfg: EvalConfig,
                  rank: int, world: int, device: torch.device, step: int) -> dict:
    """Greedy generation on held-out items by the unsharded `lm`, scored by exact match of the task's final
    answer: `task_decode`, then `task_record` (collective). Returns the `task_eval` metrics record."""
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
                rank: int, world: int, device: torch.device) -> TaskShare:
    """This rank's share of a task evaluation, decoded and scored; no collectives (it may run in a thread).

    The first `eval.task_max_examples` items are dealt out round-robin (rank r scores items r, r + world, ...),
    and each rank decodes its share on its own in batches of `eval.task_batch_size`.
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
                                    tokenizer.eos_token_id, pad_id(tokenizer))
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
    """The `task_eval` metrics record of every rank's `share` (collective: the counts are summed), the same on
    every rank; its examples and generation lengths are this rank's."""
    totals = torch.tensor([share.correct, share.n], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    n = int(totals[1].item())
    return {"kind": "task_eval", "step": step, "task": eval_cfg.task, "exact_match": totals[0].item() / max(n, 1),
            "n": n, "examples": share.examples, "decode_steps": share.decode_steps,
            "new_tokens": length_quantiles(share.lengths), "decode": "; ".join(share.decodes)}


def length_quantiles(lengths: list[int]) -> dict:
    """Median, 90th and 99th percentile and longest of this rank's generation lengths: how much of a batch's
    decoding only its longest rows needed."""
    if not lengths:
        return {}
    ordered = sorted(lengths)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1]}
