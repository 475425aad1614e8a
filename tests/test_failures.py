"""How a run ends in its record (issue 33): the structured error, the driver closing what the workers could not
(a lost rank 0), and a record left running by a lost driver marked abandoned."""

import contextlib
import datetime as dt
import errno
import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jsonschema
import pytest
import yaml

from conftest import REPO, tiny_run_config
from job import config as config_lib
from job import signals
from job.commands import compare
from job.common import checkpoints, sources
from job.driver import launch
from job.records import failures, run_record
from job.records import lease as lease_lib
from job.worker.model.export import ExportError


def validate(record):
    with open(run_record.schema_path()) as f:
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


def _caused(exc: BaseException, cause: BaseException) -> BaseException:
    exc.__cause__ = cause
    return exc


@pytest.mark.parametrize("exc, expected", [
    (ActorDiedError("worker died"), ("infrastructure", "worker_lost", "ActorDiedError")),
    (UserExceptionWithTraceback(sources.DataError("bad row")), ("data", "exception", "DataError")),
    (config_lib.ConfigError("train.lr: bad"), ("config", "exception", "ConfigError")),
    (_wrapped(OSError(errno.ENOSPC, "No space left on device")), ("infrastructure", "disk_full", "OSError")),
    (RuntimeError("checkpoint x: save failed (rank 0: OSError: [Errno 28] No space left on device)"),
     ("infrastructure", "disk_full", "RuntimeError")),
    (_wrapped(MemoryError()), ("infrastructure", "out_of_memory", "MemoryError")),
    (_wrapped(OSError(errno.EROFS, "Read-only file system")), ("infrastructure", "storage", "OSError")),
    (_wrapped(PermissionError(errno.EACCES, "Permission denied")), ("infrastructure", "storage", "PermissionError")),
    (_wrapped(OSError(errno.EDQUOT, "Disk quota exceeded")), ("infrastructure", "disk_full", "OSError")),
    (_wrapped(FileNotFoundError(errno.ENOENT, "no such file")), ("unknown", "exception", "RuntimeError")),
    (KeyboardInterrupt(), ("cancelled", "signal", "KeyboardInterrupt")),
    (_caused(launch.ClusterLost("controller unreachable"), ActorDiedError("gone")),
     ("infrastructure", "cluster_lost", "ClusterLost")),
    (_wrapped(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                           "[127.0.0.1]:41717")), ("infrastructure", "worker_lost", "RuntimeError")),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:538] Read error [10.244.0.7]:48466: Connection "
                  "reset by peer. This is typically caused by a remote worker hanging or bugs in the application."),
     ("infrastructure", "worker_lost", "RuntimeError")),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:201] Socket unexpectedly closed [10.244.0.7]:48466"),
     ("infrastructure", "worker_lost", "RuntimeError")),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:812] Socket closed [10.244.0.7]:48466"),
     ("infrastructure", "worker_lost", "RuntimeError")),
    (RuntimeError("HTTP read: Connection reset by peer"), ("unknown", "exception", "RuntimeError")),
    (RuntimeError("NCCL communicator was aborted on rank 1."), ("infrastructure", "nccl", "RuntimeError")),
    (RuntimeError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE) "
                  "ran for 600022 milliseconds before timing out."), ("infrastructure", "nccl", "RuntimeError")),
    (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"),
     ("infrastructure", "nccl", "RuntimeError")),
    (signals.Preempted(14, "/runs/r/checkpoint_00000014", 1), ("infrastructure", "preempted", "Preempted")),
    (signals.Stopped(14, "/runs/r/checkpoint_00000014", signal.SIGTERM), ("cancelled", "signal", "Stopped")),
    (_wrapped(checkpoints.ResumeRefused("checkpoint c: would not continue the same run (train.seed: ...)")),
     ("config", "resume_refused", "ResumeRefused")),
    (checkpoints.CheckpointError("run r has checkpoints, but none can be resumed from"),
     ("unknown", "exception", "CheckpointError")),
    (RuntimeError("ProcessGroupNCCL is only supported with GPUs, no GPUs found!"), ("unknown", "exception", "RuntimeError")),
    (ValueError("boom"), ("unknown", "exception", "ValueError")),
    (_wrapped(ExportError("export e failed its acceptance check: loss 9 vs 3")), ("model", "export_refused", "ExportError")),
])
def test_classify_from_the_exception_chain(exc, expected):
    err = failures.describe(exc, step=3, rank=1)
    assert (err["class"], err["reason"], err["exception"]) == expected
    saved_step = exc.step if isinstance(exc, signals.SavedThenStopped) else 3  # a save names the step it saved
    assert err["step"] == saved_step and err["rank"] == 1 and err["message"]


@pytest.mark.parametrize("exc", [signals.Preempted(14, "/runs/r/checkpoint_00000014", 2),
                                 signals.Stopped(14, "/runs/r/checkpoint_00000014", signal.SIGINT)],
                         ids=["preempted", "stopped"])
def test_a_saved_stop_reaches_the_driver_whole(exc):
    """Ray pickles a worker's exception for the driver: it comes back the same exception, with its step, checkpoint
    and words (not a TypeError in the driver's log)."""
    import ray.cloudpickle

    back = ray.cloudpickle.loads(ray.cloudpickle.dumps(exc))
    assert (type(back), back.step, back.checkpoint, str(back)) == (type(exc), exc.step, exc.checkpoint, str(exc))


