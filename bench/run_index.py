"""How long `python -m job runs` takes over many run directories, locally and on a local S3 server (moto).

    .venv/bin/python bench/run_index.py [--runs 500] [--repeats 5]

Writes `--runs` synthetic run directories into a temporary directory, each with the run.json of a real GPU run
(bench/runs/2026-12-01-run14-gsm8k-pretrained-run.json, 21 KB) varied per run, a config.yaml and a metrics.jsonl;
about 4% of them are broken the ways a directory gets broken (run.json empty, cut short, not JSON, not a
record; no run.json yet), 4% still running (half of them with a stale heartbeat), and a `datasets/` directory is
not a run. It then times, best and median of `--repeats`: the listing in this process (`runs.list_runs` plus the
table) and the whole command in a fresh process (`python -m job runs DIR`, the interpreter's start included),
first on the local directory, then on the same tree uploaded to a moto S3 server on loopback.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the local S3 server of the tests

from servers import moto_s3  # noqa: E402

from job.commands import runs  # noqa: E402

TEMPLATE = REPO / "bench" / "runs" / "2026-12-01-run14-gsm8k-pretrained-run.json"
BROKEN = (b"", b'{"schema_version": 1, "status": "succ', b"\x00\xff garbage", b"[1, 2, 3]", None)
"""run.json of the broken directories, in turn: empty, cut short, not JSON, not a record, missing."""


def make_runs(root: Path, count: int) -> dict[str, int]:
    """`count` run directories under `root`; returns how many of each kind."""
    template = json.loads(TEMPLATE.read_text())
    now = dt.datetime.now(dt.timezone.utc)
    kinds = {"closed": 0, "broken": 0, "running": 0}
    for i in range(count):
        run = root / f"exp-{i:04d}"
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(f"name: exp-{i:04d}\n")
        (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 2.0}\n')
        if i % 25 == 7:
            data = BROKEN[(i // 25) % len(BROKEN)]
            if data is not None:
                (run / "run.json").write_bytes(data)
            kinds["broken"] += 1
            continue
        record = copy.deepcopy(template)
        started = now - dt.timedelta(hours=count - i)
        record.update(run_name=run.name, run_dir=str(run), started_at=started.isoformat(timespec="seconds"))
        record["config"]["train"]["lr"] = [1e-5, 3e-5, 1e-4][i % 3]
        record["time"]["goodput"] = 0.1 + (i % 50) / 100
        if i % 25 == 13:
            record.update(status="running", ended_at=None, metrics=None)
            beat_age = dt.timedelta(hours=1) if i % 50 == 13 else dt.timedelta(0)
            (run / "heartbeat.json").write_text(json.dumps({
                "at": (now - beat_age).isoformat(timespec="seconds"), "pid": os.getpid(),
                "host": socket.gethostname(), "timeout_s": 60.0}))
            kinds["running"] += 1
        else:
            record["ended_at"] = (started + dt.timedelta(minutes=8)).isoformat(timespec="seconds")
            if i % 10 == 3:
                record.update(status="failed", error={"class": "infrastructure", "reason": "worker_lost",
                                                      "message": "lost", "exception": None, "step": 12, "rank": 1})
            kinds["closed"] += 1
        (run / "run.json").write_text(json.dumps(record, indent=2))
    (root / "datasets" / "gsm8k").mkdir(parents=True)
    (root / "datasets" / "gsm8k" / "train.jsonl").write_text("{}\n")
    return kinds


def timed(fn, repeats: int) -> tuple[float, float]:
    """(best, median) seconds of `repeats` calls of `fn`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def measure(storage_path: str, repeats: int, env: dict[str, str]) -> dict[str, object]:
    listed = runs.list_runs(storage_path)
    by_status: dict[str, int] = {}
    for r in listed:
        by_status[r.status] = by_status.get(r.status, 0) + 1
    in_process = timed(lambda: runs.format_table(runs.list_runs(storage_path)), repeats)
    command = [sys.executable, "-m", "job", "runs", storage_path]
    cli = timed(lambda: subprocess.run(command, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL), repeats)
    return {"rows": len(listed), "by_status": by_status, "in_process": in_process, "cli": cli}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "runs"
        kinds = make_runs(root, args.runs)
        print(f"{args.runs} run directories ({kinds['closed']} closed, {kinds['running']} running, "
              f"{kinds['broken']} broken) and a datasets/ directory, run.json {TEMPLATE.stat().st_size // 1024} KB each")
        results = {"local": measure(str(root), args.repeats, dict(os.environ))}
        with moto_s3() as env:
            os.environ.update(env)
            import s3fs

            s3fs.S3FileSystem().put(str(root) + "/", "runs/bench/", recursive=True)
            results["s3 (moto)"] = measure("s3://runs/bench", args.repeats, {**os.environ, **env})
    for where, r in results.items():
        print(f"{where}: {r['rows']} rows {r['by_status']}")
        print(f"  listing + table in process: best {r['in_process'][0]:.3f} s, median {r['in_process'][1]:.3f} s")
        print(f"  python -m job runs (fresh process): best {r['cli'][0]:.3f} s, median {r['cli'][1]:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
