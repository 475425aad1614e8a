"""Data sources: files, directories, object storage and hub datasets → rows → examples of the configured format,
read and checked without torch, so the driver reads every source (and trains a tokenizer, if asked) before any
worker starts; the workers tokenize and pack the same examples (`worker/data.py`).

JSON lines and CSV are read line by line so a bad row is reported as `file:line`; Parquet through pyarrow, hub
datasets (`hf:owner/name`) through the optional `datasets`. Every source is fingerprinted (file sha256 or hub
commit, rows read/kept/skipped).
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import packages, storage
from ..config import DataConfig, SourceConfig
from ..rules import is_hub_source

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
"""End-of-document token of tokenizers trained by `train_bpe_tokenizer` (also their padding token)."""


ROW_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


TEXT_SUFFIXES = (".txt",)


class DataError(ValueError):
    """Bad data source or rows; the message names the source (and file:line where there is one)."""


@dataclass
class Rows:
    """What a source yielded: rows with their location (`file:line`), and the source's fingerprint entry."""

    rows: list[tuple[str, Any]]
    """(location, row) pairs; a row is a dict, a plain-text document (str), or a `BadRow`."""
    info: dict


@dataclass
class BadRow:
    reason: str


def load_source(src: SourceConfig, key: str, max_rows: int = 0) -> Rows:
    """Every row of a source (`key`: its config path, for messages).

    `DataError` naming the source when it is missing, empty or unreachable; bad rows come back as `BadRow` for the
    caller's policy.
    """
    if src.path == "builtin:python-docs":
        from pydoc_data import topics

        docs = [(f"builtin:python-docs:{name}", topics.topics[name]) for name in sorted(topics.topics)]
        return _limit(Rows(docs, {"source": src.path, "python": sys.version.split()[0], "sha256": _hash_texts(docs)}), max_rows)
    if is_hub_source(src.path):
        return _limit(_load_hub(src, key, max_rows), max_rows)
    return _limit(_load_files(src.path, key, max_rows), max_rows)


def _limit(rows: Rows, max_rows: int) -> Rows:
    if max_rows and len(rows.rows) > max_rows:
        rows.rows = rows.rows[:max_rows]
        rows.info["max_rows"] = max_rows
    return rows


