"""Throughput accounting (FLOPs per token, MFU), rank 0's metrics log (stdout, metrics.jsonl, TensorBoard, MLflow),
the run's time accounting and goodput (`Timeline`), and the one-step profiler (`debug.profile_step`)."""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Callable

import torch

from .. import storage

# Dense (no sparsity) bf16 tensor-core peak per device, FLOP/s, from the vendors' datasheets. Matched by
# substring of `torch.cuda.get_device_name()`, first match wins (so "H100 PCIe" precedes "H100").
PEAK_BF16_FLOPS = [
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100", 989.4e12),
    ("A100", 312.0e12),
    ("L40S", 362.05e12),
    ("L4", 121.0e12),
]


def peak_flops(device: torch.device, override: float | None) -> float | None:
    """Peak bf16 FLOP/s of one device: the config override, the table entry for its name, or None (unknown)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: int, frozen: int = 0) -> float:
    """Training FLOPs per token (PaLM appendix B): 6·N for the matmuls of forward and backward, plus 12·L·H·T for
    QK^T and AV (forward 4·L·H·T, ×3 with backward; causal masking not discounted, as is conventional). N counts
    every parameter once, the tied LM head included (a real matmul). `frozen` parameters (LoRA's base) count 4
    each: forward, and the gradient of their input, which the adapters below need; none of their own."""
    return 6 * n_params - 2 * frozen + 12 * n_layers * hidden * seq_len




TENSORBOARD_DIR = "tensorboard"
"""The run directory's folder of TensorBoard event files (`tensorboard --logdir <run dir>/tensorboard`)."""


def scalars(record: dict) -> dict[str, float]:
    """The numbers of one metrics record as `<kind>/<field>[/<key>]` (`train/loss`, `time/phases_s/train`): what
    TensorBoard and MLflow plot at its step. Booleans, lists, text, non-finite values and step-less records give
    none."""
    out: dict[str, float] = {}

    def add(name: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                add(f"{name}/{key}", inner)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)

    if "step" in record:
        for key, value in record.items():
            if key not in ("kind", "step", "time"):
                add(f"{record['kind']}/{key}", value)
    return out


class TensorBoardLog:
    """Rank 0's TensorBoard event file in `<run_dir>/tensorboard/`, one per attempt, written with tensorboardX's
    synchronous record writer, so each record is on disk when `log` returns (`SummaryWriter` flushes every two
    minutes, which a live TensorBoard or a killed attempt would miss). A resumed attempt's file starts with a purge
    at its first step, hiding what an earlier attempt logged past the resume point. On object storage the file is
    written locally and uploaded whole after each record: tensorboardX's S3 writer knows neither fsspec's endpoint
    settings nor atomic writes."""

    def __init__(self, run_dir: str, purge_step: int):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        self.remote = storage.join(run_dir, TENSORBOARD_DIR) if storage.is_remote(run_dir) else None
        self.folder = (tempfile.mkdtemp(prefix="tensorboard-") if self.remote
                       else os.path.join(storage.local_path(run_dir), TENSORBOARD_DIR))
        os.makedirs(self.folder, exist_ok=True)
        # Named by the second and host, and the process: two attempts within a second write two files.
        self.writer = EventsWriter(os.path.join(self.folder, "events"), filename_suffix=f".{os.getpid()}")
        self.writer.write_event(Event(step=purge_step, wall_time=time.time(),
                                      session_log=SessionLog(status=SessionLog.START)))
        self.writer.flush()

    def log(self, step: int, values: dict[str, float], at: float) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import scalar

        if not values:
            return
        for tag, value in values.items():
            self.writer.write_event(Event(wall_time=at, step=step, summary=scalar(tag, value)))
        self.writer.flush()
        if self.remote:
            for name in os.listdir(self.folder):
                with open(os.path.join(self.folder, name), "rb") as f:
                    storage.write_atomic(storage.join(self.remote, name), f.read())

    def close(self) -> None:
        self.writer.close()
        if self.remote:  # uploaded at each record: the local copy goes
            shutil.rmtree(self.folder, ignore_errors=True)




class MetricsLogger:
    """Writes metric records as JSON lines to stdout and `<run_dir>/metrics.jsonl` (rank 0), and their `scalars` to
    its sinks (`log(step, scalars, time)`, `close()`): `TensorBoardLog` and the `sinks` given.

    The small file is rewritten whole and atomically at each record, as object storage cannot append. A resumed
    run continues it, records past `keep_until_step` (the resume step) dropped, so a recomputed step appears once.
    """

    def __init__(self, run_dir: str, max_steps: int, progress: str | None = None, keep_until_step: int | None = None,
                 sinks: list | None = None):
        """`progress`: the progress bar's style (`progress_style`), None for none."""
        self.path = storage.join(run_dir, "metrics.jsonl")
        self.lines = storage.read_text(self.path).splitlines() if storage.exists(self.path) else []
        if keep_until_step is not None:
            self.lines = [line for line in self.lines if json.loads(line).get("step", 0) <= keep_until_step]
        # A fresh start (step 0) hides all an earlier attempt logged, a resume what it logged past its step.
        self.sinks = [TensorBoardLog(run_dir, purge_step=keep_until_step + 1 if keep_until_step else 0),
                      *(sinks or [])]
        self.bar = None
        if progress == "ray":
            from ray.experimental.tqdm_ray import tqdm as ray_tqdm

            self.bar = ray_tqdm(total=max_steps, desc="train", unit="step", flush_interval_s=0)  # at log steps only
        elif progress == "tqdm":
            from tqdm import tqdm

            self.bar = tqdm(total=max_steps, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)

    def log(self, record: dict) -> None:
        record = {"time": round(time.time(), 3), **record}
        line = json.dumps(record)
        print(line, flush=True)
        self.lines.append(line)
        storage.write_atomic(self.path, "\n".join(self.lines) + "\n")
        if "step" in record:
            values = scalars(record)
            for sink in self.sinks:
                sink.log(record["step"], values, record["time"])
        if self.bar is not None and record.get("kind") == "train":
            self.bar.n = record["step"]
            self.bar.set_description(f"train loss {record['loss']:.3f}")  # (tqdm_ray has no set_postfix)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        for sink in self.sinks:
            sink.close()


PHASES = ("startup", "data", "model", "resume", "warmup", "train", "eval", "checkpoint", "task_eval", "export")
"""Where a run's wall time goes, in the order a run meets them (`Timeline`; docs/performance.md). `startup` also
counts, after a worker-group restart, the earlier attempts' whole time: their recomputed work is lost; `warmup` is
the first step's time beyond a typical step; `checkpoint` the time saves held training up."""


INNER_PHASES = ("eval", "checkpoint", "task_eval")
"""The phases timed inside the training loop (`train.LoopClock`): the loop's other time is training."""


class Timeline:
    """Wall time per phase of one attempt, on rank 0, and the goodput: training time / wall.

    Phases are timed with the host clock after a device sync at both ends, so queued GPU work is charged to the
    phase that queued it. `started_at` (epoch seconds) is the driver's start, so Ray's start counts too; what no
    phase covers is `other`. `startup` is split by `steps` (epoch seconds each startup step ended, in order:
    `LoopConfig.startup`), then `worker_imports` (to this worker's loop) and `preflight` (the rest).
    """

    def __init__(self, started_at: float, device: torch.device, steps: dict[str, float] | None = None):
        self.started_at = started_at
        self.device = device
        self.seconds = dict.fromkeys(PHASES, 0.0)
        now = time.time()
        self.seconds["startup"] = max(0.0, now - started_at)
        self.startup: dict[str, float] = {}
        previous = started_at
        for name, ended in (steps or {}).items():
            self.startup[name], previous = max(0.0, ended - previous), ended
        self.startup["worker_imports"] = max(0.0, now - previous)
        self.checkpoint_blocking_s: list[float] = []
        self.training_since: tuple[float, float] | None = None
        """While the loop runs (`train.LoopClock`): its start (perf_counter) and the seconds its inner phases
        (`INNER_PHASES`) had then; what else it has spent is training, so far (`so_far`)."""
        self.on_phase: Callable[[str, bool], None] | None = None
        """Called with (phase, entering) around each phase (the hang watchdog's `phase`)."""

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.on_phase:
            self.on_phase(name, True)
        self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.seconds[name] += time.perf_counter() - start
            if self.on_phase:
                self.on_phase(name, False)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds

    def so_far(self) -> dict:
        """`{goodput, phases_s}` of the attempt so far, the running loop's time less its `INNER_PHASES` counted as
        training (its first step's warmup too, split off at the loop's end): what a log step reports."""
        seconds = dict(self.seconds)
        if self.training_since is not None:
            start, inner_before = self.training_since
            seconds["train"] += (time.perf_counter() - start) - (sum(seconds[p] for p in INNER_PHASES) - inner_before)
        wall = time.time() - self.started_at
        return {"goodput": seconds["train"] / wall if wall else None,
                "phases_s": {k: round(v, 1) for k, v in seconds.items() if v}}

    def summary(self) -> dict:
        """`{wall_s, phases_s, goodput, checkpoint_blocking_s, startup_s}`, `phases_s` including `other`."""
        wall = time.time() - self.started_at
        phases = {k: round(v, 3) for k, v in self.seconds.items()}
        phases["other"] = round(max(0.0, wall - sum(self.seconds.values())), 3)
        startup = {**self.startup, "preflight": max(0.0, self.seconds["startup"] - sum(self.startup.values()))}
        return {"wall_s": round(wall, 3), "phases_s": phases, "goodput": self.seconds["train"] / wall if wall else None,
                "checkpoint_blocking_s": [round(s, 3) for s in self.checkpoint_blocking_s],
                "startup_s": {k: round(v, 3) for k, v in startup.items()}}


def format_timeline(summary: dict) -> str:
    """The time summary as a small table: seconds and share of the wall time per phase, then the goodput."""
    wall = summary["wall_s"] or 1.0
    lines = [f"{'phase':<10} {'seconds':>9} {'share':>7}"]
    for name, seconds in summary["phases_s"].items():
        lines.append(f"{name:<10} {seconds:>9.1f} {seconds / wall:>7.1%}")
    lines.append(f"{'wall':<10} {summary['wall_s']:>9.1f}   goodput {summary['goodput']:.1%}")
    if summary.get("startup_s"):
        lines.append("startup: " + ", ".join(f"{k} {v:.1f}" for k, v in summary["startup_s"].items()))
    return "\n".join(lines)


# Kernel (GPU) or operator (CPU) name fragments -> category; first match wins, on lower-cased names.
PROFILE_CATEGORIES = [
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "triton_tem", "aten::mm", "aten::addmm", "aten::bmm", "matmul")),
    ("compiled elementwise", ("triton",)),  # inductor's fused kernels (after its matmul templates, above)
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("copy/fill", ("copy_in", "copy_out", "memcpy", "memset", "copy", "aten::cat", "catarray", "fill", "zero")),
    ("communication", ("nccl", "c10d", "all_reduce", "allgather", "all_gather", "reduce_scatter", "backward_reduce")),
]


