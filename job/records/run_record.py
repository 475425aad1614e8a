"""The run record, `run.json` in the run directory `<storage_path>/<run name>/`: what a run ran on, how its GPUs
talked and what it produced, so that one can trust and reproduce it.

The evidence comes from `environment` (worker inventory, image digest), `nccl` (transport; `gloo_transport` on CPU)
and `preflight` (the collective benchmark). In `worker.train.train_loop` every rank enables NCCL's log before the
first collective (NCCL reads its settings once, at its first communicator) and runs the preflight; rank 0 alone keeps
the record: `start_record` after the preflight, `update_record` as training learns more, `finish_record` at the end
or on failure.

Nothing here needs a GPU, Kubernetes or network access (`s3://` aside): a value that cannot be known is `"unknown"`
plus a `reason`, not an exception. One long module on purpose: every write of `run.json` goes through it, so which
attempt's record a run keeps (a finished one is not replaced by a later failure) is decided in one place.
"""

from __future__ import annotations

import collections
import contextlib
import datetime as _dt
import hashlib
import json
import os
import socket
import sys
from typing import Any, Iterable, Mapping

from .. import storage
from . import failures
from . import lease as lease_lib
from .environment import UNKNOWN, job_sha256, job_version, worker_environment
from .nccl import describe_transport

RUN_RECORD = "run.json"
CONFIG_FILE = "config.yaml"
ATTEMPTS_DIR = "attempts"
"""`attempts/<n>/`: the config and record of attempt n where it ran beside the run's record (`start_record`)."""


def attempt_file(number: int, name: str) -> str:
    """`name` (config.yaml, run.json) of attempt `number`, relative to the run directory (`ATTEMPTS_DIR`)."""
    return storage.join(ATTEMPTS_DIR, str(number), name)
METRICS_FILE = "metrics.jsonl"
SCHEMA_VERSION = 1
CLOSED_STATUSES = ("succeeded", "failed", "cancelled", "abandoned")
"""`succeeded`/`failed` by rank 0, or by the driver for what the workers could not see (`failed` after a lost worker,
`cancelled` on a KeyboardInterrupt); `abandoned` at the next start when the driver itself was lost."""

# ---------------------------------------------------------------------------------------------
# 1. Run record (run.json)
# ---------------------------------------------------------------------------------------------

# Environment variables the chart sets, and where they land in the record.
CHART_ENV = {"name": "JOB_CHART", "version": "JOB_CHART_VERSION", "release": "JOB_RELEASE",
             "values_sha256": "JOB_VALUES_SHA256"}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def chart_metadata(env: Mapping[str, str] | None = None) -> dict:
    """Chart name/version, release and values hash from the env vars the chart sets.

    A missing one is `"unknown"`, `unknown_reasons[field]` naming the unset variable.
    """
    env = os.environ if env is None else env
    out: dict[str, Any] = {}
    reasons = {}
    for field, var in CHART_ENV.items():
        value = env.get(var)
        out[field] = value or UNKNOWN
        if not value:
            reasons[field] = f"{var} unset (not launched by the Helm chart)"
    out["unknown_reasons"] = reasons
    return out


def _image_section(pods: list[dict], env: Mapping[str, str]) -> dict:
    reference = env.get("JOB_IMAGE")
    digests = sorted({p.get("digest", UNKNOWN) for p in pods if p.get("digest", UNKNOWN) != UNKNOWN})
    section: dict[str, Any] = {"reference": reference or UNKNOWN, "digest": UNKNOWN, "pods": pods,
                               "consistent": len(digests) <= 1}
    reasons = []
    if not reference:
        reasons.append("JOB_IMAGE unset (not launched by the Helm chart)")
    if len(digests) == 1 and all(p.get("digest") == digests[0] for p in pods):
        section["digest"] = digests[0]
    elif len(digests) > 1:
        section["digest"] = "mixed"
        reasons.append("pods run different image digests: " + ", ".join(digests))
    else:
        unknown_reasons = sorted({p.get("reason", "no reason given") for p in pods if p.get("digest", UNKNOWN) == UNKNOWN})
        reasons.append("; ".join(unknown_reasons) or "no pod information")
        if digests:  # some known, some unknown
            section["digest"] = UNKNOWN
    if reasons:
        section["reason"] = "; ".join(reasons)
    return section


