"""How a run ends in its record (issue 33): the structured error, the driver closing what the workers could not
(a lost rank 0), and a record left running by a lost driver marked abandoned."""

import datetime as dt
import errno
import json
import os
import subprocess
import sys
import time

import jsonschema
import pytest
import yaml

from conftest import REPO, tiny_run_config
from job import config as config_lib
from job import data as data_lib
from job import evidence, failures


def validate(record):
    with open(evidence.schema_path()) as f:
        jsonschema.validate(record, json.load(f))


class ActorDiedError(Exception):  # named like Ray's: the classifier matches type names
    pass


class UserExceptionWithTraceback(Exception):
    def __init__(self, exc):
        super().__init__(str(exc))
        self._base_exc = exc


def _wrapped(inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as e:
            raise RuntimeError("collective failed") from e
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize("exc, expected", [
    (ActorDiedError("worker died"), ("infrastructure", "worker_lost", "ActorDiedError")),
    (UserExceptionWithTraceback(data_lib.DataError("bad row")), ("data", "exception", "DataError")),
    (config_lib.ConfigError("train.lr: bad"), ("config", "exception", "ConfigError")),
    (_wrapped(OSError(errno.ENOSPC, "No space left on device")), ("infrastructure", "disk_full", "OSError")),
    (RuntimeError("checkpoint x: save failed (rank 0: OSError: [Errno 28] No space left on device)"),
     ("infrastructure", "disk_full", "RuntimeError")),
    (_wrapped(MemoryError()), ("infrastructure", "out_of_memory", "MemoryError")),
    (KeyboardInterrupt(), ("cancelled", "signal", "KeyboardInterrupt")),
    (ValueError("boom"), ("unknown", "exception", "ValueError")),
])
def test_classify_from_the_exception_chain(exc, expected):
    err = failures.describe(exc, step=3, rank=1)
    assert (err["class"], err["reason"], err["exception"]) == expected
    assert err["step"] == 3 and err["rank"] == 1 and err["message"]


def test_non_finite_loss_is_the_model():
    from job.train import NonFiniteError

    assert failures.classify(NonFiniteError("step 3: loss nan"))[:2] == ("model", "non_finite_loss")


def _running_record(run_dir):
    record = evidence.start_record(str(run_dir), config={"name": "r"}, config_text="name: r\n", seed=0)
    now = time.time()
    rows = [{"kind": "train", "step": s, "time": now + s, "loss": 1.0} for s in (5, 10)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return record


def test_stale_heartbeat_record_is_abandoned_on_the_next_start(tmp_path):
    run_dir = tmp_path / "r"
    record = _running_record(run_dir)
    failures.write_heartbeat(str(run_dir))
    assert failures.liveness(str(run_dir), record) == "live"
    assert evidence.abandon_stale(str(run_dir)) is None  # a live driver's record is left alone
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=failures.HEARTBEAT_TIMEOUT_S + 1)
    assert failures.liveness(str(run_dir), record, now=later) == "stale"
    # A heartbeat older than its timeout: the driver is gone.
    beat = json.loads((run_dir / "heartbeat.json").read_text())
    beat["at"] = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=300)).isoformat(timespec="seconds")
    (run_dir / "heartbeat.json").write_text(json.dumps(beat))
    abandoned = evidence.abandon_stale(str(run_dir))
    validate(abandoned)
    on_disk = evidence.load_record(str(run_dir))
    assert on_disk["status"] == "abandoned" and on_disk["ended_at"]
    assert on_disk["error"]["class"] == "unknown" and on_disk["error"]["reason"] == "driver_lost"
    assert on_disk["error"]["step"] == 10 and on_disk["metrics"]["steps"] == 10
    assert on_disk["config"] == {"name": "r"} and on_disk["started_at"] == record["started_at"]  # what it knew
    assert evidence.abandon_stale(str(run_dir)) is None  # closed once
    # No heartbeat at all (torchrun, an older version): never taken for dead.
    other = tmp_path / "o"
    assert failures.liveness(str(other), _running_record(other)) == "unknown"
    # The schema is not vacuous: an abandoned record without a structured error is rejected.
    for broken in ({**on_disk, "error": "lost"}, {**on_disk, "error": {**on_disk["error"], "class": "x"}},
                   {**on_disk, "error": None}, {**on_disk, "status": "running"}):
        with pytest.raises(jsonschema.ValidationError):
            validate(broken)


def test_driver_closes_a_running_record_and_keeps_a_closed_one(tmp_path):
    run_dir = tmp_path / "r"
    _running_record(run_dir)
    closed = evidence.close_if_running(str(run_dir), "failed", ActorDiedError("gone"), rank=0)
    validate(closed)
    assert closed["status"] == "failed" and closed["error"]["reason"] == "worker_lost"
    assert evidence.close_if_running(str(run_dir), "cancelled", KeyboardInterrupt()) is None
    assert evidence.load_record(str(run_dir))["status"] == "failed"


def _driver(tmp_path, name, **sections):
    raw = tiny_run_config(tmp_path, name=name, scaling={"num_workers": 1, "max_failures": 0},
                          model={"train_tokenizer_vocab": None, "overrides": {"num_hidden_layers": 1}},
                          data={"format": "synthetic", "train": None}, **sections)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    cmd = [sys.executable, "-m", "job", "--config", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    return cmd, env, os.path.join(raw["storage_path"], name)


def test_lost_rank0_ends_failed_worker_lost(tmp_path):
    cmd, env, run_dir = _driver(tmp_path, "lost", train={"max_steps": 20, "warmup_steps": 1},
                                checkpoint={"every_steps": 10}, debug={"fail_at_step": 15, "fail_rank": 0})
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 1, proc.stderr[-3000:]
    record = evidence.load_record(run_dir)
    validate(record)
    assert record["status"] == "failed" and record["ended_at"], record["error"]
    assert (record["error"]["class"], record["error"]["reason"], record["error"]["rank"]) == \
        ("infrastructure", "worker_lost", 0)
    # Killed at step 15, before logging it: the last step seen is the last logged (logging.every_steps 5).
    assert record["error"]["step"] == record["metrics"]["steps"] == 10
