"""MLflow tracking (`job/records/tracking.py`) against a real tracking server on loopback (`servers.mlflow_server`: SQLite
store): a missing package or an unreachable server is one line at start; a server that dies mid-run costs one
warning and never the training. The run's own MLflow run, over a killed and resumed run, is checked in
test_failures.py (`check_mlflow_run`)."""

import contextlib
import os
import signal
import sys

import pytest

from conftest import tiny_run_config
from job import config as config_lib
from job.driver import launch
from job import packages
from job.commands import report
from job.records import run_record, tracking
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


def test_a_server_that_dies_mid_run_warns_once_and_never_fails_the_run(tmp_path, capsys, monkeypatch):
    import mlflow

    monkeypatch.setattr(tracking, "CLOSE_WITHIN_S", 0.5)  # the server stays gone: asked once more at most

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
    assert err[1].startswith(f"warning: mlflow: run {run_id} at {server}: not set: run.json (FileNotFoundError: no "
                             "run.json at") and "status FAILED (" in err[1] and err[1].endswith("tags; the run's own "
                                                                                             f"record is {run_dir}/run.json")


def test_a_server_back_before_the_run_ends_gets_its_end_and_no_second_warning(tmp_path, capsys):
    """Down for part of the run (the sink's one warning), back at its end, slow to answer: the driver asks again
    until the server takes the run's end status, tags and artifacts; no second warning."""
    import threading

    import mlflow

    cfg = None
    with mlflow_server(tmp_path / "mlflow") as server:
        cfg = _config(tmp_path, str(server))
        run_dir = launch.run_directory(cfg)
        run_id = tracking.start(cfg, run_dir)
        sink = tracking.MlflowMetrics(str(server), run_id)
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=30)
        sink.log(1, {"train/loss": 2.0}, 1001.0)
    record = run_record.start_record(run_dir, config=config_lib.to_dict(cfg), config_text="x", seed=0)
    run_record.finish_record(run_dir, record, metrics={"steps": 1})
    port = int(server.rsplit(":", 1)[1])
    back = contextlib.ExitStack()
    restart = threading.Timer(2.0, lambda: back.enter_context(mlflow_server(tmp_path / "mlflow", port)))
    restart.start()  # while the driver is already asking
    try:
        tracking.finish(str(server), run_dir, run_id, report.write_report)
        restart.join()
        run = mlflow.MlflowClient(str(server)).get_run(run_id)
        assert run.info.status == "FINISHED" and run.data.tags["status"] == "succeeded"
        assert {a.path for a in mlflow.MlflowClient(str(server)).list_artifacts(run_id)} == {"run.json", "report.md"}
    finally:
        restart.join()
        back.close()
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert len(err) == 1 and err[0].startswith("warning: mlflow: logging at step 1 failed"), err
