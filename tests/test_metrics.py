"""The profiler's timeline arithmetic: busy time as a union over streams, and where the device sat idle; when
the progress bar shows, and where it is drawn."""

import io
import json
import os
import sys

import pytest

from job import config as config_lib
from job.common.terminal import is_terminal
from job.driver import launch
from job.worker import contract, metrics
from job.worker.metrics import MetricsLogger, Timeline, device_timeline, idle_gap_lines


def test_timeline_splits_startup_by_the_driver_steps_and_counts_goodput_over_the_whole_wall(monkeypatch):
    import torch

    wall, clock = [1000.0], [0.0]
    monkeypatch.setattr(metrics.time, "time", lambda: wall[0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    # The driver started at 990 and ended its steps at 992, 995 and 996; Ray Train entered the worker's loop
    # function at 999, and the loop starts at 1000.
    timeline = Timeline(990.0, torch.device("cpu"), {"driver": 992.0, "ray": 995.0, "prepare": 996.0, "workers": 999.0})
    with timeline.phase("startup"):  # the preflight
        clock[0] += 1.5
    with timeline.phase("train"):
        clock[0] += 6.0
    wall[0] = 1010.0
    summary = timeline.summary()
    assert summary["startup_s"] == {"driver": 2.0, "ray": 3.0, "prepare": 1.0, "workers": 3.0, "worker_imports": 1.0,
                                    "preflight": 1.5}
    assert summary["phases_s"]["startup"] == 11.5 and summary["phases_s"]["other"] == 2.5
    assert summary["wall_s"] == 20.0 and summary["goodput"] == 0.3
    assert ("startup: driver 2.0, ray 3.0, prepare 1.0, workers 3.0, worker_imports 1.0, preflight 1.5"
            in metrics.format_timeline(summary))


def test_a_log_step_reports_goodput_so_far_with_the_running_loops_time_less_its_evaluations_and_saves(monkeypatch):
    """What the driver exports while the run goes on (job/driver/follow.py): the loop's time counts as training
    until its end splits off the warmup, less the evaluations and saves timed inside it."""
    import torch

    wall, clock = [100.0], [0.0]
    monkeypatch.setattr(metrics.time, "time", lambda: wall[0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    timeline = Timeline(90.0, torch.device("cpu"))  # 10 s of startup
    with timeline.phase("eval"):  # step 0's evaluation, before the loop
        clock[0] += 2.0
    timeline.training_since = (clock[0], timeline.seconds["eval"])  # the loop starts (train.LoopClock.begin)
    clock[0] += 5.0
    with timeline.phase("checkpoint"):
        clock[0] += 3.0
    wall[0] = 100.0 + 10.0
    assert timeline.so_far() == {"goodput": 0.25, "phases_s": {"startup": 10.0, "train": 5.0, "eval": 2.0,
                                                              "checkpoint": 3.0}}
    timeline.training_since = None  # the loop's end accounts its time itself
    assert timeline.so_far()["goodput"] == 0.0


def test_device_timeline_counts_overlap_once_and_finds_gaps():
    kernels = [  # (start µs, end µs, name): two streams overlap, then two idle gaps
        (0, 100, "gemm"),
        (50, 120, "all_gather"),
        (100, 110, "short"),  # inside the union: neither a gap nor busy time twice
        (300, 400, "attention"),
        (450, 500, "adam"),
    ]
    busy, gaps = device_timeline(kernels)
    assert busy == 120 + 100 + 50
    assert gaps == [(120, 300, "all_gather", "attention"), (400, 450, "attention", "adam")]


def test_idle_gap_lines_names_the_host_span_at_resume_largest_first():
    gaps = [(120, 300, "all_gather", "attention"), (400, 450, "attention", "adam"), (500, 505, "adam", "x")]
    host = [(0, 1000, "## step ##"), (380, 460, "Optimizer.step#AdamW.step"), (200, 310, "FSDP::pre_forward")]
    lines = idle_gap_lines(gaps, host, t0=0, min_us=20)
    assert "idle gaps >= 0.02 ms: 2, 0.2 ms (all gaps: 3, 0.2 ms)" in lines[1]
    first, second = lines[3], lines[4]
    assert first.split()[:2] == ["0.1", "0.18"] and "FSDP::pre_forward" in first and "all_gather -> attention" in first
    assert second.split()[:2] == ["0.4", "0.05"] and "Optimizer.step#AdamW.step" in second
    assert len(lines) == 5  # the 5 µs gap is below min_us


class Stream(io.StringIO):
    """A stderr that is, or is not, a terminal."""

    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("setting, driver_tty, shown", [
    ("auto", True, "ray"),  # the driver is on a terminal: it draws the bar the worker reports
    ("auto", False, None),  # redirected: no bar redraws in the log
    ("on", False, "ray"),
    ("off", True, None),
])
def test_progress_bar_under_ray_follows_the_drivers_terminal(monkeypatch, setting, driver_tty, shown):
    monkeypatch.setattr(sys, "stderr", Stream(driver_tty))
    cfg = config_lib.load_dict({"name": "a", "model": {"init": "random", "preset": "qwen2-tiny"},
                                "data": {"format": "synthetic"}})
    loop_config = contract.LoopConfig(cfg, "/runs/a", 1.5, tokenizer_json="{}")
    train_loop_config = launch.ray_loop_config(loop_config)  # in the driver
    monkeypatch.setattr(sys, "stderr", Stream(False))  # in a Ray worker: its stderr is a log file
    received, launcher = launch.ray_worker_args(train_loop_config)
    assert launcher.progress_style(setting) == shown
    assert received == loop_config  # and the loop gets what the driver prepared


@pytest.mark.parametrize("tty, shown", [(True, "tqdm"), (False, None)])
def test_progress_bar_under_torchrun_follows_rank_0s_stderr(monkeypatch, tty, shown):
    monkeypatch.setattr(sys, "stderr", Stream(tty))
    assert launch.TorchrunLauncher().progress_style("auto") == shown


@pytest.mark.parametrize("tty", [True, False])
def test_redirected_stderr_gets_no_bar(monkeypatch, tmp_path, tty):
    monkeypatch.setattr(sys, "stderr", Stream(tty))
    logger = MetricsLogger(str(tmp_path), 10, launch.TorchrunLauncher().progress_style("auto"))
    logger.log({"kind": "train", "step": 5, "loss": 2.5})
    logger.close()
    drawn = sys.stderr.getvalue()
    assert ("5/10" in drawn and "train loss 2.500" in drawn) if tty else drawn == ""


def test_a_ray_worker_reports_its_bar_to_the_driver(monkeypatch, tmp_path, capsys):
    ray = pytest.importorskip("ray")
    from ray._private import worker
    from ray.experimental.tqdm_ray import RAY_TQDM_MAGIC

    monkeypatch.setattr(worker.global_worker, "mode", ray.WORKER_MODE)
    monkeypatch.setattr(sys, "stderr", Stream(False))
    logger = MetricsLogger(str(tmp_path), 10, launch.RayLauncher(driver_tty=True).progress_style("auto"))
    logger.log({"kind": "train", "step": 5, "loss": 2.5})
    logger.close()
    states = [json.loads(line) for line in capsys.readouterr().out.splitlines() if RAY_TQDM_MAGIC in line]
    assert states and states[-1]["x"] == 5 and states[-1]["total"] == 10 and states[-1]["closed"]
    assert sys.stderr.getvalue() == ""  # the worker draws nothing itself


def test_a_terminal_needs_a_width_for_a_bar():
    """A pseudo-terminal of 0 columns (`script` with no terminal of its own) is a tty, yet tqdm draws nothing on
    it: no bar there; the same terminal given a width gets one (the Ray driver draws on it: `ray_loop_config`)."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    with os.fdopen(follower, "w") as stream:
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
        assert stream.isatty() and not is_terminal(stream)
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        assert is_terminal(stream)
    os.close(leader)
