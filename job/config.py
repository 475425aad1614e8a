"""Run configuration: one YAML file loaded into a typed dataclass tree.

The same file drives every launcher: the local embedded run, torchrun, and the Helm chart (which renders
`.Values.run` into a ConfigMap). Loading is strict, so a typo never silently falls back to a default:

* unknown keys, wrong types and impossible combinations raise `ConfigError` naming the dotted path,
  e.g. `train.seq_len: expected int, got 'abc'`;
* `--set train.max_steps=20` overrides go through the same checks (values are parsed as YAML scalars);
* `json_schema()` derives a JSON Schema from the same dataclasses (field docstrings become descriptions),
  so the chart's `values.schema.json` validates `run:` with the rules Python applies.

One module past ~500 lines on purpose: most of it is the fields' docstrings, which are the user documentation and
the schema's descriptions, and the tree is read (and its errors ordered) in one order, top to bottom.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import yaml

from . import rules


class ConfigError(ValueError):
    """A bad run configuration: one line per problem, each starting with the dotted path of its field."""

    def __init__(self, *messages: str):
        super().__init__("\n".join(messages))
        self.messages = list(messages)


def constrained(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
                note: str | None = None, **keywords) -> Any:
    """A dataclass field with JSON Schema keywords (`minimum`, `exclusiveMinimum`, `maxItems`, `items`, ...)
    that `json_schema()` adds to the field's schema, so the chart rejects at `helm install` what `validate`
    rejects at start (`_outside_bounds`); `note` is said beside the bound when a value is outside it."""
    return field(default=default, default_factory=default_factory, metadata={"json_schema": keywords, "note": note})


# --------------------------------------------------------------------------------------------------------------------
# The config tree. Each field has a docstring: it is the documentation and the JSON Schema description.
# --------------------------------------------------------------------------------------------------------------------


LORA_DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig:
    rank: Optional[int] = constrained(None, minimum=1, note="null: full fine-tune")
    """LoRA rank r: train a low-rank update B·A (A: r x in, B: out x r) beside each `targets` layer, the model's
    own weights frozen; only the adapters and their optimizer state are trained and checkpointed, and the export
    is a PEFT adapter (docs/lora.md). null: full fine-tune of every weight."""
    alpha: float = constrained(16.0, exclusiveMinimum=0)
    """Scale of the update: the layer computes W·x + (alpha / rank)·B·A·x (PEFT's `lora_alpha`)."""
    dropout: float = constrained(0.0, minimum=0, exclusiveMaximum=1)
    """Dropout on the adapters' input in training (PEFT's `lora_dropout`)."""
    targets: list[str] = constrained(default_factory=lambda: list(LORA_DEFAULT_TARGETS), minItems=1,
                                     items={"minLength": 1})
    """Linear layers that get adapters, by the last part of their module name (PEFT's `target_modules`): by
    default the attention and MLP projections. A name that matches no linear layer stops the run at start."""
    merged_export: bool = False
    """Also export merged full weights (W + (alpha / rank)·B·A, a plain Hugging Face model) in `export/merged/`,
    beside the adapter; the storage must have room for the full model (checked at start)."""
    quantize_base: Optional[Literal["nf4"]] = None
    """QLoRA: hold the frozen base's target linear weights in 4-bit NormalFloat (`nf4`: blocks of 64 weights,
    their scales double-quantized to 8 bits in blocks of 256, the QLoRA paper's recipe), dequantized to the
    compute dtype layer by layer in forward and backward; adapters, norms, embeddings and the head as with LoRA.
    The base is built one module at a time (never whole in 16 or 32 bits) and takes ~0.52 bytes per quantized
    weight. Needs the `torchao` package (the chart adds it to `runtimeEnv.pip`). null: the base in bf16 on GPU."""

    def adapts(self, module_name: str) -> bool:
        """Whether the linear layer `module_name` is one of `targets` (by the last part of its name)."""
        return module_name.rsplit(".", 1)[-1] in self.targets


@dataclass
class ModelConfig:
    path: Optional[str] = None
    """Local directory or hub id of a Hugging Face causal LM. With `init: pretrained` its weights are loaded;
    with `init: random` only its config is used. Hub access reads the token from `HF_TOKEN`."""
    revision: Optional[str] = None
    """Hub revision (branch, tag or commit) of `path`; ignored for local directories."""
    preset: Optional[Literal["qwen2.5-1.5b", "qwen2-tiny"]] = None
    """Built-in architecture for `init: random` without weights: `qwen2.5-1.5b` (the reference workload) or
    `qwen2-tiny` (a few-million-parameter Qwen2 for CPU demos and tests)."""
    init: Literal["pretrained", "random"] = "pretrained"
    """`pretrained` loads weights from `path`; `random` initialises the architecture from `preset` or `path`."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Fields of the Hugging Face model config to override, e.g. `{num_hidden_layers: 4}`."""
    tokenizer: Optional[str] = None
    """Tokenizer directory or hub id; defaults to `path`. Not needed for synthetic data."""
    train_tokenizer_vocab: Optional[int] = constrained(None, minimum=260, note="256 bytes + specials")
    """Train a byte-level BPE tokenizer of this vocabulary size on the training text instead of loading one
    (for random-init models that have no tokenizer); it is saved in the run directory."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel passed to transformers."""
    sdpa_backend: Optional[Literal["flash", "cudnn", "efficient", "math"]] = None
    """Restrict PyTorch's scaled-dot-product attention to one backend (null: PyTorch chooses per call).
    `flash` takes no attention mask, so it cannot run packed documents."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA: train low-rank adapters on the frozen model instead of every weight (`rank` null: full fine-tune)."""


@dataclass
class SourceConfig:
    """A data source. In YAML a plain string is shorthand for `{path: <string>}`."""

    _shorthand = "path"

    path: str = constrained("", minLength=1)
    """Where the rows are: a local or mounted file (`.jsonl`, `.json`, `.parquet`, `.csv`, `.txt`) or a directory
    of them; an object-storage URI such as `s3://bucket/prefix/train.jsonl` (read through fsspec, credentials
    from the environment, e.g. `AWS_ACCESS_KEY_ID`); `hf:owner/name` for a Hugging Face hub dataset (token from
    `HF_TOKEN`); or `builtin:python-docs` (the Python language reference that ships with Python, `text` only)."""
    revision: Optional[str] = None
    """Hub revision (branch, tag or commit sha) of an `hf:` source; pin a commit sha for reproducible runs.
    Not allowed for other sources (file contents are fingerprinted by their sha256 instead)."""
    subset: Optional[str] = None
    """Hub dataset configuration name (e.g. `main` for `hf:openai/gsm8k`); only for `hf:` sources."""
    split: str = "train"
    """Split of an `hf:` source to read (e.g. `train`, `test`); only for `hf:` sources."""


@dataclass
class ColumnsConfig:
    text: str = constrained("text", minLength=1)
    """Column holding the document for `format: text` (JSON/Parquet/CSV rows; `.txt` files need none)."""
    prompt: str = constrained("prompt", minLength=1)
    """Column holding the prompt for `format: prompt_completion` (no loss on its tokens)."""
    completion: str = constrained("completion", minLength=1)
    """Column holding the completion for `format: prompt_completion` (the loss is on its tokens and EOS)."""
    messages: str = constrained("messages", minLength=1)
    """Column holding the conversation for `format: chat`: a list of `{role, content}` mappings."""
    chosen: str = constrained("chosen", minLength=1)
    """Column holding the preferred completion for `format: preference`."""
    rejected: str = constrained("rejected", minLength=1)
    """Column holding the dispreferred completion for `format: preference`."""


@dataclass
class DataConfig:
    format: Literal["synthetic", "text", "prompt_completion", "chat", "preference"] = "synthetic"
    """`synthetic`: seeded random tokens (an infrastructure check, nothing to learn); `text`: language
    modelling on a text column (or plain text files), documents joined with EOS; `prompt_completion`: the loss
    is on the completion tokens (and the EOS after them) only; `chat`: a list of messages rendered with the
    chat template, the loss on the assistant turns only; `preference`: pairs for `train.objective: dpo`, TRL's
    preference rows: a prompt, a chosen and a rejected completion, all strings (the prompt rendered by
    `prompt_template`) or all lists of chat messages (rendered with the chat template); completions end with EOS."""
    train: Optional[SourceConfig] = None
    """Training source: a path/URI/`hf:` id string, or a mapping with `path`, `revision`, `subset`, `split`."""
    validation: Optional[SourceConfig] = None
    """Held-out source for evaluation (same format and columns); when unset, `validation_fraction` of the
    training rows is held out instead."""
    task_source: Optional[SourceConfig] = None
    """Rows for the task evaluation (`eval.task`) instead of the held-out split, read as `prompt_completion` rows
    (`columns.prompt`, `columns.completion`, `prompt_template`) or, for `chat`, as conversations. Needed with
    `format: preference`, whose held-out pairs carry no reference answer (e.g. the GSM8K test split)."""
    validation_fraction: float = constrained(0.05, minimum=0, exclusiveMaximum=1)
    """Fraction of the training documents held out for evaluation when no `validation` source is given
    (seeded by `train.seed`, removed before training sees them)."""
    columns: ColumnsConfig = field(default_factory=ColumnsConfig)
    """Column names of the rows, mapped to what the format needs."""
    prompt_template: str = "{prompt}"
    """`prompt_completion`: Python format string that renders a row's prompt; `{prompt}` is the mapped prompt
    column and every other column is available by its name, e.g. `"Question: {prompt}\\nAnswer: "`."""
    chat_template: Optional[str] = None
    """`chat`: Jinja chat template used instead of the tokenizer's own (required when the tokenizer has none,
    e.g. a trained one)."""
    packing: bool = True
    """`true`: pack documents back to back into `train.seq_len` blocks (EOS between them, position ids restart
    at each document so attention stays within it, no padding); `false`: one document per sequence, truncated
    to `train.seq_len` and padded (padding carries no loss)."""
    bad_rows: Literal["fail", "skip"] = "fail"
    """What to do with a row that is not valid JSON or lacks a mapped column: `fail` stops the run naming the
    file and line; `skip` drops it and counts it in the dataset fingerprint."""
    max_rows: int = constrained(0, minimum=0)
    """Read at most this many rows per source (0: all); for quick runs and tests."""
    synthetic_vocab: Optional[int] = None
    """Token ids drawn for synthetic data; defaults to the model's vocabulary size."""


@dataclass
class DpoConfig:
    beta: float = constrained(0.1, exclusiveMinimum=0)
    """DPO's β (TRL's `beta`): each pair's loss is -log σ(β·((log π(c) - log π_ref(c)) - (log π(r) - log π_ref(r))));
    larger keeps the policy nearer the reference."""
    nll_weight: float = constrained(0.0, minimum=0)
    """Weight of the chosen completion's negative log-likelihood per token, added to each pair's loss (DPO+NLL,
    Pang et al. 2024)."""


@dataclass
class TrainConfig:
    max_steps: int = constrained(100, minimum=1)
    """Optimizer steps to run."""
    micro_batch_size: int = constrained(4, minimum=1)
    """Sequences per device per forward/backward pass."""
    grad_accum_steps: int = constrained(1, minimum=1)
    """Micro-batches accumulated per optimizer step (global batch = micro_batch_size x accum x workers)."""
    seq_len: int = constrained(256, minimum=1)
    """Tokens per sequence (packed block length)."""
    lr: float = constrained(3.0e-4, exclusiveMinimum=0)
    """Peak learning rate, reached after warmup."""
    min_lr_ratio: float = constrained(0.1, minimum=0, maximum=1)
    """Final learning rate of the cosine decay as a fraction of `lr`."""
    warmup_steps: int = constrained(10, minimum=0)
    """Linear warmup steps before the cosine decay."""
    weight_decay: float = constrained(0.1, minimum=0)
    """AdamW weight decay, applied to matrices only (not to norms and biases)."""
    betas: list[float] = constrained(
        default_factory=lambda: [0.9, 0.95], minItems=2, maxItems=2, items={"minimum": 0, "exclusiveMaximum": 1}
    )
    """AdamW betas."""
    grad_clip: float = constrained(1.0, minimum=0)
    """Clip the global gradient norm to this value; 0 disables clipping."""
    loss_chunk_size: int = constrained(0, minimum=0)
    """Tokens per chunk of the fused linear cross-entropy, which never materialises the full vocabulary-wide
    logits; 0 computes plain logits and cross-entropy."""
    seed: int = 0
    """Seed for model init, data order and synthetic tokens."""
    hang_timeout_s: Optional[float] = constrained(None, minimum=0, note="0: off; null: automatic")
    """Hang watchdog: with no training step finished for this long, every rank writes its Python stacks (all
    threads) to `<run>/hang/attempt-<n>-rank<r>.txt` and ends, and the run fails as `infrastructure`/`hang`, so
    `scaling.max_failures` (or the RayJob's backoff) restarts it from the last checkpoint. null: automatic, the
    larger of 600 s and 10x the slowest step after the first; 0: off. Armed from the training loop's start (the
    model, data and resume are built before). The first step (compilation, warm-up) and each phase between steps
    (held-out and task evaluation, checkpoint save, export) may take 6 timeouts, counted from its start, so a hang
    inside them is caught too, later."""
    loss_spike_factor: float = constrained(3.0, minimum=0)
    """Fail the run as `model`/`loss_spike` when the logged loss exceeds this factor x the median of the last 20
    logged losses (spikes left out, judged after 5) for `loss_spike_intervals` log intervals in a row. Checked
    where the loop reads the loss anyway (every `logging.every_steps`). 3 is far above the noise of a healthy
    run's interval means (tens of percent) and below a divergence (a fine-tune's loss of 2 back to ln(vocab),
    ~12); near-zero losses (memorised data) are noisier in ratio: raise it or set 0 (off) there."""
    loss_spike_intervals: int = constrained(3, minimum=1)
    """Consecutive log intervals above `loss_spike_factor` x the median that fail the run (one may be noise)."""
    objective: Literal["sft", "dpo"] = "sft"
    """`sft`: cross-entropy of the data's target tokens; `dpo`: Direct Preference Optimisation on `data.format:
    preference` pairs against the model as it starts (the reference policy, whose log-probabilities are computed
    once before the first step and kept beside the run); a step's loss is a mean over pairs, and `micro_batch_size`
    counts rows of `seq_len` tokens, each holding whole pairs (docs/preference.md)."""
    dpo: DpoConfig = field(default_factory=DpoConfig)
    """DPO's settings (`objective: dpo`)."""


@dataclass
class ParallelConfig:
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    """`bf16`: bf16 parameters and compute (fp32 master weights and optimizer state); `fp32`: full
    precision; `auto`: bf16 on GPU, fp32 on CPU."""
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """Precision in which gradients are summed across workers (FSDP's reduce-scatter, HSDP's all-reduce) before
    they reach the fp32 optimizer. `bf16` halves gradient traffic and the copies around it, as Hugging Face
    accelerate's FSDP bf16 policy does, but rounds every sum to bf16 (8 bits of mantissa)."""
    reshard_after_forward: bool = True
    """Free gathered parameters after each layer's forward (less memory, one more all-gather in backward)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of storing them."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory."""
    compile: bool = False
    """`torch.compile` each decoder layer."""
    fsdp: Literal["auto", "always"] = "auto"
    """`auto`: FSDP2 (`fully_shard`) with two or more workers; one worker trains the model unwrapped, as
    torchtitan does (on one device FSDP2 only adds copies of every parameter and gradient, 1-2% of a step), with
    FSDP2's numerics (each forward computes on bf16 copies of the fp32 weights, gradients reach the fp32 weights) and
    the same checkpoints (DCP, resharded onto any number of workers on resume). `always`: FSDP2 on one worker too
    (`cpu_offload` and `activation_checkpointing` imply it)."""
    shard_group_size: int = constrained(0, minimum=0)
    """Hybrid sharding (HSDP): shard the model within groups of this many workers (e.g. the GPUs of one node)
    and replicate it across groups, so only gradient all-reduces cross groups; 0 shards across all workers."""
    float8: Literal["none", "rowwise", "tensorwise"] = "none"
    """FP8 GEMMs in the decoder layers' linear projections (torchao float8 training; never on unless set):
    `rowwise` scales each row of the inputs and weights by its own power-of-two factor (the more accurate
    recipe), `tensorwise` one factor per tensor (faster, coarser); activations, weights and gradients are cast
    to float8 e4m3 per GEMM, the master weights, optimizer state and everything outside those layers stay as
    before. Skips the output head (`lm_head`, tied to the embeddings) and any linear layer whose input or output
    width is not a multiple of 16 (float8 GEMMs need it). Needs the `torchao` package, CUDA GPUs of compute
    capability 8.9 or newer (Ada, Hopper, Blackwell) and bf16 compute. Works best with `compile: true`."""


@dataclass
class ScalingConfig:
    num_workers: int = constrained(2, minimum=1)
    """Training workers (one per GPU when `use_gpu`)."""
    use_gpu: bool = False
    """Give each worker one GPU and use NCCL; otherwise CPU workers with gloo."""
    cpus_per_worker: float = constrained(1.0, exclusiveMinimum=0)
    """CPUs reserved per worker in Ray."""
    max_failures: int = constrained(0, minimum=0)
    """Worker-group failures to recover from (restarting from the latest checkpoint) before the run fails. 0
    fails at the first lost worker (local runs, CI); the chart's values.yaml sets 1 for clusters."""


@dataclass
class CheckpointConfig:
    every_steps: int = constrained(0, minimum=0)
    """Save a sharded checkpoint (model, optimizer, step, data position, RNG states, config) to
    `<storage_path>/<name>/checkpoint_<step>/` every N steps (0: only at the end; the last step always saves)."""
    keep_last: int = constrained(2, minimum=1)
    """Complete checkpoints to keep; older ones are deleted once a newer one is complete."""
    async_save: bool = True
    """`true`: training waits only while a save copies the state to host memory; the write goes on in the
    background and the checkpoint becomes complete (resumable) at the first log step after every worker's write
    has finished, or at the next save. `false`: training waits until each save is complete, so a run killed after
    step N resumes from N's checkpoint (for drills that need to know exactly where a run resumes)."""
    async_writer: Literal["auto", "process", "thread"] = "auto"
    """Where a save's write runs. `process`: in a writer process per worker, which reads the staged state from
    shared memory (`/dev/shm`), so writing never competes with training for the worker's Python interpreter (a
    writer thread holds the interpreter lock that launches training's kernels, slowing the steps beside it); needs
    `/dev/shm` room for every local worker's share of the model and optimizer state (the chart's
    `shm.sizeLimit`), else the run stops before its first step, saying how much. `thread`: in a thread of the
    worker, from ordinary (pinned) host memory. `auto`: `process` when `/dev/shm` has the room on every node,
    else `thread`; the choice and its reason are logged before the first step (`checkpoint_writer` record)."""
    resume: str = constrained("auto", pattern=r"\S")
    """`auto`: resume from the latest complete checkpoint of this run name if there is one (after a worker
    failure, a retried job or a re-run with the same name), else start fresh; `never`: start fresh, and fail
    if the run name already has checkpoints; any other value is a checkpoint directory or URI
    (`.../checkpoint_00000100`) to start from, used only while this run has no checkpoint of its own. A
    checkpoint that exists but cannot be read stops the run with an error naming it."""
    allow_changes: list[Literal["tokenizer", "data", "seq_len", "seed", "global_batch"]] = field(default_factory=list)
    """Differences from the checkpoint's run that a resume accepts. By default a resume refuses, naming the
    field, a checkpoint saved with another tokenizer, other data (file hashes, hub revisions, row counts),
    `train.seq_len`, `train.seed` or global batch (micro-batch x accumulation x workers): it would not continue
    the same run. List those you change on purpose, e.g. `[data]` to continue on new data, `[global_batch]`
    to resume on fewer workers without raising `train.grad_accum_steps` (the data order is then not exact).
    The model architecture can never change."""
    export: bool = True
    """At the end, save the trained model as Hugging Face safetensors (with its config and tokenizer) in
    `<storage_path>/<name>/export/`, reload it in a fresh process and check it (see `export_tolerance`)."""
    export_tolerance: float = constrained(0.01, exclusiveMinimum=0)
    """Largest accepted difference (nats per token) between the held-out loss of the reloaded export and the
    final in-training evaluation; a larger one fails the run."""


@dataclass
class DebugConfig:
    fail_at_step: Optional[int] = constrained(None, minimum=1)
    """Fault injection for tests and drills: rank `fail_rank` fails as `fail_mode` says when it reaches this
    step, once per run name (a marker under `<run>/faults/` stops it from firing again after the resume)."""
    fail_rank: int = constrained(0, minimum=0)
    """Rank that fails at `fail_at_step`."""
    fail_mode: Literal["kill", "exception", "disk_full", "hang", "loss_spike", "nan"] = "kill"
    """How it fails: `kill` SIGKILLs its process (a lost worker), `exception` raises a RuntimeError in the
    training loop (a bug), `disk_full` makes its write of the checkpoint of that step (a save step) fail with
    ENOSPC, as a full disk does, `hang` sleeps before the step's first collective (the others wait in it) until
    the hang watchdog ends it, `loss_spike` multiplies its logged loss by 10 from that step on (what the
    loss-spike check reads; the training itself is unchanged), `nan` makes it NaN (what the non-finite check
    reads, at the log step or before a save)."""
    profile_step: Optional[int] = constrained(None, minimum=1)
    """Profile this training step on rank 0 (torch.profiler): device time per kernel category (matmul,
    attention, compiled elementwise, optimizer, communication, copies) and the top kernels, written to
    `<run>/profile-step<N>.txt`, with a Chrome trace beside it (`.json.gz`)."""


@dataclass
class EvalConfig:
    every_steps: int = constrained(0, minimum=0)
    """Held-out loss and perplexity every N steps (0: only at the end)."""
    max_batches: int = constrained(16, minimum=0)
    """Held-out micro-batches per evaluation per worker (0: the whole held-out split)."""
    task: Optional[Literal["gsm8k"]] = None
    """Task evaluation by greedy generation on held-out rows, scored by exact match: `gsm8k` compares the
    final number (after `####` in the reference; after `####`, else the last number, in the generation).
    Needs `data.format: prompt_completion` or `chat`."""
    task_every_steps: int = constrained(0, minimum=0)
    """Run the task evaluation every N steps (0: only at the end)."""
    task_at_start: bool = True
    """Also run the task evaluation before the first training step, so every run records its score before
    and after training (skipped when the run resumes past step 0: the earlier attempt logged it)."""
    task_max_examples: int = constrained(64, minimum=0)
    """Held-out rows scored per task evaluation (0: all)."""
    task_batch_size: int = constrained(64, minimum=1)
    """Prompts generated together per worker (left-padded; one batch stops once all its rows produced EOS).
    Larger batches decode faster until the KV cache fills the GPU: about 29 KB per token of a Qwen2.5-1.5B."""
    task_max_new_tokens: int = constrained(160, minimum=1)
    """Most tokens generated per prompt (generation stops earlier at EOS)."""
    task_log_examples: int = constrained(3, minimum=0)
    """(question, expected, got) examples included in each `task_eval` metrics record."""
    sample_prompt: Optional[str] = None
    """Greedy-generate a short continuation of this prompt after training, as a sanity check."""
    sample_tokens: int = constrained(48, minimum=1)
    """Tokens to generate for `sample_prompt`."""


@dataclass
class MlflowConfig:
    tracking_uri: Optional[str] = None
    """MLflow tracking server (`http://mlflow.mlflow:5000`), or None for no MLflow. Set, the run logs its config
    as params, every metric of metrics.jsonl at its step, and at the end tags (status, failure class, image digest,
    chart version) and artifacts (run.json, report.md) to one MLflow run named after the run; a resumed attempt
    continues it (`job/records/tracking.py`). Needs the `mlflow-skinny` package: the chart adds it to `runtimeEnv.pip`."""
    experiment: str = "ray-finetune"
    """MLflow experiment the run is logged under (created when missing)."""


@dataclass
class LoggingConfig:
    every_steps: int = constrained(10, minimum=1)
    """Log training metrics every N steps (the only host-device sync in the hot loop)."""
    progress_bar: Literal["auto", "on", "off"] = "auto"
    """Progress bar of the training steps: under Ray the driver draws it (`ray.experimental.tqdm_ray`: the workers'
    stderr is never a terminal), under torchrun rank 0 on its stderr; `auto` shows it only when that stream is a
    terminal, so redirected output gets no bar redraws; `on` always (`true`, `false` mean `on`, `off`: YAML 1.1
    reads an unquoted on/off as a boolean). A terminal with no width (`script` without a terminal of its own)
    counts as none: tqdm draws nothing there."""
    peak_flops: Optional[float] = None
    """Peak dense bf16 FLOP/s per device for MFU; defaults to a table keyed by device name."""
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    """Where the metrics also go besides metrics.jsonl and the TensorBoard event files (`<run dir>/tensorboard/`,
    always written)."""


@dataclass
class ExpectConfig:
    transport: Optional[Literal["efa", "ib", "roce", "socket", "nvlink", "nvls", "p2p", "shm", "gloo"]] = None
    """Transport the preflight must find: between nodes `efa`, `ib`, `roce` or `socket`; within a node
    `nvlink`, `nvls`, `p2p` or `shm`; or the `gloo` backend (CPU). Anything else fails the run before training."""
    min_busbw_gbps: Optional[float] = None
    """Minimum all-reduce bus bandwidth (GB/s, nccl-tests definition) at the largest message size."""


@dataclass
class PreflightConfig:
    enabled: bool = False
    """Run the preflight checks (devices, collective bandwidth, NCCL transport) before training."""
    sizes_mib: list[int] = constrained(default_factory=lambda: [1, 16, 256, 1024], minItems=1, items={"minimum": 1})
    """Message sizes of the collective benchmark, in MiB."""
    iters: int = constrained(5, minimum=1)
    """Timed iterations per collective and size."""
    warmup: int = constrained(2, minimum=0)
    """Untimed iterations before timing."""
    expect: ExpectConfig = field(default_factory=ExpectConfig)
    """What the preflight must find, or the run fails before training starts."""


@dataclass
class PairsConfig:
    samples: int = constrained(8, minimum=2)
    """Answers sampled per question, scored by `eval.task`; decoded `eval.task_batch_size` rows at a time, at most
    `eval.task_max_new_tokens` each."""
    temperature: float = constrained(0.8, exclusiveMinimum=0)
    """Sampling temperature."""
    top_p: float = constrained(1.0, exclusiveMinimum=0, maximum=1)
    """Nucleus sampling: draw from the smallest set of tokens whose probability reaches `top_p` (1: all)."""
    per_question: int = constrained(1, minimum=1)
    """Most pairs per question: a distinct incorrect answer each, beside a correct sample (else the reference)."""


_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""A run name: one directory name, so `<storage_path>/<name>` stays inside `storage_path`."""


@dataclass
class RunConfig:
    name: str = constrained("", pattern=f"^({_RUN_NAME.pattern})?$")  # empty matches: the chart fills it in
    """Run name: checkpoints, metrics and the run record live under `<storage_path>/<name>/`. Re-running the
    same name resumes it. The chart sets it from the release name."""
    storage_path: str = "./runs"
    """Directory (local, a mounted PVC/NFS path) or `s3://` URI under which runs are stored."""
    mode: Literal["train", "preflight", "pairs"] = "train"
    """`train`: fine-tune (after the preflight when `preflight.enabled`); `preflight`: only the preflight; `pairs`:
    sample answers to `data.train`'s questions with `model.path` and write preference pairs (`pairs`)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The causal LM to train."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training and held-out data."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """FSDP2 sharding, precision and compilation."""
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    """Workers and their resources."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints and resume."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics logging."""
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    """Environment and network checks before training."""
    pairs: PairsConfig = field(default_factory=PairsConfig)
    """Preference pairs the model makes itself (`mode: pairs`)."""
    debug: DebugConfig = field(default_factory=DebugConfig)
    """Fault injection (tests and failure drills); leave unset in real runs."""


def validate(cfg: RunConfig) -> None:
    """The bounds each field declares (`_outside_bounds`), the run name, and the rules across fields (`rules.RULES`,
    which the chart checks too). Raises one `ConfigError` listing every problem, each naming its field, in the order
    of the config tree (as `python -m job schema` and the resolved config list the fields; `load_dict` puts them in
    the file's order), so one edit can fix them all."""
    errors = _outside_bounds(cfg)
    if not cfg.name:
        errors.append("name: required (the run name; the chart sets it from the release name)")
    elif not _RUN_NAME.fullmatch(cfg.name):
        errors.append(f"name: {cfg.name!r} must be one directory name of letters, digits, '.', '_' and '-', "
                      "starting with a letter or digit: the run directory is <storage_path>/<name>, and a name with "
                      "'/' or '..' would place it elsewhere")
    if not cfg.checkpoint.resume.strip():
        errors.append("checkpoint.resume: expected auto, never or a checkpoint directory/URI, got ''")
    errors += rules.broken(cfg)
    if errors:
        raise ConfigError(*_in_tree_order(errors))


def _outside_bounds(node: Any, prefix: str = "") -> list[str]:
    """Every value of the config tree outside the bounds its field declares (`constrained`), one line each."""
    problems = []
    for f in dataclasses.fields(node):
        value, path = getattr(node, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            problems += _outside_bounds(value, f"{path}.")
        elif value is not None and f.metadata.get("json_schema"):
            problems += _outside(path, value, f.metadata["json_schema"], f.metadata["note"])
    return problems


def _outside(path: str, value: Any, keywords: dict, note: str | None = None) -> list[str]:
    """`value` against JSON Schema's `keywords` for it: the problems, each naming `path`."""
    if isinstance(value, list):
        least, most = keywords.get("minItems", 0), keywords.get("maxItems")
        if len(value) < least or (most is not None and len(value) > most):
            wanted = ("a non-empty list" if (least, most) == (1, None) else f"{least} values" if least == most
                      else f"{least} to {most} values" if most is not None else f"at least {least} values")
            return [f"{path}: expected {wanted}, got {value}"]
        return [p for i, item in enumerate(value) for p in _outside(f"{path}[{i}]", item, keywords.get("items", {}))]
    if isinstance(value, str):
        return [f"{path}: must not be empty"] if len(value) < keywords.get("minLength", 0) else []
    low, low_open = keywords.get("exclusiveMinimum", keywords.get("minimum")), "exclusiveMinimum" in keywords
    high, high_open = keywords.get("exclusiveMaximum", keywords.get("maximum")), "exclusiveMaximum" in keywords
    if (low is None or value > low or (value == low and not low_open)) and \
            (high is None or value < high or (value == high and not high_open)):
        return []
    if low is not None and high is not None:
        bound = f"within {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    elif low is not None:  # a count from 1 reads as positive
        bound = f"> {low}" if low_open else "> 0" if (low, isinstance(value, int)) == (1, True) else f">= {low}"
    else:
        bound = f"< {high}" if high_open else f"<= {high}"
    return [f"{path}: must be {bound}{f' ({note})' if note else ''}, got {value}"]


@functools.cache
def _tree_order() -> dict[str, int]:
    """Dotted path of every config field, numbered in the order of the config tree."""
    order: dict[str, int] = {}

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            order[prefix + f.name] = len(order)
            for tp in (_hints(cls)[f.name], *typing.get_args(_hints(cls)[f.name])):
                if dataclasses.is_dataclass(tp):
                    walk(tp, f"{prefix}{f.name}.")

    walk(RunConfig, "")
    return order


def _in_order(messages: list[str], order: dict[str, int]) -> list[str]:
    """Messages sorted (stably) by the position in `order` of the field each names, or of its nearest parent
    listed there; messages naming none of them last."""
    def position(message: str) -> int:
        path = re.split(r"[:\[ ]", message, maxsplit=1)[0]
        while path and path not in order:
            path = path.rpartition(".")[0]
        return order.get(path, len(order))

    return sorted(messages, key=position)


def _in_tree_order(messages: list[str]) -> list[str]:
    return _in_order(messages, _tree_order())


def _file_order(raw: dict) -> dict[str, int]:
    """Dotted path of every key of a raw config mapping, numbered in the order the file gives them."""
    order: dict[str, int] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            order[f"{prefix}{key}"] = len(order)
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")

    walk(raw, "")
    return order


# --------------------------------------------------------------------------------------------------------------------
# Loading: dict → dataclasses, with dotted-path errors.
# --------------------------------------------------------------------------------------------------------------------


_YAML12_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in typing.get_args(tp))}]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Checks `value` against the annotation `tp` and returns it (dataclasses built from mappings)."""
    origin = typing.get_origin(tp)
    fail = ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, str) and hasattr(tp, "_shorthand"):
            value = {tp._shorthand: value}
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return _build(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            return _convert(value, arg, path)
    if origin is Literal:
        if isinstance(value, bool) and {"on", "off"} <= set(typing.get_args(tp)):
            return "on" if value else "off"  # YAML 1.1 (PyYAML, Helm's values) reads on/off as booleans
        if value in typing.get_args(tp):
            return value
        raise fail
    if origin is list:
        if not isinstance(value, list):
            raise fail
        (item,) = typing.get_args(tp)
        return [_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise fail
        _, item = typing.get_args(tp)
        return {k: _convert(v, item, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise fail
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise fail
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _YAML12_FLOAT.fullmatch(value):
            return float(value)  # PyYAML (YAML 1.1) reads `5e-3` as a string; YAML 1.2 and Helm read a float
        raise fail
    if tp is str:
        if isinstance(value, str):
            return value
        raise fail
    raise TypeError(f"{path}: unsupported annotation {tp}")  # a bug in this module, not in the input


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: type, raw: dict, prefix: str = "") -> Any:
    """The dataclass `cls` from a mapping; every unknown key and wrong type is collected into one `ConfigError`."""
    hints = _hints(cls)
    kwargs, errors = {}, []
    for key, value in raw.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in hints:
            known = ", ".join(sorted(hints))
            errors.append(f"{path}: unknown key (known keys here: {known})")
            continue
        try:
            kwargs[key] = _convert(value, hints[key], path)
        except ConfigError as e:
            errors += e.messages
    if errors:
        raise ConfigError(*errors)
    return cls(**kwargs)


def load_dict(raw: dict | None) -> RunConfig:
    """Builds and validates a `RunConfig` from a mapping (missing keys take their defaults)."""
    cfg = _build(RunConfig, raw or {})
    try:
        validate(cfg)
    except ConfigError as e:  # in the order of the file (a field it leaves at its default: where its section is)
        raise ConfigError(*_in_order(e.messages, _file_order(raw or {}))) from None
    return cfg


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Applies `a.b.c=value` overrides to a raw config mapping; values are parsed as YAML scalars."""
    raw = copy.deepcopy(raw or {})
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected dotted.key=value")
        node = raw
        *parents, leaf = key.split(".")
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(parents[: i + 1])}: cannot set {key}, this is not a mapping")
        try:
            node[leaf] = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML ({' '.join(str(e).split())})") from None
    return raw


