"""Run index: `python -m job runs STORAGE [--status S] [--name GLOB] [--where FIELD OP VALUE] [--sort KEY] [--json]`
(docs/evidence.md, "runs").

One row per run directory under a storage path, from its `run.json` alone (and `heartbeat.json` while `running`),
read in one batched fsspec `cat` (concurrent on s3fs), so hundreds of runs list in about a second. The status is
the record's, except `stale` (`running`, its driver's heartbeat stale), `starting` (no run.json yet, a fresh
heartbeat) and `unreadable` (`reason` says why: a bad directory is a row, never an error of the listing). A
directory with none of a run's files (`RUN_FILES`, `checkpoint_*`) is not a run.

`--where` FIELD is a column (`COLUMNS`) or a dotted run.json path checked against run.json's and the config's
schemas; VALUE is JSON when it parses, else text; numbers compare as numbers, text as text (ISO times order); a
missing field satisfies only `!=`. `--sort` takes the same fields, missing values last. `resolve_run` turns a name
into its run directory for `report --storage` and `compare --storage`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import fnmatch
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable

from .. import packages, storage
from ..config import json_schema
from ..records import lease
from ..records.run_record import CLOSED_STATUSES, METRICS_FILE, RUN_RECORD, check_types, later_attempts_line, schema_path

STATUSES = ("running", "stale", "starting", *CLOSED_STATUSES, "unreadable")
RUN_FILES = (RUN_RECORD, METRICS_FILE, "config.yaml", lease.HEARTBEAT_FILE, lease.LEASE_FILE)
"""Files that make a directory a run directory (with `checkpoint_*`): the driver writes lease.json first."""
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""A bare run name (config.RunConfig.name's pattern); anything else given to `resolve_run` is a path."""
OPERATORS = ("!=", "<=", ">=", "=", "<", ">", "~")
_WHERE = re.compile(r"^\s*(?P<field>[A-Za-z0-9_.-]+?)\s*(?P<op>!=|<=|>=|=|<|>|~)\s*(?P<value>.*?)\s*$")
_MISSING = object()


class RunsError(ValueError):
    """A bad input to `runs` (or a bad run name); its message is the one line printed."""


@dataclasses.dataclass
class RunRow:
    """One row of the index. `record` (the parsed run.json) feeds `--where` on run.json paths; it is not shown."""

    name: str
    path: str
    status: str
    started: str | None = None
    ended: str | None = None
    attempts: int | None = None
    steps: int | None = None
    goodput: float | None = None
    eval_loss: float | None = None
    task: str | None = None
    task_score: float | None = None
    chart: str | None = None
    image: str | None = None
    failure: str | None = None
    reason: str | None = None
    logs: str | None = None
    """The newest attempt's logs (the driver's output, the workers' tracebacks): run.json's `logs`."""
    record: dict | None = dataclasses.field(default=None, repr=False)

    def row(self) -> dict[str, Any]:
        """The row as `--json` prints it."""
        return {f: getattr(self, f) for f in COLUMNS}


COLUMNS = tuple(f.name for f in dataclasses.fields(RunRow) if f.name != "record")


# --- reading ---------------------------------------------------------------------------------------

def _get(record: Any, *keys: str) -> Any:
    """`record[k1][k2]...`, or None where a level is missing or not an object."""
    for key in keys:
        if not isinstance(record, dict):
            return None
        record = record.get(key)
    return record


def _known(value: Any) -> Any:
    """None for the record's "unknown" placeholder (its reason stays in run.json)."""
    return None if value == "unknown" else value


def parse_record(data: bytes) -> dict:
    """run.json's bytes as a record; `ValueError` saying how it is broken (half written, corrupt, not a record)."""
    if not data.strip():
        raise ValueError(f"{RUN_RECORD} is empty (half written)")
    try:
        record = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{RUN_RECORD} is not UTF-8 text (corrupt): {exc.reason} at byte {exc.start}") from None
    except json.JSONDecodeError as exc:
        how = "corrupt" if data.rstrip().endswith(b"}") else "cut short: half written"  # a whole record ends in }
        raise ValueError(f"{RUN_RECORD} is not valid JSON ({how}): {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{RUN_RECORD} holds a JSON {type(record).__name__}, not a run record")
    status = record.get("status")
    if status not in ("running", *CLOSED_STATUSES):
        raise ValueError(f"{RUN_RECORD} has no valid status ({status!r}): not a run record")
    check_types(record, RUN_RECORD)
    return record