class StepProfiler:
    """Profiles one training step on rank 0: where the device time goes, by category and by kernel.

    The step is synchronized at both ends, so measured alone (slightly slower than pipelined); busy time is the
    union of kernel intervals, the rest of its wall time the device waiting (launch overhead, syncs, data).
    """

    def __init__(self, device: torch.device):
        from torch.profiler import ProfilerActivity, profile

        self.device = device
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._sync()
        self.profile = profile(activities=activities)
        self.profile.start()
        self.started = time.perf_counter()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def finish(self, run_dir: str, step: int) -> dict:
        """Stop, write `profile-step<N>.txt` and `.json.gz` into the run directory; returns the summary."""
        self._sync()
        wall_ms = (time.perf_counter() - self.started) * 1e3
        self.profile.stop()
        summary, text = profile_summary(self.profile.events(), self.device.type, wall_ms, step)
        storage.write_atomic(storage.join(run_dir, f"profile-step{step}.txt"), text)
        with tempfile.TemporaryDirectory() as tmp:
            trace = os.path.join(tmp, "trace.json")
            self.profile.export_chrome_trace(trace)
            with open(trace, "rb") as f:
                storage.write_atomic(storage.join(run_dir, f"profile-step{step}.json.gz"), gzip.compress(f.read()))
        return summary


