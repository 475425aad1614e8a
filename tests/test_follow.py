"""job/driver/follow.py: what the driver tells while it follows a run: annotations and Events on its RayJob (against
a stand-in API server), Ray gauges, and its own output in the run directory. The chart's real pods show the same
on a real API server and Prometheus endpoint (tests/test_k8s_pods.py)."""

from __future__ import annotations

import http.server
import json
import sys

import pytest
from servers import http_server

from job.common import kubeapi
from job.driver import follow
from job.records import failures

NAMESPACE, RAYJOB = "ml", "exp1-ray-finetune-0123abcd"
JOB_PATH = f"/apis/ray.io/v1/namespaces/{NAMESPACE}/rayjobs/{RAYJOB}"


@pytest.fixture
def api(tmp_path):
    """An API server stand-in: the RayJob (uid, status.jobId) to GET, merge-patches of its annotations, Events
    created; `refuse` answers every request with that status."""
    state = {"annotations": {}, "events": [], "refuse": None, "requests": [], "job_id": "raysubmit_mine"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            state["requests"].append((self.command, self.path, self.headers.get("Content-Type")))
            if self.headers.get("Authorization") != "Bearer test-token":
                return self.send_error(401)
            if state["refuse"]:
                return self.send_error(state["refuse"])
            if self.command == "GET" and self.path == JOB_PATH:
                return self._answer(200, {"metadata": {"uid": "uid-1"}, "status": {"jobId": state["job_id"]}})
            if self.command == "PATCH" and self.path == JOB_PATH:
                assert self.headers["Content-Type"] == "application/merge-patch+json"
                for key, value in body["metadata"]["annotations"].items():
                    if value is None:
                        state["annotations"].pop(key, None)
                    else:
                        state["annotations"][key] = value
                return self._answer(200, {})
            if self.command == "POST" and self.path == f"/api/v1/namespaces/{NAMESPACE}/events":
                state["events"].append(body)
                return self._answer(201, body)
            self.send_error(404)

        do_GET = do_PATCH = do_POST = _handle

        def log_message(self, *args):
            pass

    token = tmp_path / "token"
    token.write_text("test-token\n")
    with http_server(Handler) as url:
        state["api"] = kubeapi.InCluster(url, str(token), None)
        yield state


SUBMISSION = {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"metadata": {"job_submission_id": "raysubmit_mine"}})}


def reporter(api) -> follow.RayJobReporter:
    return follow.RayJobReporter(api["api"], NAMESPACE, RAYJOB, "head-pod")


def write_metrics(run_dir, rows) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_rayjob_tells_the_runs_progress_and_story_in_order(api, tmp_path, monkeypatch):
    """Annotations follow the logged steps; each record that tells something is an Event, in the order logged;
    the ending's Event comes last, after the last records are read. Records of earlier drivers are counted in the
    progress but told by no Event."""
    monkeypatch.setattr(follow.os, "environ", {**SUBMISSION})
    run_dir = tmp_path / "runs" / "exp1"
    since = 1000.0
    earlier = [{"kind": "start", "time": 899.0, "start_step": 0, "params": 2.5e6, "world_size": 2, "method": "full"},
               {"kind": "task_eval", "time": 900.0, "step": 0, "task": "gsm8k", "exact_match": 0.25, "n": 8},
               {"kind": "eval", "time": 901.0, "step": 0, "eval_loss": 6.5, "eval_ppl": 665.0}]
    rows = earlier + [
        {"kind": "start", "time": 1001.0, "start_step": 0, "params": 2.5e6, "world_size": 2, "method": "full"},
        *({"kind": "train", "time": 1001.0 + s, "step": s, "loss": 5.0 - s / 10, "tokens_per_s": 100.0, "mfu": None,
           "goodput": 0.5, "phases_s": {"startup": 20.0, "train": float(s)}} for s in (1, 2, 3, 4))]
    write_metrics(run_dir, earlier)
    follower = follow.Follower(str(run_dir), "exp1", 10, since, reporter(api))
    follower.follow()  # this attempt is not logging yet
    assert api["annotations"]["ray-finetune/state"] == "starting" and not api["events"]
    write_metrics(run_dir, rows)
    follower.follow()
    notes = api["annotations"]
    assert notes["ray-finetune/step"] == "4/10" and notes["ray-finetune/progress"] == "40%"
    assert notes["ray-finetune/state"] == "running" and notes["ray-finetune/train-loss"] == "4.6"
    assert notes["ray-finetune/eval-loss"] == "6.5 (step 0)" and notes["ray-finetune/task-score"] == "gsm8k 25.0% (from 25.0%)"
    assert notes["ray-finetune/goodput"] == "50.0%" and notes["ray-finetune/run-dir"] == str(run_dir)
    assert notes["ray-finetune/eta"].endswith("(in 0m06s)")  # 6 steps to go at a step a second
    write_metrics(run_dir, rows + [
        {"kind": "train", "time": 1010.0, "step": 10, "loss": 4.0, "goodput": 0.6, "phases_s": {}},
        {"kind": "checkpoint", "time": 1011.0, "step": 10, "dir": f"{run_dir}/checkpoint_000010", "write_s": 1.5,
         "blocking_s": 0.25},
        {"kind": "eval", "time": 1012.0, "step": 10, "eval_loss": 3.5, "eval_ppl": 33.1},
        {"kind": "task_eval", "time": 1013.0, "step": 10, "task": "gsm8k", "exact_match": 0.5, "n": 8},
        {"kind": "export", "time": 1014.0, "step": 10, "dir": f"{run_dir}/export", "eval_loss": 3.51,
         "reference_eval_loss": 3.5}])
    follower.stop()
    follower.ended("succeeded")
    assert notes["ray-finetune/step"] == "10/10" and notes["ray-finetune/state"] == "succeeded"
    assert notes["ray-finetune/task-score"] == "gsm8k 50.0% (from 25.0%)" and "ray-finetune/eta" not in notes
    told = [(e["type"], e["reason"]) for e in api["events"]]
    assert told == [("Normal", "Started"), ("Normal", "CheckpointSaved"), ("Normal", "Evaluated"),
                    ("Normal", "TaskEvaluated"), ("Normal", "ExportAccepted"), ("Normal", "Succeeded")]
    started, saved, *_, succeeded = api["events"]
    assert started["involvedObject"] == {"apiVersion": "ray.io/v1", "kind": "RayJob", "name": RAYJOB,
                                         "namespace": NAMESPACE, "uid": "uid-1"}
    assert started["reportingInstance"] == "head-pod" and started["eventTime"] < succeeded["eventTime"]
    assert saved["message"] == f"step 10 complete in {run_dir}/checkpoint_000010 (write 1.5 s, training held 0.2 s)"
    assert succeeded["message"] == f"step 10/10, train loss 4, goodput 60.0%; run directory {run_dir}"


