"""Tests of job/commands/runs.py: the run index (`python -m job runs`), its filters, bad directories and bad inputs, on a
local directory and on a local S3 server; `report` and `compare` by run name."""

import copy
import datetime as dt
import json
import os
import socket
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, tiny_run_config
from job.commands import compare, report, runs
from job.records import failures, run_record
from job.records import lease as lease_lib

DIGEST = "sha256:" + "ab" * 32
NOW = dt.datetime.now(dt.timezone.utc)


@pytest.fixture(scope="module")
def base_record(tmp_path_factory) -> dict:
    """A closed record as the job writes it (evidence.start_record / finish_record), to vary per run."""
    run_dir = str(tmp_path_factory.mktemp("base") / "base")
    env = {"JOB_CHART": "ray-finetune", "JOB_CHART_VERSION": "0.3.0", "JOB_RELEASE": "base", "JOB_VALUES_SHA256": "0" * 64}
    record = run_record.start_record(run_dir, config={"name": "base", "train": {"lr": 1e-4, "max_steps": 20}},
                                   config_text="x", seed=1, pods=[{"digest": DIGEST}], env=env)
    return run_record.finish_record(run_dir, record, metrics={"steps": 20, "final_eval_loss": 3.25, "task_eval": {}})


def _iso(hours_ago: float) -> str:
    return (NOW - dt.timedelta(hours=hours_ago)).isoformat(timespec="seconds")


def write_run(root, name: str, base: dict, **changes) -> dict:
    """`<root>/<name>/run.json`: `base` with `changes`, nested keys joined by `__` (`metrics__steps=250`)."""
    record = copy.deepcopy(base)
    record.update(run_name=name, run_dir=f"{root}/{name}")
    for key, value in changes.items():
        *parents, last = key.split("__")
        target = record
        for part in parents:
            if not isinstance(target.get(part), dict):
                target[part] = {}
            target = target[part]
        target[last] = value
    os.makedirs(f"{root}/{name}", exist_ok=True)
    with open(f"{root}/{name}/run.json", "w") as f:
        json.dump(record, f)
    return record


def timing(goodput: float) -> dict:
    """run.json's `time` of a 100 s attempt with this goodput."""
    phases = dict.fromkeys(("startup", "data", "model", "resume", "warmup", "eval", "checkpoint", "task_eval", "export"), 0.0)
    return {"wall_s": 100.0, "phases_s": {**phases, "train": 100.0 * goodput, "other": 100.0 * (1 - goodput)},
            "goodput": goodput, "checkpoint_blocking_s": []}


def heartbeat(root, name: str, hours_ago: float, pid: int | None = None) -> None:
    # From the present, not NOW (import time): in a long suite, "0 hours ago" at import is long stale at the test.
    at = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=hours_ago)).isoformat(timespec="seconds")
    beat = {"at": at, "pid": pid or os.getpid(), "host": socket.gethostname(), "timeout_s": 600.0}
    (root / name / lease_lib.HEARTBEAT_FILE).write_text(json.dumps(beat))


@pytest.fixture
def storage(tmp_path, base_record):
    """A storage path with one run of each ending, and directories that are not runs."""
    root = tmp_path / "runs"
    write_run(root, "gsm8k-a", base_record, started_at=_iso(5), ended_at=_iso(4), time=timing(0.5),
              metrics__steps=250, metrics__final_eval_loss=0.5667, config__train__lr=1e-5,
              metrics__task_eval={"gsm8k": {"step": 250, "exact_match": 0.535, "n": 1319}},
              previous_attempts=[{"status": "interrupted"}])
    write_run(root, "gsm8k-b", base_record, started_at=_iso(3), ended_at=_iso(2), time=timing(0.25),
              status="failed", error=failures.error("infrastructure", "worker_lost", "lost", step=12),
              metrics__steps=12, config__train__lr=3e-4, logs=f"{root}/gsm8k-b/logs/20261206T000000Z")
    write_run(root, "live", base_record, started_at=_iso(1), ended_at=None, status="running", metrics=None)
    heartbeat(root, "live", 0)
    write_run(root, "dead", base_record, started_at=_iso(2.5), ended_at=None, status="running", metrics=None)
    heartbeat(root, "dead", 2)
    (root / "datasets" / "gsm8k").mkdir(parents=True)
    (root / "datasets" / "gsm8k" / "train.jsonl").write_text("{}\n")
    (root / ".compile_cache").mkdir()
    (root / "notes.txt").write_text("a file beside the runs\n")
    return root