def profile_category(name: str) -> str:
    lowered = name.lower()
    return next((cat for cat, keys in PROFILE_CATEGORIES if any(k in lowered for k in keys)), "other")


def profile_summary(events, device_type: str, wall_ms: float, step: int, top: int = 25) -> tuple[dict, str]:
    """Device time by category and the top kernels, as (summary record, text table). On GPU: kernel and copy
    events (each once); on CPU: the operators' self time (so nested operators are not counted twice)."""
    times: dict[str, list[float]] = {}  # name -> durations (ms)
    kernels, host_spans = [], []  # (start_us, end_us, name)
    for e in events:
        if device_type == "cuda":
            # Device-side events: kernels, copies, and annotated host regions' spans (kernels counted already).
            if e.device_type != torch.autograd.DeviceType.CUDA:
                host_spans.append((e.time_range.start, e.time_range.end, e.name))
                continue
            if e.is_user_annotation:
                continue
            duration = e.time_range.elapsed_us() / 1e3
            kernels.append((e.time_range.start, e.time_range.end, e.name))
        else:
            duration = e.self_cpu_time_total / 1e3
        times.setdefault(e.name, []).append(duration)
    total = sum(map(sum, times.values()))
    lines = [f"step {step} on {device_type}: wall {wall_ms:.1f} ms, {'kernel' if device_type == 'cuda' else 'operator'}"
             f" time {total:.1f} ms"]
    busy, gaps = None, []
    if kernels:
        busy, gaps = device_timeline(kernels)
        lines[0] += f", device busy {busy / 1e3:.1f} ms ({busy / 1e3 / wall_ms:.1%} of wall)"
    category = {name: profile_category(name) for name in times}
    by_category: dict[str, float] = {}
    for name, durations in times.items():
        by_category[category[name]] = by_category.get(category[name], 0.0) + sum(durations)
    lines += ["", f"{'category':<22}{'ms':>9}{'share':>8}"]
    for cat, ms in sorted(by_category.items(), key=lambda kv: -kv[1]):
        lines.append(f"{cat:<22}{ms:>9.1f}{ms / max(total, 1e-9):>8.1%}")
    lines += ["", f"{'ms':>9}{'calls':>7}  {'category':<22}name"]
    for name, durations in sorted(times.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"{sum(durations):>9.2f}{len(durations):>7}  {category[name]:<22}{name[:160]}")
    summary = {"wall_ms": round(wall_ms, 2), "busy_ms": None if busy is None else round(busy / 1e3, 2),
               "by_category_ms": {cat: round(ms, 2) for cat, ms in by_category.items()}}
    if kernels:
        # Idle time: gaps between kernels, or the step's edges (before its first kernel, after its last).
        gap_ms = sum(g[1] - g[0] for g in gaps) / 1e3
        summary["idle_gaps_ms"] = round(gap_ms, 2)
        lines += idle_gap_lines(gaps, host_spans, min(k[0] for k in kernels))
        lines.append(f"idle at the step's edges (before the first kernel, after the last): "
                     f"{wall_ms - busy / 1e3 - gap_ms:.1f} ms")
    return summary, "\n".join(lines) + "\n"


