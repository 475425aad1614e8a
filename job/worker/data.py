"""Data: sources → rows → examples of a format → token stream with a loss mask → blocks → per-rank micro-batches.

Sources (`data.train`, `data.validation`) are local or mounted files and directories (JSONL/JSON, Parquet, CSV,
plain text), fsspec URIs (`s3://…`) and hub datasets (`hf:owner/name` with a revision). JSON lines and CSV are
read line by line here so a bad row is reported as `file:line`; Parquet through pyarrow, hub datasets through
`datasets` (optional: see `packages`).
Every source is fingerprinted (file sha256 or hub commit, rows read/kept/skipped).

Each format turns a row into an example, and an example into token ids with a per-token loss mask:
* `text`: every token (and the EOS after the document) is a target;
* `prompt_completion`: `data.prompt_template` renders the prompt; only completion tokens and EOS are targets;
* `chat`: `messages` rendered with the chat template; only the assistant turns' tokens are targets.

All examples end in one `TokenStream` (documents concatenated, each ending with EOS). Packing cuts it into
blocks of `seq_len + 1` tokens with stride `seq_len`, so every token is an input exactly once, and
`position_ids` restart at each document so attention (SDPA/flash through transformers' packed-sequence
detection) does not cross documents. Unpacked (`data.packing: false`), each document is its own padded row.

Batches are drawn from a seeded permutation of blocks, sharded by rank (`rank::world_size`), so a run is
reproducible and resumable from a step number alone: `micro_batches(..., start=k)` yields exactly what an
uninterrupted run would have seen from micro-batch k on.

One module past ~500 lines on purpose: the stages above are one pipeline, each feeding the next, and `build` /
`build_once` run it end to end (cached on the storage); read top to bottom it is the order the data flows in.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist

from .. import packages, storage
from ..config import DataConfig, SourceConfig, TrainConfig, is_hub_source

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

IGNORE_INDEX = -100
"""Label value that carries no loss (matches `torch.nn.functional.cross_entropy`'s default)."""

EOS = "<|endoftext|>"
"""End-of-document token of tokenizers trained by `train_bpe_tokenizer` (also their padding token)."""

ROW_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
TEXT_SUFFIXES = (".txt",)


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
# Sources → rows
# --------------------------------------------------------------------------------------------------------------------


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
    """Reads every row of a source (`key` is its config path, e.g. `data.train`, used in messages).

    Fails fast with a `DataError` naming the source when it is missing, empty or unreachable; bad rows are
    returned as `BadRow` entries for the caller's policy.
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


# --------------------------------------------------------------------------------------------------------------------
# Rows → examples of the configured format (the bad-row policy applies here)
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Examples:
    items: list[dict]
    """Per format: `{"text"}`, `{"prompt", "completion"}` (prompt rendered), or `{"messages"}`."""
    info: dict
    """The source's fingerprint entry with rows read/kept/skipped."""
    bad: list[str] = field(default_factory=list)
    """`location: reason` of skipped rows (the first few are reported)."""


def to_examples(rows: Rows, cfg: DataConfig, key: str) -> Examples:
    """Maps rows to examples of `cfg.format`; a bad row fails the run (`bad_rows: fail`) or is skipped."""
    items, bad = [], []
    for where, row in rows.rows:
        try:
            if isinstance(row, BadRow):
                raise DataError(row.reason)
            items.append(_example(row, cfg, where))
        except DataError as e:
            if cfg.bad_rows == "fail":
                raise DataError(f"{key}: {where}: {e} (set data.bad_rows: skip to drop such rows)") from None
            bad.append(f"{where}: {e}")
    info = {**rows.info, "rows_read": len(rows.rows), "rows_kept": len(items), "rows_skipped": len(bad)}
    if bad:
        info["skipped_examples"] = bad[:5]
    if not items:
        raise DataError(f"{key}: no usable rows in {rows.info.get('source')} ({len(bad)} skipped)")
    return Examples(items, info, bad)


def _column(row: dict, name: str, key: str, want: type) -> Any:
    if name not in row or row[name] is None:
        raise DataError(f"missing column {name!r} (data.columns.{key}); the row has {sorted(row)}")
    value = row[name]
    if want is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
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
        try:
            rendered = cfg.prompt_template.format_map({**row, "prompt": prompt})
        except KeyError as e:
            raise DataError(f"data.prompt_template: the row has no column {e.args[0]!r}") from None
        return {"prompt": rendered, "completion": completion}
    messages = _column(row, cols.messages, "messages", list)
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"column {cols.messages!r}[{i}]: expected a mapping with string role and content")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"column {cols.messages!r}: no assistant message (nothing to train on)")
    return {"messages": messages}


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
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(order[:n_val])
    val = Examples([x for i, x in enumerate(train.items) if i in held], {})
    train.items = [x for i, x in enumerate(train.items) if i not in held]
    return train, val, {"from": "data.train", "fraction": cfg.validation_fraction, "seed": seed, "rows": n_val}


