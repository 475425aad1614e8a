"""Run report: `python -m job report RUN_DIR [--out DIR] [--no-plots]`, or `report --storage STORAGE NAME`.

From `run.json`, `metrics.jsonl` and the logs (local or `s3://`), writes `report.md` and, when the metrics have those series,
`loss.png`, `throughput.png`, `mfu.png` into `--out` (default: a local run directory, else `./<run name>-report`).
Plots need matplotlib, an optional extra imported only to draw them; without it report.md says so in one line
(the same curves are in the run's TensorBoard files).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from .. import storage
from ..records import failures, run_record
from . import runs

# Config keys worth showing first (matched against the last part of the dotted path).
_HIGHLIGHT_WORDS = ("model", "name_or_path", "pretrained", "lr", "learning_rate", "batch", "seq", "steps",
                    "epochs", "seed", "precision", "dtype", "source", "format", "shard", "warmup", "objective", "beta")


class ReportError(RuntimeError):
    """A report cannot be produced (missing inputs or plotting library)."""


def load_pyplot():
    """Import matplotlib with the file-only Agg backend; `ReportError` with the fix if missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ReportError(f"no plots: matplotlib is not installed ({exc}); `pip install matplotlib` adds them, "
                          f"`tensorboard --logdir <run dir>/tensorboard` shows the same curves") from None
    return plt


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _pct(value: Any) -> str:
    return "-" if not isinstance(value, (int, float)) else f"{value * 100:.1f}%"


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)):
        return "-"
    s = int(seconds)
    return f"{s // 3600}h {s % 3600 // 60}m {s % 60}s" if s >= 3600 else f"{s // 60}m {s % 60}s"


def _method(summary: dict) -> str:
    """`full fine-tune`, `LoRA (rank r)`, `QLoRA (rank r, nf4 base)`, or `-` for records from before the method was
    logged."""
    method = summary.get("method")
    if method == "lora":
        return f"LoRA (rank {summary.get('lora_rank')})"
    if method == "qlora":
        return f"QLoRA (rank {summary.get('lora_rank')}, {summary.get('quantize_base')} base)"
    return "full fine-tune" if method == "full" else "-"


def config_highlights(config: dict, limit: int = 16) -> list[tuple[str, Any]]:
    """Leaf values of the config whose key looks important (model, lr, batch, steps, ...)."""
    flat = run_record.flatten(config or {})
    chosen = [(k, v) for k, v in flat.items()
              if any(w in k.rsplit(".", 1)[-1].lower() for w in _HIGHLIGHT_WORDS)]
    if not chosen:
        chosen = list(flat.items())
    return chosen[:limit]


def plot_metrics(rows: list[dict], out_dir: str) -> list[str]:
    """Draw loss / throughput / MFU plots from metrics rows; return the written file names."""
    plt = load_pyplot()
    train = sorted((r for r in rows if r.get("kind") == "train" and "step" in r), key=lambda r: r["step"])
    evals = sorted((r for r in rows if r.get("kind") == "eval" and r.get("eval_loss") is not None),
                   key=lambda r: r["step"])

    def series(items, key):
        pts = [(r["step"], r[key]) for r in items if isinstance(r.get(key), (int, float))]
        return [p[0] for p in pts], [p[1] for p in pts]

    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name), dpi=100)
        plt.close(fig)
        written.append(name)

    sx, sy = series(train, "loss")
    ex, ey = series(evals, "eval_loss")
    if sx or ex:
        fig, ax = plt.subplots(figsize=(7, 4))
        if sx:
            ax.plot(sx, sy, label="train loss", linewidth=1)
        if ex:
            ax.plot(ex, ey, "o-", label="eval loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title("Loss")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "loss.png")

    tx, ty = series(train, "tokens_per_s_per_device")
    if tx:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(tx, ty, linewidth=1)
        ax.set_xlabel("step")
        ax.set_ylabel("tokens/s per device")
        ax.set_title("Throughput")
        ax.grid(alpha=0.3)
        save(fig, "throughput.png")

    mx, my = series(train, "mfu")
    if mx:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(mx, [v * 100 for v in my], linewidth=1)
        ax.set_xlabel("step")
        ax.set_ylabel("MFU (%)")
        ax.set_title("Model FLOPs utilisation")
        ax.grid(alpha=0.3)
        save(fig, "mfu.png")

    tasks = sorted((r for r in rows if r.get("kind") == "task_eval"), key=lambda r: r["step"])
    if tasks:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["step"] for r in tasks], [100 * r["exact_match"] for r in tasks], "o-")
        ax.set_xlabel("step")
        ax.set_ylabel("exact match (%)")
        ax.set_title(f"Task score ({tasks[-1]['task']}, n={tasks[-1]['n']})")
        ax.grid(alpha=0.3)
        save(fig, "task.png")

    time_rows = [r for r in rows if r.get("kind") == "time"]
    if time_rows:
        phases = time_rows[-1]["phases_s"]
        fig, ax = plt.subplots(figsize=(8, 3))
        left = 0.0
        for name, seconds in phases.items():
            if seconds > 0:
                ax.barh([0], [seconds], left=left, label=f"{name} {seconds:.0f} s")
                left += seconds
        ax.set_yticks([])
        ax.set_xlabel("seconds since the driver started")
        ax.set_title(f"Where the wall time went (goodput {time_rows[-1]['goodput']:.0%})")
        ax.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.6))
        save(fig, "time.png")
    return written


