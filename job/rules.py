"""The run config's rules across fields, declared once (`RULES`).

Types, enums and bounds are declared on each field (`config.py`); what no single field can say is a rule here: a
`Rule` names the field its message leads with, the condition under which the config breaks it (`broken_when`, an
expression over the config's dotted fields), and what it says. The job checks them at load (`config.validate`,
through `broken`); `scripts/gen-values-schema.py` compiles the same declarations into the chart's
`templates/_run-rules.tpl`, so `helm install` refuses what the job would refuse, with the same message (each field
path prefixed `run.`).

The expressions are Python's syntax, read by `ast` and evaluated here, never `eval`ed; what they may use is what
both sides can compute the same way: dotted fields (null where a parent is null), literals, `and`/`or`/`not`,
comparisons (`==` and `!=` treat a null field as unequal to any value; order a nullable field only after
`is not None`), `in` a literal tuple, `%` and `*`, and the functions of `FUNCTIONS`. A message's `{dotted.field}`
is the field's value (`!r`: quoted); a literal brace is doubled.
"""

from __future__ import annotations

import ast
import dataclasses
import decimal
import functools
import json
import re
from typing import Any

SOURCES = ("train", "validation", "task_source")
"""The data source fields (`data.train`, `data.validation`, `data.task_source`), whose rules are the same."""
PROMPT_FIELDS = r"([^{}]|\{[A-Za-z_][A-Za-z0-9_]*(![^:{}])?(:([^{}]|\{[^{}]*\})*)?\})*"
"""A `data.prompt_template` with `{{` and `}}` taken out: Python format fields naming columns ({name}, {name!r},
{name:spec}), nothing else in braces."""


def is_hub_source(path: Any) -> bool:
    """`hf:owner/name`: a dataset on the Hugging Face hub, read with `datasets` (`hf://` is an fsspec file path)."""
    return isinstance(path, str) and path.startswith("hf:") and not path.startswith("hf://")


FUNCTIONS = {
    "hub": is_hub_source,
    "starts": lambda text, prefix: isinstance(text, str) and text.startswith(prefix),
    "count": lambda text, part: text.count(part),
    "format_fields_ok": lambda text: re.fullmatch(PROMPT_FIELDS, text.replace("{{", "").replace("}}", "")) is not None,
}
"""What a rule may call (the chart's generator has each in Helm's template functions too)."""


@dataclasses.dataclass(frozen=True)
class Rule:
    field: str
    """The field the message leads with: the one to change."""
    broken_when: str
    """When the config breaks the rule (see the module docstring)."""
    says: str
    """The message after `<field>: `."""

    @functools.cached_property
    def condition(self) -> ast.expr:
        return ast.parse(self.broken_when, mode="eval").body

    def broken(self, cfg) -> bool:
        return bool(_evaluate(self.condition, cfg))

    def message(self, cfg) -> str:
        def value(match: re.Match) -> str:
            return match[0][0] if match[0] in ("{{", "}}") else _shown(_lookup(cfg, match[1]), match[2])

        return f"{self.field}: " + PLACEHOLDER.sub(value, self.says)


def broken(cfg) -> list[str]:
    """The message of every rule `cfg` breaks, in the order declared."""
    return [rule.message(cfg) for rule in RULES if rule.broken(cfg)]


def _real(condition: str) -> str:
    return f"data.format != 'synthetic' and {condition}"


_NO_HELDOUT = "data.validation is None and data.validation_fraction == 0"
_NEEDS_HELDOUT = "needs held-out data: set data.validation or data.validation_fraction > 0"


