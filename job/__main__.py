"""Command line.

    python -m job [run] --config run.yaml [--set key=value ...]   train (or preflight, per `mode`)
    python -m job runs STORAGE [--status S] [--where F=V] [--json]  the runs under a storage path (job/runs.py)
    python -m job compare RUN_A RUN_B                              what differs between two runs' records
    python -m job report RUN_DIR [--out DIR]                       markdown summary and plots of a run
    python -m job accept EXPORT_DIR                                re-check an exported model (fresh process)
    python -m job schema                                           JSON Schema of the run config

`run` parses and checks the config, the optional packages it needs, the storage, the model's settings and (under Ray) whether the cluster can
place the workers: every problem found is printed, one line each naming the field, and exits 2 before any
worker starts. It then prints the resolved config, prepares the run directory, trains under Ray Train (or
under torchrun when started by it), and says where the run is; a failed run exits 1 with the workers' error.
A run that is already complete is not started again: it says so and what to do instead.
"""

from __future__ import annotations

import time

STARTED_AT = time.time()
"""When the driver started (before its imports): the start of the run's time accounting (`metrics.Timeline`)."""

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402

from . import config as config_lib  # noqa: E402
from . import failures, packages  # noqa: E402


COMMANDS = """commands:
  run (default)       train (or only the preflight, per the config's `mode`)
  runs STORAGE        the runs under a storage path: status, steps, goodput, loss, failure (filters, --json)
  compare RUN_A RUN_B what differs between two runs' records (run.json); names with --storage
  report RUN_DIR      markdown summary and plots of a run; a name with --storage
  accept EXPORT_DIR   re-check an exported model in a fresh process
  schema              JSON Schema of the run config"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["schema"]:
        if argv[1:]:
            print(f"schema: takes no arguments, got {' '.join(argv[1:])}", file=sys.stderr)
            return 2
        print(json.dumps(config_lib.json_schema(), indent=2))
        return 0
    if argv[:1] == ["compare"]:
        from .evidence import compare_main

        return compare_main(argv[1:])
    if argv[:1] == ["report"]:
        from .report import main as report_main

        return report_main(argv[1:])
    if argv[:1] == ["runs"]:
        from .runs import main as runs_main

        return runs_main(argv[1:])
    if argv[:1] == ["accept"]:
        return _accept(argv[1:])
    if argv[:1] == ["run"]:
        argv = argv[1:]
    # Training's imports (torch) here, not at the top: the other commands start in well under a second.
    from . import launch  # noqa: F401

    imported_at = time.time()
    parser = argparse.ArgumentParser(prog="python -m job [run]", description="FSDP2 fine-tune under Ray Train.",
                                     epilog=COMMANDS, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="run config YAML")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as held:  # the run lease, from the storage check to the last line
        return _run(args, imported_at, held)


def _run(args: argparse.Namespace, imported_at: float, held: contextlib.ExitStack) -> int:
    from . import checkpoint as checkpoint_lib
    from . import data as data_lib
    from . import launch
    from . import lease as lease_lib

    cfg = recordable = None  # the run directory, once its lease is held: a refusal from there on is recorded
    try:
        cfg = launch.resolve_paths(config_lib.load(args.config, args.set))
        packages.check_config(cfg)  # a missing optional package fails here, before any worker starts
        run_dir = launch.run_directory(cfg)
        launch.check_before_start(cfg, run_dir)
        if os.environ.get("RANK", "0") == "0":  # torchrun's rank 0 holds it for all its processes
            held.enter_context(lease_lib.hold(run_dir))
        recordable = run_dir
        # When each of the driver's startup steps ended (metrics.Timeline).
        startup = {"imports": imported_at, "checks": time.time()}
        if launch.under_torchrun():
            launch.run_with_torchrun(launch.prepare(cfg, run_dir, STARTED_AT, startup))
            return 0
        print(f"# resolved config\n{config_lib.to_yaml(cfg)}", flush=True)
        if (done := launch.finished(cfg, run_dir)) is not None:
            print(done, flush=True)
            return 0
        launch.connect_ray(cfg)
        startup["ray"] = time.time()
        loop_config = launch.prepare(cfg, run_dir, STARTED_AT, startup)
    except config_lib.ConfigError as e:
        for message in e.messages:
            print(f"config error: {message}", file=sys.stderr)
        _record_refusal(cfg, recordable, e)
        return 2
    except packages.MissingPackage as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except lease_lib.LeaseHeld as e:
        print(f"refused: {e}", file=sys.stderr)
        return 2
    except checkpoint_lib.CheckpointError as e:
        print(f"checkpoint error: {e}", file=sys.stderr)
        _record_refusal(cfg, recordable, e)
        return 1
    except data_lib.DataError as e:
        print(f"data error: {e}", file=sys.stderr)
        _record_refusal(cfg, recordable, e)
        return 2
    try:
        # SIGINT/SIGTERM stop the run (`cancelled`); a record left running closed on an exception.
        with failures.driver_watch(run_dir):
            error = launch.run_with_ray(cfg, loop_config)
    except failures.Cancelled as e:
        _verdict(run_dir, "cancelled", str(e), loop_config)
        return failures.exit_status(e)
    finally:
        launch.finish_tracking(loop_config)
    if error:
        _verdict(run_dir, "failed", error, loop_config)
        return 1
    print(f"run directory: {run_dir}", flush=True)
    return 0


def _verdict(run_dir: str, status: str, error: str, loop_config) -> None:
    """Ends Ray's output (its log forwarding stops with the connection), then prints the verdict
    (`failures.verdict`) as the driver's last lines, on stderr: what a person reads first in a log. With the Ray
    cluster gone the connection is left as it is: Ray ends the process once it cannot reach its cluster, and
    disconnecting only waits for that."""
    from . import evidence, launch, storage

    try:
        record = evidence.load_latest(run_dir)
    except (OSError, ValueError):
        record = {}
    if (record.get("error") or {}).get("reason") != "cluster_lost":  # a lost cluster: Ray's own exit is fatal
        launch.disconnect_ray()
    logs_dir = failures.attempt_logs(run_dir, loop_config.started_at)
    try:
        fs, path = storage.filesystem(logs_dir)
        logs = sorted(storage.join(logs_dir, p.rstrip("/").rsplit("/", 1)[-1]) for p in fs.ls(path, detail=False))
    except (OSError, ValueError):
        logs = []
    command = "python -m job " + shlex.join(sys.argv[1:])
    print(failures.verdict(run_dir, record.get("status") or status, record.get("error"), error, command, logs),
          file=sys.stderr, flush=True)


def _record_refusal(cfg: config_lib.RunConfig, run_dir: str | None, error) -> None:
    """A run refused once the driver holds its lease (a bad data row, a refused resume, a worker group the
    cluster cannot place) gets a `failed` record of this attempt, written by the driver (rank 0 of torchrun's
    processes): beside the run's record when that holds finished work, listed in its `later_attempts`
    (`evidence.start_record`), so the run stays what it was. Refused before that (the config, the packages, the
    storage itself, the model's settings, the lease), there is nowhere to write one: the exit status and the
    message are the whole record."""
    from . import evidence, launch

    if run_dir is None or os.environ.get("RANK", "0") != "0":
        return
    try:
        # No worker started, so no record is this attempt's: any there is an earlier one's, whenever it opened.
        evidence.close_if_running(run_dir, "failed", error, attempt=launch.attempt(cfg, time.time()))
    except Exception as e:  # the refusal's message is already out; a record that cannot be written must not hide it
        print(f"cannot record the failure in {run_dir}: {type(e).__name__}: {e}", file=sys.stderr)


def _accept(argv: list[str]) -> int:
    """`python -m job accept EXPORT_DIR`: the fresh-process check of an export (see export.accept)."""
    parser = argparse.ArgumentParser(prog="python -m job accept", description="Check an exported model.")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("export_dir", nargs="?", help="local export directory holding reference.json")
    where.add_argument("--wait", action="store_true",
                       help="prepare (imports), then read the export directory from standard input")
    args = parser.parse_args(argv)
    from .export import accept, prepare_acceptance

    if args.wait:
        prepare_acceptance()
        args.export_dir = sys.stdin.readline().strip()
        if not args.export_dir:  # the export was called off
            return 0
    if not os.path.isfile(os.path.join(args.export_dir, "reference.json")):
        what = "no such directory" if not os.path.exists(args.export_dir) else (
            "not a directory" if not os.path.isdir(args.export_dir) else "no reference.json in it (not an export)")
        print(f"accept: {args.export_dir}: {what}", file=sys.stderr)
        return 2
    result = accept(args.export_dir)
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
