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


def finish(tracking_uri: str, run_dir: str, run_id: str, write_report: Callable[..., list[str]]) -> None:
    """Tags, artifacts and the end status from run.json (the driver, after the attempt); `write_report(run_dir, out,
    plots=False)` writes report.md into `out`. A failure here is one warning, never the run's."""
    from mlflow.entities import RunTag

    try:
        client = _client(tracking_uri)
        record = run_record.load_record(run_dir)
        error = record.get("error") or {}
        tags = {"status": record.get("status"), "failure_class": error.get("class"),
                "failure_reason": error.get("reason"), "image_digest": (record.get("image") or {}).get("digest"),
                "image": (record.get("image") or {}).get("reference"),
                "chart_version": (record.get("chart") or {}).get("version"),
                "values_sha256": (record.get("chart") or {}).get("values_sha256"),
                "config_sha256": record.get("config_sha256")}
        client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items() if v is not None])
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, run_record.RUN_RECORD), "w") as f:
                json.dump(record, f, indent=2, default=str)
            write_report(run_dir, tmp, plots=False)
            for name in (run_record.RUN_RECORD, "report.md"):
                client.log_artifact(run_id, os.path.join(tmp, name))
        status = END_STATUS.get(record.get("status"), "FAILED")
        client.set_terminated(run_id, status=status, end_time=int(time.time() * 1000))
    except Exception as e:
        print(f"warning: mlflow: cannot close run {run_id} at {tracking_uri} ({_one_line(e)}); the run's own "
              f"record is {storage.join(run_dir, run_record.RUN_RECORD)}", file=sys.stderr, flush=True)
