"""Local paths and URIs: `file://` is a local path everywhere (storage, resolved config, run directory)."""

import pytest

from job import config as config_lib
from job.driver import launch
from job import storage


@pytest.mark.parametrize("uri, remote", [
    ("s3://bucket/runs", True), ("memory://runs", True), ("hf://datasets/owner/name", True),
    ("/mnt/runs", False), ("runs", False), ("file:///mnt/runs", False), ("file://runs", False),
])
def test_only_non_file_uris_are_remote(uri, remote):
    assert storage.is_remote(uri) is remote


def test_file_uris_resolve_to_the_os_paths_they_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    cfg = config_lib.RunConfig(name="run", storage_path="file://runs")
    cfg.data.train = config_lib.SourceConfig(f"file://{tmp_path}/train.jsonl")
    cfg.data.validation = config_lib.SourceConfig("hf:owner/name")
    cfg.checkpoint.resume = "s3://bucket/other/checkpoint_00000010"
    cfg.model.path = "file://model"
    resolved = launch.resolve_paths(cfg)
    assert resolved.storage_path == str(tmp_path / "runs")
    assert resolved.data.train.path == str(tmp_path / "train.jsonl")
    assert resolved.data.validation.path == "hf:owner/name"
    assert resolved.checkpoint.resume == "s3://bucket/other/checkpoint_00000010"
    assert resolved.model.path == str(tmp_path / "model")
    assert launch.run_directory(cfg) == launch.run_directory(resolved) == f"{tmp_path}/runs/run"


def test_atomic_write_to_a_file_uri_writes_the_local_file(tmp_path):
    storage.write_atomic(f"file://{tmp_path}/a/run.json", "{}")
    assert (tmp_path / "a" / "run.json").read_text() == "{}"
    assert storage.read_text(f"file://{tmp_path}/a/run.json") == "{}"
