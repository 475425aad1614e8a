"""MLflow tracking (`job/records/tracking.py`) against a real tracking server on loopback (`servers.mlflow_server`: SQLite
store): a missing package or an unreachable server is one line at start; a server that dies mid-run costs one
warning and never the training. The run's own MLflow run, over a killed and resumed run, is checked in
test_failures.py (`check_mlflow_run`)."""

import os
import signal
import sys

import pytest

from conftest import tiny_run_config
from job import config as config_lib
from job.driver import launch
from job import packages
from job.commands import report
from job.records import tracking
from servers import free_port, mlflow_server


def _config(tmp_path, tracking_uri: str) -> config_lib.RunConfig:
    return config_lib.load_dict(tiny_run_config(tmp_path, logging={"mlflow": {"tracking_uri": tracking_uri,
                                                                              "experiment": "unit"}}))


def test_a_missing_mlflow_is_one_config_error_naming_the_field_and_the_pin(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(packages.MissingPackage) as raised:
        packages.check_config(_config(tmp_path, "http://mlflow:5000"))
    message = str(raised.value)
    assert message.startswith("logging.mlflow.tracking_uri: http://mlflow:5000 needs the Python package 'mlflow'")
    assert f'runtimeEnv: {{pip: ["mlflow-skinny=={packages.MLFLOW_VERSION}"]}}' in message


def test_an_unreachable_server_stops_the_run_before_any_worker(tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = _config(tmp_path, uri)
    with pytest.raises(config_lib.ConfigError) as raised:
        launch.prepare(cfg, launch.run_directory(cfg))
    [message] = raised.value.messages
    assert message.startswith(f"logging.mlflow.tracking_uri: the MLflow server at {uri} did not answer (")
    assert "\n" not in message


def test_a_server_that_dies_mid_run_warns_once_and_never_fails_the_run(tmp_path, capsys):
    import mlflow

    with mlflow_server(tmp_path / "mlflow") as server:
        cfg = _config(tmp_path, str(server))
        run_dir = launch.run_directory(cfg)
        run_id = tracking.start(cfg, run_dir)
        assert tracking.start(cfg, run_dir) == run_id  # a second attempt continues the run (mlflow.json)
        sink = tracking.MlflowMetrics(str(server), run_id)
        sink.log(1, {"train/loss": 2.5}, 1000.0)
        [point] = mlflow.MlflowClient(str(server)).get_metric_history(run_id, "train/loss")
        assert (point.step, point.value, point.timestamp) == (1, 2.5, 1_000_000)
        os.killpg(server.process.pid, signal.SIGKILL)  # the server and its workers, gone at once
        server.process.wait(timeout=30)
        capsys.readouterr()
        for step in (2, 3):
            sink.log(step, {"train/loss": 2.0}, 1001.0)
        tracking.finish(str(server), run_dir, run_id, report.write_report)  # no run.json, no server: one warning
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert err[0].startswith("warning: mlflow: logging at step 2 failed (") and "training goes on" in err[0]
    assert err[1].startswith(f"warning: mlflow: cannot close run {run_id} at {server}")