def from_record(name: str, path: str, record: dict) -> RunRow:
    """The row of a readable record (its liveness not yet judged: see `_judge_running`)."""
    tasks = _get(record, "metrics", "task_eval")
    task, score = None, None
    if isinstance(tasks, dict) and tasks:  # one task per run (eval.task)
        task, result = sorted(tasks.items())[0]
        score = _get(result, "exact_match")
    error = record.get("error")
    previous, later = record.get("previous_attempts"), record.get("later_attempts")
    return RunRow(
        name=name, path=path, status=record["status"],
        started=record.get("started_at"), ended=record.get("ended_at"),
        attempts=1 + sum(len(a) for a in (previous, later) if isinstance(a, list)),
        steps=_get(record, "metrics", "steps"), goodput=_get(record, "time", "goodput"),
        eval_loss=_get(record, "metrics", "final_eval_loss"), task=task, task_score=score,
        chart=_known(_get(record, "chart", "version")), image=_known(_get(record, "image", "digest")),
        failure=(f"{error.get('class')}/{error.get('reason')}" if isinstance(error, dict) else error) or None,
        reason=later_attempts_line(record), logs=record.get("logs"), record=record)


def _judge_running(run: RunRow) -> None:
    """A `running` row whose driver's heartbeat is stale becomes `stale`, with the heartbeat's time."""
    try:
        if lease.liveness(run.path, run.record) != "stale":
            return
        beat = lease.read_heartbeat(run.path) or {}
    except Exception as exc:  # noqa: BLE001 -- an unreadable heartbeat leaves the row running, saying why
        run.reason = f"heartbeat unreadable: {_storage_problem(exc)}"
        return
    run.status = "stale"
    run.reason = (f"record running, driver heartbeat stale (last at {beat.get('at')}): the driver is gone; "
                  "the next start marks it abandoned")


def _without_record(fs, name: str, path: str, fs_path: str) -> RunRow | None:
    """The row of a directory without run.json: None when it holds none of a run's files (not a run), `starting`
    when its driver's heartbeat is fresh, else `unreadable`."""
    try:
        files = sorted(os.path.basename(p.rstrip("/")) for p in fs.ls(fs_path, detail=False))
        present = [f for f in files if f in RUN_FILES or f.startswith("checkpoint_")]
        if present and lease.liveness(path, {"status": "running"}) == "live":
            return RunRow(name=name, path=path, status="starting", reason=f"no {RUN_RECORD} yet; the driver's heartbeat is fresh")
    except Exception as exc:  # noqa: BLE001 -- a directory that cannot be listed is a row, not the listing's end
        return RunRow(name=name, path=path, status="unreadable", reason=f"no {RUN_RECORD}; {_storage_problem(exc)}")
    if not present:
        return None
    return RunRow(name=name, path=path, status="unreadable", reason=f"no {RUN_RECORD} (has {', '.join(present[:4])})")