def _hardware_section(workers: list[dict], preflight: dict | None) -> dict:
    accel_count: collections.Counter[str] = collections.Counter()
    hosts: dict[str, list[int]] = {}
    for w in workers:
        env = w["environment"]
        hosts.setdefault(w.get("hostname") or env["hostname"], []).append(w["rank"])
    # Accelerators per host, counted once per host (every worker on a host sees all its GPUs).
    first_on_host = {ranks[0] for ranks in hosts.values()}
    for w in workers:
        if w["rank"] in first_on_host:
            for name in w["environment"]["accelerator"]["names"] or [w["environment"]["cpu"]["model"]]:
                accel_count[name] += 1
    e0 = workers[0]["environment"] if workers else {}
    return {
        "nodes": len(hosts),
        "world_size": len(workers),
        "hosts": hosts,
        "accelerator_type": (e0.get("accelerator") or {}).get("type"),
        "accelerators": dict(accel_count),
        "driver_versions": sorted({w["environment"]["driver_version"] for w in workers}),
        "cuda_version": e0.get("cuda_version"),
        "nccl_version": e0.get("nccl_version"),
        "from_preflight": preflight is not None,
    }


def _transport_section(workers: list[dict]) -> dict:
    per_rank = []
    for w in workers:
        t = w.get("transport") or {}
        per_rank.append({"rank": w["rank"], "backend": t.get("backend"), "net": t.get("net"),
                         "net_plugin": t.get("net_plugin"), "net_devices": t.get("net_devices") or [],
                         "intra_node": t.get("intra_node") or [], "nccl_version": t.get("nccl_version"),
                         "net_line": t.get("net_line") or t.get("reason")})
    signatures = collections.Counter(describe_transport(w.get("transport")) for w in workers)
    return {"summary": "; ".join(f"{s} [{n} ranks]" for s, n in signatures.items()) or UNKNOWN,
            "per_rank": per_rank,
            "evidence": (workers[0].get("transport") or {}).get("lines", []) if workers else []}


def _runtime_env_section(workers: list[dict]) -> dict:
    """The job's Ray runtime env and what it installed at start, from every worker's inventory
    (`environment.runtime_env_additions`)."""
    reports = [w["environment"].get("runtime_env") or {} for w in workers]
    first = reports[0]
    return {
        "requested": first.get("requested", {}),
        "requirements": first.get("requirements", []),
        "installed_at_start": any(r.get("installed_at_start") for r in reports),
        "packages": {name: p["version"] for name, p in (first.get("packages") or {}).items()},
        "installed_on_ranks": [w["rank"] for w, r in zip(workers, reports) if r.get("installed_at_start")],
        "workers_agree": all(r.get("packages") == first.get("packages") for r in reports),
    }