def before_after(rows: list[dict], n_examples: int = 3) -> list[str]:
    """Markdown: held-out loss, perplexity and task score before training and at the end, and a few generations
    of the same questions side by side."""
    evals = sorted((r for r in rows if r.get("kind") == "eval"), key=lambda r: r["step"])
    tasks = sorted((r for r in rows if r.get("kind") == "task_eval"), key=lambda r: r["step"])
    if not evals and not tasks:
        return []
    first_step = min(r["step"] for r in evals + tasks)
    last_step = max(r["step"] for r in evals + tasks)
    at = lambda items, step: next((r for r in items if r["step"] == step), {})  # noqa: E731
    lines = ["## Before and after", "", f"| | step {first_step} | step {last_step} |", "|---|---|---|"]
    for label, items, key in (("held-out loss", evals, "eval_loss"), ("held-out perplexity", evals, "eval_ppl"),
                              *((f"held-out {k[5:].replace('_', ' ')}", evals, k) for k in run_record.PREFERENCE_KEYS),
                              ("exact match", tasks, "exact_match")):
        if any(key in r for r in items):
            lines.append(f"| {label} | {_fmt(at(items, first_step).get(key))} | {_fmt(at(items, last_step).get(key))} |")
    if tasks:
        lines.append(f"| task examples scored | {_fmt(at(tasks, first_step).get('n'))} | {_fmt(at(tasks, last_step).get('n'))} |")
        before = {x["question"]: x for x in at(tasks, first_step).get("examples", [])}
        pairs = [(before[x["question"]], x) for x in at(tasks, last_step).get("examples", []) if x["question"] in before]
        if pairs and first_step != last_step:
            lines += ["", "| question | expected | before | after |", "|---|---|---|---|"]
            flat = lambda t: " ".join(str(t).split()).replace("|", "\\|")  # noqa: E731
            cell = lambda t: flat(t)[-160:]  # noqa: E731  (the end of a solution holds its answer)
            for b, a in pairs[:n_examples]:
                lines.append(f"| {flat(a['question'])[:160]} | {a['expected']} | {'✓' if b['correct'] else '✗'} {cell(b['got'])} "
                             f"| {'✓' if a['correct'] else '✗'} {cell(a['got'])} |")
    return lines + [""]


def time_table(time: dict | None) -> list[str]:
    """Markdown: seconds and share of the wall time per phase, and the goodput (run.json `time`)."""
    if not time:
        return []
    wall = time["wall_s"] or 1.0
    lines = ["## Where the time went", "", "| phase | seconds | share |", "|---|---|---|"]
    lines += [f"| {k} | {v:.1f} | {v / wall:.1%} |" for k, v in time["phases_s"].items()]
    blocking = ", ".join(f"{s:.2f}" for s in time.get("checkpoint_blocking_s") or []) or "-"
    lines += [f"| **wall** | {time['wall_s']:.1f} | goodput **{_pct(time['goodput'])}** |", "",
              "Wall: from the driver's start (Ray's start, the workers' scheduling and imports are `startup`) to the "
              "end of this attempt's last phase, as measured by rank 0. The duration above counts from rank 0 "
              "opening run.json (after startup's first steps) to closing it. Goodput: `train` / wall.", "",
              f"Training held up per checkpoint save (s): {blocking}.", ""]
    if time.get("startup_s"):
        steps = ", ".join(f"{k} {v:.1f}" for k, v in time["startup_s"].items())
        lines += [f"Startup by step (s): {steps}.", ""]
    return lines


