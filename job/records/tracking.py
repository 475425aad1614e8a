"""MLflow tracking (`logging.mlflow`): one MLflow run per run, named after it, continued by every attempt.

* The driver, before any worker starts (`start`): creates the run (and experiment) with the flattened config as
  params, or continues the one `mlflow.json` names; an unreachable server stops the run there, naming
  `logging.mlflow.tracking_uri`.
* Rank 0 (`MlflowMetrics`, a `metrics.MetricsLogger` sink): every number of every record at its step. A server that
  stops answering gets one warning and no more calls from this attempt: training never waits on it. A step
  recomputed after a resume is logged again, so MLflow has each attempt's (the later is the run's).
* The driver, after the attempt (`finish`): tags from run.json, run.json and report.md as artifacts, the end
  status. Params stay the first attempt's (MLflow keeps a param's first value).

mlflow is imported only here, only when configured. HTTP retries are cut to none and the timeout to 10 s (unless
`MLFLOW_HTTP_REQUEST_*` are set), so a dead server costs one call, not minutes of back-off.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Callable

from .. import config as config_lib
from .. import packages, storage
from . import run_record

RUN_FILE = "mlflow.json"
"""In the run directory: `{"tracking_uri", "experiment_id", "run_id"}` of the run's MLflow run."""
END_STATUS = {"succeeded": "FINISHED", "failed": "FAILED", "cancelled": "KILLED", "abandoned": "FAILED"}


def _client(tracking_uri: str):
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    mlflow = packages.require("mlflow", f"logging.mlflow.tracking_uri: {tracking_uri}")
    return mlflow.MlflowClient(tracking_uri=tracking_uri)


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def start(cfg: config_lib.RunConfig, run_dir: str) -> str:
    """This run's MLflow run id, created or continued; `ConfigError` when the server cannot be reached."""
    from mlflow.entities import Param, RunStatus

    uri, path = cfg.logging.mlflow.tracking_uri, storage.join(run_dir, RUN_FILE)
    client = _client(uri)
    saved = json.loads(storage.read_text(path)) if storage.exists(path) else None
    try:
        if saved and saved["tracking_uri"] == uri:
            client.update_run(saved["run_id"], status=RunStatus.to_string(RunStatus.RUNNING))
            return saved["run_id"]
        experiment = client.get_experiment_by_name(cfg.logging.mlflow.experiment)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(
            cfg.logging.mlflow.experiment)
        run_id = client.create_run(experiment_id, run_name=cfg.name, tags={"run_dir": run_dir}).info.run_id
        params = [Param(k, json.dumps(v) if isinstance(v, (dict, list)) else str(v))
                  for k, v in run_record.flatten(config_lib.to_dict(cfg)).items()]
        for i in range(0, len(params), 100):  # MLflow's batch limit
            client.log_batch(run_id, params=params[i:i + 100])
    except Exception as e:  # requests' connection errors, MlflowException (bad URI, server errors)
        raise config_lib.ConfigError(f"logging.mlflow.tracking_uri: the MLflow server at {uri} did not answer "
                                     f"({_one_line(e)})") from None
    storage.write_atomic(path, json.dumps({"tracking_uri": uri, "experiment_id": experiment_id, "run_id": run_id}))
    print(f"mlflow: run {run_id} in experiment {cfg.logging.mlflow.experiment!r} at {uri}", flush=True)
    return run_id


class MlflowMetrics:
    """Rank 0's metrics sink: each record's numbers at its step; after the first failed call, none (one warning)."""

    def __init__(self, tracking_uri: str, run_id: str):
        self.client, self.run_id, self.failed = _client(tracking_uri), run_id, False

    def log(self, step: int, values: dict[str, float], at: float) -> None:
        from mlflow.entities import Metric

        if self.failed or not values:
            return
        try:
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, int(at * 1000), step) for k, v in values.items()])
        except Exception as e:
            self.failed = True
            print(f"warning: mlflow: logging at step {step} failed ({_one_line(e)}); training goes on, this attempt "
                  "logs no more to MLflow (metrics.jsonl and the TensorBoard files have every step)",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


CLOSE_WITHIN_S = 60.0
CLOSE_WAIT_S = 3.0
"""How long the driver keeps asking a server that does not answer to take the run's end, and how far apart: a
server back from an outage may take seconds to answer again, and a run it never hears the end of stays RUNNING."""


def finish(tracking_uri: str, run_dir: str, run_id: str, write_report: Callable[..., list[str]]) -> None:
    """The run's end status from the record first, then its tags and artifacts (run.json, report.md:
    `write_report(run_dir, out, plots=False)`), each asked again until `CLOSE_WITHIN_S` has passed (the driver,
    after the attempt); once one is not taken by then, the server counts as gone and the rest are not asked. What
    was not set is one warning, never the run's failure."""
    from mlflow.entities import RunTag

    failed = []
    try:
        record = run_record.load_record(run_dir)
    except (OSError, ValueError) as e:
        record, failed = {}, [f"run.json ({_one_line(e)})"]
    error, image, chart = record.get("error") or {}, record.get("image") or {}, record.get("chart") or {}
    tags = {"status": record.get("status"), "failure_class": error.get("class"), "failure_reason": error.get("reason"),
            "image_digest": image.get("digest"), "image": image.get("reference"), "chart_version": chart.get("version"),
            "values_sha256": chart.get("values_sha256"), "config_sha256": record.get("config_sha256")}
    status = END_STATUS.get(record.get("status"), "FAILED")

    def artifacts(client) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, run_record.RUN_RECORD), "w") as f:
                json.dump(record, f, indent=2, default=str)
            write_report(run_dir, tmp, plots=False)
            for name in (run_record.RUN_RECORD, "report.md"):
                client.log_artifact(run_id, os.path.join(tmp, name))

    steps = [(f"status {status}", lambda c: c.set_terminated(run_id, status=status, end_time=int(time.time() * 1000))),
             ("tags", lambda c: c.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items() if v is not None])),
             *([("artifacts", artifacts)] if record else [])]
    deadline = time.monotonic() + CLOSE_WITHIN_S
    for i, (what, step) in enumerate(steps):
        if (refused := _asked_until(deadline, lambda: step(_client(tracking_uri)))) is not None:
            failed += [f"{what} ({_one_line(refused)})", *(later for later, _ in steps[i + 1:])]
            break
    if failed:
        print(f"warning: mlflow: run {run_id} at {tracking_uri}: not set: {'; '.join(failed)}; the run's own record "
              f"is {storage.join(run_dir, run_record.RUN_RECORD)}", file=sys.stderr, flush=True)


def _asked_until(deadline: float, call: Callable[[], object]) -> Exception | None:
    """`call()` until it returns (None) or `deadline` (monotonic seconds) is near: its last error."""
    while True:
        try:
            call()
            return None
        except Exception as e:  # requests' connection errors, MlflowException
            if time.monotonic() + CLOSE_WAIT_S >= deadline:
                return e
            time.sleep(CLOSE_WAIT_S)