# Two gloo ranks all-reducing until rank 1 is SIGKILLed; rank 0 prints how `failures.describe` records the error
# torch.distributed raised on it (gloo says `Read error ...: Connection reset by peer` or `Connection closed by peer`).
GLOO_PEER_KILLED = """
import json, os, signal, sys, torch, torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=rank, world_size=2)
t = torch.ones(100_000)
for step in range(1_000_000):
    try:
        dist.all_reduce(t)
    except RuntimeError as e:
        from job.records import failures
        print(json.dumps(failures.describe(e, step=step, rank=rank)), flush=True)
        break
    if rank == 1 and step == 50:
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_gloo_peer_killed_mid_collective_is_worker_lost(tmp_path):
    """The surviving rank's own error, from a real gloo pair: what rank 0 records when its peer's process dies."""
    ranks = [subprocess.Popen([sys.executable, "-c", GLOO_PEER_KILLED, str(rank), str(tmp_path / "rendezvous")],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    out, err = ranks[0].communicate(timeout=120)
    ranks[1].wait(timeout=30)
    assert ranks[1].returncode == -signal.SIGKILL
    error = json.loads(out.splitlines()[-1]) if out.strip() else pytest.fail(err[-2000:])
    assert (error["class"], error["reason"], error["rank"]) == ("infrastructure", "worker_lost", 0), error


def test_non_finite_loss_is_the_model():
    from job.worker.parts import NonFiniteError

    assert failures.classify(NonFiniteError("step 3: loss nan"))[:2] == ("model", "non_finite_loss")


def _running_record(run_dir):
    record = run_record.start_record(str(run_dir), config={"name": "r"}, config_text="name: r\n", seed=0)
    now = time.time()
    rows = [{"kind": "train", "step": s, "time": now + s, "loss": 1.0} for s in (5, 10)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return record


def test_stale_heartbeat_record_is_abandoned_on_the_next_start(tmp_path):
    run_dir = tmp_path / "r"
    record = _running_record(run_dir)
    lease_lib.write_heartbeat(str(run_dir))
    assert lease_lib.liveness(str(run_dir), record) == "live"
    assert run_record.abandon_stale(str(run_dir)) is None  # a live driver's record is left alone
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=lease_lib.HEARTBEAT_TIMEOUT_S + 1)
    assert lease_lib.liveness(str(run_dir), record, now=later) == "stale"
    # A heartbeat older than its timeout: the driver is gone.
    beat = json.loads((run_dir / "heartbeat.json").read_text())
    beat["at"] = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=300)).isoformat(timespec="seconds")
    (run_dir / "heartbeat.json").write_text(json.dumps(beat))
    abandoned = run_record.abandon_stale(str(run_dir))
    validate(abandoned)
    on_disk = run_record.load_record(str(run_dir))
    assert on_disk["status"] == "abandoned" and on_disk["ended_at"]
    assert on_disk["error"]["class"] == "unknown" and on_disk["error"]["reason"] == "driver_lost"
    assert on_disk["error"]["step"] == 10 and on_disk["metrics"]["steps"] == 10
    assert on_disk["config"] == {"name": "r"} and on_disk["started_at"] == record["started_at"]  # what it knew
    assert run_record.abandon_stale(str(run_dir)) is None  # closed once
    # No heartbeat at all (torchrun, an older version): never taken for dead.
    other = tmp_path / "o"
    assert lease_lib.liveness(str(other), _running_record(other)) == "unknown"
    # The schema is not vacuous: an abandoned record without a structured error is rejected.
    for broken in ({**on_disk, "error": "lost"}, {**on_disk, "error": {**on_disk["error"], "class": "x"}},
                   {**on_disk, "error": None}, {**on_disk, "status": "running"}):
        with pytest.raises(jsonschema.ValidationError):
            validate(broken)


def test_a_preempted_record_names_its_checkpoint_step(tmp_path):
    run_dir = tmp_path / "r"
    record = _running_record(run_dir)
    uri = str(run_dir / "checkpoint_00000012")  # saved at step 12; the metrics were last logged at step 10
    closed = run_record.finish_record(str(run_dir), record, status="failed", error=signals.Preempted(12, uri, 1),
                                    rank=0, checkpoints={"dir": str(run_dir), "latest": uri, "keep_last": 2})
    validate(closed)
    assert (closed["error"]["class"], closed["error"]["reason"], closed["error"]["step"]) == \
        ("infrastructure", "preempted", 12)
    for broken in ({**closed, "checkpoints": None}, {**closed, "error": {**closed["error"], "step": None}},
                   {**closed, "error": {**closed["error"], "class": "unknown"}}, {**closed, "status": "cancelled"}):
        with pytest.raises(jsonschema.ValidationError):
            validate(broken)


def test_an_nccl_error_names_the_transport_it_failed_on(tmp_path):
    record = _running_record(tmp_path / "r")
    record["transport"]["summary"] = "nccl 2.28.9, net efa (aws-ofi-nccl), intra-node nvlink [16 ranks]"
    nccl = RuntimeError("[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
                        "OpType=ALLREDUCE) ran for 600022 milliseconds before timing out.")
    closed = run_record.finish_record(str(tmp_path / "r"), record, status="failed", error=nccl, rank=3)
    validate(closed)
    assert (closed["error"]["reason"], closed["error"]["transport"]) == ("nccl", record["transport"]["summary"])
    full = run_record.finish_record(str(tmp_path / "r"), record, status="failed", error=_wrapped(
        OSError(errno.ENOSPC, "No space left on device")), rank=0)
    assert full["error"]["reason"] == "disk_full" and "transport" not in full["error"]  # not the network's
    with pytest.raises(jsonschema.ValidationError):
        validate({**closed, "error": {**closed["error"], "transport": None}})


def test_driver_closes_a_running_record_and_keeps_a_closed_one(tmp_path):
    run_dir = tmp_path / "r"
    _running_record(run_dir)
    closed = run_record.close_if_running(str(run_dir), "failed", ActorDiedError("gone"), rank=0)
    validate(closed)
    assert closed["status"] == "failed" and closed["error"]["reason"] == "worker_lost"
    assert run_record.close_if_running(str(run_dir), "cancelled", KeyboardInterrupt()) is None
    assert run_record.load_record(str(run_dir))["status"] == "failed"


def _driver(tmp_path, name, workers=1, max_failures=0, **sections):
    raw = tiny_run_config(tmp_path, name=name, scaling={"num_workers": workers, "max_failures": max_failures},
                          model={"train_tokenizer_vocab": None, "overrides": {"num_hidden_layers": 1}},
                          data={"format": "synthetic", "train": None}, **sections)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    cmd = [sys.executable, "-m", "job", "--config", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    return cmd, env, os.path.join(raw["storage_path"], name)


def test_a_failed_attempt_keeps_the_training_it_did_in_its_goodput(tmp_path):
    """A run that fails after training some steps shows the time it trained (goodput above 0), in run.json and in
    `python -m job runs`."""
    from job.__main__ import main

    cmd, env, run_dir = _driver(tmp_path, "partial", train={"max_steps": 12, "warmup_steps": 1},
                                debug={"fail_at_step": 9, "fail_mode": "exception"})
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 1, proc.stderr[-3000:]
    time_ = run_record.load_record(run_dir)["time"]
    assert time_["phases_s"]["train"] > 0 and time_["goodput"] > 0, time_
    rows = json.loads(subprocess.run([sys.executable, "-m", "job", "runs", os.path.dirname(run_dir), "--json"],
                                     cwd=REPO, capture_output=True, text=True, check=True).stdout)
    assert rows[0]["status"] == "failed" and rows[0]["goodput"] == time_["goodput"] > 0


def test_a_lost_worker_is_blamed_on_its_own_rank_and_a_retry_keeps_the_cause(tmp_path):
    """Rank 1 killed: the record names rank 1 as lost (and rank 0 as the one that noticed, when it recorded its
    peer's error first); retried within the run, the lost attempt keeps that cause in `previous_attempts`."""
    args = dict(workers=2, train={"max_steps": 10, "warmup_steps": 1}, checkpoint={"every_steps": 4},
                debug={"fail_at_step": 6, "fail_rank": 1})
    cmd, env, run_dir = _driver(tmp_path, "lost1", **args)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 1, proc.stderr[-3000:]
    error = run_record.load_record(run_dir)["error"]
    assert (error["class"], error["reason"], error["rank"]) == ("infrastructure", "worker_lost", 1), error
    assert error.get("noticed_by") in (None, 0), error
    assert "run failed: infrastructure/worker_lost at step" in proc.stderr and "rank 1" in proc.stderr, proc.stderr

    cmd, env, run_dir = _driver(tmp_path, "retried", max_failures=1, **args)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = run_record.load_record(run_dir)
    (lost,) = record["previous_attempts"]
    assert record["status"] == "succeeded" and lost["status"] in ("failed", "interrupted"), lost
    assert (lost["error"]["class"], lost["error"]["reason"], lost["error"]["rank"]) == \
        ("infrastructure", "worker_lost", 1), lost


def test_lost_rank0_ends_failed_worker_lost(tmp_path):
    cmd, env, run_dir = _driver(tmp_path, "lost", train={"max_steps": 20, "warmup_steps": 1},
                                checkpoint={"every_steps": 10}, debug={"fail_at_step": 15, "fail_rank": 0})
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=400)
    assert proc.returncode == 1, proc.stdout[-3000:]
    record = run_record.load_record(run_dir)
    validate(record)
    assert record["status"] == "failed" and record["ended_at"], record["error"]
    assert (record["error"]["class"], record["error"]["reason"], record["error"]["rank"]) == \
        ("infrastructure", "worker_lost", 0)
    # Killed at step 15, before logging it: the last step seen is the last logged (logging.every_steps 5).
    assert record["error"]["step"] == record["metrics"]["steps"] == 10
    # The verdict is the last thing printed, after Ray's own output: at most 5 lines.
    lines = proc.stdout.strip().splitlines()
    verdict = lines[max(i for i, line in enumerate(lines) if line.startswith("run failed: ")):]
    assert len(verdict) <= 5 and verdict[0] == "run failed: infrastructure/worker_lost at step 10, rank 0", lines[-30:]
    assert verdict[1].startswith("cause: ") and f"run directory: {run_dir} (run.json)" in verdict
    assert verdict[-1] == ("next: rerun; it resumes from its newest complete checkpoint, if any: "
                           f"python -m job --config {cmd[-1]}"), verdict
    # The driver's output, verdict included, is kept beside the workers' tracebacks, where the record points.
    assert f"logs: {record['logs']}/ (driver.log)" in verdict and record["logs"].startswith(f"{run_dir}/logs/")
    kept = open(os.path.join(record["logs"], "driver.log")).read()
    assert "# resolved config" in kept and kept.rstrip().endswith(verdict[-1]), kept[-2000:]


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if (value := predicate()):
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _trained(run_dir):
    try:
        return [r for r in run_record.read_metrics(run_dir) if r.get("kind") == "train"]
    except OSError:
        return []