def listing(*args: str, capsys) -> tuple[int, str, str]:
    code = runs.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_lists_every_run_with_its_columns(storage, capsys):
    code, out, err = listing(str(storage), capsys=capsys)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "STATUS", "STARTED", "(UTC)", "ENDED", "(UTC)", "ATTEMPTS", "STEPS", "GOODPUT",
                                "EVAL", "LOSS", "TASK", "CHART", "IMAGE", "FAILURE", "/", "REASON"]
    assert [line.split()[0] for line in lines[1:5]] == ["gsm8k-a", "gsm8k-b", "dead", "live"]  # oldest start first
    a = lines[1].split()
    assert a[1] == "succeeded" and a[6:] == ["2", "250", "50.0%", "0.5667", "gsm8k", "53.5%", "0.3.0", DIGEST[:19], "-"]
    assert lines[2].split()[1] == "failed" and lines[2].endswith(
        f"  infrastructure/worker_lost; logs {storage}/gsm8k-b/logs/20261206T000000Z")  # where the failure is told
    assert lines[3].split()[1] == "stale" and "driver heartbeat stale" in lines[3]
    assert lines[4].split()[1] == "running"
    assert lines[5] == f"4 of 4 runs under {storage} (1 running, 1 stale, 1 failed)"  # datasets/ is not a run

    code, out, _ = listing(str(storage), "--json", capsys=capsys)
    rows = {r["name"]: r for r in json.loads(out)}
    assert set(rows) == {"gsm8k-a", "gsm8k-b", "live", "dead"}
    assert rows["gsm8k-a"] == {"name": "gsm8k-a", "path": f"{storage}/gsm8k-a", "status": "succeeded",
                               "started": _iso(5), "ended": _iso(4), "attempts": 2, "steps": 250, "goodput": 0.5,
                               "eval_loss": 0.5667, "task": "gsm8k", "task_score": 0.535, "chart": "0.3.0",
                               "image": DIGEST, "failure": None, "reason": None, "logs": None}
    assert rows["gsm8k-b"]["failure"] == "infrastructure/worker_lost"
    assert rows["gsm8k-b"]["logs"] == f"{storage}/gsm8k-b/logs/20261206T000000Z"
    assert rows["dead"]["reason"].startswith("record running, driver heartbeat stale (last at ")


def test_half_written_and_corrupt_directories_are_rows(storage, capsys):
    bad = {"empty": b"", "cut": b'{"schema_version": 1, "status": "succ', "binary": b"\x00\xff{}",
           "list": b"[1, 2]", "no-status": b'{"run_name": "x"}', "bad-json": b'{"status": succeeded}'}
    for name, data in bad.items():
        (storage / name).mkdir()
        (storage / name / "run.json").write_bytes(data)
    (storage / "before-record").mkdir()
    (storage / "before-record" / "config.yaml").write_text("name: before-record\n")
    (storage / "starting").mkdir()
    (storage / "starting" / "config.yaml").write_text("name: starting\n")
    heartbeat(storage, "starting", 0)
    (storage / "dir-record" / "run.json").mkdir(parents=True)

    code, out, err = listing(str(storage), "--json", capsys=capsys)
    assert code == 0 and err == ""
    rows = {r["name"]: r for r in json.loads(out)}
    reasons = {name: rows[name]["reason"] for name in rows if rows[name]["status"] == "unreadable"}
    assert reasons == {
        "empty": "run.json is empty (half written)",
        "cut": "run.json is not valid JSON (cut short: half written): Unterminated string starting at (line 1, column 33)",
        "binary": "run.json is not UTF-8 text (corrupt): invalid start byte at byte 1",
        "list": "run.json holds a JSON list, not a run record",
        "no-status": "run.json has no valid status (None): not a run record",
        "bad-json": "run.json is not valid JSON (corrupt): Expecting value (line 1, column 12)",
        "before-record": "no run.json (has config.yaml)",
        "dir-record": reasons["dir-record"],
    }
    assert reasons["dir-record"].startswith("cannot read run.json: ")
    assert rows["starting"]["status"] == "starting"
    assert rows["gsm8k-a"]["status"] == "succeeded"  # the good runs are still there

    code, out, _ = listing(str(storage), capsys=capsys)
    assert out.splitlines()[-1] == (f"13 of 13 runs under {storage} "
                                    "(1 running, 1 stale, 1 starting, 1 failed, 8 unreadable)")