def start_record(run_dir: str, *, config: dict, config_text: str, run_name: str | None = None,
                 seed: int | None = None, preflight: dict | None = None,
                 dataset: dict | None = None, tokenizer_sha256: str | None = None,
                 pods: list[dict] | None = None, env: Mapping[str, str] | None = None, logs: str | None = None) -> dict:
    """Create `<run_dir>/run.json` with status `running`; return the record.

    Rank 0 only, once, after `preflight.run_preflight` (hardware, transport and every worker's environment known)
    and before training. `run_dir`: local or `s3://`. `config`: the resolved config as a dict; `config_text`: its
    YAML as resolved (its sha256 is the config hash). `run_name` defaults to `run_dir`'s last component.
    `preflight`: rank 0's `run_preflight` result (or `PreflightError.result`); None records this process's
    environment only. `dataset` / `tokenizer_sha256`: the data fingerprint and tokenizer hash if known (else via
    `update_record`). `pods`: `environment.pod_image` results overriding the preflight's (tests). `env`: where the
    chart's env vars are read (default `os.environ`). `logs`: the attempt's logs (`failures.attempt_logs`).
    """
    env = os.environ if env is None else env
    if preflight is not None:
        workers = preflight["workers"]
    else:
        workers = [{"rank": 0, "hostname": socket.gethostname(), "environment": worker_environment(pod=pods is None),
                    "transport": None}]
    if pods is None:
        pods = [w["environment"].get("pod") or {"digest": UNKNOWN, "reason": "not recorded"} for w in workers]
    packages = workers[0]["environment"]["packages"]
    worker_rows = []
    for w in workers:
        environment = dict(w["environment"])
        own = environment.pop("packages", {})
        environment["packages_differ_from_rank0"] = {
            name: own.get(name) for name in sorted(set(own) | set(packages)) if own.get(name) != packages.get(name)}
        worker_rows.append({"rank": w["rank"], "hostname": w.get("hostname"), "environment": environment})
    e0 = workers[0]["environment"]
    record = {
        "schema_version": SCHEMA_VERSION,
        "run_name": run_name or os.path.basename(run_dir.rstrip("/")),
        "run_dir": run_dir,
        "status": "running",
        "error": None,
        "started_at": _now(),
        "ended_at": None,
        "duration_s": None,
        "chart": chart_metadata(env),
        "pod": {"name": env.get("POD_NAME") or UNKNOWN, "namespace": env.get("POD_NAMESPACE") or UNKNOWN},
        "image": _image_section(pods, env),
        "job": {"version": job_version(), "sha256": job_sha256()},
        "config_sha256": hashlib.sha256(config_text.encode("utf-8")).hexdigest(),
        "config": config,
        "seed": seed,
        "runtime_env": _runtime_env_section(workers),
        "software": {"python": e0["python"], **e0["versions"], "cuda": e0["cuda_version"],
                     "nccl": e0["nccl_version"]},
        "packages": packages,
        "workers": worker_rows,
        "hardware": _hardware_section(workers, preflight),
        "transport": _transport_section(workers) if preflight is not None else
        {"summary": UNKNOWN, "per_rank": [], "evidence": [], "reason": "no preflight run"},
        "preflight": None if preflight is None else {k: v for k, v in preflight.items() if k != "workers"},
        "data": {"fingerprint": dataset, "tokenizer_sha256": tokenizer_sha256},
        "metrics": None,
        "evaluation": None,
        "checkpoints": None,
        "export": None,
        "time": None,
        "weights": None,
        "extra": {},
        "lease": _lease(run_dir),
        "logs": logs,
        "record_file": RUN_RECORD,
        "previous_attempts": [],
        "later_attempts": [],
    }
    if record["pod"]["name"] == UNKNOWN:
        record["pod"]["reason"] = "POD_NAME/POD_NAMESPACE unset (not running in the chart's pods)"
    try:
        old = load_record(run_dir)
    except (FileNotFoundError, ValueError):
        old = None
    record["previous_attempts"] = _previous_attempts(run_dir, old)
    if old is not None and _has_results(old):  # this attempt goes beside the run's record, listed in it
        record["record_file"] = attempt_file(len(record["previous_attempts"]) + 1, RUN_RECORD)
        old["later_attempts"] = [*(old.get("later_attempts") or []), _summary(record)]
        write_record(run_dir, old)
    write_record(run_dir, record)
    return record


def _lease(run_dir: str) -> dict | None:
    """The lease of the driver that started this attempt, with what it took over; None under a driver that holds
    none (tests calling the loop directly)."""
    try:
        return lease_lib.read(run_dir)
    except (OSError, lease_lib.LeaseHeld):
        return None


def _has_results(record: dict) -> bool:
    """Whether a closed record holds finished work (it succeeded, or trained steps) that a later attempt must
    not replace unless it succeeds or trains itself (`finish_record`)."""
    return record.get("status") in CLOSED_STATUSES and (
        record.get("status") == "succeeded" or bool((record.get("metrics") or {}).get("steps")))


_UPDATABLE = ("metrics", "evaluation", "checkpoints", "export", "seed", "preflight", "time", "weights")


def update_record(run_dir: str, record: dict, *, dataset: dict | None = None,
                  tokenizer_sha256: str | None = None, **updates) -> dict:
    """Merge `updates` into `record` and rewrite `run.json` (rank 0; any time mid-run).

    Keys beyond `dataset`, `tokenizer_sha256` and `_UPDATABLE` go under `extra`: a typo never crashes the end of a
    long run.
    """
    if dataset is not None:
        record["data"]["fingerprint"] = dataset
    if tokenizer_sha256 is not None:
        record["data"]["tokenizer_sha256"] = tokenizer_sha256
    for key, value in updates.items():
        if key in _UPDATABLE:
            record[key] = value
        else:
            record.setdefault("extra", {})[key] = value
    write_record(run_dir, record)
    return record


