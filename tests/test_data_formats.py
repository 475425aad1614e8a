"""Data formats, loss masks, packing, sources, bad rows and fail-fast errors (no Ray, no model training)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from job import config as config_lib
from job.common import sources
from job.worker import data as data_lib

REPO = Path(__file__).resolve().parents[1]
SHARED = next((p for p in (REPO.parent / "shared" / "data", REPO.parent.parent / "shared" / "data") if p.exists()), None)
GSM8K = SHARED / "gsm8k" if SHARED else None
needs_gsm8k = pytest.mark.skipif(GSM8K is None, reason="shared GSM8K data not found")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def gsm8k_rows(n=40, split="train"):
    with open(GSM8K / f"{split}.jsonl") as f:
        return [json.loads(next(f)) for _ in range(n)]


def data_cfg(**kw) -> config_lib.DataConfig:
    raw = {"name": "t", "model": {"preset": "qwen2-tiny", "init": "random", "train_tokenizer_vocab": 512},
           "data": kw, "checkpoint": {"export": False}}  # rows without a held-out split cannot be exported
    return config_lib.load_dict(raw).data


@pytest.fixture(scope="module")
def tokenizer():
    corpus = [r["question"] + r["answer"] for r in gsm8k_rows(200)] if GSM8K else ["hello world"] * 10
    corpus.append("user assistant system <|im_start|> <|im_end|>")
    return sources.train_bpe_tokenizer(corpus, 600)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def targets_per_doc(stream: data_lib.TokenStream) -> list[list[int]]:
    starts = torch.nonzero(stream.doc_start).flatten().tolist() + [len(stream.tokens)]
    return [stream.tokens[a:b][stream.loss_mask[a:b]].tolist() for a, b in zip(starts, starts[1:])]


# ---- formats and masks -----------------------------------------------------------------------------------------------


def test_text_format_every_token_is_a_target_and_documents_end_with_eos(tmp_path, tokenizer):
    docs = ["The first document.", "A second one, longer than the first."]
    path = write_jsonl(tmp_path / "t.jsonl", [{"body": d} for d in docs])
    cfg = data_cfg(format="text", train=path, columns={"text": "body"}, validation_fraction=0)
    train, val, _ = sources.read_examples(cfg, seed=0)
    assert val is None and [x["text"] for x in train.items] == docs
    stream = data_lib.tokenize(train.items, cfg, tokenizer)
    assert stream.loss_mask.all()
    eos = tokenizer.eos_token_id
    for ids, doc in zip(targets_per_doc(stream), docs):
        assert ids[-1] == eos and tokenizer.decode(ids[:-1]) == doc


@needs_gsm8k
def test_prompt_completion_loss_only_on_completion_tokens(tokenizer):
    cfg = data_cfg(format="prompt_completion", train=str(GSM8K / "train.jsonl"), max_rows=20, validation_fraction=0,
                   columns={"prompt": "question", "completion": "answer"}, prompt_template="Question: {prompt}\nAnswer: ")
    train, _, _ = sources.read_examples(cfg, seed=0)
    rows = gsm8k_rows(20)
    stream = data_lib.tokenize(train.items, cfg, tokenizer)
    eos = tokenizer.eos_token_id
    starts = torch.nonzero(stream.doc_start).flatten().tolist() + [len(stream.tokens)]
    for (a, b), row in zip(zip(starts, starts[1:]), rows):
        ids, mask = stream.tokens[a:b].tolist(), stream.loss_mask[a:b].tolist()
        completion = tokenizer(row["answer"], add_special_tokens=False)["input_ids"]
        # The mask is exactly the completion tokens plus the EOS, all at the end; the prompt carries no loss.
        assert mask == [False] * (len(ids) - len(completion) - 1) + [True] * (len(completion) + 1)
        assert ids[len(ids) - len(completion) - 1 : -1] == completion and ids[-1] == eos
        assert tokenizer.decode([t for t, m in zip(ids, mask) if not m]) == f"Question: {row['question']}\nAnswer: "
    # After packing, the labels are exactly the completion tokens + EOS of every document, in order.
    blocks = data_lib.pack(stream, 64)
    labels = blocks.labels.flatten()
    expected = [t for doc in targets_per_doc(stream) for t in doc]
    assert labels[labels != data_lib.IGNORE_INDEX].tolist() == expected


def test_chat_loss_only_on_assistant_turns(tmp_path, tokenizer):
    conv = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5\n#### 5"},
        {"role": "user", "content": "And times 4?"},
        {"role": "assistant", "content": "5 * 4 = 20\n#### 20"},
    ]
    path = write_jsonl(tmp_path / "c.jsonl", [{"conv": conv}, {"conv": conv[1:3]}])
    cfg = data_cfg(format="chat", train=path, columns={"messages": "conv"}, chat_template=CHATML, validation_fraction=0)
    train, _, _ = sources.read_examples(cfg, seed=0)
    stream = data_lib.tokenize(train.items, cfg, tokenizer)
    eos = tokenizer.eos_token_id
    got = targets_per_doc(stream)
    # Targets: each assistant turn's content and its end-of-turn markup, then the document's EOS; nothing else.
    assert tokenizer.decode(got[0][:-1]) == "2 + 3 = 5\n#### 5<|im_end|>\n5 * 4 = 20\n#### 20<|im_end|>\n"
    assert tokenizer.decode(got[1][:-1]) == "2 + 3 = 5\n#### 5<|im_end|>\n"
    assert got[0][-1] == eos and got[1][-1] == eos
    non_targets = tokenizer.decode(stream.tokens[~stream.loss_mask].tolist())
    assert "What is 2 + 3?" in non_targets and "Be brief." in non_targets and "#### 5" not in non_targets


def test_chat_without_template_names_the_setting(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                             {"role": "assistant", "content": "hello"}]}])
    cfg = data_cfg(format="chat", train=path, validation_fraction=0)
    train, _, _ = sources.read_examples(cfg, seed=0)
    with pytest.raises(sources.DataError, match="data.chat_template"):
        data_lib.tokenize(train.items, cfg, tokenizer)


# ---- packing ----------------------------------------------------------------------------------------------------------


def stream_of(lengths, start_id=1):
    docs, t = [], start_id
    for n in lengths:
        docs.append((list(range(t, t + n)), [i % 3 != 0 for i in range(n)]))
        t += n
    return data_lib._concat(docs)


@pytest.mark.parametrize("seq_len", [4, 7, 16])
def test_packing_reproduces_every_token_exactly_once(seq_len):
    stream = stream_of([5, 1, 9, 3, 12, 2])
    blocks = data_lib.pack(stream, seq_len, pad_id=0)
    n = len(stream.tokens)
    flat = blocks.input_ids.flatten()
    real = flat[flat != 0]  # token ids start at 1; 0 is padding
    # Every token is an input exactly once, in order (the last one too when the final block has room for it,
    # its label then being padding); only the final block is padded, by less than a block.
    assert real.tolist() == stream.tokens[: len(real)].tolist() and len(real) in (n - 1, n)
    assert (flat[len(real):] == 0).all() and flat.numel() - (n - 1) < seq_len
    # Labels: the next token where it is a target and not a document start; nothing else.
    want = stream.tokens[1:].masked_fill(~stream.loss_mask[1:] | stream.doc_start[1:], data_lib.IGNORE_INDEX)
    assert blocks.labels.flatten()[: n - 1].tolist() == want.tolist()
    assert (blocks.labels.flatten()[n - 1 :] == data_lib.IGNORE_INDEX).all()
    # Positions restart at each document start and at each block start.
    pos = blocks.position_ids.flatten()[: n - 1]
    starts = stream.doc_start[:-1].clone()
    starts[::seq_len] = True
    for i in range(n - 1):
        assert pos[i] == (0 if starts[i] else pos[i - 1] + 1)


def test_packed_documents_do_not_attend_across_boundaries():
    from transformers import AutoModelForCausalLM, Qwen2Config

    from job.worker.model.causal_lm import CausalLMWithLoss

    torch.manual_seed(0)
    arch = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=64, vocab_size=64)
    model = CausalLMWithLoss(AutoModelForCausalLM.from_config(arch, attn_implementation="sdpa")).eval()
    a, b = torch.randint(1, 64, (6,)), torch.randint(1, 64, (9,))
    stream = data_lib._concat([(a.tolist(), None), (b.tolist(), None)])
    packed = data_lib.pack(stream, len(stream.tokens) - 1)
    only_b = packed.labels.clone()
    only_b[:, : len(a)] = data_lib.IGNORE_INDEX
    with torch.no_grad():
        loss_packed, n_packed = model(packed.input_ids, only_b, packed.position_ids)
        alone = data_lib.pack(data_lib._concat([(b.tolist(), None)]), len(b) - 1)
        loss_alone, n_alone = model(alone.input_ids, alone.labels, alone.position_ids)
    assert n_packed == n_alone == len(b) - 1
    torch.testing.assert_close(loss_packed, loss_alone, rtol=1e-5, atol=1e-5)


def test_unpacked_padding_one_document_per_row():
    stream = stream_of([5, 1, 9, 3])
    blocks, truncated = data_lib.pad_documents(stream, 6, pad_id=0)
    assert len(blocks) == 3 and truncated == 1  # the 1-token document has nothing to predict; 9 > 6 + 1
    assert blocks.input_ids[0].tolist() == [1, 2, 3, 4, 5, 0]
    assert blocks.labels[0].tolist() == [2, 3, data_lib.IGNORE_INDEX, 5, data_lib.IGNORE_INDEX, data_lib.IGNORE_INDEX]  # mask: i % 3 != 0
    assert blocks.input_ids[1].tolist() == list(range(7, 13))
    assert blocks.position_ids.tolist() == [list(range(6))] * 3


def test_micro_batches_are_a_pure_function_of_the_position():
    blocks = data_lib.pack(stream_of([40] * 10), 8)
    full = data_lib.micro_batches(blocks, 2, rank=1, world_size=2, seed=3)
    seen = [next(full)["input_ids"] for _ in range(60)]
    resumed = data_lib.micro_batches(blocks, 2, rank=1, world_size=2, seed=3, start=37)
    for k in range(37, 60):
        assert torch.equal(next(resumed)["input_ids"], seen[k])


# ---- sources, bad rows, validation split, fingerprint ------------------------------------------------------------------


def test_bad_rows_report_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"prompt": "p1", "completion": "c1"},
        {"prompt": "p2"},
        '{"prompt": "p3", "completion": ',
        "",
        {"prompt": "p5", "completion": "c5"},
    ])
    cfg = data_cfg(format="prompt_completion", train=path, validation_fraction=0)
    with pytest.raises(sources.DataError) as e:
        sources.read_examples(cfg, seed=0)
    assert str(e.value).startswith(f"data.train: {path}:2: missing column 'completion' (data.columns.completion)")
    skip = data_cfg(format="prompt_completion", train=path, validation_fraction=0, bad_rows="skip")
    train, _, _ = sources.read_examples(skip, seed=0)
    assert [x["completion"] for x in train.items] == ["c1", "c5"]
    assert (train.info["rows_read"], train.info["rows_kept"], train.info["rows_skipped"]) == (4, 2, 2)
    assert train.info["skipped_examples"][1].startswith(f"{path}:3: not valid JSON")
    # Only the invalid JSON line left: still reported with its line.
    write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p1", "completion": "c1"}, "{oops"])
    with pytest.raises(sources.DataError, match=rf"data.train: {path}:2: not valid JSON"):
        sources.read_examples(cfg, seed=0)


def test_a_number_where_text_belongs_is_a_bad_row(tmp_path):
    """A JSON number in a text column is not turned into text and trained on: the row is bad, named by file:line
    (and skipped and counted under `data.bad_rows: skip`)."""
    path = write_jsonl(tmp_path / "numbers.jsonl", [{"text": "words"}, {"text": 5}, {"text": 2.5}])
    with pytest.raises(sources.DataError, match=rf"^data.train: {path}:2: column 'text' \(data.columns.text\): "
                                                r"expected str, got int"):
        sources.read_examples(data_cfg(format="text", train=path, validation_fraction=0), seed=0)
    train, _, _ = sources.read_examples(data_cfg(format="text", train=path, validation_fraction=0, bad_rows="skip"), 0)
    assert [x["text"] for x in train.items] == ["words"] and train.info["rows_skipped"] == 2


def test_directory_of_csv_parquet_json_and_fsspec_uri(tmp_path):
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "mixed"
    d.mkdir()
    (d / "a.csv").write_text("question,answer\nq1,a1\n\"q,2\",a2\n")
    pq.write_table(pa.table({"question": ["q3"], "answer": ["a3"]}), d / "b.parquet")
    (d / "c.json").write_text(json.dumps([{"question": "q4", "answer": "a4"}]))
    write_jsonl(d / "d.jsonl", [{"question": "q5", "answer": "a5"}])
    (d / "README.md").write_text("not data")
    cols = {"prompt": "question", "completion": "answer"}
    cfg = data_cfg(format="prompt_completion", train=str(d), columns=cols, validation_fraction=0)
    train, _, _ = sources.read_examples(cfg, seed=0)
    assert [x["prompt"] for x in train.items] == ["q1", "q,2", "q3", "q4", "q5"]
    assert [f["path"].rsplit("/", 1)[1] for f in train.info["files"]] == ["a.csv", "b.parquet", "c.json", "d.jsonl"]
    assert all(len(f["sha256"]) == 64 for f in train.info["files"])
    # CSV rows are located by line: a row without the answer field fails naming a.csv:3.
    (d / "a.csv").write_text("question,answer\nq1,a1\nq2\n")
    with pytest.raises(sources.DataError, match=r"a\.csv:3: missing column 'answer'"):
        sources.read_examples(cfg, seed=0)
    # Any fsspec URI reads the same way (memory:// stands in for s3://).
    with fsspec.open("memory://bucket/gsm/train.jsonl", "w") as f:
        f.write(json.dumps({"question": "q", "answer": "a"}) + "\n")
    remote = data_cfg(format="prompt_completion", train="memory://bucket/gsm", columns=cols, validation_fraction=0)
    train, _, _ = sources.read_examples(remote, seed=0)
    assert train.items == [{"prompt": "q", "completion": "a"}]
    shown = train.info["files"][0]["path"]  # memory:// keeps a root slash; s3:// gives s3://bucket/key
    assert shown.startswith("memory://") and shown.endswith("bucket/gsm/train.jsonl")
    with pytest.raises(sources.DataError, match=r"^data.train: source not found: memory://bucket/nope"):
        sources.read_examples(data_cfg(format="prompt_completion", train="memory://bucket/nope"), seed=0)


def test_validation_fraction_is_seeded_and_disjoint(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": f"doc {i}"} for i in range(100)])
    cfg = data_cfg(format="text", train=path, validation_fraction=0.1)
    train, val, info = sources.read_examples(cfg, seed=7)
    train2, val2, _ = sources.read_examples(cfg, seed=7)
    assert len(val.items) == 10 and info == {"from": "data.train", "fraction": 0.1, "seed": 7, "rows": 10}
    assert val.items == val2.items and train.items == train2.items
    assert {x["text"] for x in train.items}.isdisjoint(x["text"] for x in val.items)
    _, val3, _ = sources.read_examples(cfg, seed=8)
    assert val3.items != val.items


@needs_gsm8k
def test_build_fingerprint_names_sources_hashes_counts_and_tokenizer(tokenizer):
    import hashlib

    cfg = data_cfg(format="prompt_completion", columns={"prompt": "question", "completion": "answer"}, max_rows=50,
                   train=str(GSM8K / "train.jsonl"), validation=str(GSM8K / "test.jsonl"))
    ds = data_lib.build(cfg, config_lib.TrainConfig(seq_len=64), tokenizer)
    fp = ds.fingerprint
    f = fp["train"]["files"][0]
    assert f["sha256"] == hashlib.sha256((GSM8K / "train.jsonl").read_bytes()).hexdigest()
    assert (fp["train"]["rows_read"], fp["train"]["rows_kept"], fp["train"]["rows_skipped"]) == (50, 50, 0)
    assert fp["validation"]["source"] == str(GSM8K / "test.jsonl") and fp["validation"]["rows_kept"] == 50
    assert fp["tokenizer"]["sha256"] and fp["tokenizer"]["vocab_size"] == len(tokenizer)
    assert fp["train_blocks"] == len(ds.train) and len(ds.validation_examples) == 50


def test_build_once_reads_back_what_it_built_and_rebuilds_for_other_settings(tokenizer, tmp_path):
    """The run's data is built once and read back by later attempts, even after the source changed; another
    seq_len or seed is another dataset."""
    train = tmp_path / "train.jsonl"
    write_jsonl(train, gsm8k_rows(30))
    cfg = data_cfg(format="prompt_completion", columns={"prompt": "question", "completion": "answer"},
                   train=str(train), validation=str(GSM8K / "test.jsonl"), max_rows=30)
    first, how = data_lib.build_once(cfg, config_lib.TrainConfig(seq_len=64), tokenizer, str(tmp_path / "run"))
    assert how == "built" and len(list((tmp_path / "run" / data_lib.DATA_CACHE).iterdir())) == 1
    write_jsonl(train, gsm8k_rows(10))  # changed under the run: the run keeps the data it started with
    again, how = data_lib.build_once(cfg, config_lib.TrainConfig(seq_len=64), tokenizer, str(tmp_path / "run"))
    assert how == "read"
    for name in ("train", "validation"):
        for field in ("input_ids", "labels", "position_ids"):
            assert torch.equal(getattr(getattr(again, name), field), getattr(getattr(first, name), field))
    assert again.fingerprint == first.fingerprint and again.validation_examples == first.validation_examples
    for other in (config_lib.TrainConfig(seq_len=32), config_lib.TrainConfig(seq_len=64, seed=1)):
        assert data_lib.build_once(cfg, other, tokenizer, str(tmp_path / "run"))[1] == "built"
    assert len(list((tmp_path / "run" / data_lib.DATA_CACHE).iterdir())) == 3


def test_build_once_hands_over_the_heldout_rows_before_tokenizing_or_once_read(tokenizer, tmp_path, monkeypatch):
    """The task baseline starts on the held-out rows while the data is tokenized: the rank that builds gets them
    before any tokenizing, a rank (or attempt) that reads the file gets the same rows from it."""
    cfg = data_cfg(format="prompt_completion", columns={"prompt": "question", "completion": "answer"},
                   train=str(GSM8K / "train.jsonl"), validation=str(GSM8K / "test.jsonl"), max_rows=20)
    events, tokenize = [], data_lib.tokenize
    monkeypatch.setattr(data_lib, "tokenize", lambda *a: events.append("tokenize") or tokenize(*a))
    rows = []
    on_rows = lambda r: (events.append("rows"), rows.append(r))  # noqa: E731
    built, how = data_lib.build_once(cfg, config_lib.TrainConfig(seq_len=64), tokenizer, str(tmp_path), on_rows)
    assert how == "built" and events == ["rows", "tokenize", "tokenize"]
    assert rows[0] == built.validation_examples and len(rows[0]) == 20 and "completion" in rows[0][0]
    events.clear()
    _, how = data_lib.build_once(cfg, config_lib.TrainConfig(seq_len=64), tokenizer, str(tmp_path), on_rows)
    assert how == "read" and events == ["rows"] and rows[1] == rows[0]


def test_missing_path_fails_fast_in_the_driver_naming_the_source(tmp_path):
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "job", "--config", str(REPO / "examples" / "gsm8k.yaml"),
         "--set", f"storage_path={tmp_path}", "--set", "data.train.path=/nonexistent/gsm8k/train.jsonl"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "data error: data.train: source not found: /nonexistent/gsm8k/train.jsonl" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - start < 60


def test_unreachable_hub_dataset_fails_fast_naming_it():
    cfg = data_cfg(format="prompt_completion", train={"path": "hf:openai/gsm8k", "revision": "main", "subset": "main"})
    start = time.monotonic()
    with pytest.raises(sources.DataError, match=r"^data.train: cannot load hub dataset 'openai/gsm8k' \(revision main\): "):
        sources.read_examples(cfg, seed=0)
    assert time.monotonic() - start < 15


# ---- config ----------------------------------------------------------------------------------------------------------


def test_data_config_shorthand_and_errors_name_the_field():
    cfg = data_cfg(format="text", train="a.jsonl", validation={"path": "hf:org/ds", "revision": "abc", "split": "test"})
    assert cfg.train.path == "a.jsonl" and cfg.validation.split == "test"
    bad = [
        ({"format": "text", "train": {"path": "a.jsonl", "revision": "v1"}}, "data.train.revision: only for hub"),
        ({"format": "text", "train": "a.jsonl", "columns": {"txt": "body"}}, "data.columns.txt: unknown key"),
        ({"format": "text", "train": "a.jsonl", "columns": {"text": ""}}, "data.columns.text: must not be empty"),
        ({"format": "prompt_completion", "train": "a", "prompt_template": "Q: {0}"}, "data.prompt_template:"),
        ({"format": "text", "train": "a", "chat_template": "x"}, "data.chat_template: only used with"),
        ({"format": "chat", "train": "builtin:python-docs"}, "data.train.path: builtin:python-docs is plain text"),
        ({"format": "text", "train": "hf:gsm8k"}, "data.train.path: expected hf:owner/name"),
        ({"format": "text", "bad_rows": "ignore", "train": "a"}, "data.bad_rows: expected"),
    ]
    for data, message in bad:
        with pytest.raises(config_lib.ConfigError) as e:
            data_cfg(**data)
        assert str(e.value).startswith(message), (data, str(e.value))
    raw = {"name": "t", "model": {"preset": "qwen2-tiny", "init": "random", "train_tokenizer_vocab": 512},
           "data": {"format": "text", "train": "a"}, "eval": {"task": "gsm8k"}}
    with pytest.raises(config_lib.ConfigError, match="^eval.task: needs data.format prompt_completion or chat"):
        config_lib.load_dict(raw)
    schema = config_lib.json_schema()["properties"]["data"]["properties"]
    assert schema["train"]["anyOf"][0] == {"type": "string", "minLength": 1} and schema["train"]["anyOf"][-1] == {"type": "null"}
    assert "description" in schema["columns"]["properties"]["prompt"]