def test_filters_and_sorting(storage, capsys):
    def names(*args):
        code, out, err = listing(str(storage), "--json", *args, capsys=capsys)
        assert code == 0, err
        return [r["name"] for r in json.loads(out)]

    assert names("--status", "failed,stale") == ["gsm8k-b", "dead"]
    assert names("--status", "running", "--status", "succeeded") == ["gsm8k-a", "live"]
    assert names("--name", "gsm8k-*") == ["gsm8k-a", "gsm8k-b"]
    assert names("--name", "l*", "--name", "d*") == ["dead", "live"]
    assert names("--where", "config.train.lr=0.00001") == ["gsm8k-a"]  # 1e-5 as a number
    assert names("--where", "config.train.lr>1e-5") == ["gsm8k-b", "dead", "live"]
    assert names("--where", "goodput>=0.25", "--where", "steps<100") == ["gsm8k-b"]
    assert names("--where", "failure~infrastructure/*") == ["gsm8k-b"]
    assert names("--where", "error.class!=infrastructure") == ["gsm8k-a", "dead", "live"]  # no error: not infra
    assert names("--where", "chart.version=0.3.0", "--where", "task=gsm8k") == ["gsm8k-a"]
    assert names("--where", f"started>={_iso(2.6)}") == ["dead", "live"]  # ISO times order as text
    assert names("--where", "status=succeeded", "--name", "nothing*") == []
    # Sorting: missing values last either way.
    assert names("--sort", "goodput") == ["gsm8k-b", "gsm8k-a", "dead", "live"]
    assert names("--sort", "goodput", "--reverse") == ["gsm8k-a", "gsm8k-b", "dead", "live"]
    assert names("--sort", "name") == ["dead", "gsm8k-a", "gsm8k-b", "live"]
    assert names("--sort", "config.train.lr", "--reverse")[:2] == ["gsm8k-b", "dead"]

    code, out, _ = listing(str(storage), "--status", "cancelled", capsys=capsys)
    assert out.splitlines() == ["no run matches the filters", f"0 of 4 runs under {storage} (1 running, 1 stale, 1 failed)"]


