"""Command line.

    python -m job [run] --config run.yaml [--set key=value ...]   train (or preflight, or pairs, per `mode`)
    python -m job pairs --config run.yaml [--set key=value ...]    `run` with `mode: pairs`: preference pairs
    python -m job runs STORAGE [--status S] [--where F=V] [--json]  the runs under a storage path (job/commands/runs.py)
    python -m job compare RUN_A RUN_B                              what differs between two runs' records
    python -m job report RUN_DIR [--out DIR]                       markdown summary and plots of a run
    python -m job accept EXPORT_DIR                                re-check an exported model (fresh process)
    python -m job schema                                           JSON Schema of the run config

`run` (`driver/main.py`) exits 2 when its checks before any worker starts find a problem (each printed in one line
naming the field), 1 when the run fails; a complete run is not started again. The other commands import no
training code, so they start in well under a second.
"""

from __future__ import annotations

import time

STARTED_AT = time.time()
"""When the driver started (before its imports): the start of the run's time accounting (`metrics.Timeline`)."""

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from . import config as config_lib  # noqa: E402
from .commands import compare, report, runs  # noqa: E402


COMMANDS = """commands:
  run (default)       train (or only the preflight, or pairs, per the config's `mode`)
  pairs               sample answers with model.path, score them (eval.task), write preference pairs
  runs STORAGE        the runs under a storage path: status, steps, goodput, loss, failure (filters, --json)
  compare RUN_A RUN_B what differs between two runs' records (run.json); names with --storage
  report RUN_DIR      markdown summary and plots of a run; a name with --storage
  accept EXPORT_DIR   re-check an exported model in a fresh process
  schema              JSON Schema of the run config"""


VERBS = ("run", "runs", "compare", "report", "accept", "schema")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-") and argv[0] not in VERBS:
        print(f"python -m job: unknown command {argv[0]!r} (commands: {', '.join(VERBS)}; python -m job --help)",
              file=sys.stderr)
        return 2
    if argv[:1] == ["schema"]:
        if argv[1:] in (["-h"], ["--help"]):
            print("usage: python -m job schema\n\nPrints the run config's JSON Schema (values.schema.json's run: is "
                  "generated from it).")
            return 0
        if argv[1:]:
            print(f"schema: takes no arguments, got {' '.join(argv[1:])}", file=sys.stderr)
            return 2
        print(json.dumps(config_lib.json_schema(), indent=2))
        return 0
    if argv[:1] == ["compare"]:
        return compare.main(argv[1:])
    if argv[:1] == ["report"]:
        return report.main(argv[1:])
    if argv[:1] == ["runs"]:
        return runs.main(argv[1:])
    if argv[:1] == ["accept"]:
        return _accept(argv[1:])
    if argv[:1] == ["run"]:
        argv = argv[1:]
    if argv[:1] == ["pairs"]:
        argv = [*argv[1:], "--set", "mode=pairs"]
    from .driver import main as driver  # torch: here, not at the top, to keep the other commands' start short

    imported_at = time.time()
    parser = argparse.ArgumentParser(prog="python -m job [run]", description="FSDP2 fine-tune under Ray Train.",
                                     epilog=COMMANDS, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="run config YAML")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    args = parser.parse_args(argv)
    return driver.run(args, STARTED_AT, imported_at)


def _accept(argv: list[str]) -> int:
    """`python -m job accept EXPORT_DIR`: the fresh-process check of an export (see export.accept)."""
    parser = argparse.ArgumentParser(prog="python -m job accept", description="Check an exported model.")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("export_dir", nargs="?", help="local export directory holding reference.json")
    where.add_argument("--wait", action="store_true",
                       help="prepare (imports), then read the export directory from standard input")
    args = parser.parse_args(argv)
    from .worker.model.export import accept, prepare_acceptance  # here: keeps the other commands' start short

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
