"""The driver follows its run and tells those who operate the cluster (docs/chart.md, "Watching a run"):

* its own output, teed into `<run_dir>/logs/<attempt>/driver.log` beside the workers' tracebacks (`DriverLog`);
* the run's progress as annotations on its RayJob, and what happens as Kubernetes Events on it (`RayJobReporter`),
  where the chart names the RayJob (`JOB_RAYJOB`);
* the fine-tune's numbers as Ray metrics (`RunMetrics`), which the head's Ray node exports on its metrics port,
  labelled with the run's name, for Prometheus.

The driver, not a part of the loop, does it: it outlives every worker (a lost rank 0 cannot tell of its own loss;
the driver sees it, and the verdict), it lives in the head pod, which a run keeps from start to end, and it already
watches the run. So one process, with the head's service account, writes to the API server, and the loop pays
nothing per step: `Follower` reads what rank 0 records (metrics.jsonl, run.json) every `FOLLOW_EVERY_S` in a daemon
thread. Nothing here can fail the run: a missing API server, token or permission is one warning, and the
reporting stops; a request that fails is retried at most twice.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
import sys
import tempfile
import threading
import time

from .. import storage
from ..common import kubeapi
from ..records import failures, run_record

FOLLOW_EVERY_S = 5.0
"""How often the follower reads the run's records: annotations and metrics trail a logged step by at most this
(plus Ray's 10 s metrics export)."""
ANNOTATION_PREFIX = "ray-finetune/"
RAYJOB_ENV = "JOB_RAYJOB"
"""The RayJob the driver reports on (the chart sets it with `monitoring.rayJob`); unset: no reporting."""
COMPONENT = "ray-finetune-driver"
DRIVER_LOG = "driver.log"


def _iso(at: float, micro: bool = False) -> str:
    text = _dt.datetime.fromtimestamp(at, _dt.timezone.utc).isoformat(timespec="microseconds" if micro else "seconds")
    return text.replace("+00:00", "Z")


def _epoch(iso: str | None) -> float:
    """An ISO time as epoch seconds; an unknown one as long ago."""
    try:
        return _dt.datetime.fromisoformat(iso).timestamp()
    except (TypeError, ValueError):
        return -math.inf


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    return (f"{hours}h" if hours else "") + f"{rest // 60}m{rest % 60:02d}s"


def event_reason(err: dict | None) -> str:
    """An Event's reason for a run's `error`: its reason in CamelCase (`worker_lost` -> `WorkerLost`), for a plain
    `exception` its class (`DataError`, `ConfigError`, `UnknownError`), `Cancelled` for a cancelled run."""
    err = err or {}
    reason = err.get("reason") or "exception"
    if err.get("class") == "cancelled":
        return "Cancelled"
    if reason == "exception":
        reason = f"{err.get('class') or 'unknown'}_error"
    return "".join(part.capitalize() for part in reason.split("_"))


class Progress:
    """What the run's records have said so far, as annotations (`annotations`) and numbers (`RunMetrics`)."""

    def __init__(self, run_dir: str, max_steps: int):
        self.run_dir, self.max_steps = run_dir, max_steps
        self.state = "starting"
        self.step = self.loss = self.eval_loss = self.eval_step = self.goodput = None
        self.tokens_per_s = self.mfu = self.blocking_s = None
        self.phases: dict[str, float] = {}
        self.task: str | None = None
        self.task_first = self.task_now = None
        self.pace: tuple[float, int] | None = None
        """(time, step) of the attempt's first train record: the ETA's rate."""
        self.at: float | None = None

    def add(self, row: dict) -> None:
        kind, at = row.get("kind"), row.get("time")
        if kind == "start":
            self.state, self.pace = "running", None
        elif kind == "train":
            self.step, self.loss, self.at = row.get("step"), row.get("loss"), at
            self.tokens_per_s, self.mfu = row.get("tokens_per_s"), row.get("mfu")
            self.goodput = row.get("goodput", self.goodput)
            self.phases = row.get("phases_s") or self.phases
            self.pace = self.pace or (at, row.get("step"))
        elif kind == "eval":
            self.eval_loss, self.eval_step = row.get("eval_loss"), row.get("step")
        elif kind == "task_eval":
            self.task, self.task_now = row.get("task"), row.get("exact_match")
            self.task_first = self.task_now if self.task_first is None else self.task_first
        elif kind == "checkpoint":
            self.blocking_s = row.get("blocking_s")
        elif kind == "time":
            self.goodput, self.phases = row.get("goodput"), row.get("phases_s") or self.phases

    def eta_s(self) -> float | None:
        if not (self.pace and self.step and self.at) or self.step <= self.pace[1] or self.at <= self.pace[0]:
            return None
        return (self.max_steps - self.step) * (self.at - self.pace[0]) / (self.step - self.pace[1])

    def annotations(self, now: float) -> dict[str, str | None]:
        """The RayJob's annotations (None removes one the run no longer has)."""
        pct = lambda v: None if v is None else f"{v:.1%}"  # noqa: E731
        num = lambda v: None if v is None else f"{v:.4g}"  # noqa: E731
        eta = self.eta_s() if self.state == "running" else None
        task = None if self.task is None else f"{self.task} {pct(self.task_now)} (from {pct(self.task_first)})"
        values = {
            "state": self.state,
            "step": None if self.step is None else f"{self.step}/{self.max_steps}",
            "progress": None if self.step is None else f"{self.step / self.max_steps:.0%}",
            "eta": None if eta is None else f"{_iso(now + eta)} (in {_duration(eta)})",
            "train-loss": num(self.loss),
            "eval-loss": None if self.eval_loss is None else f"{self.eval_loss:.4g} (step {self.eval_step})",
            "task-score": task,
            "goodput": pct(self.goodput),
            "run-dir": self.run_dir,
            "updated": _iso(now),
        }
        return {ANNOTATION_PREFIX + k: v for k, v in values.items()}


def story(row: dict, record: dict | None) -> list[tuple[str, str, str]]:
    """The Events (type, reason, message) a new metrics record tells; `record` is run.json's newest, whose last
    previous attempt is why a resumed attempt resumes: its failure is told first, its class the reason."""
    kind, step = row.get("kind"), row.get("step")
    if kind == "start" and not row.get("start_step"):
        return [("Normal", "Started", f"training from step 0, {row.get('world_size')} workers, "
                                      f"{row.get('params', 0) / 1e6:.1f}M parameters ({row.get('method')})")]
    if kind == "resume":
        events, why = [], "a re-run of the same run name"
        attempts = (record or {}).get("previous_attempts") or []  # the newest record's: later ones may have ended
        ended = [a for a in attempts if _epoch(a.get("ended_at")) <= row.get("time", math.inf)]
        previous = (ended or attempts or [None])[-1]
        if previous:
            err = previous.get("error")
            if previous.get("status") == "interrupted" and not err:  # its process died without a word
                err = failures.error("infrastructure", "worker_lost", "an attempt's process died without closing "
                                     "its record (its pod deleted, killed, out of memory)", step=previous.get("steps"))
            why = f"the previous attempt ended {previous.get('status')}"
            if err:
                events.append(("Warning", event_reason(err), f"the attempt started {previous.get('started_at')} "
                                                             f"ended {previous.get('status')}: {failures.one_line(err)}"))
        events.append(("Normal", "Resumed", f"from step {step} ({row.get('checkpoint')}) after {why}"))
        return events
    if kind == "checkpoint":
        return [("Normal", "CheckpointSaved", f"step {step} complete in {row.get('dir')} (write "
                                              f"{row.get('write_s') or 0:.1f} s, training held {row.get('blocking_s') or 0:.1f} s)")]
    if kind == "eval":
        return [("Normal", "Evaluated", f"step {step}: held-out loss {row['eval_loss']:.4f} "
                                        f"(perplexity {row.get('eval_ppl', 0):.4g})")]
    if kind == "task_eval":
        return [("Normal", "TaskEvaluated", f"step {step}: {row.get('task')} exact match {row['exact_match']:.1%} "
                                            f"of {row.get('n')}")]
    if kind == "export":
        return [("Normal", "ExportAccepted", f"{row.get('dir')}: reloaded held-out loss {row['eval_loss']:.4f}, "
                                             f"training's {row.get('reference_eval_loss') or 0:.4f}")]
    return []


class RayJobReporter:
    """Annotations and Events on one RayJob, through the API server (`kubeapi`): needs `patch` on the RayJob and
    `create` on events (the chart's Role with `monitoring.rayJob`). After the first failure one warning; after a
    refusal (no permission, no such RayJob), no API server or three failed calls, it stops."""

    def __init__(self, api: kubeapi.InCluster, namespace: str, name: str, pod: str | None = None):
        self.api, self.namespace, self.name, self.pod = api, namespace, name, pod or COMPONENT
        self.path = f"/apis/ray.io/v1/namespaces/{namespace}/rayjobs/{name}"
        self.uid: str | None = None
        self.failed = 0
        self.off = False

    @classmethod
    def in_cluster(cls, env) -> RayJobReporter:
        """The reporter of the RayJob `JOB_RAYJOB` names; `kubeapi.ApiError` without one or outside Kubernetes."""
        if not env.get(RAYJOB_ENV):
            raise kubeapi.ApiError(f"{RAYJOB_ENV} unset")
        return cls(kubeapi.InCluster.from_env(env), kubeapi.pod_namespace(env) or "default", env[RAYJOB_ENV],
                   env.get("POD_NAME"))

    @classmethod
    def from_env(cls, env=None) -> RayJobReporter | None:
        """The reporter of the RayJob `JOB_RAYJOB` names, or None without one; outside Kubernetes one warning."""
        env = os.environ if env is None else env
        if not env.get(RAYJOB_ENV):
            return None
        try:
            return cls.in_cluster(env)
        except kubeapi.ApiError as e:
            print(f"warning: RayJob {env[RAYJOB_ENV]}: no annotations or Events: {e}", flush=True)
            return None

    def _call(self, method: str, path: str, body: dict, content_type: str = "application/json") -> dict | None:
        if self.off:
            return None
        for attempt in range(3):
            try:
                answer = self.api.request(method, path, body, content_type=content_type)
                self.failed = 0
                return answer
            except kubeapi.ApiError as e:
                error = e
                if not e.retry:
                    break
                time.sleep(0.5 * (attempt + 1))
        self.failed += 1
        self.off = not error.retry or self.failed >= 3
        if self.failed == 1 or self.off:
            then = ("reporting stops" if error.status not in (401, 403) else
                    "reporting stops (the service account needs `patch` on it and `create` on events: "
                    "monitoring.rayJob)") if self.off else "retrying at the next update"
            print(f"warning: RayJob {self.namespace}/{self.name}: {error}; {then}", flush=True)
        return None

    def check_submission(self, env=None) -> None:
        """Reporting stops when the RayJob runs another submission than this driver's (another job on the warm
        cluster, whose head has the chart's RayJob in its environment); keeps its uid for the Events."""
        job = self._call("GET", self.path, None) or {}
        self.uid = (job.get("metadata") or {}).get("uid")
        env = os.environ if env is None else env
        try:
            mine = json.loads(env.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")).get("metadata", {}).get("job_submission_id")
        except ValueError:
            mine = None
        theirs = (job.get("status") or {}).get("jobId")
        if mine and theirs and mine != theirs:
            print(f"RayJob {self.name} runs submission {theirs}, not this driver's ({mine}): no annotations or "
                  "Events on it", flush=True)
            self.off = True

    def annotate(self, annotations: dict[str, str | None]) -> None:
        self._call("PATCH", self.path, {"metadata": {"annotations": annotations}},
                   content_type="application/merge-patch+json")

    def event(self, kind: str, reason: str, message: str) -> None:
        now = time.time()
        body = {
            "metadata": {"name": f"{self.name}.{time.time_ns():x}", "namespace": self.namespace},
            "involvedObject": {"apiVersion": "ray.io/v1", "kind": "RayJob", "name": self.name,
                               "namespace": self.namespace, **({"uid": self.uid} if self.uid else {})},
            "type": kind, "reason": reason, "message": message[:1000], "action": "Train", "count": 1,
            "firstTimestamp": _iso(now), "lastTimestamp": _iso(now), "eventTime": _iso(now, micro=True),
            "source": {"component": COMPONENT}, "reportingComponent": COMPONENT, "reportingInstance": self.pod[:128],
        }
        self._call("POST", f"/api/v1/namespaces/{self.namespace}/events", body)


GAUGES = (("step", "last logged training step"), ("max_steps", "train.max_steps"),
          ("train_loss", "training loss of the last log interval"), ("eval_loss", "last held-out loss"),
          ("tokens_per_second", "training tokens per second, all workers"), ("mfu", "model FLOPs utilisation"),
          ("goodput", "training time / wall time of the attempt so far"),
          ("checkpoint_blocking_seconds", "training time the last checkpoint held up"),
          ("eta_seconds", "estimated time to the last step"))
"""`finetune_<name>{run}` (Ray adds `ray_`), besides `finetune_task_score{run, task}` and
`finetune_phase_seconds{run, phase}`: what dashboards/ray-finetune.json plots."""


class RunMetrics:
    """The run's numbers as Ray gauges (`ray_finetune_*{run=...}` on the node's metrics port), set again at every
    follow: Ray drops a gauge not recorded within two export intervals."""

    def __init__(self, run_name: str):
        from ray.util.metrics import Gauge  # here: only a driver under Ray has metrics to export

        def gauge(name: str, about: str, *tags: str) -> Gauge:
            g = Gauge(f"finetune_{name}", about, tag_keys=("run", *tags))
            g.set_default_tags({"run": run_name})
            return g

        self.gauges = {name: gauge(name, about) for name, about in GAUGES}
        self.task = gauge("task_score", "task exact match (eval.task)", "task")
        self.phases = gauge("phase_seconds", "seconds of the attempt in each phase", "phase")

    def update(self, p: Progress) -> None:
        values = {"step": p.step, "max_steps": p.max_steps, "train_loss": p.loss, "eval_loss": p.eval_loss,
                  "tokens_per_second": p.tokens_per_s, "mfu": p.mfu, "goodput": p.goodput,
                  "checkpoint_blocking_seconds": p.blocking_s, "eta_seconds": p.eta_s()}
        for name, value in values.items():
            if isinstance(value, (int, float)):
                self.gauges[name].set(value)
        if p.task is not None and p.task_now is not None:
            self.task.set(p.task_now, tags={"task": p.task})
        for phase, seconds in p.phases.items():
            self.phases.set(seconds, tags={"phase": phase})


class Follower:
    """The driver's follow of its run from its start (`since`): a thread reading the records every
    `FOLLOW_EVERY_S`, feeding `Progress` to the RayJob (`reporter`, may be None) and to Ray's metrics (once Ray is
    connected); `stop` reads the last records, `ended` tells the ending."""

    def __init__(self, run_dir: str, run_name: str, max_steps: int, since: float,
                 reporter: RayJobReporter | None):
        self.run_dir, self.run_name, self.since, self.reporter = run_dir, run_name, since, reporter
        self.progress = Progress(run_dir, max_steps)
        self.seen = 0.0
        """The time of the last record read."""
        self.metrics: RunMetrics | None = None
        self._warned: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="job-follow", daemon=True)
        self._lock = threading.Lock()
        self._checked = False

    def start(self) -> Follower:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(FOLLOW_EVERY_S):
            self.follow()

    def _check(self) -> None:
        """At the first report, in the thread where one runs: the RayJob's submission checked, the run's state."""
        if self.reporter and not self._checked:
            self._checked = True
            self.reporter.check_submission()
            self.reporter.annotate(self.progress.annotations(time.time()))

    def follow(self) -> None:
        """Reads the records logged since the last read and tells what they say; never raises."""
        with self._lock:
            try:
                self._check()
                self._follow()
            except Exception as e:  # noqa: BLE001 -- following must never end the run
                self.warn(f"following {self.run_dir}: {type(e).__name__}: {e}")

    def warn(self, message: str) -> None:
        """One warning per kind of trouble, not one per follow."""
        if message not in self._warned:
            self._warned.add(message)
            print(f"warning: {message}", flush=True)

    def _follow(self) -> None:
        try:
            rows = [r for r in run_record.read_metrics(self.run_dir) if (r.get("time") or 0) > self.seen]
        except FileNotFoundError:
            rows = []
        record = None
        for row in rows:
            self.progress.add(row)
            self.seen = max(self.seen, row["time"])
            if self.reporter and row["time"] >= self.since:
                if row.get("kind") == "resume" and record is None:
                    try:
                        record = run_record.load_latest(self.run_dir)
                    except (OSError, ValueError):
                        record = {}
                for kind, reason, message in story(row, record):
                    self.reporter.event(kind, reason, message)
        if self.seen < self.since:  # only earlier attempts' records so far: this one is starting
            self.progress.state = "starting"
        if self.reporter and rows:
            self.reporter.annotate(self.progress.annotations(time.time()))
        if self.metrics is None and "metrics" not in self._warned and _ray_connected():
            try:
                self.metrics = RunMetrics(self.run_name)
            except Exception as e:  # noqa: BLE001 -- a Ray without metrics: the run goes on without them
                self._warned.add("metrics")
                self.warn(f"no Ray metrics of the run: {type(e).__name__}: {e}")
        if self.metrics is not None:
            self.metrics.update(self.progress)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.follow()

    def ended(self, status: str, err: dict | None = None, message: str | None = None) -> None:
        """The run's ending on the RayJob: its state annotation and an Event (`Succeeded`, with `message` or the
        last step, loss and goodput; or the failure's class as the reason and its cause as the message)."""
        if not self.reporter:
            return
        with self._lock:
            try:
                self._check()
                p = self.progress
                p.state = f"{status}: {err.get('class')}/{err.get('reason')}" if err else status
                self.reporter.annotate(p.annotations(time.time()))
                if status != "succeeded":
                    self.reporter.event("Warning", event_reason(err), message or failures.one_line(err) or status)
                    return
                done = [f"step {p.step}/{p.max_steps}"] if p.step is not None else []
                done += [f"train loss {p.loss:.4g}"] if isinstance(p.loss, (int, float)) else []
                done += [f"goodput {p.goodput:.1%}"] if isinstance(p.goodput, (int, float)) else []
                self.reporter.event("Normal", "Succeeded", message or f"{', '.join(done)}; run directory {self.run_dir}")
            except Exception as e:  # noqa: BLE001 -- the run's ending is already decided
                self.warn(f"telling the run's ending on its RayJob: {type(e).__name__}: {e}")


def _ray_connected() -> bool:
    ray = sys.modules.get("ray")  # imported by the driver when it connects; never imported here
    return ray is not None and ray.is_initialized()


class _Tee:
    """A text stream that also writes to the driver's log."""

    def __init__(self, stream, log: DriverLog):
        self._stream, self._log = stream, log

    def write(self, text: str) -> int:
        self._log.write(text)
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class DriverLog:
    """The driver's stdout and stderr, as the submitter showed them, also in `<run_dir>/logs/<stamp>/driver.log`
    (`failures.attempt_logs`: beside the workers' tracebacks of the same attempt), so they outlive the pods. Written
    as it comes on a volume; on object storage kept locally and uploaded at `close` (the run's end or failure).
    Output written by Ray's or other libraries' C++ code to the file descriptors directly is not in it."""

    def __init__(self, run_dir: str, started_at: float):
        self.path = storage.join(failures.attempt_logs(run_dir, started_at), DRIVER_LOG)
        self.remote = storage.is_remote(self.path)
        try:
            if self.remote:
                fd, self.local = tempfile.mkstemp(prefix="driver-", suffix=".log")
                os.close(fd)
            else:
                self.local = storage.local_path(self.path)
                os.makedirs(os.path.dirname(self.local), exist_ok=True)
            self._file = open(self.local, "a", encoding="utf-8", errors="replace", buffering=1)
        except OSError as e:  # the run goes on; its output is still where it was
            print(f"warning: cannot keep the driver's output in {self.path}: {e}", file=sys.stderr, flush=True)
            self._file = open(os.devnull, "w", encoding="utf-8")
            self.remote = False
        self._lock = threading.Lock()
        self._streams = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(sys.stdout, self), _Tee(sys.stderr, self)
        self._handlers = [h for h in _stream_handlers() if h.stream in self._streams]
        for handler in self._handlers:  # Ray's logger holds the stream it was configured with
            handler.setStream(sys.stdout if handler.stream is self._streams[0] else sys.stderr)
        self.write(f"{_iso(time.time())} driver pid {os.getpid()} on {os.environ.get('POD_NAME') or os.uname().nodename}\n")

    def write(self, text: str) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write(text)

    def close(self) -> None:
        """Puts the streams back, closes the file and, on object storage, uploads it (a failure said, not raised)."""
        for handler in self._handlers:
            handler.setStream(self._streams[0] if handler.stream is sys.stdout else self._streams[1])
        sys.stdout, sys.stderr = self._streams
        with self._lock:
            self._file.close()
        if self.remote:
            try:
                with open(self.local, "rb") as f:
                    storage.write_atomic(self.path, f.read())
                os.remove(self.local)
            except Exception as e:  # noqa: BLE001 -- the run's ending is already out; the log is extra
                print(f"cannot write {self.path}: {type(e).__name__}: {e} (kept at {self.local})", file=sys.stderr)


def _stream_handlers() -> list[logging.StreamHandler]:
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]
    return [h for lg in loggers if isinstance(lg, logging.Logger) for h in lg.handlers
            if type(h) is logging.StreamHandler]