def _last_step(run_dir) -> int:
    return max((r["step"] for r in _trained(run_dir)), default=0)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_lost_rank_whose_poll_still_hung_is_named_before_the_shutdown(tmp_path, ray_cluster):
    """The race behind a retried attempt blamed on the rank that noticed its peer's loss: Ray Train's poll returned
    rank 0's gloo error while the killed rank 1's poll still hung. Before the group's shutdown the callback asks the
    ranks without an error: the dead actor answers `RayActorError`, the live one answers, and rank 1 is the lost one."""
    from types import SimpleNamespace

    import ray
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    @ray.remote(num_cpus=0)
    class Rank:
        pass

    workers = [SimpleNamespace(actor=Rank.remote()) for _ in range(3)]
    ray.get([w.actor.__ray_ready__.remote() for w in workers])
    ray.kill(workers[1].actor, no_restart=True)
    trainer = launch.trainer_class(TorchTrainer, str(tmp_path))(lambda config: None,
                                                                scaling_config=ScalingConfig(num_workers=1))
    (callback,) = [cb for cb in trainer._create_default_callbacks() if type(cb).__name__ == "RecordGroupFailure"]
    noticed = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    callback.after_worker_group_poll_status(SimpleNamespace(errors={0: noticed}))
    callback.before_worker_group_shutdown(SimpleNamespace(get_workers=lambda: workers))
    assert failures.lost_ranks(callback.errors) == [1] and callback.errors[0] is noticed and 2 not in callback.errors