def render_markdown(record: dict | None, summary: dict, plots: list[str], notes: list[str],
                    metric_rows: list[dict] = (), logs: dict[str, dict[str, str]] | None = None) -> str:
    """The text of report.md; `logs` as `read_logs` gives them."""
    rec = record or {}
    name = rec.get("run_name") or "(no run.json)"
    lines = [f"# Run report: {name}", ""]
    chart = rec.get("chart") or {}
    image = rec.get("image") or {}
    digest = image.get("digest", "unknown")
    if digest == "unknown" and image.get("reason"):
        digest += f" ({image['reason']})"
    rows = [
        ("Status", rec.get("status", "-") + (f" — {failures.one_line(rec['error'])}" if rec.get("error") else "")),
        ("Attempts", 1 + len(rec.get("previous_attempts") or []) + len(rec.get("later_attempts") or [])),
        ("Later attempts", run_record.later_attempts_line(rec) or "-"),
        ("Started", rec.get("started_at")),
        ("Ended", rec.get("ended_at")),
        ("Duration (this attempt's record)", _duration(rec.get("duration_s"))),
        ("Image", f"{image.get('reference', '-')} @ {digest}"),
        ("Chart", f"{chart.get('name', '-')} {chart.get('version', '')} (release {chart.get('release', '-')})"),
        ("Job package", (rec.get("job") or {}).get("version")),
        ("Config sha256", rec.get("config_sha256")),
        ("Seed", rec.get("seed")),
    ]
    lines += ["| | |", "|---|---|"] + [f"| {k} | {_fmt(v)} |" for k, v in rows] + [""]

    lines += ["## Config highlights", ""]
    highlights = config_highlights(rec.get("config") or {})
    lines += [f"- `{k}`: {_fmt(v)}" for k, v in highlights] or ["- (no config recorded)"]
    lines.append("")

    data = rec.get("data") or {}
    lines += ["## Data", "", f"- tokenizer sha256: {_fmt(data.get('tokenizer_sha256'))}"]
    fingerprint = run_record.flatten(data.get("fingerprint") or {})
    lines += [f"- `{k}`: {_fmt(v)}" for k, v in fingerprint.items()] or ["- fingerprint: -"]
    lines.append("")

    hw = rec.get("hardware") or {}
    transport = rec.get("transport") or {}
    devices = ", ".join(f"{n} x {name}" for name, n in (hw.get("accelerators") or {}).items()) or "-"
    if hw.get("accelerator_type") == "cpu":  # the names are the hosts' CPU models; CUDA is only torch's build
        device_lines = [f"- devices: **CPU run**, no accelerator ({devices}, one per host)",
                        f"- torch built for CUDA {_fmt(hw.get('cuda_version'))} (not used)"]
    else:
        device_lines = [f"- devices: **GPU run** ({_fmt(hw.get('accelerator_type'))}): {devices}",
                        f"- driver: {', '.join(hw.get('driver_versions') or ['-'])}; CUDA "
                        f"{_fmt(hw.get('cuda_version'))}; NCCL {_fmt(hw.get('nccl_version'))}"]
    lines += ["## Hardware and transport", "",
              f"- nodes: {_fmt(hw.get('nodes'))}, world size: {_fmt(hw.get('world_size'))}", *device_lines,
              f"- transport: {transport.get('summary', '-')}"
              + (f" ({transport['reason']})" if transport.get("reason") else "")]
    pre = rec.get("preflight")
    if pre:
        for op in ("all_reduce", "all_gather"):
            bench = (pre.get("all_ranks") or {}).get(op) or []
            if bench:
                top = max(bench, key=lambda r: r["size_bytes"])
                lines.append(f"- preflight {op}: busbw {top['busbw_gbps']:.3g} GB/s, algbw {top['algbw_gbps']:.3g} GB/s "
                             f"at {top['size_bytes'] / 2**20:g} MiB over {pre.get('world_size')} ranks")
        if pre.get("failures"):
            lines += [f"- preflight FAILED: {f}" for f in pre["failures"]]
    lines.append("")

    m = summary
    best = _fmt(m.get("best_eval_loss")) + (f" (step {m['best_eval_step']})" if m.get("best_eval_step") is not None else "")
    lines += ["## Results", "", "| metric | value |", "|---|---|",
              f"| method | {_method(m)} |",
              f"| trainable parameters | {_fmt(m.get('trainable_params'))} |",
              f"| frozen base per device (GiB) | {_fmt(m.get('base_gib'))} |",
              f"| steps | {_fmt(m.get('steps'))} |",
              f"| final train loss | {_fmt(m.get('final_train_loss'))} |",
              f"| final eval loss | {_fmt(m.get('final_eval_loss'))} |",
              f"| best eval loss | {best} |",
              f"| tokens/s (all devices) | {_fmt(m.get('tokens_per_s'))} |",
              f"| tokens/s per device | {_fmt(m.get('tokens_per_s_per_device'))} |",
              f"| MFU | {_pct(m.get('mfu'))} |",
              f"| peak memory (GiB) | {_fmt(m.get('peak_mem_gib'))} |",
              "", "Throughput and MFU: medians over the second half of the train steps.", ""]
    lines += before_after(list(metric_rows))
    lines += time_table(rec.get("time"))
    outputs = [("checkpoints", rec.get("checkpoints")), ("export", rec.get("export"))]
    if any(v for _, v in outputs):
        lines += ["## Outputs", ""] + [f"- {k}: {json.dumps(v, default=str)}" for k, v in outputs if v] + [""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p[:-4]}]({p})" for p in plots] + [""]
    lines += logs_section(logs or {})
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


