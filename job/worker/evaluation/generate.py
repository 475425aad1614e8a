"""Greedy generation on a plain (unsharded) causal LM: for the task evaluation, the sample and the export's check;
sampled generation (`Sampling`) for the pairs a model makes itself (`worker/pairs.py`).

`greedy_generate` decodes what Transformers' `generate(do_sample=False, cache_implementation="static")` decodes,
token for token (tests/test_generate.py), without its per-step host work:
* a static KV cache written in place (the dynamic cache concatenates every layer's keys and values at every step:
  terabytes at a batch of hundreds);
* decode state in device tensors, so on a GPU a step is captured as a CUDA graph and replayed;
* whether every row has ended asked only every `CHECK_EVERY` steps, the output cut where `generate` would stop;
* ended rows dropped from the steps (`DROP_ENDED_BELOW`; half the rows: 0.68x the step's time, a 256-token
  GSM8K decode 17% shorter);
* grouped-query attention on the key/value heads as they are (`sdpa_grouped_decode`).
Other models (attention other than SDPA, sliding-window layers) go through `generate`, as `Generated.decode` says.
GSM8K's 1,319 test questions with Qwen2.5-Coder-1.5B on an H200: 10.7 s through `generate`, 9.0 s here, the same
generations; a step is then device-bound (docs/performance.md, "Where the time goes").
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..data import pad_id

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

CHECK_EVERY = 16
"""Decode steps between two looks at whether every row has ended (each look waits for the device)."""

DROP_ENDED_BELOW = 0.75
"""Ended rows leave the decode steps when those still going fall below this share of the rows decoded; each drop
copies the remaining cache rows and captures the step again."""

WARMUP_STEPS = 2
"""Decode steps run eagerly before the step is captured as a CUDA graph (kernels' first-call setup)."""

GROUPED_DECODE = "sdpa_grouped_decode"
"""The attention implementation generation runs with: SDPA, with decode steps on grouped key/value heads as is."""


@dataclass
class Generated:
    ids: torch.Tensor
    """Prompt and continuation ids, (batch, prompt width + new tokens); rows that ended are padded after EOS."""
    decode: str
    """How the decode steps ran: `cuda_graph`, `eager`, or `generate (<why>)` (Transformers' loop)."""


def sdpa_grouped_decode(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """SDPA whose one-token decode steps attend each key/value head's group of query heads to that head directly.

    Transformers' SDPA path (before 5.24) repeats each key/value head per query head when a mask is given (always,
    left-padded): with a static cache that rereads the whole cache `num_key_value_groups` times per layer per step
    (~0.3 TB a step for Qwen2.5-1.5B at a batch of 1,319). Here query head `h` becomes a query of key/value head
    `h // groups`, as in `repeat_kv`: the same attention. Prefill and training keep the stock function.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    batch, heads, _, dim = query.shape
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(batch, heads // groups, groups, dim), key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, 1, heads, dim), None


def use_grouped_decode(lm: PreTrainedModel) -> None:
    """Switches the plain `lm` from SDPA to `sdpa_grouped_decode` (registered with Transformers on first use)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(getattr(lm, "config", None), "_attn_implementation", None) != "sdpa":
        return
    AttentionInterface.register(GROUPED_DECODE, sdpa_grouped_decode)
    AttentionMaskInterface.register(GROUPED_DECODE, sdpa_mask)
    lm.set_attn_implementation(GROUPED_DECODE)


@dataclass
class Sampling:
    """Each token drawn from softmax(logits / `temperature`) within the nucleus of probability `top_p`, seeded."""

    temperature: float
    top_p: float
    seed: int

    def __call__(self, logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """One token per row: the largest probability / Exponential(1) noise is a draw (the exponential race) that
        needs no host sync, so a CUDA graph holds it."""
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1:
            ordered, order = probs.sort(dim=-1, descending=True)
            outside = ordered.cumsum(dim=-1) - ordered >= self.top_p  # the tokens after the nucleus is reached
            probs = probs.scatter(-1, order, ordered.masked_fill(outside, 0.0))
        noise = torch.empty_like(probs).exponential_(generator=generator)
        return (probs / noise).argmax(dim=-1)


@torch.no_grad()
def greedy_generate(lm: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                    eos_token_id: int | None, pad_token_id: int, cuda_graph: bool = True,
                    drop_ended_below: float = DROP_ENDED_BELOW, sampling: Sampling | None = None,
                    capture_allowed: threading.Event | None = None) -> Generated:
    """Greedy continuation of the left-padded `input_ids` by `lm`, at most `max_new_tokens` new tokens; with
    `sampling`, sampled instead.

    With `eos_token_id`, stops once every row has produced it (ended rows padded with `pad_token_id`); without,
    runs exactly `max_new_tokens` steps. On CUDA the step is a CUDA graph unless `cuda_graph` is False or the
    capture fails (`decode` says why). `drop_ended_below`: as `DROP_ENDED_BELOW` (0: never). `capture_allowed`:
    for a decoding in a thread beside other device work, whose steps stay eager until it is set: while a stream
    captures, any device-wide synchronize in the process fails (the compiler's benchmarks and the phases' clock
    make them), so the other thread sets it once it only waits.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
    use_grouped_decode(lm)
    if (why := unsupported(lm)) is not None:
        return Generated(hf_generate(lm, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id,
                                     sampling), f"generate ({why})")
    decoder = StaticDecoder(lm, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, drop_ended_below,
                            sampling)
    decode = decoder.run(cuda_graph and input_ids.device.type == "cuda", capture_allowed)
    return Generated(torch.cat([input_ids, decoder.new_tokens()], dim=1), decode)


def hf_generate(lm: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                eos_token_id: int | None, pad_token_id: int, sampling: Sampling | None = None) -> torch.Tensor:
    """Transformers' own loop with a static cache: greedy (what `greedy_generate` reproduces), or sampled."""
    if sampling is not None:
        torch.manual_seed(sampling.seed)
    how = (dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p) if sampling else
           dict(do_sample=False, temperature=None, top_p=None))
    return lm.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, top_k=None,
                       cache_implementation="static", disable_compile=True, eos_token_id=eos_token_id,
                       pad_token_id=pad_token_id, **how)


def unsupported(lm: PreTrainedModel) -> str | None:
    """Why `StaticDecoder` cannot run `lm` (it builds full-attention masks for SDPA itself), or None."""
    config = lm.config
    if config._attn_implementation not in ("sdpa", GROUPED_DECODE):
        return f"attention {config._attn_implementation}"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        return "sliding-window layers"
    if "logits_to_keep" not in inspect.signature(lm.forward).parameters:
        return f"{type(lm).__name__}.forward has no logits_to_keep"
    return None


class StaticDecoder:
    """One batch's greedy decoding: the prefill at construction, then `run` for the decode steps.

    All a step reads or writes is a device tensor updated in place, so it can be captured as a CUDA graph. Per
    step, as Transformers' loop: each row's argmax, the pad token once ended, ending at its first EOS. The rows
    decoded (`rows`: their batch rows) shrink as rows end (`drop_ended`); `new` keeps every row.
    """

    def __init__(self, lm: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 max_new_tokens: int, eos_token_id: int | None, pad_token_id: int,
                 drop_ended_below: float = DROP_ENDED_BELOW, sampling: Sampling | None = None):
        from transformers import StaticCache

        batch, width = input_ids.shape
        device = input_ids.device
        self.lm, self.eos, self.pad, self.max_new = lm, eos_token_id, pad_token_id, max_new_tokens
        self.drop_ended_below, self.sampling = drop_ended_below, sampling
        self.generator = torch.Generator(device).manual_seed(sampling.seed) if sampling else None
        # `past_key_values` was renamed `cache` in Transformers 5.24 (the old name still works there, with a warning).
        self.cache_arg = "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"
        self.cache = StaticCache(config=lm.config, max_cache_len=width + max_new_tokens)
        # Positions as `generate` makes them: counted over the real tokens, pads at 1.
        positions = attention_mask.long().cumsum(-1) - 1
        positions.masked_fill_(attention_mask == 0, 1)
        first = self.pick(self.forward(input_ids, attention_mask, positions))

        self.new = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
        self.new[:, 0] = first
        self.produced = 1
        self.token = first.clone()
        self.ended = first == eos_token_id if eos_token_id is not None else torch.zeros_like(first, dtype=torch.bool)
        self.rows = torch.arange(batch, device=device)
        self.position = positions[:, -1:] + 1
        self.slot = torch.tensor([width], device=device)  # the cache slot the next token is written to
        self.column = torch.tensor([1], device=device)  # its column in `new`
        # Which cache slots a row attends to once they are filled: its real prompt tokens and all new tokens.
        self.attendable = torch.cat([attention_mask.bool(), torch.ones_like(self.new, dtype=torch.bool)], dim=1)
        self.slots = torch.arange(width + max_new_tokens, device=device)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The last position's logits of `ids` appended to the cache."""
        out = self.lm(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                      **{self.cache_arg: self.cache})
        return out.logits[:, -1]

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's next token: the argmax, or a draw (`sampling`)."""
        return self.sampling(logits, self.generator) if self.sampling else logits.argmax(-1)

    def step(self) -> None:
        """One decode step, in place: feed `token`, write the next one to `new`."""
        mask = (self.attendable & (self.slots <= self.slot))[:, None, None, :]
        token = self.pick(self.forward(self.token[:, None], mask, self.position))
        if self.eos is not None:
            token = torch.where(self.ended, self.pad, token)
            self.ended.logical_or_(token == self.eos)
        self.new.view(-1).index_copy_(0, self.rows * self.max_new + self.column, token)
        self.token.copy_(token)
        self.position.add_(1)
        self.slot.add_(1)
        self.column.add_(1)

    def run(self, cuda_graph: bool, capture_allowed: threading.Event | None = None) -> str:
        """The decode steps, until every row has ended or `max_new_tokens` are out; returns how they ran. Graphs
        are captured only while `capture_allowed` (if given) is set (`greedy_generate`)."""
        graph, decode, eager_until = None, "eager", WARMUP_STEPS
        while self.produced < self.max_new:
            if self.eos is not None and self.produced % CHECK_EVERY == 0:
                going = int(self.rows.numel() - self.ended.sum())
                if going == 0:
                    break
                if going < self.drop_ended_below * self.rows.numel():
                    graph, eager_until = None, self.produced  # one eager step at the new batch size, then a capture
                    self.drop_ended()
            if (cuda_graph and graph is None and self.produced > eager_until
                    and (capture_allowed is None or capture_allowed.is_set())):
                graph, decode = self.capture()
                cuda_graph = graph is not None
            graph.replay() if graph is not None else self.step()
            self.produced += 1
        return decode

    def drop_ended(self) -> None:
        """Decode only the rows still going from now on (their state and cache rows copied; `new` already holds
        the ended rows' pads)."""
        going = (~self.ended).nonzero().squeeze(1)
        self.rows, self.token, self.ended = self.rows[going], self.token[going], self.ended[going]
        self.position, self.attendable = self.position[going], self.attendable[going]
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[going], layer.values[going]
            layer.batch_size = going.numel()

    def capture(self) -> tuple[torch.cuda.CUDAGraph | None, str]:
        """`step` captured as a CUDA graph (capturing runs nothing: the state stays as it was), or None and why not."""
        graph = torch.cuda.CUDAGraph()
        if self.generator is not None:
            graph.register_generator_state(self.generator)  # each replay draws anew, as the eager step would
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.step()
        except Exception as e:  # an operation that cannot be captured; the steps go on eagerly
            torch.cuda.synchronize()
            return None, f"eager (CUDA graph capture failed: {type(e).__name__}: {' '.join(str(e).split())[:200]})"
        return graph, "cuda_graph"

    def new_tokens(self) -> torch.Tensor:
        """The new tokens, cut where `generate` stops: after the step in which the last row produced EOS."""
        new = self.new[:, : self.produced]
        if self.eos is None or not bool(self.ended.all()):
            return new
        return new[:, : max(generated_lengths(new, self.eos))]


def generated_lengths(new: torch.Tensor, eos_token_id: int | None) -> list[int]:
    """Tokens each row generated up to and including its first EOS (all of them without one)."""
    if eos_token_id is None:
        return [new.shape[1]] * new.shape[0]
    ended = (new == eos_token_id).int()
    first = ended.argmax(dim=1) + 1
    return torch.where(ended.any(dim=1), first, new.shape[1]).tolist()


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


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded `input_ids` and `attention_mask` (generation continues every row from the same column)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids, mask