def finish_record(run_dir: str, record: dict, *, status: str = "succeeded",
                  error: str | BaseException | dict | None = None, rank: int | None = None,
                  metrics: dict | None = None, ended_at: str | None = None, **updates) -> dict:
    """Close the record (status, end time, metric summary, results) and rewrite `run.json`.

    Rank 0 at the end of training (`status="succeeded"`) or in its `except` (`status="failed", error=exc, rank=0`);
    the driver closes what the workers could not (`close_if_running`, `abandon_stale`). `error` becomes
    `failures.describe`'s structured error (step: the last train step in the metrics; an `nccl` or `hang` error also
    names the `transport` summary). `ended_at` defaults to now, `metrics` to `summarize_metrics` of
    metrics.jsonl; other keyword arguments as in `update_record`. `ValueError` for an unknown status, or a status
    other than succeeded without an error.
    """
    if status not in CLOSED_STATUSES:
        raise ValueError(f"status must be one of {', '.join(CLOSED_STATUSES)}, not {status!r}")
    if status != "succeeded" and error is None:
        raise ValueError(f"a {status} record needs its error")
    record["status"] = status
    step = _last_seen(run_dir, record.get("started_at")).get("steps") if error is not None else None
    record["error"] = failures.describe(error, step=step, rank=rank)
    if (record["error"] or {}).get("reason") in failures.COLLECTIVE_REASONS and record.get("transport"):
        record["error"] = {**record["error"], "transport": record["transport"]["summary"]}  # the path it failed on
    record["ended_at"] = ended_at or _now()
    try:
        start = _dt.datetime.fromisoformat(record["started_at"])
        record["duration_s"] = max(0.0, round((_dt.datetime.fromisoformat(record["ended_at"]) - start).total_seconds(), 1))
    except (KeyError, TypeError, ValueError):
        record["duration_s"] = None
    if metrics is None:
        try:
            metrics = summarize_metrics(read_metrics(run_dir))
        except (OSError, ValueError) as exc:
            metrics = {"reason": f"no metrics: {exc}"}
    update_record(run_dir, record, metrics=metrics, **updates)
    if (record.get("record_file") or RUN_RECORD) != RUN_RECORD:
        _settle(run_dir, record)
    return record