def _source_rules(key: str) -> list[Rule]:
    src, path = f"data.{key}", f"data.{key}.path"
    file = _real(f"{src} is not None and not hub({path})")
    return [
        Rule(path, _real(f"{src} is not None and hub({path}) and count({path}, '/') != 1"),
             f"expected hf:owner/name, got {{{path}!r}}"),
        *(Rule(f"{src}.{option}", f"{file} and {src}.{option} is not None",
               f"only for hub sources (hf:owner/name), not {{{path}!r}}") for option in ("revision", "subset")),
        Rule(f"{src}.split", f"{file} and {src}.split != 'train'", f"only for hub sources (hf:owner/name), not {{{path}!r}}"),
        Rule(path, _real(f"starts({path}, 'builtin:') and {path} != 'builtin:python-docs'"),
             f"unknown builtin source {{{path}!r}} (known: builtin:python-docs)"),
        Rule(path, _real(f"starts({path}, 'builtin:') and data.format != 'text'"),
             "builtin:python-docs is plain text, for data.format: text only"),
    ]


RULES = (
    Rule("train.warmup_steps", "train.warmup_steps >= train.max_steps",
         "{train.warmup_steps} must be below train.max_steps ({train.max_steps})"),
    Rule("train.loss_spike_factor", "0 < train.loss_spike_factor <= 1",
         "must be 0 (off) or > 1, got {train.loss_spike_factor}"),
    Rule("model.path", "model.init == 'pretrained' and model.path is None",
         "required with model.init: pretrained (or set model.init: random)"),
    Rule("model.preset", "model.init == 'random' and model.path is None and model.preset is None",
         "model.init: random needs an architecture: set model.preset or model.path"),
    Rule("model.preset", "model.preset is not None and model.path is not None",
         "give either model.preset or model.path, not both"),
    Rule("model.sdpa_backend", "model.sdpa_backend is not None and model.attn_implementation != 'sdpa'",
         "needs model.attn_implementation: sdpa, not {model.attn_implementation}"),
    Rule("model.train_tokenizer_vocab", "model.train_tokenizer_vocab is not None and model.tokenizer is not None",
         "contradicts model.tokenizer: load a tokenizer or train one"),
    Rule("model.tokenizer", _real("model.tokenizer is None and model.path is None and model.train_tokenizer_vocab is None"),
         "real data needs a tokenizer: set model.tokenizer, model.path or model.train_tokenizer_vocab"),
    Rule("model.lora.quantize_base", "model.lora.quantize_base is not None and model.lora.rank is None",
         "{model.lora.quantize_base} quantizes LoRA's frozen base, and model.lora.rank is null (a full fine-tune "
         "trains every weight); set model.lora.rank (QLoRA) or model.lora.quantize_base: null"),
    Rule("model.lora.quantize_base", "model.lora.quantize_base is not None and parallel.float8 != 'none'",
         "{model.lora.quantize_base} does not run with parallel.float8: {parallel.float8} (the 4-bit base is "
         "dequantized to bf16 for its GEMMs; float8 would quantize it again); set parallel.float8: none"),
    Rule("model.lora.quantize_base", "model.lora.quantize_base is not None and parallel.cpu_offload",
         "{model.lora.quantize_base} is not supported with parallel.cpu_offload (the 4-bit base already takes about "
         "a quarter of a bf16 base's memory; FSDP2's offload of its shards is untested); set parallel.cpu_offload: false"),
    Rule("model.lora.rank", "model.lora.rank is not None and model.lora.quantize_base is None "
         "and parallel.float8 != 'none'",
         "LoRA does not run with parallel.float8: {parallel.float8} (the frozen weights would be cast to float8 in "
         "every GEMM and the adapters' small GEMMs gain nothing); set parallel.float8: none or model.lora.rank: null"),
    Rule("model.lora.merged_export", "model.lora.rank is None and model.lora.merged_export",
         "merges adapters, and model.lora.rank is null (a full fine-tune, whose export is already full weights)"),
    Rule("model.lora.merged_export", "model.lora.merged_export and not checkpoint.export",
         "needs checkpoint.export: true (the merged weights are part of the export)"),
    *(Rule(f"data.{key}", f"data.format == 'synthetic' and data.{key} is not None",
           "synthetic data takes no source (set data.format: text to train on it)") for key in SOURCES),
    Rule("data.train", _real("data.train is None"), "required with data.format: {data.format}"),
    *(rule for key in SOURCES for rule in _source_rules(key)),
    Rule("data.prompt_template", "data.format == 'prompt_completion' and not format_fields_ok(data.prompt_template)",
         "fields must be column names like {{prompt}}, got {data.prompt_template!r}"),
    Rule("data.chat_template", "data.chat_template is not None and data.format != 'chat'",
         "only used with data.format: chat"),
    Rule("parallel.shard_group_size", "parallel.shard_group_size > 0 and scaling.num_workers % parallel.shard_group_size != 0",
         "{parallel.shard_group_size} must be 0 or divide scaling.num_workers ({scaling.num_workers})"),
    Rule("parallel.compile", "parallel.cpu_offload and parallel.compile",
         "not supported together with parallel.cpu_offload"),
    Rule("parallel.mixed_precision", "parallel.mixed_precision == 'bf16' and not scaling.use_gpu",
         "bf16 needs scaling.use_gpu: true (CPU runs use fp32)"),
    Rule("parallel.float8", "parallel.float8 != 'none' and not scaling.use_gpu",
         "{parallel.float8} needs scaling.use_gpu: true (float8 GEMMs run on CUDA GPUs of compute capability >= 8.9)"),
    Rule("parallel.float8", "parallel.float8 != 'none' and scaling.use_gpu and parallel.mixed_precision == 'fp32'",
         "{parallel.float8} needs bf16 compute (parallel.mixed_precision: auto or bf16), not fp32"),
    Rule("checkpoint.every_steps", "checkpoint.every_steps > train.max_steps",
         "{checkpoint.every_steps} is longer than the run (train.max_steps {train.max_steps}), so no checkpoint would "
         "come before the last step; set it to at most train.max_steps, or 0 to save only at the end"),
    Rule("checkpoint.export", _real(f"{_NO_HELDOUT} and eval.task is None and checkpoint.export"),
         f"the export's acceptance check (its held-out loss against the final evaluation's) {_NEEDS_HELDOUT}, or set "
         "checkpoint.export: false"),
    Rule("eval.every_steps", _real(f"{_NO_HELDOUT} and eval.task is None and eval.every_steps > 0"),
         f"evaluation {_NEEDS_HELDOUT}"),
    Rule("eval.task", "data.format == 'synthetic' and eval.task is not None",
         "task evaluation needs real data (data.format: prompt_completion or chat)"),
    Rule("eval.task", _real("eval.task is not None and data.format not in ('prompt_completion', 'chat', 'preference')"),
         "needs data.format prompt_completion or chat, not {data.format}"),
    Rule("eval.task", _real("eval.task is not None and data.format == 'preference' and data.task_source is None"),
         "held-out pairs carry no reference answer: set data.task_source (rows with data.columns.prompt and "
         "data.columns.completion, e.g. the GSM8K test split)"),
    Rule("eval.task", _real(f"eval.task is not None and mode == 'train' and data.task_source is None and {_NO_HELDOUT}"),
         "needs held-out rows: set data.validation or data.validation_fraction > 0"),
    Rule("data.task_source", "data.task_source is not None and eval.task is None",
         "only read for eval.task: set eval.task or remove data.task_source"),
    Rule("train.objective", "train.objective == 'dpo' and data.format != 'preference'",
         "dpo trains on preference pairs: needs data.format: preference, not {data.format}"),
    Rule("data.format", "data.format == 'preference' and mode == 'train' and train.objective != 'dpo'",
         "preference pairs are trained with train.objective: dpo, not {train.objective}"),
    Rule("mode", "mode == 'pairs' and data.format not in ('prompt_completion', 'chat')",
         "pairs samples answers to data.train's questions: needs data.format prompt_completion or chat, not "
         "{data.format}"),
    Rule("mode", "mode == 'pairs' and eval.task is None",
         "pairs scores each sampled answer with a task: set eval.task (gsm8k)"),
    Rule("eval.sample_prompt", "eval.sample_prompt is not None and data.format == 'synthetic'",
         "synthetic data has no tokenizer to encode a prompt"),
    Rule("debug.fail_at_step", "debug.fail_at_step is not None and debug.fail_at_step > train.max_steps",
         "must be within [1, train.max_steps={train.max_steps}], got {debug.fail_at_step}"),
    Rule("debug.fail_at_step",
         "debug.fail_mode == 'disk_full' and debug.fail_at_step is not None and debug.fail_at_step != train.max_steps "
         "and (checkpoint.every_steps == 0 or debug.fail_at_step % checkpoint.every_steps != 0)",
         "debug.fail_mode disk_full needs a save step (a multiple of checkpoint.every_steps="
         "{checkpoint.every_steps}, or train.max_steps), got {debug.fail_at_step}"),
    Rule("debug.fail_mode", "debug.fail_mode == 'hang' and debug.fail_at_step is not None and train.hang_timeout_s == 0",
         "hang needs its check on: train.hang_timeout_s is 0"),
    Rule("debug.fail_mode",
         "debug.fail_mode == 'loss_spike' and debug.fail_at_step is not None and train.loss_spike_factor == 0",
         "loss_spike needs its check on: train.loss_spike_factor is 0"),
    Rule("debug.profile_step", "debug.profile_step is not None and debug.profile_step > train.max_steps",
         "must be within [1, train.max_steps={train.max_steps}], got {debug.profile_step}"),
    Rule("debug.fail_rank", "scaling.num_workers >= 1 and debug.fail_rank >= scaling.num_workers",
         "must be within [0, scaling.num_workers={scaling.num_workers}), got {debug.fail_rank}"),
)