def device_timeline(kernels: list[tuple]) -> tuple[float, list[tuple]]:
    """From kernel intervals `(start_us, end_us, name)` on any streams: busy µs (their union) and the idle gaps,
    `(start_us, end_us, name_before, name_after)` in time order."""
    busy, end, last, gaps = 0.0, None, None, []
    for start, stop, name in sorted(kernels):
        if end is not None and start > end:
            gaps.append((end, start, last, name))
        busy += stop - start if end is None else max(0.0, stop - max(start, end))
        if end is None or stop >= end:
            end, last = stop, name
    return busy, gaps


def idle_gap_lines(gaps: list[tuple], host_spans: list[tuple], t0: float, top: int = 10,
                   min_us: float = 20.0) -> list[str]:
    """Text table of the largest idle gaps: when, how long, the kernels around it, and the innermost host span
    at the device's resume (the operator or region that launched the next kernel or held it back)."""
    def host_at(t: float) -> str:
        spans = [(stop - start, name) for start, stop, name in host_spans if start <= t <= stop]
        return min(spans)[1] if spans else "-"

    large = [g for g in gaps if g[1] - g[0] >= min_us]
    lines = ["", f"idle gaps >= {min_us / 1e3:.2f} ms: {len(large)}, {sum(g[1] - g[0] for g in large) / 1e3:.1f} ms "
                 f"(all gaps: {len(gaps)}, {sum(g[1] - g[0] for g in gaps) / 1e3:.1f} ms)",
             f"{'at ms':>8}{'idle ms':>9}  {'host at resume':<40}{'kernel before -> kernel after'}"]
    for start, stop, before, after in sorted(large, key=lambda g: g[0] - g[1])[:top]:
        lines.append(f"{(start - t0) / 1e3:>8.1f}{(stop - start) / 1e3:>9.2f}  {host_at(stop)[:38]:<40}"
                     f"{before[:50]} -> {after[:50]}")
    return lines
