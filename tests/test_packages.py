"""Optional packages (s3fs, datasets): a run that needs a missing one fails on the driver with one message naming
the package, the field and the runtimeEnv line that adds it; features that do not need it work without it.

A missing package is simulated with `sys.modules[name] = None`, which makes `import name` fail as if it were
not installed.
"""

import importlib.metadata
import re
import subprocess
import sys

import pytest

from conftest import REPO, tiny_run_config
from job import config as config_lib
from job import packages, storage
from job.common import sources
from job.config import SourceConfig

pytestmark = pytest.mark.image_set

HIDE_AND_RUN = "import sys; sys.modules[{module!r}] = None; from job.__main__ import main; sys.exit(main(sys.argv[1:]))"


def run_cli_without(module: str, tmp_path, **sections) -> subprocess.CompletedProcess:
    config = tmp_path / "run.yaml"
    config.write_text(config_lib.to_yaml(config_lib.load_dict(tiny_run_config(tmp_path, **sections))))
    return subprocess.run([sys.executable, "-c", HIDE_AND_RUN.format(module=module), "--config", str(config)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_s3_storage_without_s3fs_fails_at_config_time_with_the_fix(tmp_path):
    proc = run_cli_without("s3fs", tmp_path, storage_path="s3://bucket/runs")
    assert proc.returncode == 2 and proc.stdout == ""  # before the resolved config is printed or Ray starts
    fsspec_version = importlib.metadata.version("fsspec")
    assert proc.stderr.strip() == (
        "config error: storage_path: s3://bucket/runs needs the Python package 's3fs', which this environment "
        "does not have. Add it to the Ray runtime env in the chart's values, "
        f"`runtimeEnv: {{pip: [\"s3fs=={fsspec_version}\"]}}` (every pod installs it at start), or to the image; "
        f"locally: pip install 's3fs=={fsspec_version}'")


def test_hub_source_without_datasets_fails_at_config_time(tmp_path):
    proc = run_cli_without("datasets", tmp_path, data={
        "format": "prompt_completion", "train": {"path": "hf:openai/gsm8k", "revision": "main", "subset": "main"},
        "columns": {"prompt": "question", "completion": "answer"}})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("config error: data.train: hub dataset hf:openai/gsm8k needs the Python package 'datasets'")
    assert f'runtimeEnv: {{pip: ["datasets=={packages.DATASETS_VERSION}"]}}' in proc.stderr


def test_use_sites_raise_the_same_error(monkeypatch, tmp_path):
    """Code paths that skip the driver's check (compare on s3://, a worker) still fail with the message."""
    monkeypatch.setitem(sys.modules, "s3fs", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(packages.MissingPackage, match=r"^storage: s3://bucket/run/run.json needs the Python package 's3fs'"):
        storage.read_text("s3://bucket/run/run.json")
    with pytest.raises(packages.MissingPackage, match=r"^data.train: s3://bucket/train.jsonl needs .*'s3fs'"):
        sources.load_source(SourceConfig("s3://bucket/train.jsonl"), "data.train")
    with pytest.raises(packages.MissingPackage, match=r"^data.validation: hub dataset hf:o/n needs .*'datasets'"):
        sources.load_source(SourceConfig("hf:o/n", revision="main"), "data.validation")
    # Local storage, local files (Parquet included: pyarrow comes with ray[train]) need neither package.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["one", "two"]}), tmp_path / "docs.parquet")
    rows = sources.load_source(SourceConfig(str(tmp_path / "docs.parquet")), "data.train").rows
    assert [row for _, row in rows] == [{"text": "one"}, {"text": "two"}]
    storage.write_atomic(str(tmp_path / "x.json"), "{}")
    assert storage.read_text(str(tmp_path / "x.json")) == "{}"
    packages.check_config(config_lib.load_dict(tiny_run_config(tmp_path)))


def test_a_broken_package_is_not_reported_as_missing(monkeypatch, tmp_path):
    """Only the package itself missing is 'missing'; a dependency missing inside it keeps its own error."""
    (tmp_path / "half_installed").mkdir()
    (tmp_path / "half_installed" / "__init__.py").write_text("import its_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError) as info:
        packages.require("half_installed", "a feature")
    assert not isinstance(info.value, packages.MissingPackage) and info.value.name == "its_missing_dependency"


def test_datasets_fix_pins_what_requirements_txt_pins():
    pins = dict(re.findall(r"^([A-Za-z0-9_.\-\[\],]+)==(\S+)", (REPO / "requirements.txt").read_text(), re.M))
    assert packages.DATASETS_VERSION == pins["datasets"]