def test_a_resumed_attempt_tells_the_class_of_the_failure_it_resumes_from(api, tmp_path, monkeypatch):
    """Ray Train restarted the workers, or a new driver resumes the run: the failed attempt's class is the
    Warning's reason (an attempt whose process died without a word is a lost worker); a failure that ends the run
    is told by `ended`."""
    monkeypatch.setattr(follow.os, "environ", {**SUBMISSION})
    run_dir = tmp_path / "runs" / "exp1"
    since = 1000.0
    started = "1970-01-01T00:16:50+00:00"  # 1010 s: in this driver
    for previous, reason in ((failures.error("infrastructure", "disk_full", "No space left on device", step=6),
                              "DiskFull"), (None, "WorkerLost")):
        api["events"].clear()
        (run_dir).mkdir(parents=True, exist_ok=True)
        (run_dir / "run.json").write_text(json.dumps({"status": "running", "previous_attempts": [
            {"started_at": started, "ended_at": "1970-01-01T00:16:55+00:00", "status": "failed" if previous else
             "interrupted", "error": previous, "steps": 6},
            # An attempt after the resumed one, in the newest record when the follower reads it: not why it resumed.
            {"started_at": "1970-01-01T00:17:00+00:00", "ended_at": "1970-01-01T00:17:30+00:00", "status": "failed",
             "error": failures.error("model", "loss_spike", "spike")}]}))
        write_metrics(run_dir, [{"kind": "start", "time": 1020.0, "start_step": 3},
                                {"kind": "resume", "time": 1020.5, "step": 3, "checkpoint": f"{run_dir}/checkpoint_000003"}])
        follower = follow.Follower(str(run_dir), "exp1", 10, since, reporter(api))
        follower.follow()
        (warning, resumed) = api["events"]
        assert (warning["type"], warning["reason"], resumed["reason"]) == ("Warning", reason, "Resumed"), api["events"]
        assert resumed["message"].startswith(f"from step 3 ({run_dir}/checkpoint_000003) after the previous attempt ended ")
        assert warning["message"].startswith(f"the attempt started {started} ended ")
    follower.ended("failed", failures.error("model", "export_refused", "export failed its acceptance check"))
    assert (api["events"][-1]["reason"], api["events"][-1]["message"]) == (
        "ExportRefused", "model/export_refused: export failed its acceptance check")
    assert api["annotations"]["ray-finetune/state"] == "failed: model/export_refused"