def list_runs(storage_path: str) -> list[RunRow]:
    """Every run directory directly under `storage_path`, as rows, in directory order.

    `RunsError` when the path cannot be listed; a bad run directory is an `unreadable` row instead.
    """
    try:
        fs, root = storage.filesystem(storage_path)
        entries = fs.ls(root, detail=True)
    except packages.MissingPackage as exc:
        raise RunsError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 -- every storage failure becomes one line naming the path
        raise RunsError(f"{storage_path}: {_storage_problem(exc)}") from None
    if not entries and not fs.isdir(root):
        raise RunsError(f"{storage_path}: no such directory")
    if len(entries) == 1 and entries[0]["type"] != "directory" and entries[0]["name"].rstrip("/") == root.rstrip("/"):
        raise RunsError(f"{storage_path}: not a directory")
    dirs = sorted(e["name"].rstrip("/") for e in entries
                  if e["type"] == "directory" and not os.path.basename(e["name"].rstrip("/")).startswith("."))
    # One concurrent batch of GETs (s3fs); max_concurrency=1 spares each a HEAD asking whether to read it in parts.
    options = {"max_concurrency": 1} if "s3" in fs.protocol else {}
    records = fs.cat([f"{d}/{RUN_RECORD}" for d in dirs], on_error="return", **options) if dirs else {}
    runs = []
    for fs_path in dirs:
        name = os.path.basename(fs_path)
        path = storage.join(storage_path, name)
        data = records.get(f"{fs_path}/{RUN_RECORD}")
        if isinstance(data, FileNotFoundError):
            run = _without_record(fs, name, path, fs_path)
        elif isinstance(data, Exception):
            run = RunRow(name=name, path=path, status="unreadable", reason=f"cannot read {RUN_RECORD}: {_storage_problem(data)}")
        else:
            try:
                run = from_record(name, path, parse_record(data))
            except ValueError as exc:
                run = RunRow(name=name, path=path, status="unreadable", reason=str(exc))
        if run is not None:
            runs.append(run)
    with ThreadPoolExecutor(max_workers=16) as pool:  # a heartbeat read each: concurrent on an object store
        list(pool.map(_judge_running, [r for r in runs if r.status == "running"]))
    return runs


def _storage_problem(exc: BaseException) -> str:
    """One line for a storage failure (botocore's errors are matched by name: botocore need not be installed)."""
    names = {t.__name__ for t in type(exc).__mro__}
    if "NoCredentialsError" in names or "PartialCredentialsError" in names:
        return ("no AWS credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, "
                "or run where an IAM role provides them)")
    if "EndpointConnectionError" in names or "ConnectTimeoutError" in names:
        return f"cannot reach the object store ({exc})"
    if isinstance(exc, FileNotFoundError):
        return "no such bucket" if "bucket does not exist" in str(exc) else "no such directory"
    if isinstance(exc, NotADirectoryError):
        return "not a directory"
    if isinstance(exc, PermissionError):
        return f"access denied ({exc})"
    return f"cannot list it: {type(exc).__name__}: {exc}"


# --- fields, filters, sorting ----------------------------------------------------------------------

def _schemas() -> tuple[dict, dict]:
    """(run.json's schema, the run config's schema): the fields `--where` and `--sort` may name."""
    with open(schema_path(), encoding="utf-8") as f:
        return json.load(f), json_schema()


def _alternatives(schema: dict, root: dict) -> list[dict]:
    """`schema` with local `$ref`s resolved and `anyOf`/`oneOf` spread into alternatives (`allOf` adds no fields
    here)."""
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return _alternatives(target, root)
    parts = [s for key in ("anyOf", "oneOf") for s in schema.get(key, [])]
    return [schema] + [a for s in parts for a in _alternatives(s, root)] if parts else [schema]


def _field_problem(schema: dict, root: dict, parts: list[str], done: list[str]) -> str | None:
    """None when the dotted path `parts` can name a value under `schema`, else why not (naming `done`)."""
    if not parts:
        return None
    alternatives = _alternatives(schema, root)
    names: list[str] = []
    for alt in alternatives:
        props = alt.get("properties") or {}
        if parts[0] in props:
            return _field_problem(props[parts[0]], root, parts[1:], done + parts[:1])
        names += props
    for alt in alternatives:
        extra = alt.get("additionalProperties", True)
        types = alt.get("type")
        if extra is not False and ("object" in types if isinstance(types, list) else types == "object"):
            return _field_problem(extra, root, parts[1:], done + parts[:1]) if isinstance(extra, dict) else None
    where = ".".join(done)
    if not names:
        listed = any("array" in (a.get("type") or ()) for a in alternatives)
        return f"{where} is {'a list' if listed else 'a value'}, it has no field {parts[0]!r}"
    return f"unknown field {'.'.join(done + parts[:1])!r} ({where or 'run.json'} has: {', '.join(dict.fromkeys(names))})"


def check_field(field: str) -> None:
    """`RunsError` unless `field` is a column or a run.json path its schema (and the run config's) allows."""
    if field in COLUMNS:
        return
    record_schema, config_schema = _schemas()
    parts = field.split(".")
    if parts[0] == "config":
        problem = _field_problem(config_schema, config_schema, parts[1:], ["config"])
    else:
        problem = _field_problem(record_schema, record_schema, parts, [])
    if problem and "." not in field and parts[0] not in record_schema["properties"]:
        problem = f"unknown field {field!r} (a column: {', '.join(COLUMNS)}; or a run.json path such as config.train.lr)"
    if problem:
        raise RunsError(problem)