def _settle(run_dir: str, record: dict) -> None:
    """A closed attempt that ran beside the run's record: one that succeeded, or trained steps of a run that had not
    succeeded, becomes run.json (its config.yaml too: the config of the newest checkpoints); any other stays beside
    it, its `later_attempts` entry closed."""
    run = load_record(run_dir)
    trained = _last_seen(run_dir, record.get("started_at")).get("steps")
    if record["status"] == "succeeded" or (run.get("status") != "succeeded" and trained):
        # The driver's config of this attempt; a Ray Train retry's record is numbered after it.
        for number in range(len(record["previous_attempts"]) + 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                config = storage.read_bytes(storage.join(run_dir, attempt_file(number, CONFIG_FILE)))
                storage.write_atomic(storage.join(run_dir, CONFIG_FILE), config)
                break
        write_record(run_dir, {**record, "record_file": RUN_RECORD})
        return
    run["later_attempts"] = [_summary(record) if a.get("record") == record["record_file"] else a
                             for a in run.get("later_attempts") or []]
    write_record(run_dir, run)


def later_attempts_line(record: dict) -> str | None:
    """The attempts after the one `record` describes that did not replace it, in one line (`runs`, `report`,
    `compare`): `later attempts: 2 failed config/resume_refused (attempts/2/run.json)`; None when there are none."""
    later = record.get("later_attempts")
    if not isinstance(later, list) or not later:
        return None
    first = len(record.get("previous_attempts") or []) + 2

    def one(number: int, attempt) -> str:
        attempt = attempt if isinstance(attempt, dict) else {}
        err = attempt.get("error")
        ending = f" {err.get('class')}/{err.get('reason')}" if isinstance(err, dict) else ""
        return f"{number} {attempt.get('status')}{ending} ({attempt.get('record', '-')})"

    return "later attempts: " + "; ".join(one(first + i, a) for i, a in enumerate(later))


def config_file(run_dir: str) -> str:
    """Where the driver saves the config of the attempt it starts, relative to the run directory: config.yaml, or
    `attempts/<n>/config.yaml` when the record holds finished work (`_has_results`), so that config.yaml stays the
    one of the run's checkpoints until this attempt replaces the record (`_settle`)."""
    try:
        old = load_record(run_dir)
    except (FileNotFoundError, ValueError):
        return CONFIG_FILE
    if not _has_results(old):
        return CONFIG_FILE
    return attempt_file(len(_previous_attempts(run_dir, old)) + 1, CONFIG_FILE)


def load_latest(run_dir: str) -> dict:
    """The record of the run's newest attempt: run.json, or the record of its last `later_attempts` entry."""
    record = load_record(run_dir)
    later = record.get("later_attempts") or []
    if later and later[-1].get("record"):
        with contextlib.suppress(FileNotFoundError):
            return json.loads(storage.read_text(storage.join(run_dir, later[-1]["record"])))
    return record


def close_if_running(run_dir: str, status: str, error: BaseException | dict, *, rank: int | None = None,
                     attempt: dict | None = None) -> dict | None:
    """The driver's close of a record its workers left `running` (a lost worker, a signal to the driver), with
    `status` and `error`, keeping all it knew; a closed record is left alone. With `attempt` (`{"started_at": epoch
    seconds of this driver's start, **start_record's config, config_text, run_name, seed}`) only this attempt's
    record is closed: one that failed before rank 0 opened a record gets one here, with the driver's environment.
    Returns the record written, or None (also when storage refuses the write, e.g. a full disk: said on stderr, so
    that the driver still reports the run's own error)."""
    try:
        record = load_latest(run_dir)
    except FileNotFoundError:
        record = None
    except (OSError, ValueError):  # half written or corrupt: not this driver's to judge
        return None
    earlier = record is None or (attempt is not None and not opened_since(record, attempt["started_at"]))
    try:
        if not earlier and record.get("status") == "running":
            return finish_record(run_dir, record, status=status, error=error, rank=rank)
        if attempt is None or not earlier:
            return None
        args = {k: v for k, v in attempt.items() if k != "started_at"}
        return finish_record(run_dir, start_record(run_dir, **args), status=status, error=error, rank=rank)
    except Exception as e:
        print(f"{run_dir}/{RUN_RECORD}: cannot close the record as {status}: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        return None


def record_group_failure(run_dir: str, errors: dict[int, BaseException], *, attempt: dict | None = None) -> None:
    """The driver's account of a worker group that failed (`errors`: each failed rank's error, as Ray Train reports
    them), once its workers are gone: a record left running is closed with the error of the rank whose process died
    (else the lowest failed rank's); one a surviving rank closed with its peer's loss is blamed on the lost rank, the
    surviving one kept as `noticed_by`. `attempt` as in `close_if_running`."""
    lost = failures.lost_ranks(errors)
    culprit = lost[0] if lost else min(errors)
    if close_if_running(run_dir, "failed", errors[culprit], rank=culprit, attempt=attempt) is not None or not lost:
        return
    try:
        record = load_latest(run_dir)
        error = record.get("error") or {}
        if record.get("status") == "failed" and error.get("reason") == "worker_lost" and error.get("rank") not in lost:
            record["error"] = {**error, "rank": culprit, "noticed_by": error.get("rank")}
            write_record(run_dir, record)
    except Exception as e:  # as in close_if_running: the run's own error is reported all the same
        print(f"{run_dir}/{RUN_RECORD}: cannot name the lost rank: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def opened_since(record: dict, since: float) -> bool:
    """Whether `record` was opened at or after epoch second `since` (its `started_at` has whole seconds)."""
    try:
        return _dt.datetime.fromisoformat(record["started_at"]).timestamp() >= int(since)
    except (KeyError, TypeError, ValueError):
        return False


def abandon_stale(run_dir: str) -> dict | None:
    """At a run's start, close `abandoned` (`unknown`/`driver_lost`) a record left `running` by a driver whose
    heartbeat is stale, ending when last seen (its last metrics record or heartbeat). The record written, or None."""
    try:
        record = load_latest(run_dir)
    except (OSError, ValueError):
        return None
    if lease_lib.liveness(run_dir, record) != "stale":
        return None
    beat = lease_lib.read_heartbeat(run_dir) or {}
    seen = _last_seen(run_dir, record.get("started_at"))
    error = failures.error("unknown", "driver_lost", f"the driver stopped its heartbeat (last at {beat.get('at')}) "
                           "without closing the record (killed, its pod or node lost)", step=seen.get("steps"))
    return finish_record(run_dir, record, status="abandoned", error=error,
                         ended_at=max(filter(None, (seen.get("ended_at"), beat.get("at"))), default=None))


def write_record(run_dir: str, record: dict) -> None:
    """Write `record` to its file, `<run_dir>/run.json` or its attempt's (`record_file`), atomically."""
    storage.write_atomic(storage.join(run_dir, record.get("record_file") or RUN_RECORD),
                         json.dumps(record, indent=2, sort_keys=False, default=str) + "\n")


def _previous_attempts(run_dir: str, old: dict | None) -> list[dict]:
    """Earlier attempts of the run (a retried RayJob, a resumed re-run), oldest first, from its record `old`: its
    `previous_attempts`, itself and its `later_attempts`."""
    if old is None:
        return []
    return [*old.get("previous_attempts", []),
            *(_close_summary(run_dir, a) for a in [_summary(old), *(old.get("later_attempts") or [])])]


def _summary(record: dict) -> dict:
    """An attempt in a few fields (`previous_attempts`, `later_attempts`); `record` names its own file when it is
    not run.json."""
    summary = {key: record.get(key) for key in ("started_at", "ended_at", "status", "error", "config_sha256")}
    summary["image_digest"] = (record.get("image") or {}).get("digest")
    summary["steps"] = (record.get("metrics") or {}).get("steps")
    if (record.get("record_file") or RUN_RECORD) != RUN_RECORD:
        summary["record"] = record["record_file"]
    return summary


def _close_summary(run_dir: str, summary: dict) -> dict:
    """`summary` of an attempt that never closed its record (killed: node loss, SIGKILL, OOM) as `interrupted`,
    with its last step and time seen."""
    if summary.get("status") == "running":
        summary = {**summary, "status": "interrupted", **_last_seen(run_dir, summary.get("started_at"))}
    return summary


def _last_seen(run_dir: str, started_at: str | None) -> dict:
    """An unclosed attempt's last train step and the time of its last metrics record (its end, to within one
    logging interval)."""
    try:
        since = _dt.datetime.fromisoformat(started_at).timestamp() if started_at else 0.0
        rows = [r for r in read_metrics(run_dir) if isinstance(r.get("time"), (int, float)) and r["time"] >= since]
    except (OSError, ValueError):
        return {}
    if not rows:
        return {}
    steps = [r["step"] for r in rows if r.get("kind") == "train" and isinstance(r.get("step"), int)]
    ended = _dt.datetime.fromtimestamp(rows[-1]["time"], _dt.timezone.utc).isoformat(timespec="seconds")
    return {"steps": steps[-1] if steps else None, "ended_at": ended, "ended_at_from": "last metrics record"}


def flatten(value, prefix: str = "") -> dict[str, Any]:
    """A nested record as dotted keys (`train.lr`); an empty mapping below the top stays, as `{}`."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        if not value and prefix:
            out[prefix] = {}
        return out
    return {prefix: value}


def load_record(run_dir: str) -> dict:
    """Read `<run_dir>/run.json`; `FileNotFoundError` naming the path when absent, `ValueError` naming the field
    when it is not a run record or a section has the wrong JSON type (`check_types`)."""
    path = storage.join(run_dir, RUN_RECORD)
    try:
        record = json.loads(storage.read_text(path))
    except FileNotFoundError:
        raise FileNotFoundError(f"no {RUN_RECORD} at {path}") from None
    except IsADirectoryError:
        raise ValueError(f"{path} is a directory, not a run record") from None
    check_types(record, path)
    return record


_JSON_TYPES = {"object": dict, "array": list, "string": str, "number": (int, float), "integer": int,
               "boolean": bool, "null": type(None)}


def check_types(record, path: str) -> None:
    """`ValueError` naming the first top-level field of `record` whose JSON type the schema does not allow, or
    `record` not an object: the readers rely on these types."""
    if not isinstance(record, dict):
        raise ValueError(f"{path} holds a JSON {type(record).__name__}, not a run record (an object)")
    with open(schema_path()) as f:
        fields = json.load(f)["properties"]
    for key, spec in fields.items():
        options = [spec] if "type" in spec else spec.get("anyOf", [])
        if key not in record or not options or any("type" not in option for option in options):
            continue  # a field whose type a reference or a constant states: no simple check
        allowed = [t for option in options for t in ([option["type"]] if isinstance(option["type"], str)
                                                     else option["type"])]
        if not isinstance(record[key], tuple(_JSON_TYPES[t] for t in allowed)):
            found = next(t for t, kind in reversed(_JSON_TYPES.items()) if isinstance(record[key], kind))
            raise ValueError(f"{path}: {key} must be {' or '.join(allowed)}, not {found}")


def schema_path() -> str:
    """Path of `run_record.schema.json` (next to this module)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_record.schema.json")


def read_metrics(run_dir: str) -> list[dict]:
    """Rows of `<run_dir>/metrics.jsonl` (blank or unparsable lines are skipped)."""
    rows = []
    for line in storage.read_text(storage.join(run_dir, METRICS_FILE)).splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash must not hide the rest
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _median(values: list[float]) -> float | None:
    values = sorted(v for v in values if isinstance(v, (int, float)))
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def summarize_metrics(rows: Iterable[dict]) -> dict:
    """Summary of metrics.jsonl rows for the record and the report.

    Throughput and MFU are medians over the second half of the train steps (the first includes compilation and
    warm-up), peak memory the maximum, `task_eval` the last result per task; method, LoRA rank, trainable
    parameters, the frozen base's quantization and memory per device come from the start row.
    """
    rows = list(rows)
    train = sorted((r for r in rows if r.get("kind") == "train"), key=lambda r: r.get("step", 0))
    evals = sorted((r for r in rows if r.get("kind") == "eval" and r.get("eval_loss") is not None),
                   key=lambda r: r.get("step", 0))
    steady = train[len(train) // 2:]
    best = min(evals, key=lambda r: r["eval_loss"]) if evals else None
    tasks: dict[str, dict] = {}
    for r in rows:
        if r.get("kind") == "task_eval" and r.get("task"):
            tasks[r["task"]] = {"step": r.get("step"), "exact_match": r.get("exact_match"), "n": r.get("n")}
    peaks = [r["peak_mem_gib"] for r in train if isinstance(r.get("peak_mem_gib"), (int, float))]
    start = next((r for r in rows if r.get("kind") == "start"), {})
    return {
        "method": start.get("method"),
        "lora_rank": start.get("lora_rank"),
        "trainable_params": start.get("trainable_params"),
        "quantize_base": start.get("quantize_base"),
        "base_gib": start.get("base_gib"),
        "steps": train[-1].get("step") if train else None,
        "final_train_loss": train[-1].get("loss") if train else None,
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "final_eval_step": evals[-1].get("step") if evals else None,
        "best_eval_loss": best["eval_loss"] if best else None,
        "best_eval_step": best.get("step") if best else None,
        "tokens_per_s": _median([r.get("tokens_per_s") for r in steady]),
        "tokens_per_s_per_device": _median([r.get("tokens_per_s_per_device") for r in steady]),
        "mfu": _median([r.get("mfu") for r in steady]),
        "peak_mem_gib": max(peaks) if peaks else None,
        "task_eval": tasks,
        **({"preference": preference(evals)} if evals and "eval_rewards/margins" in evals[-1] else {}),
    }


PREFERENCE_KEYS = ("eval_rewards/accuracies", "eval_rewards/margins", "eval_preference_accuracy")


def preference(evals: list[dict]) -> dict:
    """A DPO run's held-out preference metrics (TRL's names) at the last evaluation, and the preference accuracy at
    the first (the starting model's)."""
    return {**{k: evals[-1].get(k) for k in PREFERENCE_KEYS},
            "eval_preference_accuracy_at_start": evals[0].get("eval_preference_accuracy"), "at_step": evals[-1]["step"]}