def test_a_refused_or_absent_api_server_is_one_warning_and_never_fails(api, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(follow.os, "environ", {})
    monkeypatch.setattr(follow.time, "sleep", lambda s: None)
    api["refuse"] = 403
    run_dir = tmp_path / "runs" / "exp1"
    write_metrics(run_dir, [{"kind": "start", "time": 2.0, "start_step": 0}, {"kind": "train", "time": 3.0, "step": 1}])
    follower = follow.Follower(str(run_dir), "exp1", 10, 1.0, reporter(api))
    follower.follow()
    follower.ended("failed", failures.error("infrastructure", "worker_lost", "lost"))
    out = capsys.readouterr().out
    assert out.count("warning: ") == 1 and "HTTP 403" in out and "needs `patch` on it and `create` on events" in out
    assert len(api["requests"]) == 1, "nothing asked after a refusal"

    api["refuse"], api["requests"] = 503, []  # a server error is retried, then reporting stops after three calls
    again = follow.Follower(str(run_dir), "exp1", 10, 1.0, reporter(api))
    for _ in range(5):
        again.follow()
    assert len(api["requests"]) == 9 and capsys.readouterr().out.count("warning: ") == 2  # the first, and stopping

    assert follow.RayJobReporter.from_env({}) is None  # not asked for
    assert follow.RayJobReporter.from_env({follow.RAYJOB_ENV: RAYJOB}) is None
    assert "no annotations or Events: not running in Kubernetes" in capsys.readouterr().out


def test_another_submission_on_the_rayjobs_cluster_leaves_it_alone(api, tmp_path, monkeypatch, capsys):
    """Another team's RayJob on the warm cluster: its driver has the chart's RayJob in its environment."""
    monkeypatch.setattr(follow.os, "environ", {**SUBMISSION})
    api["job_id"] = "raysubmit_theirs"
    follower = follow.Follower(str(tmp_path / "r"), "r", 10, 1.0, reporter(api))
    follower.ended("succeeded")
    assert not api["events"] and not api["annotations"]
    assert "runs submission raysubmit_theirs, not this driver's (raysubmit_mine)" in capsys.readouterr().out


def test_run_metrics_are_ray_gauges_labelled_with_the_run(monkeypatch):
    """Each number a Ray gauge with the run's name as its tag, set again at every follow."""
    recorded = []

    class Gauge:
        def __init__(self, name, description, tag_keys):
            self.name, self.tag_keys, self.defaults = name, tag_keys, {}

        def set_default_tags(self, tags):
            self.defaults = tags

        def set(self, value, tags=None):
            recorded.append((self.name, {**self.defaults, **(tags or {})}, value))

    monkeypatch.setitem(sys.modules, "ray.util.metrics", type(sys)("ray.util.metrics"))
    sys.modules["ray.util.metrics"].Gauge = Gauge
    progress = follow.Progress("/runs/exp1", 100)
    for row in ({"kind": "start", "time": 1.0}, {"kind": "train", "time": 2.0, "step": 10, "loss": 2.5, "mfu": 0.4,
                 "tokens_per_s": 900.0, "goodput": 0.7, "phases_s": {"startup": 5.0, "train": 7.0}},
                {"kind": "train", "time": 3.0, "step": 20, "loss": 2.0, "goodput": 0.75, "phases_s": {"train": 8.0}},
                {"kind": "checkpoint", "time": 4.0, "step": 20, "blocking_s": 0.5},
                {"kind": "task_eval", "time": 5.0, "step": 20, "task": "gsm8k", "exact_match": 0.5}):
        progress.add(row)
    follow.RunMetrics("exp1").update(progress)
    values = {(name, tuple(sorted(tags.items()))): v for name, tags, v in recorded}
    run = ("run", "exp1")
    assert values[("finetune_step", (run,))] == 20 and values[("finetune_train_loss", (run,))] == 2.0
    assert values[("finetune_goodput", (run,))] == 0.75 and values[("finetune_checkpoint_blocking_seconds", (run,))] == 0.5
    assert values[("finetune_eta_seconds", (run,))] == 8.0  # 80 steps at ten a second
    assert values[("finetune_task_score", (run, ("task", "gsm8k")))] == 0.5
    assert values[("finetune_phase_seconds", (("phase", "train"), run))] == 8.0
    assert all(tags["run"] == "exp1" for _, tags, _ in recorded)


def test_the_drivers_output_is_teed_into_the_attempts_logs(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "exp1"
    log = follow.DriverLog(str(run_dir), 0.0)
    print("resolved config")
    print("run failed: infrastructure/worker_lost", file=sys.stderr)
    log.close()
    print("after the run")
    assert capsys.readouterr().out == "resolved config\nafter the run\n"  # still shown where it was
    text = (run_dir / "logs" / "19700101T000000Z" / "driver.log").read_text()
    assert text.endswith("resolved config\nrun failed: infrastructure/worker_lost\n") and "after" not in text