def value_of(run: RunRow, field: str) -> Any:
    """A row column, or the value at a dotted run.json path (`_MISSING` when the record lacks it)."""
    if field in COLUMNS:
        value = getattr(run, field)
        return _MISSING if value is None else value
    value: Any = run.record
    for key in field.split("."):
        if not isinstance(value, dict) or key not in value:
            return _MISSING
        value = value[key]
    return _MISSING if value is None else value


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


@dataclasses.dataclass(frozen=True)
class Condition:
    """One `--where FIELD OP VALUE`."""

    field: str
    op: str
    text: str

    @classmethod
    def parse(cls, expression: str) -> "Condition":
        m = _WHERE.match(expression)
        if not m or not m["value"]:
            raise RunsError(f"--where {expression!r}: expected FIELD OP VALUE, OP one of {' '.join(OPERATORS)} "
                            "(e.g. config.train.lr=1e-5, goodput>0.5, name~gsm8k-*)")
        try:
            check_field(m["field"])
        except RunsError as exc:
            raise RunsError(f"--where {expression!r}: {exc}") from None
        return cls(m["field"], m["op"], m["value"])

    def holds(self, run: RunRow) -> bool:
        actual = value_of(run, self.field)
        if actual is _MISSING:
            return self.op == "!="
        if self.op == "~":
            return fnmatch.fnmatchcase(actual if isinstance(actual, str) else json.dumps(actual), self.text)
        try:
            wanted = json.loads(self.text)
        except json.JSONDecodeError:
            wanted = self.text
        a, w = _number(actual), _number(wanted)
        if a is None or w is None:  # compare as text (a string value against the text as typed)
            a, w = (actual, self.text) if isinstance(actual, str) else (actual, wanted)
        if self.op in ("=", "!="):
            return (a == w) == (self.op == "=")
        try:
            return {"<": a < w, "<=": a <= w, ">": a > w, ">=": a >= w}[self.op]
        except TypeError:  # a number against text: no order
            return False


def select(runs: Iterable[RunRow], *, statuses: Iterable[str] = (), names: Iterable[str] = (),
           where: Iterable[Condition] = ()) -> list[RunRow]:
    """The runs that pass every filter (an empty filter passes all)."""
    statuses, names, where = set(statuses), list(names), list(where)
    return [r for r in runs
            if (not statuses or r.status in statuses)
            and (not names or any(fnmatch.fnmatchcase(r.name, n) for n in names))
            and all(c.holds(r) for c in where)]


def sort_runs(runs: list[RunRow], key: str, reverse: bool = False) -> list[RunRow]:
    """Sorted by `key` (then name); missing values last either way; numbers before text."""
    def sort_key(run: RunRow):
        value = value_of(run, key)
        number = None if isinstance(value, str) else _number(value)
        return (0, number, "") if number is not None else (1, 0.0, str(value))

    present = [r for r in runs if value_of(r, key) is not _MISSING]
    missing = [r for r in runs if value_of(r, key) is _MISSING]
    ordered = sorted(sorted(present, key=lambda r: r.name), key=sort_key, reverse=reverse)
    return ordered + sorted(missing, key=lambda r: r.name)


# --- output ----------------------------------------------------------------------------------------