@pytest.mark.parametrize("args, message", [
    (["--where", "trian.lr=1"], "--where 'trian.lr=1': unknown field 'trian' (run.json has: schema_version, run_name, "),
    (["--where", "config.train.lrr=1"], "--where 'config.train.lrr=1': unknown field 'config.train.lrr' (config.train has: max_steps, "),
    (["--where", "config.train.lr.x=1"], "--where 'config.train.lr.x=1': config.train.lr is a value, it has no field 'x'"),
    (["--where", "goodput"], "--where 'goodput': expected FIELD OP VALUE, OP one of != <= >= = < > ~"),
    (["--where", "goodput>"], "--where 'goodput>': expected FIELD OP VALUE"),
    (["--sort", "speed"], "--sort 'speed': unknown field 'speed' (a column: name, path, status, "),
    (["--status", "done"], "--status 'done': unknown status (one of running, stale, starting, succeeded, failed, "),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bad_filters_give_one_line(storage, capsys, args, message):
    code, out, err = listing(str(storage), *args, capsys=capsys)
    assert code == 2 and out == "" and err.startswith(f"runs: {message}") and err.count("\n") == 1


def test_bad_paths_give_one_line(tmp_path, capsys):
    assert listing(capsys=capsys)[2] == "runs: the following arguments are required: storage\n"
    assert listing(str(tmp_path / "nope"), capsys=capsys)[1:] == ("", f"runs: {tmp_path / 'nope'}: no such directory\n")
    (tmp_path / "file").write_text("x")
    assert listing(str(tmp_path / "file"), capsys=capsys)[2] == f"runs: {tmp_path / 'file'}: not a directory\n"
    code, out, _ = listing(str(tmp_path), capsys=capsys)
    assert code == 0 and out == f"no runs under {tmp_path}\n"


def test_the_cli_lists_without_importing_torch(storage):
    probe = ("import sys; from job.__main__ import main; code = main(['runs', sys.argv[1]]); "
             "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", probe, str(storage)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "gsm8k-a" in proc.stdout


def test_report_and_compare_by_name(storage, tmp_path, capsys):
    assert report.main(["--storage", str(storage), "gsm8k-a", "--no-plots", "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "report.md").read_text().startswith("# Run report: gsm8k-a\n")
    capsys.readouterr()
    assert compare.main(["--storage", str(storage), "gsm8k-a", "gsm8k-b"]) == 1  # the lr differs
    out = capsys.readouterr().out
    assert out.startswith(f"A: {storage}/gsm8k-a  (gsm8k-a, succeeded)\nB: {storage}/gsm8k-b  (gsm8k-b, failed)\n")
    assert "train.lr: 1e-05 -> 0.0003" in out
    # A path is still a path, with --storage or without.
    assert compare.main(["--storage", str(tmp_path), str(storage / "gsm8k-a"), str(storage / "gsm8k-a")]) == 0
    capsys.readouterr()
    assert compare.main(["--storage", str(storage), "gsm8k-a", "gsm8k-z"]) == 2
    assert capsys.readouterr().err == (f"compare: no run named 'gsm8k-z' under {storage} "
                                       f"(python -m job runs {storage} lists them)\n")
    assert report.main(["--storage", str(storage), "gsm8k-z"]) == 2
    assert capsys.readouterr().err.startswith("report: no run named 'gsm8k-z' under ")


def test_lists_runs_on_s3(s3_endpoint, storage, base_record, monkeypatch, capsys):
    import s3fs

    for key, value in s3_endpoint.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    fs.put(str(storage) + "/", "runs/idx/", recursive=True)
    fs.pipe("runs/idx/cut/run.json", b'{"status": "succ')
    fs.pipe("runs/idx/before-record/config.yaml", b"name: before-record\n")

    code, out, err = listing("s3://runs/idx", "--json", capsys=capsys)
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)}
    assert {n: r["status"] for n, r in rows.items()} == {
        "gsm8k-a": "succeeded", "gsm8k-b": "failed", "live": "running", "dead": "stale", "cut": "unreadable",
        "before-record": "unreadable"}
    assert rows["gsm8k-a"]["path"] == "s3://runs/idx/gsm8k-a" and rows["gsm8k-a"]["task_score"] == 0.535
    assert rows["before-record"]["reason"] == "no run.json (has config.yaml)"
    code, out, _ = listing("s3://runs/idx", "--where", "config.train.lr=1e-5", capsys=capsys)
    assert [line.split()[0] for line in out.splitlines()[1:-1]] == ["gsm8k-a"]
    assert report.main(["--storage", "s3://runs/idx", "gsm8k-a", "--no-plots", "--out", str(storage / "r")]) == 0

    assert listing("s3://nobucket/idx", capsys=capsys)[2] == "runs: s3://nobucket/idx: no such bucket\n"
    assert listing("s3://runs/nothing", capsys=capsys)[2] == "runs: s3://runs/nothing: no such directory\n"
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(storage / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(storage / "no-config"))
    s3fs.S3FileSystem.clear_instance_cache()
    code, out, err = listing("s3://runs/idx", capsys=capsys)
    assert code == 2 and out == "" and err == (
        "runs: s3://runs/idx: no AWS credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, "
        "or run where an IAM role provides them)\n")


CLI_MISTAKES = {
    "runs on a file": ["runs", "{file}"],
    "runs on nothing": ["runs", "{tmp}/nope"],
    "report on a list": ["report", "{list_run}"],
    "report on a wrongly typed record": ["report", "{typed_run}"],
    "report into a file": ["report", "{good_run}", "--out", "{file}"],
    "report on nothing": ["report", "{tmp}/nope"],
    "compare a list": ["compare", "{list_run}", "{good_run}"],
    "compare a wrongly typed record": ["compare", "{good_run}", "{typed_run}"],
    "compare a file": ["compare", "{file}", "{good_run}"],
    "accept nothing": ["accept", "{tmp}/nope"],
    "accept a file": ["accept", "{file}"],
    "accept a run directory": ["accept", "{good_run}"],
    "schema with an argument": ["schema", "extra"],
    "an unknown command": ["rport", "{good_run}"],
    "config a directory": ["--config", "{tmp}"],
    "config a list": ["--config", "{list_yaml}"],
    "config nothing": ["--config", "{tmp}/nope.yaml"],
    "set without =": ["--config", "{config}", "--set", "train.max_steps"],
    "set an unknown key": ["--config", "{config}", "--set", "train.max_stepz=3"],
    "set a section to a number": ["--config", "{config}", "--set", "train=3"],
    "set a number to text": ["--config", "{config}", "--set", "train.max_steps=abc"],
    "set a number to a list": ["--config", "{config}", "--set", "train.max_steps=[1]"],
    "set a list to a number": ["--config", "{config}", "--set", "train.betas=0.9"],
    "storage a file": ["--config", "{config}", "--set", "storage_path={file}"],
    "set a value that is not YAML": ["--config", "{config}", "--set", "train.lr=[1"],
    "set below a number": ["--config", "{config}", "--set", "train.lr.x=1"],
    "set an empty key": ["--config", "{config}", "--set", "=1"],
}


@pytest.mark.parametrize("argv", CLI_MISTAKES.values(), ids=CLI_MISTAKES.keys())
def test_every_verb_answers_a_mistake_with_one_line_and_a_failing_status(argv, storage, tmp_path, capsys):
    """What an operator may type wrong: one line on stderr naming what is wrong, exit status not 0, no traceback."""
    from job.__main__ import main

    good = storage / "gsm8k-a"
    for name, record in (("list_run", [1]), ("typed_run", {**json.loads((good / "run.json").read_text()),
                                                            "metrics": [1]})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(json.dumps(record))
    (tmp_path / "file").write_text("x")
    (tmp_path / "list.yaml").write_text("- 1\n")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(tiny_run_config(tmp_path)))
    paths = {"tmp": tmp_path, "file": tmp_path / "file", "list_run": tmp_path / "list_run", "good_run": good,
             "typed_run": tmp_path / "typed_run", "list_yaml": tmp_path / "list.yaml", "config": tmp_path / "run.yaml"}
    code = main([arg.format(**paths) for arg in argv])
    err = capsys.readouterr().err.strip()
    assert code not in (0, None) and len(err.splitlines()) == 1 and "Traceback" not in err, (code, err)


def test_the_command_line_names_what_is_missing_and_helps_every_verb(tmp_path, capsys):
    from job.__main__ import main

    assert main(["report", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == f"report: {tmp_path / 'nope'}: no such run directory\n"
    assert main(["rport", "x"]) == 2
    assert "unknown command 'rport' (commands: run, runs, compare, report, accept, schema" in capsys.readouterr().err
    assert main(["schema", "--help"]) == 0 and capsys.readouterr().out.startswith("usage: python -m job schema")
