"""Command line.

    python -m job [run] --config run.yaml [--set key=value ...]   train (or preflight, per `mode`)
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
import json  # noqa: E402
import sys  # noqa: E402

from . import checkpoint as checkpoint_lib  # noqa: E402
from . import config as config_lib  # noqa: E402
from . import data as data_lib  # noqa: E402
from . import failures, launch, packages  # noqa: E402

IMPORTED_AT = time.time()


COMMANDS = """commands:
  run (default)       train (or only the preflight, per the config's `mode`)
  compare RUN_A RUN_B what differs between two runs' records (run.json)
  report RUN_DIR      markdown summary and plots of a run
  accept EXPORT_DIR   re-check an exported model in a fresh process
  schema              JSON Schema of the run config"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["schema"]:
        print(json.dumps(config_lib.json_schema(), indent=2))
        return 0
    if argv[:1] == ["compare"]:
        from .evidence import compare_main

        return compare_main(argv[1:])
    if argv[:1] == ["report"]:
        from .report import main as report_main

        return report_main(argv[1:])
    if argv[:1] == ["accept"]:
        return _accept(argv[1:])
    if argv[:1] == ["run"]:
        argv = argv[1:]
    parser = argparse.ArgumentParser(prog="python -m job [run]", description="FSDP2 fine-tune under Ray Train.",
                                     epilog=COMMANDS, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="run config YAML")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    args = parser.parse_args(argv)
    try:
        cfg = launch.resolve_paths(config_lib.load(args.config, args.set))
        packages.check_config(cfg)  # a missing optional package fails here, before any worker starts
        run_dir = launch.run_directory(cfg)
        launch.check_before_start(cfg, run_dir)
        # When each of the driver's startup steps ended (metrics.Timeline).
        startup = {"imports": IMPORTED_AT, "checks": time.time()}
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
        return 2
    except packages.MissingPackage as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except checkpoint_lib.CheckpointError as e:
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 1
    except data_lib.DataError as e:
        print(f"data error: {e}", file=sys.stderr)
        return 2
    with failures.driver_watch(run_dir):  # the heartbeat; a record left running closed on an exception
        error = launch.run_with_ray(cfg, loop_config)
    print(f"run directory: {run_dir}", flush=True)
    if error:
        print(f"run failed: {error}", file=sys.stderr)
        return 1
    return 0


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
    result = accept(args.export_dir)
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