def _time(iso: str | None) -> str:
    try:
        return _dt.datetime.fromisoformat(iso).astimezone(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
    except (TypeError, ValueError):
        return "-" if iso is None else str(iso)


def _cells(run: RunRow) -> list[str]:
    pct = lambda v: f"{v:.1%}" if isinstance(v, (int, float)) else "-"  # noqa: E731
    image = run.image or "-"
    if image.startswith("sha256:"):
        image = image[:19]  # sha256: and 12 hex digits, as docker shows it
    failure = "; ".join(filter(None, (run.failure, run.reason, run.failure and run.logs and f"logs {run.logs}")))
    return [run.name, run.status, _time(run.started), _time(run.ended) if run.ended else "-",
            "-" if run.attempts is None else str(run.attempts), "-" if run.steps is None else str(run.steps),
            pct(run.goodput), f"{run.eval_loss:.4g}" if isinstance(run.eval_loss, (int, float)) else "-",
            f"{run.task} {pct(run.task_score)}" if run.task else "-", run.chart or "-", image,
            run.reason if run.status in ("stale", "starting", "unreadable") else failure or "-"]


HEADER = ["NAME", "STATUS", "STARTED (UTC)", "ENDED (UTC)", "ATTEMPTS", "STEPS", "GOODPUT", "EVAL LOSS", "TASK",
          "CHART", "IMAGE", "FAILURE / REASON"]


def format_table(runs: list[RunRow]) -> str:
    rows = [HEADER] + [_cells(r) for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows)


def summary_line(storage_path: str, shown: list[RunRow], total: list[RunRow]) -> str:
    counts = [f"{n} {s}" for s in ("running", "stale", "starting", "failed", "unreadable")
              if (n := sum(r.status == s for r in total))]
    return (f"{len(shown)} of {len(total)} runs under {storage_path}"
            + (f" ({', '.join(counts)})" if counts else ""))


# --- names for report and compare ------------------------------------------------------------------

def resolve_run(name_or_path: str, storage_path: str | None) -> str:
    """The run directory of `name_or_path`: with `storage_path`, a bare name is that run under it (`RunsError` when
    there is none); a path is kept as given."""
    if storage_path is None or not RUN_NAME.fullmatch(name_or_path):
        return name_or_path
    path = storage.join(storage_path, name_or_path)
    try:
        found = storage.exists(path)
    except packages.MissingPackage as exc:
        raise RunsError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 -- as for the listing: one line naming the path
        raise RunsError(f"{storage_path}: {_storage_problem(exc)}") from None
    if not found:
        raise RunsError(f"no run named {name_or_path!r} under {storage_path} "
                        f"(python -m job runs {storage_path} lists them)")
    return path


# --- command line ----------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (a `RunsError`) instead of the usage and a message."""

    def error(self, message: str):
        raise RunsError(message)


def main(argv: list[str]) -> int:
    """`python -m job runs STORAGE ...` (`argv` without "runs"): 0 listed, 2 bad input (one line `runs: ...`)."""
    parser = _Parser(prog="python -m job runs", description="List the runs under a storage path.",
                     epilog="FIELD: a column (" + ", ".join(COLUMNS) + ") or a dotted run.json path "
                            "(config.train.lr, chart.version, error.class)")
    parser.add_argument("storage", help="storage path: local directory, PVC mount or s3:// URI")
    parser.add_argument("--status", action="append", default=[], metavar="S[,S]",
                        help=f"only these statuses ({', '.join(STATUSES)})")
    parser.add_argument("--name", action="append", default=[], metavar="GLOB", help="only names matching a glob")
    parser.add_argument("--where", action="append", default=[], metavar="FIELD<OP>VALUE",
                        help=f"only runs where FIELD OP VALUE holds; OP: {' '.join(OPERATORS)} (~: glob)")
    parser.add_argument("--sort", default="started", metavar="FIELD", help="sort key (default: started)")
    parser.add_argument("--reverse", action="store_true", help="reverse the order (missing values stay last)")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    try:
        args = parser.parse_args(argv)
        statuses = [s.strip() for item in args.status for s in item.split(",") if s.strip()]
        for s in statuses:
            if s not in STATUSES:
                raise RunsError(f"--status {s!r}: unknown status (one of {', '.join(STATUSES)})")
        where = [Condition.parse(w) for w in args.where]
        try:
            check_field(args.sort)
        except RunsError as exc:
            raise RunsError(f"--sort {args.sort!r}: {exc}") from None
        every = list_runs(args.storage)
    except RunsError as exc:
        print(f"runs: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    shown = sort_runs(select(every, statuses=statuses, names=args.name, where=where), args.sort, args.reverse)
    if args.json:
        text = json.dumps([r.row() for r in shown], indent=1)
    elif not every:
        text = f"no runs under {args.storage}"
    else:
        text = (format_table(shown) if shown else "no run matches the filters") + "\n" + summary_line(args.storage, shown, every)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `runs ... | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