def test_a_lost_stop_request_neither_blocks_nor_fails_the_worker_groups_after_it(ray_cluster):
    """The driver's `StopRequest` lost with the node it was placed on (a deleted worker Pod): Ray restarts it and
    retries the call, and one that cannot be reached at all reads as no stop. Asked directly, a dead actor failed
    every later worker group at once, which Ray Train retried as a preemption without end (seen on real pods)."""
    import ray

    request = launch.stop_request_actor()
    assert launch.stop_pending(request) is False
    ray.kill(request, no_restart=False)  # its node lost: restarted, empty
    assert launch.stop_pending(request) is False
    ray.get(request.request.remote(15))
    assert launch.stop_pending(request) is True
    ray.kill(request, no_restart=True)
    assert launch.stop_pending(request, timeout_s=10) is False


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_stopped_driver_has_the_workers_save_at_their_next_log_step_and_a_rerun_resumes_there(tmp_path, signum):
    """A signal to the driver (a Ctrl-C; the head pod's `ray job stop` on `helm uninstall`): the ranks save at their
    next log step, the record says `cancelled` with that checkpoint, the workers end, and the same command resumes
    from the save, training no step twice (a constant learning rate after warmup: the rerun's nearer end leaves the
    schedule alone). No worker says it is saving when Ray ends it afterwards."""
    cmd, env, run_dir = _driver(tmp_path, "sig", train={"max_steps": 5000, "warmup_steps": 1, "min_lr_ratio": 1.0},
                                logging={"every_steps": 2}, checkpoint={"every_steps": 1000, "export": False})
    with open(tmp_path / "driver.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_for(lambda: _trained(run_dir), 400, "the first train record")
            worker = int(open(os.path.join(run_dir, "workers", "rank0.pid")).read())
            proc.send_signal(signum)
            proc.wait(timeout=120)
        finally:
            proc.kill()
    output = (tmp_path / "driver.log").read_text()
    assert proc.returncode == 128 + signum, output[-3000:]
    record = run_record.load_record(run_dir)
    validate(record)
    assert record["status"] == "cancelled" and record["ended_at"], record["error"]
    err = record["error"]
    assert (err["class"], err["reason"], err["exception"], err["rank"]) == ("cancelled", "signal", "Stopped", 0), err
    saved = err["step"]
    assert signal.Signals(signum).name in err["message"] and f"checkpoint_{saved:08d}" in err["message"], err
    assert saved % 2 == 0 and saved == record["metrics"]["steps"], (saved, record["metrics"])  # a log step, the last
    assert record["checkpoints"]["latest"].endswith(f"checkpoint_{saved:08d}")
    assert checkpoints.latest_complete(run_dir).endswith(f"checkpoint_{saved:08d}")
    assert "saving a checkpoint" not in output, output[-3000:]
    _wait_for(lambda: _gone(worker), 30, f"worker {worker} to end")  # the workers are stopped, not orphaned
    assert lease_lib.read_heartbeat(run_dir)["final"] is True
    if signum == signal.SIGINT:
        return
    again = subprocess.run([*cmd, "--set", f"train.max_steps={saved + 2}", "--set", "checkpoint.every_steps=0"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    record = run_record.load_record(run_dir)
    assert record["status"] == "succeeded" and record["extra"]["resumed_from"]["step"] == saved
    assert record["previous_attempts"][0]["status"] == "cancelled"
    assert [r["step"] for r in _trained(run_dir)] == list(range(2, saved + 3, 2)), "each step trained once"


@pytest.mark.parametrize("ending", ["succeeded", "cancelled"])
def test_the_verdict_is_the_last_thing_shown(tmp_path, ending):
    """Whatever the ending, the driver's verdict comes after the workers' forwarded lines and progress bars (a bar
    the cancelled workers never closed is not drawn again under it)."""
    cmd, env, run_dir = _driver(tmp_path, ending, train={"max_steps": 12 if ending == "succeeded" else 5000,
                                                         "warmup_steps": 1},
                                logging={"every_steps": 2, "progress_bar": "on"}, checkpoint={"export": False})
    with open(tmp_path / "driver.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            if ending == "cancelled":
                _wait_for(lambda: _trained(run_dir) and _last_step(run_dir) >= 4, 400, "a few train records")
                proc.send_signal(signal.SIGINT)
            proc.wait(timeout=400)
        finally:
            proc.kill()
    lines = [line for line in (tmp_path / "driver.log").read_text().replace("\r", "\n").splitlines() if line.strip()]
    first = max(i for i, line in enumerate(lines) if line.startswith(f"run {ending}: "))
    assert lines[-1].startswith("next: ") and len(lines) - first <= 5, lines[-30:]
    if ending == "succeeded":
        assert proc.returncode == 0 and lines[first] == "run succeeded: 12 steps", lines[first:]
        assert lines[first + 1] == f"run directory: {run_dir} (run.json)"


def test_sigkilled_driver_is_abandoned_by_the_next_start_which_resumes_and_succeeds(tmp_path):
    # scripts/drills.sh's kill-driver: SIGKILL the driver's process group and its Ray workers (a lost head pod;
    # the workers would otherwise finish the run without it), then start the same run again. Both attempts log to
    # one MLflow run on a real tracking server.
    import mlflow
    from servers import mlflow_server

    server = contextlib.ExitStack()
    tracking_uri = str(server.enter_context(mlflow_server(tmp_path / "mlflow")))
    # A constant learning rate after warmup (min_lr_ratio 1): the second attempt's nearer end recomputes the cosine
    # schedule (docs/checkpoints.md), which would change every update after the resume point, and so every loss
    # after the first resumed step; at a constant rate a step both attempts trained must log the same loss.
    cmd, env, run_dir = _driver(tmp_path, "killed",
                                train={"max_steps": 5000, "warmup_steps": 1, "min_lr_ratio": 1.0},
                                logging={"every_steps": 1, "mlflow": {"tracking_uri": tracking_uri}},
                                checkpoint={"every_steps": 4, "export": False})
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            saved = _wait_for(lambda: checkpoints.latest_complete(run_dir), 400, "the first complete checkpoint")
            saved_step = int(saved.rsplit("_", 1)[-1])
            _wait_for(lambda: _last_step(run_dir) > saved_step, 120, "a step after the save")
            workers = [int(open(os.path.join(run_dir, "workers", "rank0.pid")).read())]
            os.killpg(proc.pid, signal.SIGKILL)
            for pid in workers:
                os.kill(pid, signal.SIGKILL)
            proc.wait(timeout=30)  # reaped: its pid is gone, as a killed pod's is
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    assert run_record.load_record(run_dir)["status"] == "running"  # nothing could close it
    killed_after = _last_step(run_dir)
    resume_at = int(checkpoints.latest_complete(run_dir).rsplit("_", 1)[-1])  # a save may have completed since
    # The same run again (the same config, only a nearer end): it closes the stale record and resumes.
    again = subprocess.run([*cmd, "--set", f"train.max_steps={resume_at + 2}"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "heartbeat stale: marked abandoned" in again.stdout, again.stdout[-3000:]
    record = run_record.load_record(run_dir)
    validate(record)
    # The dead driver's lease, taken over and said so in the record.
    assert f"took over the stale lease of host {record['lease']['host']}, pid {proc.pid}," in again.stdout
    assert record["lease"]["took_over"]["pid"] == proc.pid and "is gone from this host" in \
        record["lease"]["took_over"]["stale"], record["lease"]
    assert record["status"] == "succeeded" and record["error"] is None, record["error"]
    assert record["extra"]["resumed_from"]["step"] == resume_at >= saved_step
    assert record["extra"]["resumed_from"]["lr_schedule_changes"] == {"max_steps": [5000, resume_at + 2]}
    assert record["metrics"]["steps"] == resume_at + 2
    # It trained beside the abandoned record (attempts/2), and, having succeeded, its record and config are the run's.
    assert record["record_file"] == "run.json" and record["later_attempts"] == []
    for config in ("config.yaml", "attempts/2/config.yaml"):
        assert yaml.safe_load(open(os.path.join(run_dir, config)))["train"]["max_steps"] == resume_at + 2
    (abandoned,) = record["previous_attempts"]
    err = abandoned["error"]
    assert (abandoned["status"], err["class"], err["reason"], err["exception"], err["rank"]) == \
        ("abandoned", "unknown", "driver_lost", None, None), abandoned
    assert "the driver stopped its heartbeat" in err["message"]
    assert err["step"] == abandoned["steps"] == killed_after and abandoned["ended_at"]  # what it knew, kept
    with server:
        check_mlflow_run(tracking_uri, run_dir, record, last_logged=max(killed_after, resume_at + 2))
        # Exact resume: the steps both attempts trained (a save completes only after a later step is logged, so
        # there is at least one) have one loss and one learning rate, each attempt's point the same.
        client = mlflow.MlflowClient(tracking_uri)
        run_id = json.load(open(os.path.join(run_dir, "mlflow.json")))["run_id"]
        trained_twice = range(resume_at + 1, min(killed_after, resume_at + 2) + 1)
        assert trained_twice
        for metric in ("train/loss", "train/lr"):
            points = {}
            for m in client.get_metric_history(run_id, metric):
                points.setdefault(m.step, []).append(m.value)
            assert {step: points[step] for step in trained_twice} == \
                {step: [points[step][0]] * 2 for step in trained_twice}, metric


def check_mlflow_run(tracking_uri: str, run_dir: str, record: dict, last_logged: int) -> None:
    """The run's one MLflow run holds its params, the metrics of every step up to `last_logged` (each attempt's
    points: MLflow keeps them all), the closing tags and the artifacts; it ended with the run's status."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    run_id = json.load(open(os.path.join(run_dir, "mlflow.json")))["run_id"]
    [experiment] = [e for e in client.search_experiments() if e.name == "ray-finetune"]
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]  # continued, not new
    run = client.get_run(run_id)
    assert run.info.run_name == record["run_name"] and run.info.status == "FINISHED"
    assert run.data.params["train.max_steps"] == "5000"  # the first attempt's (MLflow keeps a param's first value)
    assert run.data.params["logging.mlflow.tracking_uri"] == tracking_uri
    assert run.data.tags["status"] == "succeeded" and run.data.tags["image_digest"] == "unknown"
    assert run.data.tags["chart_version"] == "unknown" and "failure_class" not in run.data.tags
    rows = [r for r in run_record.read_metrics(run_dir) if r["kind"] == "train"]
    history = client.get_metric_history(run_id, "train/loss")
    # Continuous: every step from 1 on, each attempt's points (MLflow cannot drop any: a step the second attempt
    # recomputed has two, the first attempt's steps past the run's end stay); the latest point of each step of
    # the run is metrics.jsonl's.
    assert sorted({m.step for m in history}) == list(range(1, last_logged + 1))
    latest = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}
    assert {step: latest[step] for step in (r["step"] for r in rows)} == \
        {r["step"]: pytest.approx(r["loss"]) for r in rows}
    assert [r["step"] for r in rows] == list(range(1, record["metrics"]["steps"] + 1))
    assert {a.path for a in client.list_artifacts(run_id)} == {"run.json", "report.md"}
    artifact = json.load(open(client.download_artifacts(run_id, "run.json")))
    assert artifact["status"] == "succeeded" and artifact["previous_attempts"][0]["status"] == "abandoned"


def test_a_workers_sigterm_is_a_preemption_until_its_loop_returns_then_goes_to_the_handler_it_replaced(
        monkeypatch, capsys):
    """During the loop a SIGTERM is noted and said, not obeyed; once the loop has returned (Ray ending the worker
    after a finished run) it goes to the handler `catch_preemption` replaced, with no claim of a save."""
    monkeypatch.setattr(signals, "_preemption_signals", [])
    monkeypatch.setattr(signals, "_sigterm_ends", [])
    replaced = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: replaced.append(signum))
    try:
        assert signals.catch_preemption()
        signal.raise_signal(signal.SIGTERM)
        assert signals.preemption_signalled() and replaced == []
        assert "saving a checkpoint at the ranks' next log step" in capsys.readouterr().out

        monkeypatch.setattr(signals, "_preemption_signals", [])
        assert signals.catch_preemption()
        signals.stop_catching_preemption()
        signal.raise_signal(signal.SIGTERM)
        assert replaced == [signal.SIGTERM] and not signals.preemption_signalled()
        assert capsys.readouterr().out == ""
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_to_a_worker_saves_at_the_next_step_and_the_retry_resumes_there(tmp_path):
    # Checkpoints every 20 steps; rank 1 gets SIGTERM mid-interval. The ranks agree at the next log step (every
    # step here), save it, and end the attempt preempted; Ray Train's retry (max_failures 1) resumes from that save.
    cmd, env, run_dir = _driver(tmp_path, "preempt", workers=2, max_failures=1,
                                train={"max_steps": 30, "warmup_steps": 1}, logging={"every_steps": 1},
                                checkpoint={"every_steps": 20, "keep_last": 5})
    with open(tmp_path / "driver.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_for(lambda: len(_trained(run_dir)) >= 5, 400, "step 5")
            worker = int(open(os.path.join(run_dir, "workers", "rank1.pid")).read())
            signalled_after = _trained(run_dir)[-1]["step"]
            os.kill(worker, signal.SIGTERM)
            proc.wait(timeout=400)
        finally:
            proc.kill()
    output = (tmp_path / "driver.log").read_text()
    assert proc.returncode == 0, output[-3000:]
    # Said once, by the signalled worker: Ray's SIGTERMs ending the workers after the run are no preemption.
    assert output.count("saving a checkpoint at the ranks' next log step") == 1, output[-3000:]
    record = run_record.load_record(run_dir)
    validate(record)
    assert record["status"] == "succeeded", record["error"]
    (preempted,) = record["previous_attempts"]
    err = preempted["error"]
    assert (preempted["status"], err["class"], err["reason"], err["exception"]) == \
        ("failed", "infrastructure", "preempted", "Preempted"), preempted
    saved = err["step"]
    assert signalled_after <= saved < 20, (signalled_after, saved)  # no step before the signal lost; mid-interval
    assert f"checkpoint_{saved:08d}" in err["message"]
    steps = [s for s, _, ok in checkpoints.list_checkpoints(run_dir) if ok]
    assert steps == [saved, 20, 30], steps
    # The retry started from that save: no step up to it was trained again.
    assert record["extra"]["resumed_from"]["step"] == saved
    rows = run_record.read_metrics(run_dir)
    assert [r["step"] for r in rows if r["kind"] == "resume"] == [saved]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, 31))


def test_the_head_stagings_refusal_is_recorded_and_ends_its_first_driver(tmp_path):
    """The chart's staging init container finds a data source missing (templates/_staging.tpl): it records the run
    `failed`/`data` from its pod (job/driver/staging.py). The driver then started in that pod ends with the same line
    and exit status 2 before it connects to Ray, adding no record; a later driver of the run in the pod (a warm
    cluster's next job) and one in another pod check for themselves."""
    from job.driver import staging

    cmd, env, run_dir = _driver(tmp_path, "staged")
    env = {**env, "POD_NAME": "staged-head-0", "POD_NAMESPACE": "t-staged"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    line = "run.data.train: /mnt/runs/data/train.jsonl does not exist: copy it there (staging.copies) or point " \
           "run.data.train at it"
    staged = subprocess.run([sys.executable, "-m", "job.driver.staging", "--config", cmd[-1], line], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert staged.returncode == 0, staged.stdout + staged.stderr
    assert "no Event: JOB_RAYJOB unset" in staged.stdout
    refused = run_record.load_record(run_dir)
    validate(refused)
    err = refused["error"]
    assert (refused["status"], err["class"], refused["pod"]["name"]) == ("failed", "data", "staged-head-0"), refused
    assert line in err["message"] and refused["previous_attempts"] == []
    driver = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert driver.returncode == 2, driver.stdout[-3000:] + driver.stderr[-3000:]
    assert f"data error: {line} (found by the head's data staging; in run.json)" in driver.stderr
    assert "resolved config" not in driver.stdout, "it ended before Ray"
    assert run_record.load_record(run_dir) == refused, "no second record"
    assert staging.refused_here(run_dir, {"POD_NAME": "staged-head-0"}) is None, "a driver has beaten since"
    assert staging.refused_here(run_dir, {"POD_NAME": "another-head"}) is None


def test_a_failure_before_rank0_opens_the_record_gets_one_from_the_driver(tmp_path):
    run_dir = tmp_path / "r"
    attempt = {"started_at": time.time(), "config": {"name": "r"}, "config_text": "name: r\n", "run_name": "r",
               "seed": 0}
    made = run_record.close_if_running(str(run_dir), "failed", ActorDiedError("gone"), rank=1, attempt=attempt)
    validate(made)
    assert (made["status"], made["error"]["reason"], made["error"]["rank"]) == ("failed", "worker_lost", 1)
    assert made["previous_attempts"] == [] and made["config"] == {"name": "r"}
    # This attempt's record is closed once; without `attempt` nothing is made up.
    assert run_record.close_if_running(str(run_dir), "failed", ValueError("x"), attempt=attempt) is None
    assert run_record.close_if_running(str(tmp_path / "none"), "failed", ValueError("x")) is None
    # An earlier attempt's record (closed, or left running) is kept in previous_attempts of a new one.
    later = {**attempt, "started_at": time.time() + 2}
    again = run_record.close_if_running(str(run_dir), "failed", sources.DataError("bad row"), attempt=later)
    assert again["error"]["class"] == "data" and again["started_at"] >= made["started_at"]
    assert [a["status"] for a in again["previous_attempts"]] == ["failed"]


def _run(tmp_path, name, workers=1, max_failures=0, **sections):
    """A tiny synthetic run under Ray in this process: (its record, validated; the driver's error; its directory)."""
    model = {"train_tokenizer_vocab": None, "overrides": {"num_hidden_layers": 1}, **sections.pop("model", {})}
    raw = tiny_run_config(tmp_path, name=name, scaling={"num_workers": workers, "max_failures": max_failures},
                          model=model, data={"format": "synthetic", "train": None}, logging={"every_steps": 1},
                          **sections)
    raw["checkpoint"] = {"export": False, "every_steps": 4, **raw.get("checkpoint", {})}
    from job.driver import launch

    cfg = launch.resolve_paths(config_lib.load_dict(raw))
    run_dir = launch.run_directory(cfg)
    error = launch.run_with_ray(cfg, launch.prepare(cfg, run_dir))
    record = run_record.load_record(run_dir)
    validate(record)
    return record, error, run_dir


def _in_process(tmp_path, name, workers=1, **sections):
    record, error, _ = _run(tmp_path, name, workers, **sections)
    assert error, "the run should have failed"
    assert record["status"] == "failed" and record["ended_at"]
    return record["error"], error


def test_exception_in_the_loop_ends_failed_with_the_rank_and_step(tmp_path, ray_cluster):
    # Rank 1 raises at step 6 while rank 0 waits in the step's collectives: Ray Train stops rank 0 before its
    # except branch can run, so the driver closes the record with rank 1's error.
    err, message = _in_process(tmp_path, "raise", workers=2, train={"max_steps": 8, "warmup_steps": 1},
                               debug={"fail_at_step": 6, "fail_rank": 1, "fail_mode": "exception"})
    assert (err["class"], err["reason"], err["exception"], err["rank"], err["step"]) == \
        ("unknown", "exception", "RuntimeError", 1, 5), err
    assert "injected failure at step 6" in err["message"] and "rank 1" in message
    (log,) = glob.glob(str(tmp_path / "runs" / "raise" / "logs" / "*" / "rank1.log"))  # its traceback, in the run
    assert "Traceback (most recent call last)" in open(log).read() and "injected failure at step 6" in open(log).read()


def test_disk_full_during_a_save_ends_failed_infrastructure_disk_full(tmp_path, ray_cluster):
    err, message = _in_process(tmp_path, "full", train={"max_steps": 8, "warmup_steps": 1},
                               checkpoint={"every_steps": 4, "async_save": False},
                               debug={"fail_at_step": 4, "fail_rank": 0, "fail_mode": "disk_full"})
    assert (err["class"], err["reason"], err["exception"], err["rank"], err["step"]) == \
        ("infrastructure", "disk_full", "OSError", 0, 4), err
    assert "checkpoint_00000004" in err["message"] and "No space left on device" in message


@contextlib.contextmanager
def small_tmpfs(path, size: str):
    """A tmpfs of `size` mounted at `path` (needs root, as CI has; skipped without)."""
    path.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_a_full_disk_at_the_start_is_named_as_one(tmp_path, capsys):
    """A storage with no room left is refused before anything starts, as the full disk it is."""
    from job.__main__ import main

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_run_config(tmp_path)))
    with small_tmpfs(tmp_path / "full", "1m"):
        with open(tmp_path / "full" / "filler", "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"x" * 65536)
                f.flush()
        code = main(["--config", str(config), "--set", f"storage_path={tmp_path / 'full'}"])
    err = capsys.readouterr().err
    assert code == 2 and "config error: storage_path: cannot create and write the run directory" in err, err
    assert "No space left on device" in err and "lease" not in err, err


def test_a_really_full_disk_ends_failed_disk_full_with_the_partial_save_removed(tmp_path, ray_cluster):
    # drills.sh disk-full in CI: run storage of 2 MiB holds one checkpoint, not two. The save of step 8 fills it
    # while in flight, so the loop's next write (its metrics) fails first; the attempt removes the partial save,
    # which makes room for its record, and so does the retry, which resumes from step 4 and fails the same way.
    with small_tmpfs(tmp_path / "runs", "2m"):
        record, error, run_dir = _run(
            tmp_path, "full", workers=2, max_failures=1, train={"max_steps": 12, "warmup_steps": 1},
            model={"overrides": {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
                                 "vocab_size": 512}})
        err = record["error"]
        assert (record["status"], err["class"], err["reason"]) == ("failed", "infrastructure", "disk_full"), err
        assert "No space left on device" in err["message"] and run_dir in err["message"], err
        assert [a["status"] for a in record["previous_attempts"]] == ["failed"], record["previous_attempts"]
        assert [(step, complete) for step, _, complete in checkpoints.list_checkpoints(run_dir)] == [(4, True)]
        assert "disk_full" in error and "No space left on device" in error


def test_loss_spike_needs_n_intervals_in_a_row_above_the_median():
    from job.worker.watchdog import LossSpikeError, LossSpikes

    spikes = LossSpikes(3.0, 3)
    for step, loss in enumerate([5, 4, 3, 2.5, 2.4, 2.3, 9, 2.2, 9, 9], 1):  # before 5 losses, and 2 in a row: no
        spikes.check(step, loss)
    with pytest.raises(LossSpikeError, match=r"step 11: loss 9 above train.loss_spike_factor 3 x the median 2.5 .* "
                                             r"for 3 log intervals"):
        spikes.check(11, 9)  # the median leaves the spikes out: 2.5 of the 7 others
    off = LossSpikes(0, 1)
    for step, loss in enumerate([1] * 6 + [1e6], 1):
        off.check(step, loss)


def test_watchdog_allows_phases_longer_and_dumps_every_thread_when_one_hangs(tmp_path):
    script = f"""
import time
from job.worker import watchdog
watchdog.HANG_GRACE_S = 0
w = watchdog.Watchdog(1.0, {str(tmp_path)!r}, rank=1, attempt=2, step=0)
w.phase("eval", True); time.sleep(2.5); w.phase("eval", False)  # within 6 timeouts: no hang
w.step_done(1); time.sleep(0.5); w.step_done(2)
print("no hang so far", flush=True)
def stuck_in_a_save():
    time.sleep(60)
w.phase("checkpoint", True)
stuck_in_a_save()
"""
    (tmp_path / "hangs.py").write_text(script)  # a file: the stacks show its source lines
    proc = subprocess.run([sys.executable, str(tmp_path / "hangs.py")], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 70 and "no hang so far" in proc.stdout, proc.stdout + proc.stderr
    stacks = (tmp_path / "hang" / "attempt-2-rank1.txt").read_text()
    assert stacks.startswith("rank 1: no progress for 6 s (allowed 6 s, train.hang_timeout_s) in the checkpoint "
                             f"phase after step 2; every rank's Python stacks: {tmp_path}/hang/attempt-2-rank*.txt")
    assert "Thread MainThread" in stacks and "in stuck_in_a_save\n    time.sleep(60)" in stacks
    assert "Thread job-hang-watchdog" in stacks


HANG = {"train": {"max_steps": 8, "warmup_steps": 1, "hang_timeout_s": 5},
        "checkpoint": {"every_steps": 4, "async_save": False},
        "debug": {"fail_at_step": 6, "fail_rank": 1, "fail_mode": "hang"}}


def test_a_hung_rank_fails_the_run_as_a_hang_naming_it_from_every_ranks_stacks(tmp_path, ray_cluster):
    err, message = _in_process(tmp_path, "hang", workers=2, **HANG)
    # Rank 0 closes the record; the rank it names is the one that hung: outside any collective, rank 0 inside one.
    assert (err["class"], err["reason"], err["exception"], err["rank"], err["step"]) == \
        ("infrastructure", "hang", "HangError", 1, 5), err
    transport = run_record.load_record(str(tmp_path / "runs" / "hang"))["transport"]["summary"]
    assert err["transport"] == transport and "gloo" in transport, (err, transport)
    assert message.startswith("run.json: infrastructure/hang at step 5, rank 1: HangError: rank 0: no progress"), \
        message
    stacks = tmp_path / "runs" / "hang" / "hang"
    assert f"after step 5; every rank's Python stacks: {stacks}/attempt-1-rank*.txt; hung: rank 1; rank 1 after " \
           "step 5, outside any collective at faults.py:" in err["message"], err["message"]
    assert err["message"].endswith(" in maybe_fail"), err["message"]
    sleeper, waiter = ((stacks / f"attempt-1-rank{r}.txt").read_text() for r in (1, 0))
    assert "in maybe_fail\n    time.sleep(60)" in sleeper  # rank 1 sleeps before the step's first collective
    assert "in train_step\n    dist.all_reduce(global_units)" in waiter  # rank 0 waits in it
    assert json.loads(waiter.split("\n")[1]) | {"at": None} == {"rank": 0, "step": 5, "in_collective": True, "at": None}


def test_hung_ranks_are_those_outside_a_collective_or_behind_the_others():
    from job.worker.watchdog import hung_ranks

    def where(rank, step, inside):
        return {"rank": rank, "step": step, "in_collective": inside, "at": "x.py:1 in f"}

    assert hung_ranks([where(0, 5, True), where(1, 5, False), where(2, 5, True)]) == [1]
    assert hung_ranks([where(0, 5, True), where(1, 4, True)]) == [1]  # in another collective (a desync), behind
    assert hung_ranks([where(0, 5, True), where(1, 5, True)]) == []  # the stacks cannot tell
    assert hung_ranks([where(0, 5, False), where(1, 5, False)]) == [0, 1]  # each stuck on its own (storage)


def test_a_hang_is_retried_from_the_last_checkpoint_and_kept_in_previous_attempts(tmp_path, ray_cluster):
    record, error, run_dir = _run(tmp_path, "hang-retry", workers=2, max_failures=1, **HANG)
    assert error is None and record["status"] == "succeeded", (error, record["error"])
    (hung,) = record["previous_attempts"]
    assert (hung["status"], hung["error"]["class"], hung["error"]["reason"], hung["steps"]) == \
        ("failed", "infrastructure", "hang", 5), hung
    assert record["extra"]["resumed_from"]["step"] == 4 and record["metrics"]["steps"] == 8


def test_a_loss_spike_ends_failed_model_loss_spike(tmp_path, ray_cluster):
    err, message = _in_process(tmp_path, "spike", train={"max_steps": 16, "warmup_steps": 1},
                               debug={"fail_at_step": 10, "fail_rank": 0, "fail_mode": "loss_spike"})
    assert (err["class"], err["reason"], err["exception"], err["rank"], err["step"]) == \
        ("model", "loss_spike", "LossSpikeError", 0, 12), err  # spikes at 10, 11 and 12
    assert "step 12: loss" in err["message"] and "x the median" in err["message"] and "step 12" in message


def test_a_nan_loss_ends_failed_model_non_finite_loss_before_its_save(tmp_path, ray_cluster):
    err, message = _in_process(tmp_path, "nan", train={"max_steps": 8, "warmup_steps": 1},
                               debug={"fail_at_step": 4, "fail_mode": "nan"})  # a save step (every 4)
    assert (err["class"], err["reason"], err["exception"], err["step"]) == \
        ("model", "non_finite_loss", "NonFiniteError", 3), err  # the last step logged: step 4's loss was not
    assert "step 4: loss nan" in err["message"], err["message"]
    run_dir = tmp_path / "runs" / "nan"
    assert not list(run_dir.glob("checkpoint_*")), "no checkpoint holds the non-finite state"


def test_bad_data_row_after_the_run_directory_exists_is_recorded_by_the_driver(tmp_path):
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps({"text": f"row {i} " * 20}) + "\n" for i in range(50)) + '{"txt": "x"}\n')
    raw = tiny_run_config(tmp_path, name="bad", data={"train": str(rows)})
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(raw))
    cmd, env, _ = _driver(tmp_path, "unused")
    cmd[-1], run_dir = str(tmp_path / "bad.yaml"), os.path.join(raw["storage_path"], "bad")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "data error:" in proc.stderr, proc.stderr[-3000:]
    record = run_record.load_record(run_dir)
    validate(record)
    assert record["status"] == "failed" and record["ended_at"]
    err = record["error"]
    assert (err["class"], err["exception"], err["step"], err["rank"]) == ("data", "DataError", None, None), err
    assert "train.jsonl:51" in err["message"] and record["config"]["data"]["format"] == "text"


def test_refused_resumes_are_config_errors_and_a_finished_run_keeps_its_record_with_the_refusals_listed(
        tmp_path, ray_cluster, capsys):
    from job.__main__ import main

    record, error, run_dir = _run(tmp_path, "refused", train={"max_steps": 4, "warmup_steps": 1})
    assert error is None and record["status"] == "succeeded"
    trained_config = open(os.path.join(run_dir, "config.yaml")).read()
    path = tmp_path / "refused.yaml"
    path.write_text(yaml.safe_dump(record["config"]))
    # The driver refuses before any worker starts. A new run name gets a failed record of the refusal ...
    assert main(["--config", str(path), "--set", "name=fresh", "--set", f"checkpoint.resume={tmp_path}/none"]) == 2
    fresh = run_record.load_record(str(tmp_path / "runs" / "fresh"))
    validate(fresh)
    err = fresh["error"]
    assert (fresh["status"], err["class"], err["reason"], err["exception"], err["step"], err["rank"]) == \
        ("failed", "config", "resume_refused", "ResumeRefused", None, None), err
    assert f"checkpoint.resume: no checkpoint at {tmp_path}/none" in err["message"] and fresh["ended_at"]
    # ... while a finished run keeps its record (status, config, results): the refusal is a later attempt beside it.
    assert main(["--config", str(path), "--set", "checkpoint.resume=never", "--set", "train.max_steps=8"]) == 2
    # Another seed is refused by the workers too (the driver's check aside), once this attempt's record is open.
    refused, error, _ = _run(tmp_path, "refused", train={"max_steps": 8, "warmup_steps": 1, "seed": 1})
    assert "would not continue the same run (train.seed: checkpoint 0, now 1)" in error
    validate(refused)
    assert {k: v for k, v in refused.items() if k != "later_attempts"} == \
        {k: v for k, v in record.items() if k != "later_attempts"}
    assert open(os.path.join(run_dir, "config.yaml")).read() == trained_config
    assert [(a["status"], a["error"]["reason"], a["record"]) for a in refused["later_attempts"]] == \
        [("failed", "resume_refused", "attempts/2/run.json"), ("failed", "resume_refused", "attempts/3/run.json")]
    assert "seed: 1" in open(os.path.join(run_dir, "attempts", "3", "config.yaml")).read()
    attempt = json.load(open(os.path.join(run_dir, "attempts", "3", "run.json")))
    validate(attempt)
    err = attempt["error"]
    assert (attempt["status"], err["class"], err["reason"], err["exception"], err["rank"]) == \
        ("failed", "config", "resume_refused", "ResumeRefused", 0), err
    assert [(a["status"], a["started_at"]) for a in attempt["previous_attempts"]][0] == \
        ("succeeded", record["started_at"])
    # runs, report and compare show the run as it finished, with the refused attempts listed.
    from job.commands import report, runs

    capsys.readouterr()
    assert runs.main([str(tmp_path / "runs"), "--name", "refused"]) == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert row.split()[1] == "succeeded" and "later attempts: 2 failed config/resume_refused" in row, row
    assert report.main([run_dir, "--out", str(tmp_path / "report"), "--no-plots"]) == 0
    assert "| Later attempts | later attempts: 2 failed" in (tmp_path / "report" / "report.md").read_text()
    assert compare.main([run_dir, run_dir]) == 0
    assert "(refused, succeeded; later attempts: 2 failed" in capsys.readouterr().out


def test_a_resume_or_adapters_the_config_cannot_have_are_refused_by_the_driver_in_seconds(tmp_path, ray_cluster,
                                                                                          capsys):
    """What the checkpoint's train state and the model's config tell, the driver checks before Ray or any worker
    starts: the same refusal the workers would give a minute later, as a config error (exit status 2)."""
    from job.__main__ import main

    record, error, run_dir = _run(tmp_path, "settled", train={"max_steps": 4, "warmup_steps": 1})
    assert error is None and record["status"] == "succeeded"
    path = tmp_path / "settled.yaml"
    path.write_text(yaml.safe_dump(record["config"]))
    cases = {
        "train.seed=1": "would not continue the same run (train.seed: checkpoint 0, now 1)",
        "train.seq_len=32": "would not continue the same run (train.seq_len: checkpoint 64, now 32)",
        "model.lora.rank=4": "holds what another model trains (model.lora (rank, alpha, targets): checkpoint none",
        "model.overrides.num_hidden_layers=2": "saved for another model architecture (num_hidden_layers: checkpoint 1",
    }
    for override, said in cases.items():
        capsys.readouterr()
        start = time.monotonic()
        assert main(["--config", str(path), "--set", "train.max_steps=8", "--set", override]) == 2, override
        err = capsys.readouterr().err
        assert err.startswith(f"config error: checkpoint {run_dir}/checkpoint_00000004: {said}"), err
        assert time.monotonic() - start < 30, override  # no worker started: the workers' check took a minute
    assert main(["--config", str(path), "--set", "name=other", "--set", "model.lora.rank=4",
                 "--set", "model.lora.targets=[q_proj,qproj]"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: model.lora.targets: qproj match(es) no linear layer of Qwen2ForCausalLM"), err


def test_extending_a_finished_run_keeps_the_export_it_ended_with(tmp_path, ray_cluster):
    """Raising train.max_steps of a finished run continues it to a new export; the export the first attempt ended
    with stays, whole, at exports/step-<N>/, and the record points at it."""
    record, error, run_dir = _run(tmp_path, "grown", train={"max_steps": 4, "warmup_steps": 1},
                                  checkpoint={"export": True})
    assert error is None and record["export"]["ok"] and record["export"]["earlier"] == []
    first = {p.name: p.read_bytes() for p in Path(run_dir, "export").iterdir() if p.is_file()}
    record, error, _ = _run(tmp_path, "grown", train={"max_steps": 6, "warmup_steps": 1}, checkpoint={"export": True})
    assert error is None and record["status"] == "succeeded" and record["export"]["ok"]
    kept = Path(run_dir, "exports", "step-00000004")
    assert record["export"]["earlier"] == [{"step": 4, "dir": str(kept)}]
    assert {p.name: p.read_bytes() for p in kept.iterdir() if p.is_file()} == first
    assert json.loads(Path(run_dir, "export", "_VALID").read_text())["step"] == 6


def test_async_saves_first_write_is_not_slower_and_each_completes_within_an_interval(tmp_path, ray_cluster):
    """The window a crash can lose (docs/checkpoints.md, "What a crash loses"): the writer process starts before
    the first step, so the first save's write is not the slow one (it took 6.1 s, 5 steps' worth, in issue 33),
    and a save always completes before the next begins."""
    from job.driver import launch

    every = 10
    raw = tiny_run_config(tmp_path, name="window", scaling={"num_workers": 1, "max_failures": 0},
                          model={"train_tokenizer_vocab": None, "overrides": {"num_hidden_layers": 1}},
                          data={"format": "synthetic", "train": None}, logging={"every_steps": 1},
                          train={"max_steps": 40, "warmup_steps": 1},
                          checkpoint={"every_steps": every, "async_writer": "process", "export": False})
    cfg = launch.resolve_paths(config_lib.load_dict(raw))
    run_dir = launch.run_directory(cfg)
    assert launch.run_with_ray(cfg, launch.prepare(cfg, run_dir)) is None
    rows = run_record.read_metrics(run_dir)
    assert [r["writer"] for r in rows if r["kind"] == "checkpoint_writer"] == ["process"]
    saves, last_step = {}, 0
    for row in rows:
        if row["kind"] == "train":
            last_step = row["step"]
        elif row["kind"] == "checkpoint":
            saves[row["step"]] = (row["write_s"], last_step)  # completed after the last step logged before it
    assert sorted(saves) == [10, 20, 30, 40]
    first, later = saves[10][0], sorted(w for step, (w, _) in saves.items() if step > 10)
    assert first <= 2 * later[len(later) // 2], saves
    for step, (_, completed) in saves.items():  # at most one save in flight: a crash loses < 2 intervals
        assert step <= completed <= step + every, saves


def test_the_ray_cluster_going_away_under_the_driver_ends_failed_cluster_lost(tmp_path):
    import tempfile

    temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths live under it
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_gcs_rpc_server_reconnect_timeout_s": "5"}
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    subprocess.run([ray_bin, "start", "--head", "--port=0", "--num-cpus=2", "--include-dashboard=false",
                    f"--temp-dir={temp_dir}", "--disable-usage-stats"], env=env, check=True, capture_output=True,
                   timeout=120)
    with open(os.path.join(temp_dir, "ray_current_cluster")) as f:
        address = f.read().strip()

    def cluster_pids():  # this cluster's processes only: their command lines name its temp dir
        out = subprocess.run(["pgrep", "-f", temp_dir], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    cmd, driver_env, run_dir = _driver(tmp_path, "gone", train={"max_steps": 5000, "warmup_steps": 1},
                                       logging={"every_steps": 2})
    driver_env.update(env, RAY_ADDRESS=address)
    try:
        with open(tmp_path / "driver.log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=driver_env, stdout=log, stderr=subprocess.STDOUT)
            try:
                _wait_for(lambda: _trained(run_dir), 400, "the first train record")
                for pid in cluster_pids():
                    os.kill(pid, signal.SIGKILL)
                proc.wait(timeout=180)
            finally:
                proc.kill()
    finally:
        for pid in cluster_pids():
            os.kill(pid, signal.SIGKILL)
    output = (tmp_path / "driver.log").read_text()
    assert proc.returncode == 1 and "run failed: infrastructure/cluster_lost" in output, output[-3000:]
    assert "cause: ClusterLost: Ray Train's controller is unreachable" in output, output[-3000:]
    record = run_record.load_record(run_dir)
    validate(record)
    assert record["status"] == "failed" and record["ended_at"], record["error"]
    err = record["error"]
    assert (err["class"], err["reason"], err["exception"]) == ("infrastructure", "cluster_lost", "ClusterLost"), err
    assert err["step"] >= 2 and err["step"] == record["metrics"]["steps"]


# --- one run, one writer (issue 43) ---------------------------------------------------------------


def _lease_cases(tmp_path, s3_env, monkeypatch):
    """The run directory to take leases in: a local path, or a moto S3 bucket when `s3_env` is given."""
    if s3_env is None:
        return str(tmp_path / "r")
    import s3fs

    for key, value in s3_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()
    return "s3://runs/leased"


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_live_lease_refuses_a_second_driver_and_a_stale_one_is_taken_over(tmp_path, monkeypatch, backend, request):
    from job import storage
    from job.records import lease as lease_lib

    run_dir = _lease_cases(tmp_path, request.getfixturevalue("s3_endpoint") if backend == "s3" else None,
                           monkeypatch)
    first = lease_lib.acquire(run_dir)
    assert first["took_over"] is None and lease_lib.read(run_dir)["id"] == first["id"]
    lease_lib.write_heartbeat(run_dir, lease=first["id"])
    with pytest.raises(lease_lib.LeaseHeld) as refused:
        lease_lib.acquire(run_dir)
    message = str(refused.value)
    assert "\n" not in message and f"pid {os.getpid()}" in message and first["started_at"] in message, message
    assert "lease.json" in message and "60 s old" in message, message
    assert lease_lib.read(run_dir)["id"] == first["id"]  # the refused one wrote nothing
    # The holder's heartbeat goes stale: the next driver takes the lease over and names the one it replaced.
    beat = json.loads(storage.read_text(storage.join(run_dir, lease_lib.HEARTBEAT_FILE)))
    beat["at"] = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=300)).isoformat(timespec="seconds")
    storage.write_atomic(storage.join(run_dir, lease_lib.HEARTBEAT_FILE), json.dumps(beat))
    second = lease_lib.acquire(run_dir)
    assert second["took_over"]["id"] == first["id"] and "s old (timeout 60 s)" in second["took_over"]["stale"], second
    assert lease_lib.read(run_dir) == second
    lease_lib.release(run_dir, first)  # a stale holder's release leaves the new lease alone
    assert lease_lib.read(run_dir)["id"] == second["id"]
    lease_lib.release(run_dir, second)
    assert lease_lib.read(run_dir) is None


def _lease_of_another_host(run_dir: str, beat_age_s: float) -> dict:
    """A lease held by a driver on another host (a head Pod's), renewed `beat_age_s` ago."""
    from job import storage
    from job.records import lease as lease_lib

    at = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=beat_age_s)).isoformat(timespec="seconds")
    held = {"id": "0" * 32, "host": "old-head-pod", "pid": 475, "pod": "old-head-pod", "started_at": at,
            "timeout_s": lease_lib.HEARTBEAT_TIMEOUT_S, "took_over": None}
    storage.write_atomic(storage.join(run_dir, lease_lib.LEASE_FILE), json.dumps(held))
    storage.write_atomic(storage.join(run_dir, lease_lib.HEARTBEAT_FILE),
                         json.dumps({"at": at, "pid": 475, "host": "old-head-pod", "final": False, "lease": held["id"]}))
    return held


def test_a_lease_of_another_host_is_watched_taken_over_when_its_heartbeat_stops_refused_when_it_beats(
        tmp_path, monkeypatch, capsys):
    """A RayJob retry's driver on a new head, seconds after the old head (and its driver) died: the dead driver's
    lease still looks live. The new driver watches it: silence until the lease is stale -> taken over; a heartbeat
    meanwhile (the holder is alive, e.g. a second release on the same claim) -> refused."""
    from job.records import lease as lease_lib

    monkeypatch.setattr(lease_lib, "WATCH_EVERY_S", 0.2)
    run_dir = str(tmp_path / "r")
    os.makedirs(run_dir)
    dead = _lease_of_another_host(run_dir, lease_lib.HEARTBEAT_TIMEOUT_S - 3)
    t0 = time.monotonic()
    mine = lease_lib.acquire(run_dir)
    assert 1.5 < time.monotonic() - t0 < 10, "waited for the lease to go stale, no longer"
    assert mine["took_over"]["id"] == dead["id"] and "s old (timeout 60 s)" in mine["took_over"]["stale"], mine
    assert "waiting up to 60 s for that driver's next heartbeat" in capsys.readouterr().out
    lease_lib.release(run_dir, mine)

    alive = _lease_of_another_host(run_dir, 1)
    stop = threading.Event()

    def beat():  # the holder renewing its lease, as failures.Heartbeat does
        while not stop.wait(0.3):
            lease_lib.write_heartbeat(run_dir, lease=alive["id"])

    beating = threading.Thread(target=beat)
    beating.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(lease_lib.LeaseHeld) as refused:
            lease_lib.acquire(run_dir)
        assert time.monotonic() - t0 < 10, "refused at the holder's next heartbeat, not at the timeout"
    finally:
        stop.set()
        beating.join()
    assert "host old-head-pod, pid 475" in str(refused.value) and lease_lib.read(run_dir)["id"] == alive["id"]


def test_two_drivers_of_one_run_at_once_one_is_refused_before_writing_anything(tmp_path):
    cmd, env, run_dir = _driver(tmp_path, "twice", train={"max_steps": 6, "warmup_steps": 1},
                                checkpoint={"every_steps": 3, "export": False})
    with open(tmp_path / "a.log", "w") as a_log, open(tmp_path / "b.log", "w") as b_log:
        drivers = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
                   for log in (a_log, b_log)]
        try:
            codes = [p.wait(timeout=400) for p in drivers]
        finally:
            for p in drivers:
                p.kill()
    logs = [(tmp_path / f"{x}.log").read_text() for x in "ab"]
    assert sorted(codes) == [0, 2], (codes, [log[-2000:] for log in logs])
    winner, loser = (0, 1) if codes[0] == 0 else (1, 0)
    refusal = logs[loser].strip().splitlines()[-1]
    assert refusal.startswith(f"refused: run {run_dir} is being written by another driver (host ")
    assert f"pid {drivers[winner].pid}," in refusal and "lease.json" in refusal, refusal
    assert "# resolved config" not in logs[loser]  # refused before anything else
    record = run_record.load_record(run_dir)
    validate(record)
    assert record["status"] == "succeeded" and record["previous_attempts"] == [] and record["later_attempts"] == []
    assert record["lease"]["pid"] == drivers[winner].pid and record["lease"]["took_over"] is None
    assert not os.path.exists(os.path.join(run_dir, "lease.json"))  # released at the end
    assert not os.path.exists(os.path.join(run_dir, "attempts"))