# --------------------------------------------------------------------------------------------------------------------
# Evaluation (the job's side; the chart's is compiled by scripts/gen-values-schema.py)
# --------------------------------------------------------------------------------------------------------------------

PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([a-z_][a-z0-9_.]*)(!r)?\}")
"""In a message: a doubled brace (a literal one), or a field's value (`!r`: quoted)."""


def dotted(node: ast.expr) -> str | None:
    """`a.b.c` of a name or attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _lookup(cfg, path: str) -> Any:
    value = cfg
    for part in path.split("."):
        if value is None:
            return None
        value = getattr(value, part)
    return value


_COMPARE = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Lt: lambda a, b: a < b,
            ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
            ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b, ast.Is: lambda a, b: a is b,
            ast.IsNot: lambda a, b: a is not b}


def _evaluate(node: ast.expr, cfg) -> Any:
    if (path := dotted(node)) is not None:
        return _lookup(cfg, path)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        return tuple(_evaluate(e, cfg) for e in node.elts)
    if isinstance(node, ast.BoolOp):
        values = (_evaluate(v, cfg) for v in node.values)
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return not _evaluate(node.operand, cfg)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mod, ast.Mult)):
        left, right = _evaluate(node.left, cfg), _evaluate(node.right, cfg)
        return left % right if isinstance(node.op, ast.Mod) else left * right
    if isinstance(node, ast.Compare):
        left = _evaluate(node.left, cfg)
        for op, comparator in zip(node.ops, node.comparators):
            right = _evaluate(comparator, cfg)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS:
        return FUNCTIONS[node.func.id](*(_evaluate(a, cfg) for a in node.args))
    raise ValueError(f"rules: {ast.unparse(node)!r} is not part of the rules' language")


def go_float(value: float) -> str:
    """`value` as Go's `%v` prints a float64 (what the chart's message shows): the shortest digits that read back,
    in exponent form from 1e+06 up and below 1e-04 (`1e+06`, `2e-05`), else plain with no trailing `.0`."""
    digits = decimal.Decimal(repr(float(value))).normalize()
    sign, numbers, exponent = digits.as_tuple()
    point = len(numbers) + exponent  # digits before the decimal point
    if digits.is_zero():
        return "0"
    if point - 1 < -4 or point - 1 >= 6:
        mantissa = "".join(map(str, numbers))
        mantissa = mantissa[0] + ("." + mantissa[1:] if len(mantissa) > 1 else "")
        return f"{'-' if sign else ''}{mantissa}e{point - 1:+03d}"
    return format(digits, "f")


def _shown(value: Any, quoted: str | None) -> str:
    if quoted:
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return go_float(value)
    return str(value)
