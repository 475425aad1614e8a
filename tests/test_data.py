"""Packing and batching: every token a target once, document-aware positions, deterministic rank shards."""

import sys

import pytest
import torch

from job.common import sources
from job.worker import data as data_lib
from job.worker.data import IGNORE_INDEX, TokenStream


def stream(docs, masks=None):
    return data_lib._concat([(d, m) for d, m in zip(docs, masks or [None] * len(docs))])


def test_pack_reproduces_every_token_once_and_resets_positions():
    docs = [[1, 2, 3, 99], [4, 5, 99], [6, 7, 8, 9, 10, 99], [11, 99]]
    s = stream(docs)
    blocks = data_lib.pack(s, seq_len=4)
    flat = s.tokens.tolist()
    n = len(blocks)
    assert n == -(-(len(flat) - 1) // 4)  # the last, partial block is padded (with 0), not dropped
    # Inputs tile the stream without overlap; labels are the inputs shifted by one.
    assert blocks.input_ids.flatten().tolist() == flat + [0] * (n * 4 - len(flat))
    raw_targets = flat[1:]
    labels = blocks.labels.flatten().tolist()
    assert labels[len(raw_targets):] == [IGNORE_INDEX] * (n * 4 - len(raw_targets))
    starts = s.doc_start.tolist()
    for i, (label, target) in enumerate(zip(labels, raw_targets)):
        # A document's first token is never a target (nothing before it in the document predicts it).
        assert label == (IGNORE_INDEX if starts[i + 1] else target)
    # Positions restart at document starts and block starts.
    assert blocks.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 2, 3], [0, 0, 1, 2]]


def test_loss_mask_hides_non_target_tokens():
    s = stream([[1, 2, 3, 4, 99]], [[False, False, True, True, True]])
    blocks = data_lib.pack(s, seq_len=4)
    assert blocks.labels.tolist() == [[IGNORE_INDEX, 3, 4, 99]]


def test_rank_shards_are_disjoint_and_resumable():
    s = TokenStream(torch.arange(401), torch.ones(401, dtype=torch.bool), torch.zeros(401, dtype=torch.bool))
    blocks = data_lib.pack(s, seq_len=4)  # 100 blocks
    firsts = {}
    for rank in range(2):
        it = data_lib.micro_batches(blocks, batch_size=5, rank=rank, world_size=2, seed=0)
        epoch = [next(it)["input_ids"][:, 0].tolist() for _ in range(10)]  # 10 batches of 5 = one epoch per rank
        firsts[rank] = [x for batch in epoch for x in batch]
        # Resuming at micro-batch k yields what the uninterrupted iterator yields from k on (across epochs too).
        full = data_lib.micro_batches(blocks, 5, rank, 2, seed=0)
        expected = [next(full)["input_ids"] for _ in range(27)][13:]
        resumed = data_lib.micro_batches(blocks, 5, rank, 2, seed=0, start=13)
        assert all(torch.equal(next(resumed)["input_ids"], e) for e in expected)
    assert not set(firsts[0]) & set(firsts[1])
    assert len(set(firsts[0]) | set(firsts[1])) == 100


def test_synthetic_batches_differ_by_rank_and_repeat_by_index():
    a = data_lib.synthetic_batches(1000, 2, 8, rank=0, seed=1)
    b = data_lib.synthetic_batches(1000, 2, 8, rank=1, seed=1)
    first_a, first_b = next(a), next(b)
    assert not torch.equal(first_a["input_ids"], first_b["input_ids"])
    assert torch.equal(first_a["labels"][:, :-1], first_a["input_ids"][:, 1:])
    again = data_lib.synthetic_batches(1000, 2, 8, rank=0, seed=1, start=1)
    next(a)
    assert torch.equal(next(a)["input_ids"], next(data_lib.synthetic_batches(1000, 2, 8, rank=0, seed=1, start=2))["input_ids"])
    assert not torch.equal(next(again)["input_ids"], first_a["input_ids"])


def test_builtin_corpus_and_missing_source():
    from job.config import SourceConfig

    # The corpus is the running Python's pydoc_data, so its size varies by version: only its order of magnitude
    # and its fingerprint are fixed.
    rows = sources.load_source(SourceConfig("builtin:python-docs"), "data.train")
    assert sum(len(text) for _, text in rows.rows) > 300_000 and len(rows.info["sha256"]) == 64
    assert rows.info["python"] == sys.version.split()[0]
    with pytest.raises(sources.DataError, match="^data.train: source not found: /nonexistent/corpus.txt$"):
        sources.load_source(SourceConfig("/nonexistent/corpus.txt"), "data.train")


@pytest.mark.parametrize("pad, eos, expected", [(7, 3, 7), (None, 3, 3), (None, None, 0), (0, 3, 0)])
def test_padding_id_is_the_pad_token_else_eos_else_zero(pad, eos, expected):
    from types import SimpleNamespace

    assert data_lib.pad_id(SimpleNamespace(pad_token_id=pad, eos_token_id=eos)) == expected