def load(path: str, overrides: list[str] = ()) -> RunConfig:
    """Reads a YAML run config file, applies `--set` overrides, and validates the result."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file: {path}") from None
    except (IsADirectoryError, UnicodeDecodeError, PermissionError) as e:
        raise ConfigError(f"--config: cannot read {path} as a YAML file ({type(e).__name__})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config: {path} is not valid YAML: {e}") from None
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"--config: {path} must hold a mapping at the top level")
    return load_dict(apply_overrides(raw, list(overrides)))


def to_dict(cfg: RunConfig) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


# --------------------------------------------------------------------------------------------------------------------
# JSON Schema, for the chart's values.schema.json.
# --------------------------------------------------------------------------------------------------------------------


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal after each field) of a dataclass, read from its source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


_FLOAT_PATTERN = f"^{_YAML12_FLOAT.pattern}$"


def _default(f: dataclasses.Field) -> Any:
    """A field's default as JSON (MISSING for nested dataclasses, whose fields carry their own)."""
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return dataclasses.MISSING if dataclasses.is_dataclass(value) else value


def _schema(tp: Any) -> dict:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        docs = _field_docs(tp)
        props = {}
        for f in dataclasses.fields(tp):
            prop = _schema(_hints(tp)[f.name])
            for key, value in f.metadata.get("json_schema", {}).items():
                prop[key] = {**prop[key], **value} if key == "items" else value
            if (default := _default(f)) is not dataclasses.MISSING:
                prop["default"] = default
            props[f.name] = {**prop, "description": docs[f.name]}
        obj = {"type": "object", "additionalProperties": False, "properties": props}
        if hasattr(tp, "_shorthand"):  # a string stands for {<_shorthand>: string}, with that field's bounds
            bounds = {k: v for k, v in props[tp._shorthand].items() if k not in ("type", "default", "description")}
            return {"anyOf": [{"type": "string", **bounds}, obj]}
        return obj
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        schema = _schema(inner)
        if "enum" in schema:
            return {"enum": [*schema["enum"], None]}
        if "anyOf" in schema:
            return {"anyOf": [*schema["anyOf"], {"type": "null"}]}
        types_ = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        return {**schema, "type": [*types_, "null"]}
    if origin is Literal:
        values = list(typing.get_args(tp))
        return {"enum": values + [True, False] if {"on", "off"} <= set(values) else values}  # on/off read as booleans
    if origin is list:
        return {"type": "array", "items": _schema(typing.get_args(tp)[0])}
    if origin is dict:
        return {"type": "object"}
    if tp is float:
        # A number, or its YAML 1.2 spelling as a string: Helm's `--set train.lr=2e-5` passes a string (the
        # chart renders it as a number); bounds apply to numbers, the pattern to strings.
        return {"type": ["number", "string"], "pattern": _FLOAT_PATTERN}
    return {bool: {"type": "boolean"}, int: {"type": "integer"}, str: {"type": "string"}}[tp]


def json_schema() -> dict:
    """JSON Schema of the run config: types, enums, no unknown keys, defaults and the fields' `constrained`
    keywords; cross-field checks stay in `validate`."""
    return _schema(RunConfig)
