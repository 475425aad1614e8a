"""What differs between two runs' records (`python -m job compare RUN_A RUN_B`): image, runtime env, packages,
config, data and hardware decide whether the environments are identical; results are shown beside them."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Iterable, Mapping

from .. import storage
from ..records.environment import UNKNOWN
from ..records.run_record import RUN_RECORD, flatten, later_attempts_line, load_record
from .runs import RunsError, resolve_run

# Groups whose differences make two runs' environments "not identical" (exit status 1).
ENVIRONMENT_GROUPS = ("image", "runtime_env", "packages", "config", "data", "hardware")
# Config keys that name or place the run rather than define it (job/config.py's RunConfig.name
# and .storage_path); ignored by default, `--ignore-config` replaces the list.
DEFAULT_IGNORED_CONFIG = ("name", "storage_path", "run_name", "run.name")
_RESULT_KEYS = ("method", "lora_rank", "quantize_base", "base_gib", "trainable_params", "final_eval_loss", "best_eval_loss", "final_train_loss", "tokens_per_s_per_device",
                "tokens_per_s", "mfu", "peak_mem_gib", "steps")


def _diff(a: Mapping, b: Mapping, ignore: Iterable[str] = ()) -> list[tuple[str, Any, Any]]:
    ignore = set(ignore)
    keys = sorted(set(a) | set(b))
    return [(k, a.get(k), b.get(k)) for k in keys if k not in ignore and a.get(k) != b.get(k)]


def _transport_signature(record: dict) -> list[str]:
    per_rank = (record.get("transport") or {}).get("per_rank") or []
    return sorted({f"{r.get('backend')}:{r.get('net')}:{'+'.join(r.get('intra_node') or [])}" for r in per_rank})


def compare_records(a: dict, b: dict, *, ignore_config: Iterable[str] = DEFAULT_IGNORED_CONFIG) -> dict:
    """Differences between two run records, grouped: `{"image", "runtime_env", "packages", "config", "data",
    "hardware", "results"}`, each a list of `(key, value_in_a, value_in_b)`.

    Package keys are distribution names (None: not installed on that side); config and data keys dotted paths (the
    weights' fingerprint counts as data). `results` (losses, throughput, MFU, goodput, phases) is informational and
    never makes environments differ; hostnames, times and bandwidth figures are not compared.
    """
    img_a, img_b = a.get("image") or {}, b.get("image") or {}
    hw_a, hw_b = a.get("hardware") or {}, b.get("hardware") or {}

    def hw(record, h):
        return {"nodes": h.get("nodes"), "world_size": h.get("world_size"),
                "accelerators": h.get("accelerators"), "driver_versions": h.get("driver_versions"),
                "cuda_version": h.get("cuda_version"), "nccl_version": h.get("nccl_version"),
                "transport": _transport_signature(record)}

    def packages(record):
        out = dict(record.get("packages") or {})
        out["(python)"] = (record.get("software") or {}).get("python")
        out["(job)"] = (record.get("job") or {}).get("version")
        return out

    def runtime_env(record):
        section = record.get("runtime_env") or {}
        flat = flatten({"requested": section.get("requested") or {}, "packages": section.get("packages") or {}})
        flat["installed_at_start"] = section.get("installed_at_start")
        return {k: v for k, v in flat.items() if v != {}}

    def config(record):
        flat = flatten(record.get("config") or {})
        flat["(seed)"] = record.get("seed")
        return flat

    def data(record):
        d = record.get("data") or {}
        flat = flatten(d.get("fingerprint") or {})
        flat["(tokenizer_sha256)"] = d.get("tokenizer_sha256")
        weights = {k: v for k, v in (record.get("weights") or {}).items() if k != "provenance"}
        flat.update({f"(weights).{k}": v for k, v in flatten(weights).items()})
        return flat

    def timing(record):
        t = record.get("time") or {}
        return {"goodput": t.get("goodput"), "wall_s": t.get("wall_s"),
                **{f"time.{k}": v for k, v in (t.get("phases_s") or {}).items()},
                **{f"time.startup.{k}": v for k, v in (t.get("startup_s") or {}).items()}}

    ma, mb = a.get("metrics") or {}, b.get("metrics") or {}
    results = [(k, ma.get(k), mb.get(k)) for k in _RESULT_KEYS if ma.get(k) != mb.get(k)]
    results += _diff(*(flatten({"preference": m.get("preference") or {}}) for m in (ma, mb)))
    results += _diff(timing(a), timing(b))
    def ending(record):
        err = record.get("error")
        return f"{err.get('class')}/{err.get('reason')}" if isinstance(err, dict) else err

    if ending(a) != ending(b):
        results.insert(0, ("error", ending(a), ending(b)))
    if a.get("status") != b.get("status"):
        results.insert(0, ("status", a.get("status"), b.get("status")))
    return {
        "image": _diff({"reference": img_a.get("reference"), "digest": img_a.get("digest")},
                       {"reference": img_b.get("reference"), "digest": img_b.get("digest")}),
        "runtime_env": _diff(runtime_env(a), runtime_env(b)),
        "packages": _diff(packages(a), packages(b)),
        "config": _diff(config(a), config(b), ignore_config),
        "data": _diff(data(a), data(b)),
        "hardware": _diff(hw(a, hw_a), hw(b, hw_b)),
        "results": results,
    }


def _show(value, width: int = 60) -> str:
    text = "-" if value is None else (value if isinstance(value, str) else json.dumps(value, default=str))
    return text if len(text) <= width else text[: width - 3] + "..."


def _delta(a, b) -> str:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        d = b - a
        pct = f", {d / a * 100:+.1f}%" if a else ""
        return f"  ({d:+.4g}{pct})"
    return ""


def format_comparison(diffs: dict, a: dict, b: dict, name_a: str, name_b: str) -> str:
    """Concise text of `compare_records` output."""
    out = []
    for side, name, record in (("A", name_a, a), ("B", name_b, b)):
        later = later_attempts_line(record)
        out.append(f"{side}: {name}  ({record.get('run_name')}, {record.get('status')}{'; ' + later if later else ''})")
    labels = {"image": "image", "runtime_env": "runtime env", "packages": "packages", "config": "config", "data": "data",
              "hardware": "hardware/transport", "results": "results"}
    for group, label in labels.items():
        rows = diffs[group]
        if not rows:
            note = ""
            if group == "image" and (a.get("image") or {}).get("digest") == UNKNOWN:
                note = " (digest unknown in both: cannot be verified)"
            if group != "results":
                out.append(f"{label}: identical{note}")
            continue
        out.append(f"{label}: {len(rows)} differ" if group != "results" else f"{label}:")
        for key, va, vb in rows:
            out.append(f"  {key}: {_show(va)} -> {_show(vb)}{_delta(va, vb) if group == 'results' else ''}")
    differing = [labels[g] for g in ENVIRONMENT_GROUPS if diffs[g]]
    out.append("verdict: environments differ in " + ", ".join(differing) if differing
               else "verdict: environments identical")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    """`python -m job compare RUN_A RUN_B [--storage STORAGE] [--ignore-config KEY ...]`; `argv` excludes "compare".

    Prints the grouped differences; exit status 0 environments identical, 1 they differ, 2 bad input.
    """
    parser = argparse.ArgumentParser(prog="python -m job compare",
                                     description="Compare the run records (run.json) of two runs.")
    parser.add_argument("run_a", help="run directory (local or s3://) holding run.json, or with --storage a run name")
    parser.add_argument("run_b")
    parser.add_argument("--storage", help="storage path whose runs bare names are (python -m job runs STORAGE lists them)")
    parser.add_argument("--ignore-config", action="append", default=None, metavar="KEY",
                        help=f"dotted config key to ignore (default: {', '.join(DEFAULT_IGNORED_CONFIG)})")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0
    records = []
    try:
        args.run_a, args.run_b = (resolve_run(arg, args.storage) for arg in (args.run_a, args.run_b))
    except RunsError as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 2
    for path in (args.run_a, args.run_b):
        try:
            records.append(load_record(path))
        except FileNotFoundError as exc:
            print(f"compare: {exc}", file=sys.stderr)
            return 2
        except (OSError, ValueError) as exc:
            print(f"compare: cannot read {storage.join(path, RUN_RECORD)}: {exc}", file=sys.stderr)
            return 2
    ignore = DEFAULT_IGNORED_CONFIG if args.ignore_config is None else tuple(args.ignore_config)
    diffs = compare_records(records[0], records[1], ignore_config=ignore)
    print(format_comparison(diffs, records[0], records[1], args.run_a, args.run_b))
    return 1 if any(diffs[g] for g in ENVIRONMENT_GROUPS) else 0