def tokenizer_corpus(cfg: DataConfig, seed: int) -> list[str]:
    """The training examples' text, to train a tokenizer on (reads and checks every configured source first,
    so a bad source fails here, in the driver, before any worker starts)."""
    train, _, _ = read_examples(cfg, seed)
    out = []
    for x in train.items:
        if "text" in x:
            out.append(x["text"])
        elif "prompt" in x:
            out.append(x["prompt"] + x["completion"])
        else:
            out.append("\n".join(f"{m['role']}\n{m['content']}" for m in x["messages"]))
    return out


# --------------------------------------------------------------------------------------------------------------------
# Tokenizers and tokenization
# --------------------------------------------------------------------------------------------------------------------


def train_bpe_tokenizer(documents: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `documents` (deterministic), with `<|endoftext|>` as EOS and pad.

    It uses Qwen2's normalizer and pre-tokenizer: `AutoTokenizer` loads a tokenizer saved beside a Qwen2 config
    as `Qwen2Tokenizer`, which rebuilds that pipeline around the saved vocabulary and merges, so an exported
    model's tokenizer reloads with exactly the token ids it was trained on.
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


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None) -> dict:
    """Name and sha256 of the tokenizer's full JSON (vocabulary, merges, normalisation, specials: the run
    record's `tokenizer_sha256`), and of the chat template in use, if any."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(_sorted_vocabulary(tokenizer))
    out = {"name": tokenizer.name_or_path or f"trained byte-level BPE ({len(tokenizer)} tokens)",
           "vocab_size": len(tokenizer), "sha256": _sha256(text)}
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        out["chat_template_sha256"] = _sha256(str(template))
    return out


def vocabulary_sha256(tokenizer: PreTrainedTokenizerBase | None) -> str | None:
    """sha256 of the vocabulary and the EOS/padding ids: what a tokenizer must keep through save and reload (its
    JSON serialisation itself may change, so the export's check does not use `tokenizer_fingerprint`)."""
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
    """The id that fills padding (never a target, so any id the model embeds will do): the tokenizer's pad
    token, else its EOS, else 0."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


def tokenize_text(documents: list[str], tokenizer: PreTrainedTokenizerBase) -> TokenStream:
    """Language modelling: every token is a target; each document ends with EOS."""
    eos = _eos(tokenizer)
    ids = tokenizer(documents, add_special_tokens=False)["input_ids"]
    return _concat([(doc + [eos], None) for doc in ids])


def tokenize_prompt_completion(examples: list[dict], tokenizer: PreTrainedTokenizerBase) -> TokenStream:
    """Prompt and completion tokenized separately (so the boundary is exact, as at generation time); only the
    completion tokens and the EOS after them are targets."""
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

    Assistant turn i spans the characters between the rendering of messages[:i] with the generation prompt
    and the rendering of messages[:i+1] (the turn's content and its end-of-turn markup); a token is a target
    when it starts inside such a span. Needs a template whose renderings of prefixes are prefixes.
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


# --------------------------------------------------------------------------------------------------------------------
# Packing and batching
# --------------------------------------------------------------------------------------------------------------------


def pack(stream: TokenStream, seq_len: int, pad_id: int = 0) -> Blocks:
    """Cuts the stream into blocks of `seq_len` inputs and their next-token labels.

    Block k covers stream[k*T : k*T + T + 1]: inputs are its first T tokens and labels its last T, so every
    token but the last is an input exactly once and every token after the first is a label exactly once. A
    label is IGNORE_INDEX where the target token is not in the loss mask or starts a new document (nothing
    before it predicts it). Positions restart at each document start and at each block start. The last block
    is padded with `pad_id` (no loss, positions continuing) rather than dropped.
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
    # Position = distance to the latest document start within the block (block start counts as one).
    starts = starts[:, :-1].clone()
    starts[:, 0] = True
    steps = torch.arange(seq_len).expand(n_blocks, seq_len)
    last_start = torch.cummax(torch.where(starts, steps, torch.zeros_like(steps)), dim=1).values
    return Blocks(tokens[:, :-1].contiguous(), labels.contiguous(), steps - last_start)


def pad_documents(stream: TokenStream, seq_len: int, pad_id: int = 0) -> tuple[Blocks, int]:
    """Unpacked: one row per document, truncated to `seq_len + 1` tokens and right-padded with `pad_id`
    (padding carries no loss; positions run on through it). Returns the rows and how many were truncated."""
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
    """What the train loop needs from data: packed blocks, held-out blocks and rows, and the fingerprint."""

    train: Blocks | None
    """Packed training blocks (None for synthetic data)."""
    validation: Blocks | None
    """Held-out blocks for the held-out loss (None without a held-out split)."""
    fingerprint: dict
    """What was read: sources with file hashes or hub revisions, row counts, tokenizer name and hash, sizes."""
    validation_examples: list[dict] = field(default_factory=list)
    """Held-out examples (for task evaluation by generation)."""


DATA_CACHE = "data_cache"
"""`<run>/data_cache/<key>.pt`: the run's tokenized and packed data, built once per run (see `build_once`)."""


def build_once(cfg: DataConfig, train_cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase | None,
               run_dir: str, on_heldout_rows: Callable[[list[dict]], None] | None = None) -> tuple[Dataset, str]:
    """`build`, once per run rather than once per worker and attempt: rank 0 builds the dataset and writes it to
    the run's storage, the other ranks (and every rank of a later attempt) read it back. Collective. Returns the
    dataset and `"built"` or `"read"`. `on_heldout_rows` is called with the held-out examples as soon as this
    rank has them: on the rank that builds, before anything is tokenized (work that needs only the rows, such as
    the task baseline's decoding, then overlaps the tokenizing); on a rank that reads, once read.

    The file's key is the data config, `seq_len`, seed and tokenizer hash: a run keeps training on the data it
    first read (so a resumed attempt sees exactly the same blocks, even if a source file has changed since);
    delete `<run>/data_cache/` to re-read the sources.
    """
    if cfg.format == "synthetic":
        return build(cfg, train_cfg, tokenizer), "built"
    key = storage.json_sha256({
        "data": asdict(cfg), "seq_len": train_cfg.seq_len, "seed": train_cfg.seed,
        "tokenizer": tokenizer_fingerprint(tokenizer, cfg.chat_template)["sha256"],
    })[:16]
    uri = storage.join(run_dir, DATA_CACHE, f"{key}.pt")
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


def _blocks_dict(blocks: Blocks | None) -> dict | None:
    return None if blocks is None else {"input_ids": blocks.input_ids, "labels": blocks.labels,
                                        "position_ids": blocks.position_ids}


def _blocks(saved: dict | None) -> Blocks | None:
    return None if saved is None else Blocks(saved["input_ids"], saved["labels"], saved["position_ids"])


def build(cfg: DataConfig, train_cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase | None,
          on_heldout_rows: Callable[[list[dict]], None] | None = None) -> Dataset:
    """Reads, tokenizes and packs the configured data (synthetic data has nothing to build); `on_heldout_rows`
    gets the held-out examples once they are read, before the tokenizing."""
    if cfg.format == "synthetic":
        return Dataset(None, None, {"format": "synthetic", "seed": train_cfg.seed})
    train_ex, val_ex, val_info = read_examples(cfg, train_cfg.seed)
    if on_heldout_rows is not None:
        on_heldout_rows(val_ex.items if val_ex is not None else [])
    padding = pad_id(tokenizer)
    fingerprint = {
        "format": cfg.format,
        "train": train_ex.info,
        "validation": val_info,
        "tokenizer": tokenizer_fingerprint(tokenizer, cfg.chat_template),
        "seq_len": train_cfg.seq_len,
        "packing": cfg.packing,
    }
    out = []
    for name, ex in (("train", train_ex), ("validation", val_ex)):
        if ex is None:
            out.append(None)
            continue
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
    return Dataset(out[0], out[1], fingerprint, val_ex.items if val_ex is not None else [])
