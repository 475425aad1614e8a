"""`python -m job [run]`: check the config, its optional packages, the storage, the model's settings and whether
Ray can place the workers, printing every problem (one line each, naming the field) and exiting 2 before any worker
starts; then hold the run's lease, prepare the run directory, train under Ray Train or torchrun, and end with the
verdict of a failed run or where the run is."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time

from .. import config as config_lib
from .. import packages, signals, storage
from ..common import checkpoints
from ..common.checkpoints import CheckpointError, ResumeRefused
from ..common.sources import DataError
from ..records import failures, run_record
from ..records import lease as lease_lib
from . import follow, launch, staging, watch


def run(args: argparse.Namespace, started_at: float, imported_at: float) -> int:
    """`python -m job [run]` with its parsed `--config`, `--set`; `started_at`, `imported_at`: when the driver
    started and its imports ended (the first steps of the run's time accounting)."""
    with contextlib.ExitStack() as held:  # the run lease, from the storage check to the last line
        return _run(args, started_at, imported_at, held)


def _run(args: argparse.Namespace, started_at: float, imported_at: float, held: contextlib.ExitStack) -> int:
    # `recordable`: the run directory, once its lease is held: a refusal from there on is recorded (and told).
    cfg = recordable = follower = None
    try:
        cfg = launch.resolve_paths(config_lib.load(args.config, args.set))
        packages.check_config(cfg)  # a missing optional package fails here, before any worker starts
        run_dir = launch.run_directory(cfg)
        staged_refusal = staging.refused_here(run_dir)  # read before this driver's heartbeat
        launch.check_before_start(cfg, run_dir)
        if os.environ.get("RANK", "0") == "0":  # torchrun's rank 0 holds it for all its processes
            held.callback(follow.DriverLog(run_dir, started_at).close)
            held.enter_context(watch.hold(run_dir))
        recordable = run_dir
        if staged_refusal:
            print(f"data error: {staged_refusal} (found by the head's data staging; in run.json)", file=sys.stderr)
            return 2
        if not launch.under_torchrun():
            follower = follow.Follower(run_dir, cfg.name, cfg.train.max_steps, started_at,
                                       follow.RayJobReporter.from_env())
        checkpoints.check_before_start(cfg, run_dir)  # a resume this config cannot make, refused in seconds
        # When each of the driver's startup steps ended (metrics.Timeline).
        startup = {"imports": imported_at, "checks": time.time()}
        if launch.under_torchrun():
            launch.run_with_torchrun(launch.prepare(cfg, run_dir, started_at, startup))
            return 0
        print(f"# resolved config\n{config_lib.to_yaml(cfg)}", flush=True)
        if (done := launch.finished(cfg, run_dir)) is not None:
            print(done, flush=True)
            follower.ended("succeeded", message=done)
            return 0
        launch.connect_ray(cfg)
        startup["ray"] = time.time()
        loop_config = launch.prepare(cfg, run_dir, started_at, startup)
    except config_lib.ConfigError as e:
        for message in e.messages:
            print(f"config error: {message}", file=sys.stderr)
        _record_refusal(cfg, recordable, e, follower)
        return 2
    except packages.MissingPackage as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except lease_lib.LeaseHeld as e:
        print(f"refused: {e}", file=sys.stderr)
        return 2
    except ResumeRefused as e:  # what the config asks of the run's checkpoints: a config error
        print(f"config error: {e}", file=sys.stderr)
        _record_refusal(cfg, recordable, e, follower)
        return 2
    except CheckpointError as e:
        print(f"checkpoint error: {e}", file=sys.stderr)
        _record_refusal(cfg, recordable, e, follower)
        return 1
    except DataError as e:
        print(f"data error: {e}", file=sys.stderr)
        _record_refusal(cfg, recordable, e, follower)
        return 2
    follower.start()
    try:
        # SIGINT/SIGTERM stop the run (`cancelled`); a record left running closed on an exception.
        with watch.driver_watch(run_dir):
            error = launch.run_with_ray(cfg, loop_config)
    except signals.Cancelled as e:
        follower.stop()
        _verdict(run_dir, "cancelled", str(e), loop_config, follower)
        return signals.exit_status(e)
    finally:
        launch.finish_tracking(loop_config)
    follower.stop()
    if error:
        _verdict(run_dir, "failed", error, loop_config, follower)
        return 1
    follower.ended("succeeded")
    launch.disconnect_ray()  # Ray's forwarding of the workers' output ends: the verdict is the last thing shown
    try:
        record = run_record.load_latest(run_dir)
    except (OSError, ValueError):
        record = {}
    print(failures.success(run_dir, record), flush=True)
    return 0


def _verdict(run_dir: str, status: str, error: str, loop_config, follower: follow.Follower) -> None:
    """End Ray's output (its forwarding stops with the connection), then print `failures.verdict` as the driver's
    last lines, on stderr: what a person reads first, also told on the RayJob (`follower`). With the cluster gone the
    connection is left: Ray ends the process once it cannot reach its cluster, and disconnecting only waits for
    that."""
    try:
        record = run_record.load_latest(run_dir)
    except (OSError, ValueError):
        record = {}
    if (record.get("error") or {}).get("reason") != "cluster_lost":  # a lost cluster: Ray's own exit is fatal
        launch.disconnect_ray()
    else:
        launch.close_progress_bars()
    logs_dir = failures.attempt_logs(run_dir, loop_config.started_at)
    try:
        fs, path = storage.filesystem(logs_dir)
        logs = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)}
    except (OSError, ValueError):
        logs = set()
    command = "python -m job " + shlex.join(sys.argv[1:])
    status, err = record.get("status") or status, record.get("error") or failures.describe(error)
    print(failures.verdict(run_dir, status, err, error, command, logs_dir, sorted(logs | {follow.DRIVER_LOG})),
          file=sys.stderr, flush=True)
    follower.ended(status, err)


def _record_refusal(cfg: config_lib.RunConfig, run_dir: str | None, error, follower: follow.Follower | None) -> None:
    """A run refused once the driver holds its lease (a bad data row, a refused resume, an unplaceable worker group)
    gets a `failed` record of this attempt (beside a record with finished work, which stays what it was). Refused
    before that, there is nowhere to write one: the exit status and the message are the whole record."""
    if follower:
        follower.ended("failed", failures.describe(error))
    if run_dir is None or os.environ.get("RANK", "0") != "0":
        return
    try:
        # No worker started, so no record is this attempt's: any there is an earlier one's, whenever it opened.
        run_record.close_if_running(run_dir, "failed", error, attempt=launch.attempt(cfg, time.time()))
    except Exception as e:  # the refusal's message is already out; a record that cannot be written must not hide it
        print(f"cannot record the failure in {run_dir}: {type(e).__name__}: {e}", file=sys.stderr)