def read_logs(run_dir: str) -> dict[str, dict[str, str]]:
    """Every attempt's logs (`failures.attempt_logs`): `{<driver start>: {driver.log / rank<r>.log: text}}`, oldest
    attempt first; empty when the run has none or they cannot be read."""
    try:
        fs, path = storage.filesystem(storage.join(run_dir, failures.LOGS_DIR))
        files = sorted(fs.find(path))
        texts = fs.cat(files) if files else {}
    except (OSError, ValueError):
        return {}
    logs: dict[str, dict[str, str]] = {}
    for file in files:
        stamp, name = file.rstrip("/").split("/")[-2:]
        logs.setdefault(stamp, {})[name] = texts[file].decode("utf-8", "replace")
    return logs


def logs_section(logs: dict[str, dict[str, str]], tail: int = 15) -> list[str]:
    """Markdown: each attempt's log files, and the end of the newest attempt's (the driver's last words, the
    workers' tracebacks)."""
    if not logs:
        return []
    lines = ["## Logs", "", f"In `{failures.LOGS_DIR}/` of the run directory, a folder per attempt (its driver's start):", ""]
    lines += [f"- `{stamp}/`: " + ", ".join(f"{name} ({len(text.splitlines())} lines)" for name, text in files.items())
              for stamp, files in logs.items()]
    stamp, files = list(logs.items())[-1]
    for name, text in files.items():
        lines += ["", f"The end of `{stamp}/{name}`:", "", "```", *text.rstrip().splitlines()[-tail:], "```"]
    return lines + [""]


def write_report(run_dir: str, out: str, plots: bool = True) -> list[str]:
    """Write `<out>/report.md` (and, with `plots`, the plots) for the run at `run_dir`; returns the names written,
    report.md first. `ReportError` (one line) when the run cannot be read or `out` not created; a plot that cannot
    be drawn is a note in the report and on stderr."""
    if not storage.exists(run_dir):
        raise ReportError(f"{run_dir}: no such run directory")
    notes: list[str] = []
    try:
        record = run_record.load_record(run_dir)
    except FileNotFoundError as exc:
        record = None
        notes.append(str(exc))
    except (OSError, ValueError) as exc:
        raise ReportError(f"cannot read run.json in {run_dir}: {exc}") from None
    try:
        rows = run_record.read_metrics(run_dir)
    except FileNotFoundError:
        rows = []
        notes.append(f"no {run_record.METRICS_FILE} in {run_dir}")
    if record is None and not rows:
        raise ReportError(f"{run_dir} has neither run.json nor {run_record.METRICS_FILE}")
    summary = run_record.summarize_metrics(rows) if rows else ((record or {}).get("metrics") or {})
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise ReportError(f"--out {out}: cannot create the directory ({exc.strerror})") from None
    drawn: list[str] = []
    if plots and rows:
        try:
            drawn = plot_metrics(rows, out)
        except ReportError as exc:
            notes.append(str(exc))
            print(f"report: {exc}", file=sys.stderr)
    with open(os.path.join(out, "report.md"), "w", encoding="utf-8") as f:
        f.write(render_markdown(record, summary, drawn, notes, rows, read_logs(run_dir)))
    return ["report.md", *drawn]


def main(argv: list[str]) -> int:
    """`python -m job report RUN_DIR [--out DIR] [--no-plots]`; `argv` excludes "report".

    Exit status: 0 written (perhaps without plots), 2 bad input (neither run.json nor metrics.jsonl in RUN_DIR).
    """
    parser = argparse.ArgumentParser(prog="python -m job report", description="Write report.md and plots for a run.")
    parser.add_argument("run_dir", help="run directory (local or s3://) with run.json and metrics.jsonl, "
                                        "or with --storage a run name")
    parser.add_argument("--storage", help="storage path whose run RUN_DIR names (python -m job runs STORAGE lists them)")
    parser.add_argument("--out", help="output directory (default: RUN_DIR if local, else ./<run name>-report)")
    parser.add_argument("--no-plots", action="store_true", help="write report.md only")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0
    try:
        run_dir = runs.resolve_run(args.run_dir, args.storage)
        out = args.out or (f"./{os.path.basename(run_dir.rstrip('/'))}-report" if storage.is_remote(run_dir)
                           else run_dir)
        written = write_report(run_dir, out, plots=not args.no_plots)
    except (runs.RunsError, ReportError) as exc:
        print(f"report: {exc}", file=sys.stderr)
        return 2
    print(f"report: wrote {os.path.join(out, written[0])}" + (f" and {', '.join(written[1:])}" if written[1:] else ""))
    return 0