def _hash_texts(items: list[tuple[str, str]]) -> str:
    digest = hashlib.sha256()
    for _, text in items:
        digest.update(text.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _load_files(path: str, key: str, max_rows: int) -> Rows:
    try:
        fs, fs_path = storage.filesystem(path, key)
        exists = fs.exists(fs_path)
    except packages.MissingPackage:
        raise
    except Exception as e:  # unknown protocol, bad credentials, unreachable endpoint
        raise DataError(f"{key}: cannot open {path}: {type(e).__name__}: {e}") from None
    if not exists:
        raise DataError(f"{key}: source not found: {path}")
    remote = storage.is_remote(path)
    if fs.isdir(fs_path):
        names = sorted(fs.find(fs_path))
        files = [n for n in names if n.endswith(ROW_SUFFIXES + TEXT_SUFFIXES)]
        if not files:
            raise DataError(f"{key}: no data files ({', '.join(ROW_SUFFIXES + TEXT_SUFFIXES)}) in directory {path}")
    else:
        files = [fs_path]
        if not fs_path.endswith(ROW_SUFFIXES + TEXT_SUFFIXES):
            raise DataError(f"{key}: unsupported file type {path} (use {', '.join(ROW_SUFFIXES + TEXT_SUFFIXES)})")
    rows, file_info = [], []
    for name in files:
        shown = fs.unstrip_protocol(name) if remote else name
        with fs.open(name, "rb") as f:
            raw = f.read()
        file_info.append({"path": shown, "sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)})
        rows.extend(_parse_file(shown, raw, key))
        if max_rows and len(rows) >= max_rows:
            break
    return Rows(rows, {"source": path, "files": file_info})


def _parse_file(name: str, raw: bytes, key: str) -> list[tuple[str, Any]]:
    if name.endswith(".parquet"):
        return _parse_parquet(name, raw, key)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{key}: {name} is not UTF-8 text: {e}") from None
    if name.endswith(".txt"):
        return [(f"{name}:paragraphs#{i}", doc) for i, doc in enumerate(_split_paragraphs(text))]
    if name.endswith(".csv"):
        reader = csv.DictReader(io.StringIO(text, newline=""))
        out = []
        for row in reader:
            # A row with fewer fields than the header gets None for the missing ones: a missing column.
            out.append((f"{name}:{reader.line_num}", {k: v for k, v in row.items() if v is not None and k is not None}))
        return out
    if name.endswith(".json") and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{key}: {name}:{e.lineno}: not valid JSON: {e.msg}") from None
        return [(f"{name}:item {i}", r if isinstance(r, dict) else BadRow(f"expected a JSON object, got {type(r).__name__}"))
                for i, r in enumerate(items)]
    out = []  # JSON lines (.jsonl, or .json holding one object per line)
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            out.append((where, BadRow(f"not valid JSON: {e.msg} (column {e.colno})")))
            continue
        out.append((where, row if isinstance(row, dict) else BadRow(f"expected a JSON object, got {type(row).__name__}")))
    return out


def _parse_parquet(name: str, raw: bytes, key: str) -> list[tuple[str, Any]]:
    import pyarrow as pa  # a dependency of ray[train]: Parquet needs no optional package
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(pa.BufferReader(raw))
    except Exception as e:
        raise DataError(f"{key}: {name}: not a readable Parquet file: {e}") from None
    return [(f"{name}:row {i}", row) for i, row in enumerate(table.to_pylist())]


def _load_hub(src: SourceConfig, key: str, max_rows: int) -> Rows:
    datasets = packages.require("datasets", f"{key}: hub dataset {src.path}")
    from huggingface_hub import constants

    repo = src.path[len("hf:"):]
    what = f"{key}: cannot load hub dataset {repo!r} (revision {src.revision or 'main'})"
    token = os.environ.get("HF_TOKEN")
    info = {"source": src.path, "revision": src.revision, "subset": src.subset, "split": src.split}
    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_DATASETS_OFFLINE", "0").upper() in ("1", "ON", "YES", "TRUE")
    if not offline:
        # One metadata request with a short timeout: a missing repo, a wrong revision or no network fails here
        # in seconds, before `datasets` starts its own retries.
        from huggingface_hub import HfApi

        try:
            meta = HfApi(token=token).dataset_info(repo, revision=src.revision, timeout=15)
        except Exception as e:
            raise DataError(f"{what}: {type(e).__name__}: {_first_line(e)}") from None
        info["commit"] = meta.sha
    try:
        split = src.split if not max_rows else f"{src.split}[:{max_rows}]"
        ds = datasets.load_dataset(repo, src.subset, revision=src.revision, split=split, token=token)
    except Exception as e:
        raise DataError(f"{what}: {type(e).__name__}: {_first_line(e)}") from None
    info["fingerprint"] = getattr(ds, "_fingerprint", None)
    return Rows([(f"{src.path}[{src.split}] row {i}", row) for i, row in enumerate(ds)], info)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else repr(e)


def _split_paragraphs(text: str, target_chars: int = 65536) -> list[str]:
    """Plain text as documents: blank-line-separated paragraphs grouped to ~64 KiB, so packing sees document
    boundaries without splitting prose mid-sentence too often."""
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


@dataclass
class Examples:
    items: list[dict]
    """Per format: `{"text"}`, `{"prompt", "completion"}` (prompt rendered), `{"messages"}`, or `{"prompt",
    "chosen", "rejected"}`."""
    info: dict
    """The source's fingerprint entry with rows read/kept/skipped."""
    bad: list[str] = field(default_factory=list)
    """`location: reason` of skipped rows (the first few are reported)."""
    rows: list[dict] = field(default_factory=list)
    """The rows the items come from, item by item (`to_examples`)."""


def to_examples(rows: Rows, cfg: DataConfig, key: str) -> Examples:
    """Maps rows to examples of `cfg.format`; a bad row fails the run (`bad_rows: fail`) or is skipped."""
    items, kept, bad = [], [], []
    for where, row in rows.rows:
        try:
            if isinstance(row, BadRow):
                raise DataError(row.reason)
            items.append(_example(row, cfg, where))
            kept.append(row)
        except DataError as e:
            if cfg.bad_rows == "fail":
                raise DataError(f"{key}: {where}: {e} (set data.bad_rows: skip to drop such rows)") from None
            bad.append(f"{where}: {e}")
    info = {**rows.info, "rows_read": len(rows.rows), "rows_kept": len(items), "rows_skipped": len(bad)}
    if bad:
        info["skipped_examples"] = bad[:5]
    if not items:
        raise DataError(f"{key}: no usable rows in {rows.info.get('source')} ({len(bad)} skipped)")
    return Examples(items, info, bad, kept)


def _column(row: dict, name: str, key: str, want: type) -> Any:
    if name not in row or row[name] is None:
        raise DataError(f"missing column {name!r} (data.columns.{key}); the row has {sorted(row)}")
    value = row[name]
    if not isinstance(value, want):
        raise DataError(f"column {name!r} (data.columns.{key}): expected {want.__name__}, got {type(value).__name__}")
    return value


def _example(row: Any, cfg: DataConfig, where: str) -> dict:
    cols = cfg.columns
    if isinstance(row, str):  # a plain-text document
        if cfg.format != "text":
            raise DataError(f"plain text has no columns; data.format: {cfg.format} needs JSON/Parquet/CSV rows")
        return {"text": row}
    if cfg.format == "text":
        return {"text": _column(row, cols.text, "text", str)}
    if cfg.format == "prompt_completion":
        prompt = _column(row, cols.prompt, "prompt", str)
        completion = _column(row, cols.completion, "completion", str)
        return {"prompt": _render_prompt(row, cfg, prompt), "completion": completion}
    if cfg.format == "preference":
        return _preference(row, cfg)
    messages = _messages(_column(row, cols.messages, "messages", list), cols.messages)
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"column {cols.messages!r}: no assistant message (nothing to train on)")
    return {"messages": messages}


def _messages(messages: list, column: str) -> list:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"column {column!r}[{i}]: expected a mapping with string role and content")
    return messages


def _preference(row: dict, cfg: DataConfig) -> dict:
    """`{prompt, chosen, rejected}`: strings (the prompt rendered by `prompt_template`), or, when the chosen column
    holds a list, lists of chat messages (TRL's conversational form), rendered in the workers."""
    cols = cfg.columns
    kind = list if isinstance(row.get(cols.chosen), list) else str
    out = {key: _column(row, getattr(cols, key), key, kind) for key in ("prompt", "chosen", "rejected")}
    for key in ("chosen", "rejected"):
        column = getattr(cols, key)
        text = "".join(m["content"] for m in _messages(out[key], column)) if kind is list else out[key]
        if not text.strip():
            raise DataError(f"column {column!r} (data.columns.{key}): empty")
    if out["chosen"] == out["rejected"]:
        raise DataError(f"columns {cols.chosen!r} and {cols.rejected!r}: identical (nothing to prefer)")
    if kind is list:
        _messages(out["prompt"], cols.prompt)
    else:
        out["prompt"] = _render_prompt(row, cfg, out["prompt"])
    return out


def _render_prompt(row: dict, cfg: DataConfig, prompt: str) -> str:
    try:
        return cfg.prompt_template.format_map({**row, "prompt": prompt})
    except KeyError as e:
        raise DataError(f"data.prompt_template: the row has no column {e.args[0]!r}") from None


def read_examples(cfg: DataConfig, seed: int) -> tuple[Examples, Examples | None, dict]:
    """Training and held-out examples (an explicit validation source, or a seeded fraction of the training
    rows), and the validation part of the fingerprint. Raises `DataError` naming the source on any problem."""
    train = to_examples(load_source(cfg.train, "data.train", cfg.max_rows), cfg, "data.train")
    if cfg.validation is not None:
        val = to_examples(load_source(cfg.validation, "data.validation", cfg.max_rows), cfg, "data.validation")
        return train, val, val.info
    if cfg.validation_fraction == 0:
        return train, None, {"none": True}
    n = len(train.items)
    n_val = max(1, int(n * cfg.validation_fraction))
    if n_val >= n:
        raise DataError(f"data.validation_fraction: {n} training rows are too few to hold out {cfg.validation_fraction:.0%}")
    import torch  # the seeded split every run has drawn: torch's generator

    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(order[:n_val])
    val = Examples([x for i, x in enumerate(train.items) if i in held], {})
    train.items = [x for i, x in enumerate(train.items) if i not in held]
    return train, val, {"from": "data.train", "fraction": cfg.validation_fraction, "seed": seed, "rows": n_val}


def read_task_examples(cfg: DataConfig) -> Examples | None:
    """`data.task_source`'s rows as task examples (a preference run reads them as `prompt_completion` rows)."""
    if cfg.task_source is None:
        return None
    as_rows = dataclasses.replace(cfg, format="prompt_completion") if cfg.format == "preference" else cfg
    return to_examples(load_source(cfg.task_source, "data.task_source", cfg.max_rows), as_rows, "data.task_source")


def tokenizer_corpus(cfg: DataConfig, seed: int) -> list[str]:
    """The training examples' text, to train a tokenizer on; reads and checks every source first, so a bad one
    fails in the driver, before any worker starts."""
    train, _, _ = read_examples(cfg, seed)
    read_task_examples(cfg)

    def text(value) -> str:
        return value if isinstance(value, str) else "\n".join(f"{m['role']}\n{m['content']}" for m in value)

    return ["".join(text(x[key]) for key in ("text", "prompt", "completion", "messages", "chosen", "rejected")
                    if key in x) for x in train.items]


def train_bpe_tokenizer(documents: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `documents` (deterministic), with `<|endoftext|>` as EOS and pad.

    It uses Qwen2's normalizer and pre-tokenizer, which `Qwen2Tokenizer` rebuilds around the saved vocabulary when
    it loads one beside a Qwen2 config, so an exported model's tokenizer reloads with exactly the ids it trained on.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def tokenizer_from_json(text: str) -> PreTrainedTokenizerFast:
    """Rebuilds a `train_bpe_tokenizer` tokenizer from its JSON (`tokenizer.backend_tokenizer.to_str()`)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(text), eos_token=EOS, pad_token=EOS)
