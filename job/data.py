"""Data: sources → token stream with a loss mask → packed blocks → deterministic per-rank micro-batches.

Every format ends in the same representation, a `TokenStream`: all documents' tokens concatenated (each
document ends with EOS), a per-token loss mask (which tokens are worth predicting) and document starts.
Packing cuts the stream into blocks of `seq_len + 1` tokens with stride `seq_len`, so every token is a
prediction target exactly once, and `position_ids` restart at each document so attention (SDPA through
transformers' packed-sequence mask) does not cross documents.

Batches are drawn from a seeded permutation of blocks, sharded by rank (`rank::world_size`), so a run is
reproducible and resumable from a step number alone: `micro_batches(..., start_step=k)` yields exactly what
an uninterrupted run would have seen from step k on.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from typing import Iterator

import torch

from .config import DataConfig, TrainConfig

IGNORE_INDEX = -100
"""Label value that carries no loss (matches `torch.nn.functional.cross_entropy`'s default)."""

EOS = "<|endoftext|>"
"""End-of-document token of tokenizers trained by `train_bpe_tokenizer` (also their padding token)."""


class DataError(ValueError):
    """Bad data source or rows; the message names the source (and file:line where there is one)."""


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

    def select(self, index: torch.Tensor) -> "Blocks":
        return Blocks(self.input_ids[index], self.labels[index], self.position_ids[index])


# --------------------------------------------------------------------------------------------------------------------
# Sources and tokenization
# --------------------------------------------------------------------------------------------------------------------


def read_documents(source: str) -> tuple[list[str], dict]:
    """Plain-text documents of a source, and its fingerprint entry (what was read, with a content hash).

    A file is one document per blank-line-separated paragraph group of ~64 KiB (so packing sees document
    boundaries without splitting prose mid-sentence too often); a directory reads its `*.txt` files.
    """
    if source == "builtin:python-docs":
        from pydoc_data import topics

        docs = [topics.topics[key] for key in sorted(topics.topics)]
        origin = {"source": source, "python": sys.version.split()[0]}
    else:
        if not os.path.exists(source):
            raise DataError(f"data.train: source not found: {source}")
        files = (
            sorted(os.path.join(source, f) for f in os.listdir(source) if f.endswith(".txt"))
            if os.path.isdir(source)
            else [source]
        )
        if not files:
            raise DataError(f"data.train: no *.txt files in directory {source}")
        docs = []
        for path in files:
            with open(path, encoding="utf-8") as f:
                docs.extend(_split_paragraphs(f.read()))
        origin = {"source": source, "files": [os.path.basename(p) for p in files]}
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(doc.encode())
        digest.update(b"\0")
    return docs, {**origin, "documents": len(docs), "sha256": digest.hexdigest()}


def _split_paragraphs(text: str, target_chars: int = 65536) -> list[str]:
    docs, current, size = [], [], 0
    for para in text.split("\n\n"):
        current.append(para)
        size += len(para) + 2
        if size >= target_chars:
            docs.append("\n\n".join(current))
            current, size = [], 0
    if current:
        docs.append("\n\n".join(current))
    return [d for d in docs if d.strip()]


def train_bpe_tokenizer(documents: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on `documents` (deterministic), with `<|endoftext|>` as EOS and pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def tokenizer_from_json(text: str):
    """Rebuilds a `train_bpe_tokenizer` tokenizer from its JSON (`tokenizer.backend_tokenizer.to_str()`)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(text), eos_token=EOS, pad_token=EOS)


def tokenize_text(documents: list[str], tokenizer) -> TokenStream:
    """Language modelling: every token is a target; each document ends with EOS."""
    if tokenizer.eos_token_id is None:
        raise DataError("model.tokenizer: the tokenizer has no EOS token, needed to separate documents")
    ids = tokenizer(documents, add_special_tokens=False)["input_ids"]
    return _concat([(doc + [tokenizer.eos_token_id], None) for doc in ids])


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


# --------------------------------------------------------------------------------------------------------------------
# Packing and batching
# --------------------------------------------------------------------------------------------------------------------


def pack(stream: TokenStream, seq_len: int) -> Blocks:
    """Cuts the stream into blocks of `seq_len` inputs and their next-token labels.

    Block k covers stream[k*T : k*T + T + 1]: inputs are its first T tokens and labels its last T, so every
    token after the first is a label exactly once. A label is IGNORE_INDEX where the target token is not in the
    loss mask or starts a new document (nothing before it predicts it). Positions restart at each document
    start and at each block start. The incomplete tail (< T + 1 tokens) is dropped.
    """
    n_blocks = (len(stream.tokens) - 1) // seq_len
    if n_blocks < 1:
        raise DataError(f"data: {len(stream.tokens)} tokens are fewer than one block of train.seq_len={seq_len} + 1")
    index = torch.arange(n_blocks)[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
    tokens, target_ok, starts = stream.tokens[index], stream.loss_mask[index], stream.doc_start[index]
    labels = tokens[:, 1:].masked_fill(~target_ok[:, 1:] | starts[:, 1:], IGNORE_INDEX)
    # Position = distance to the latest document start within the block (block start counts as one).
    starts = starts[:, :-1].clone()
    starts[:, 0] = True
    steps = torch.arange(seq_len).expand(n_blocks, seq_len)
    last_start = torch.cummax(torch.where(starts, steps, torch.zeros_like(steps)), dim=1).values
    return Blocks(tokens[:, :-1].contiguous(), labels.contiguous(), steps - last_start)


def split_holdout(blocks: Blocks, fraction: float, seed: int) -> tuple[Blocks, Blocks | None]:
    """A seeded random `fraction` of blocks becomes the held-out split (at least one block when fraction > 0)."""
    if fraction == 0:
        return blocks, None
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed))
    n_val = max(1, int(len(blocks) * fraction))
    if n_val >= len(blocks):
        raise DataError(f"data.validation_fraction: {len(blocks)} blocks are too few to hold out {fraction:.0%}")
    return blocks.select(order[n_val:].sort().values), blocks.select(order[:n_val].sort().values)


def micro_batches(
    blocks: Blocks, batch_size: int, rank: int, world_size: int, seed: int, start: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless micro-batches for one rank, starting at this rank's `start`-th micro-batch.

    Each epoch is a fresh seeded permutation of all blocks; rank r takes positions r, r+W, r+2W, … so ranks
    never share a block, and every rank has the same number of batches per epoch (the remainder is dropped).
    """
    per_rank = len(blocks) // world_size // batch_size
    if per_rank == 0:
        raise DataError(
            f"data: {len(blocks)} blocks cannot give each of {world_size} workers one micro-batch of "
            f"{batch_size}; lower train.micro_batch_size or train.seq_len, or add data"
        )
    epoch, offset = divmod(start, per_rank)
    while True:
        order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        mine = order[rank::world_size][: per_rank * batch_size].view(per_rank, batch_size)
        for i in range(offset, per_rank):
            b = blocks.select(mine[i])
            yield {"input_ids": b.input_ids, "labels": b.labels, "position_ids": b.position_ids}
        epoch, offset = epoch + 1, 0


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
    """What the train loop needs from data: per-rank batch iterators, held-out blocks, and the fingerprint."""

    train: Blocks | None
    """Packed training blocks (None for synthetic data)."""
    validation: Blocks | None
    fingerprint: dict


def build(cfg: DataConfig, train_cfg: TrainConfig, tokenizer) -> Dataset:
    """Reads, tokenizes and packs the configured data (synthetic data has nothing to build)."""
    if cfg.format == "synthetic":
        return Dataset(None, None, {"format": "synthetic", "seed": train_cfg.seed})
    documents, origin = read_documents(cfg.train)
    stream = tokenize_text(documents, tokenizer)
    blocks = pack(stream, train_cfg.seq_len)
    train, validation = split_holdout(blocks, cfg.validation_fraction, train_cfg.seed)
    fingerprint = {
        "format": cfg.format,
        "train": origin,
        "tokens": int(stream.tokens.numel()),
        "train_blocks": len(train),
        "validation_blocks": len(validation) if validation is not None else 0,
        "seq_len": train_cfg.seq_len,
    }
    return Dataset(train, validation, fingerprint)
