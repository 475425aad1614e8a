"""Data in the workers: examples (`common/sources.py`) → token stream with a loss mask (per format: `tokenize_*`)
→ blocks → per-rank micro-batches; `build` / `build_once` run it end to end.

Packing cuts the stream into blocks of `seq_len + 1` tokens with stride `seq_len`, so every token is an input
exactly once, and `position_ids` restart at each document so attention (SDPA/flash through transformers'
packed-sequence detection) does not cross documents. Unpacked, each document is its own padded row. Batches come
from a seeded permutation of blocks sharded by rank, so a run is reproducible and resumable from a step number
alone: `micro_batches(..., start=k)` yields what an uninterrupted run would have from micro-batch k on.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.distributed as dist

from .. import storage
from ..common.sources import DataError, read_examples, read_task_examples
from ..config import DataConfig, TrainConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100
"""Label value that carries no loss (matches `torch.nn.functional.cross_entropy`'s default)."""


@dataclass
class TokenStream:
    tokens: torch.Tensor
    """All documents' token ids, concatenated; each document ends with EOS (int64, [n])."""
    loss_mask: torch.Tensor
    """True where the token is a prediction target (bool, [n])."""
    doc_start: torch.Tensor
    """True at the first token of each document (bool, [n])."""


@dataclass
class Blocks:
    """Packed training examples: `input_ids`, `labels` (next token, or IGNORE_INDEX) and `position_ids`."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor) -> Blocks:
        return Blocks(self.input_ids[index], self.labels[index], self.position_ids[index])

    def batch(self) -> dict[str, torch.Tensor]:
        """The micro-batch these blocks make (the model's inputs)."""
        return {"input_ids": self.input_ids, "labels": self.labels, "position_ids": self.position_ids}


@dataclass
class PairBlocks(Blocks):
    """Rows of whole preference pairs (`pack_pairs`): each label also says which completion it belongs to."""

    sequence: torch.Tensor
    """Per label: its completion, `2·pair + 0` (chosen) or `+ 1` (rejected), pairs numbered in data order; -1 for
    none."""
    reference: torch.Tensor | None = None
    """The reference policy's log-probability of each completion, by the same number (`evaluation.preference`)."""

    def select(self, index: torch.Tensor) -> PairBlocks:
        return PairBlocks(self.input_ids[index], self.labels[index], self.position_ids[index], self.sequence[index],
                          self.reference)

    def batch(self) -> dict[str, torch.Tensor]:
        """Also `completion` (the labels' completions renumbered: 2·i, 2·i + 1 for the batch's i-th pair), `pairs`
        (their numbers in data order) and `reference` (their log-probabilities), on the host: the loss needs no sync."""
        used = self.sequence >= 0
        pairs, inverse = torch.unique(self.sequence[used] // 2, return_inverse=True)
        completion = torch.full_like(self.sequence, -1)
        completion[used] = 2 * inverse + self.sequence[used] % 2
        out = {**super().batch(), "completion": completion, "pairs": pairs}
        if self.reference is not None:
            out["reference"] = self.reference[completions_of(pairs)]
        return out


def completions_of(pairs: torch.Tensor) -> torch.Tensor:
    """The completions' numbers of `pairs`, chosen then rejected for each (`PairBlocks.sequence`)."""
    return torch.stack([2 * pairs, 2 * pairs + 1], dim=1).flatten()


# --------------------------------------------------------------------------------------------------------------------
# Tokenizers and tokenization
# --------------------------------------------------------------------------------------------------------------------

def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None) -> dict:
    """Name and sha256 of the tokenizer's full JSON (the record's `tokenizer_sha256`), and of the chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(_sorted_vocabulary(tokenizer))
    out = {"name": tokenizer.name_or_path or f"trained byte-level BPE ({len(tokenizer)} tokens)",
           "vocab_size": len(tokenizer), "sha256": _sha256(text)}
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        out["chat_template_sha256"] = _sha256(str(template))
    return out


def vocabulary_sha256(tokenizer: PreTrainedTokenizerBase | None) -> str | None:
    """sha256 of the vocabulary and EOS/padding ids: what a tokenizer keeps through save and reload (its JSON may
    change, so the export's check does not use `tokenizer_fingerprint`)."""
    if tokenizer is None:
        return None
    return _sha256(json.dumps([_sorted_vocabulary(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id]))


def _sorted_vocabulary(tokenizer: PreTrainedTokenizerBase) -> list[tuple[str, int]]:
    return sorted(tokenizer.get_vocab().items())


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _eos(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.eos_token_id is None:
        raise DataError("model.tokenizer: the tokenizer has no EOS token, needed to separate documents")
    return tokenizer.eos_token_id


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The padding id (never a target, so any will do): pad token, else EOS, else 0."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


def tokenize_text(documents: list[str], tokenizer: PreTrainedTokenizerBase) -> TokenStream:
    """Language modelling: every token is a target; each document ends with EOS."""
    eos = _eos(tokenizer)
    ids = tokenizer(documents, add_special_tokens=False)["input_ids"]
    return _concat([(doc + [eos], None) for doc in ids])


def tokenize_prompt_completion(examples: list[dict], tokenizer: PreTrainedTokenizerBase) -> TokenStream:
    """Prompt and completion tokenized apart (the boundary exact, as at generation); targets: completion and EOS."""
    eos = _eos(tokenizer)
    prompts = tokenizer([x["prompt"] for x in examples], add_special_tokens=False)["input_ids"]
    completions = tokenizer([x["completion"] for x in examples], add_special_tokens=False)["input_ids"]
    return _concat([(p + c + [eos], [False] * len(p) + [True] * (len(c) + 1)) for p, c in zip(prompts, completions)])


def render_chat(messages: list[dict], tokenizer: PreTrainedTokenizerBase, template: str | None, generation_prompt: bool = False) -> str:
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise DataError("data.chat_template: the tokenizer has no chat template; set data.chat_template")
    return tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
    )


def chat_ids_and_mask(messages: list[dict], tokenizer: PreTrainedTokenizerBase, template: str | None) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and the mask of assistant-turn tokens.

    Turn i spans the characters from messages[:i] rendered with the generation prompt to messages[:i+1] rendered
    (content and end-of-turn markup); a token starting inside is a target. Needs a template that renders prefixes
    as prefixes.
    """
    full = render_chat(messages, tokenizer, template)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render_chat(messages[:i], tokenizer, template, generation_prompt=True) if i else ""
        upto = render_chat(messages[: i + 1], tokenizer, template)
        if not (full.startswith(before) and full.startswith(upto)):
            raise DataError("data.chat_template: rendering a conversation prefix does not give a prefix of the "
                            "whole rendering, so assistant turns cannot be located")
        spans.append((len(before), len(upto)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
    return enc["input_ids"], mask


def tokenize_chat(examples: list[dict], tokenizer: PreTrainedTokenizerBase, template: str | None) -> TokenStream:
    """Chat: only assistant turns are targets (and the EOS that ends the document, after an assistant turn)."""
    eos = _eos(tokenizer)
    docs = []
    for x in examples:
        ids, mask = chat_ids_and_mask(x["messages"], tokenizer, template)
        docs.append((ids + [eos], mask + [x["messages"][-1]["role"] == "assistant"]))
    return _concat(docs)


def tokenize_preference(examples: list[dict], tokenizer: PreTrainedTokenizerBase,
                        template: str | None) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt, chosen + EOS, rejected + EOS) ids per pair, tokenized apart; a conversational pair rendered first:
    the prompt with the generation prompt, a completion as what the whole conversation's rendering adds."""
    eos = _eos(tokenizer)
    texts = []
    for x in examples:
        if isinstance(x["prompt"], str):
            texts.append((x["prompt"], x["chosen"], x["rejected"]))
            continue
        prompt = render_chat(x["prompt"], tokenizer, template, generation_prompt=True)
        whole = [render_chat(x["prompt"] + x[key], tokenizer, template) for key in ("chosen", "rejected")]
        if not all(w.startswith(prompt) for w in whole):
            raise DataError("data.chat_template: the prompt rendered with the generation prompt is not a prefix of "
                            "the prompt and completion rendered, so the completion cannot be located")
        texts.append((prompt, *(w[len(prompt):] for w in whole)))
    ids = [tokenizer([t[i] for t in texts], add_special_tokens=False)["input_ids"] for i in range(3)]
    return [(p, c + [eos], r + [eos]) for p, c, r in zip(*ids)]


def tokenize(examples: list[dict], cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> TokenStream:
    if cfg.format == "text":
        return tokenize_text([x["text"] for x in examples], tokenizer)
    if cfg.format == "prompt_completion":
        return tokenize_prompt_completion(examples, tokenizer)
    return tokenize_chat(examples, tokenizer, cfg.chat_template)


def _concat(docs: list[tuple[list[int], list[bool] | None]]) -> TokenStream:
    """Joins (token ids, loss mask or None = all) documents into one stream."""
    tokens, mask, start = [], [], []
    for ids, doc_mask in docs:
        tokens.extend(ids)
        mask.extend(doc_mask if doc_mask is not None else [True] * len(ids))
        start.extend([True] + [False] * (len(ids) - 1))
    return TokenStream(
        torch.tensor(tokens, dtype=torch.long), torch.tensor(mask, dtype=torch.bool), torch.tensor(start, dtype=torch.bool)
    )


def pack(stream: TokenStream, seq_len: int, pad_id: int = 0) -> Blocks:
    """Cut the stream into blocks of `seq_len` inputs and their next-token labels.

    Block k covers stream[k*T : k*T + T + 1]: inputs its first T tokens, labels its last T, so each token is an
    input once and a label once. A label is IGNORE_INDEX outside the loss mask or at a document start (nothing
    before predicts it). Positions restart at each document and block start. The last block is padded with
    `pad_id` (no loss), not dropped.
    """
    n = len(stream.tokens)
    if n < 2:
        raise DataError(f"data: {n} tokens are too few to train on")
    n_blocks = -(-(n - 1) // seq_len)
    pad = n_blocks * seq_len + 1 - n
    tokens = torch.cat([stream.tokens, torch.full((pad,), pad_id, dtype=torch.long)])
    ok = torch.cat([stream.loss_mask, torch.zeros(pad, dtype=torch.bool)])
    starts = torch.cat([stream.doc_start, torch.zeros(pad, dtype=torch.bool)])
    index = torch.arange(n_blocks)[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
    tokens, target_ok, starts = tokens[index], ok[index], starts[index]
    labels = tokens[:, 1:].masked_fill(~target_ok[:, 1:] | starts[:, 1:], IGNORE_INDEX)
    return Blocks(tokens[:, :-1].contiguous(), labels.contiguous(), _positions(starts))


def _positions(starts: torch.Tensor) -> torch.Tensor:
    """Position ids of blocks of `seq_len + 1` tokens with document starts `starts`: the distance of each input to
    the latest document start within its block (the block's start counts as one)."""
    starts = starts[:, :-1].clone()
    starts[:, 0] = True
    steps = torch.arange(starts.shape[1]).expand(starts.shape)
    return steps - torch.cummax(torch.where(starts, steps, torch.zeros_like(steps)), dim=1).values


def pack_pairs(pairs: list[tuple[list[int], list[int], list[int]]], seq_len: int, packing: bool,
               pad_id: int = 0) -> tuple[PairBlocks, int]:
    """Each pair's two documents (prompt + chosen, prompt + rejected) in one row of `seq_len + 1` tokens, as `pack`'s
    blocks; with `packing` pairs follow one another while they fit. A pair longer than a row has each document cut
    to half a row (the completion's end, then the prompt's start); returns the rows and how many pairs were cut."""
    budget, half = seq_len + 1, (seq_len + 1) // 2
    rows: list[list[tuple[list[int], int, int]]] = []  # per row: (document ids, prompt length, completion number)
    used, truncated = budget, 0
    for number, (prompt, *completions) in enumerate(pairs):
        docs = [(prompt + c, len(prompt), 2 * number + k) for k, c in enumerate(completions)]
        if sum(len(d) for d, _, _ in docs) > budget:
            truncated += 1
            docs = []
            for k, c in enumerate(completions):
                c = c[: max(half - len(prompt), min(len(c), half // 2))]
                p = prompt[max(0, len(prompt) + len(c) - half):]
                docs.append((p + c, len(p), 2 * number + k))
        length = sum(len(d) for d, _, _ in docs)
        if not packing or used + length > budget:
            rows.append([])
            used = 0
        rows[-1] += docs
        used += length
    tokens = torch.full((len(rows), budget), pad_id, dtype=torch.long)
    sequence = torch.full((len(rows), budget), -1, dtype=torch.long)
    starts = torch.zeros((len(rows), budget), dtype=torch.bool)
    for r, docs in enumerate(rows):
        at = 0
        for ids, prompt_len, number in docs:
            tokens[r, at : at + len(ids)] = torch.tensor(ids)
            sequence[r, at + max(prompt_len, 1) : at + len(ids)] = number  # a document's first token has no input
            starts[r, at] = True
            at += len(ids)
    labels = tokens[:, 1:].masked_fill(sequence[:, 1:] < 0, IGNORE_INDEX)
    return PairBlocks(tokens[:, :-1].contiguous(), labels.contiguous(), _positions(starts),
                      sequence[:, 1:].contiguous()), truncated


def pad_documents(stream: TokenStream, seq_len: int, pad_id: int = 0) -> tuple[Blocks, int]:
    """Unpacked: one row per document, truncated to `seq_len + 1` tokens and right-padded (no loss); returns the
    rows and how many were truncated."""
    starts = torch.nonzero(stream.doc_start).flatten().tolist() + [len(stream.tokens)]
    rows, truncated = [], 0
    for a, b in zip(starts, starts[1:]):
        if b - a < 2:
            continue
        truncated += b - a > seq_len + 1
        b = min(b, a + seq_len + 1)
        ids = torch.full((seq_len + 1,), pad_id, dtype=torch.long)
        ok = torch.zeros(seq_len + 1, dtype=torch.bool)
        ids[: b - a], ok[: b - a] = stream.tokens[a:b], stream.loss_mask[a:b]
        rows.append((ids, ok))
    if not rows:
        raise DataError("data: no document has two or more tokens")
    ids = torch.stack([r[0] for r in rows])
    ok = torch.stack([r[1] for r in rows])
    labels = ids[:, 1:].masked_fill(~ok[:, 1:], IGNORE_INDEX)
    positions = torch.arange(seq_len).expand(len(rows), seq_len).contiguous()
    return Blocks(ids[:, :-1].contiguous(), labels.contiguous(), positions), truncated


def micro_batches(
    blocks: Blocks, batch_size: int, rank: int, world_size: int, seed: int, start: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless micro-batches for one rank, starting at this rank's `start`-th micro-batch.

    Each epoch is a seeded permutation of all blocks; rank r takes positions r, r+W, …, so ranks share no block
    and have as many batches (the remainder dropped).
    """
    per_rank = _per_rank(len(blocks), batch_size, world_size)
    epoch, offset = divmod(start, per_rank)
    while True:
        mine = _rank_rows(len(blocks), batch_size, rank, world_size, seed, epoch)
        for i in range(offset, per_rank):
            yield blocks.select(mine[i]).batch()
        epoch, offset = epoch + 1, 0


def _per_rank(n_blocks: int, batch_size: int, world_size: int) -> int:
    per_rank = n_blocks // world_size // batch_size
    if per_rank == 0:
        raise DataError(
            f"data: {n_blocks} blocks cannot give each of {world_size} workers one micro-batch of "
            f"{batch_size}; lower train.micro_batch_size or train.seq_len, or add data"
        )
    return per_rank


def _rank_rows(n_blocks: int, batch_size: int, rank: int, world_size: int, seed: int, epoch: int) -> torch.Tensor:
    """The blocks of rank `rank`'s micro-batches in `epoch`, [micro-batches, batch_size]."""
    per_rank = _per_rank(n_blocks, batch_size, world_size)
    order = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    return order[rank::world_size][: per_rank * batch_size].view(per_rank, batch_size)


def blocks_trained(n_blocks: int, batch_size: int, world_size: int, seed: int, n_micro: int) -> torch.Tensor:
    """Every block the first `n_micro` micro-batches of each rank hold (`micro_batches`' order), sorted."""
    per_rank, used = _per_rank(n_blocks, batch_size, world_size), []
    for epoch in range(-(-n_micro // per_rank)):
        take = min(per_rank, n_micro - epoch * per_rank)
        used += [_rank_rows(n_blocks, batch_size, r, world_size, seed, epoch)[:take].flatten() for r in range(world_size)]
    return torch.unique(torch.cat(used))


def synthetic_batches(
    vocab_size: int, batch_size: int, seq_len: int, rank: int, seed: int, start: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless uniform random tokens, distinct per rank and micro-batch index, reproducible from the index."""
    index = start
    while True:
        g = torch.Generator().manual_seed(hash((seed, rank, index)) & 0x7FFFFFFF)
        tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=g)
        yield {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": None}
        index += 1


@dataclass
class Dataset:
    """What the train loop needs from data: packed blocks, held-out blocks and rows, and the fingerprint."""

    train: Blocks | None
    """Packed training blocks (None for synthetic data)."""
    validation: Blocks | None
    """Held-out blocks for the held-out loss (None without a held-out split)."""
    fingerprint: dict
    """What was read: sources with file hashes or hub revisions, row counts, tokenizer name and hash, sizes."""
    validation_examples: list[dict] = field(default_factory=list)
    """The task evaluation's examples: `data.task_source`'s, else the held-out ones."""


DATA_CACHE = "data_cache"
"""`<run>/data_cache/<key>.pt`: the run's tokenized and packed data, built once per run (see `build_once`)."""


def build_once(cfg: DataConfig, train_cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase | None,
               run_dir: str, on_heldout_rows: Callable[[list[dict]], None] | None = None) -> tuple[Dataset, str]:
    """`build`, once per run rather than per worker and attempt: rank 0 builds and writes it to the run's storage,
    the other ranks and later attempts read it. Collective. Returns the dataset and `"built"` or `"read"`.
    `on_heldout_rows` gets the held-out examples as soon as this rank has them (before tokenizing, so that the
    task baseline's decoding overlaps it).

    Keyed by the data config, `seq_len`, seed and tokenizer hash: a run keeps training on the data it first read,
    even if a source changed since; delete `<run>/data_cache/` to re-read the sources.
    """
    if cfg.format == "synthetic":
        return build(cfg, train_cfg, tokenizer), "built"
    uri = storage.join(run_dir, DATA_CACHE, f"{data_key(cfg, train_cfg, tokenizer)}.pt")
    collective = dist.is_initialized() and dist.get_world_size() > 1
    how = "read"
    if not storage.exists(uri) and (not collective or dist.get_rank() == 0):
        dataset, how = build(cfg, train_cfg, tokenizer, on_heldout_rows), "built"
        blob = io.BytesIO()
        torch.save({"train": _blocks_dict(dataset.train), "validation": _blocks_dict(dataset.validation),
                    "fingerprint": dataset.fingerprint, "validation_examples": dataset.validation_examples}, blob)
        storage.write_atomic(uri, blob.getvalue())
    if collective:
        dist.barrier()  # rank 0 has written the file (a build error on rank 0 ends the attempt on every rank)
    if how == "read":
        saved = torch.load(io.BytesIO(storage.read_bytes(uri)), weights_only=True)
        dataset = Dataset(_blocks(saved["train"]), _blocks(saved["validation"]), saved["fingerprint"],
                          saved["validation_examples"])
        if on_heldout_rows is not None:
            on_heldout_rows(dataset.validation_examples)
    return dataset, how


def data_key(cfg: DataConfig, train_cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase) -> str:
    """What the tokenized data depends on, hashed: the data config, `seq_len`, seed and tokenizer."""
    return storage.json_sha256({
        "data": asdict(cfg), "seq_len": train_cfg.seq_len, "seed": train_cfg.seed,
        "tokenizer": tokenizer_fingerprint(tokenizer, cfg.chat_template)["sha256"],
    })[:16]


def _blocks_dict(blocks: Blocks | None) -> dict | None:
    return None if blocks is None else {k: v for k, v in vars(blocks).items() if v is not None}


def _blocks(saved: dict | None) -> Blocks | None:
    return None if saved is None else (PairBlocks if "sequence" in saved else Blocks)(**saved)


def build(cfg: DataConfig, train_cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase | None,
          on_heldout_rows: Callable[[list[dict]], None] | None = None) -> Dataset:
    """Read, tokenize and pack the configured data; `on_heldout_rows` as in `build_once`."""
    if cfg.format == "synthetic":
        return Dataset(None, None, {"format": "synthetic", "seed": train_cfg.seed})
    train_ex, val_ex, val_info = read_examples(cfg, train_cfg.seed)
    task_ex = read_task_examples(cfg)
    task_items = task_ex.items if task_ex is not None else val_ex.items if val_ex is not None else []
    if on_heldout_rows is not None:
        on_heldout_rows(task_items)
    padding = pad_id(tokenizer)
    fingerprint = {
        "format": cfg.format,
        "train": train_ex.info,
        "validation": val_info,
        "tokenizer": tokenizer_fingerprint(tokenizer, cfg.chat_template),
        "seq_len": train_cfg.seq_len,
        "packing": cfg.packing,
        **({"task_source": task_ex.info} if task_ex is not None else {}),
    }
    out = []
    for name, ex in (("train", train_ex), ("validation", val_ex)):
        if ex is None:
            out.append(None)
            continue
        if cfg.format == "preference":
            pairs = tokenize_preference(ex.items, tokenizer, cfg.chat_template)
            blocks, truncated = pack_pairs(pairs, train_cfg.seq_len, cfg.packing, padding)
            fingerprint[f"{name}_pairs"], fingerprint[f"{name}_truncated_pairs"] = len(pairs), truncated
            fingerprint[f"{name}_tokens"] = sum(2 * len(p) + len(c) + len(r) for p, c, r in pairs)
        else:
            stream = tokenize(ex.items, cfg, tokenizer)
            if cfg.packing:
                blocks = pack(stream, train_cfg.seq_len, padding)
            else:
                blocks, truncated = pad_documents(stream, train_cfg.seq_len, padding)
                fingerprint[f"{name}_truncated_documents"] = truncated
            fingerprint[f"{name}_tokens"] = int(stream.tokens.numel())
        fingerprint[f"{name}_target_tokens"] = int((blocks.labels != IGNORE_INDEX).sum())
        fingerprint[f"{name}_blocks"] = len(blocks)
        out.append(blocks)
    return Dataset(out[0], out[1], fingerprint, task_items)
