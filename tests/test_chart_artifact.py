"""The chart as an artifact: what `helm package` puts in it, and whether a release of it fits where Helm keeps it.

Helm stores every release, the chart's files included, in one Secret (its default storage driver): the release
as JSON, gzip-compressed at the best level, then base64 (helm's `pkg/storage/driver` `encodeRelease`). A Secret
holds at most 1 MiB, so a release over that is refused by the API server (`data: Too long`) while `helm template`
and `--dry-run` still pass. The release JSON here is helm's own: `helm install --dry-run=client -o json` prints
the release object it would store. The job package also travels in one ConfigMap (same 1 MiB limit).

The bytes that grow are the job package's, and the release holds them twice (as chart files and in the rendered
ConfigMap), so the release, not the ConfigMap, binds first: measured, release ~= 70 KB + 1.04 x the job's bytes.
The job's budget is three quarters of the limit and the release's seven eighths, so a job at its cap (786 KB)
gives a ~887 KB release with ~30 KB left for user values and templates. The job's tree ships as it is, one key
per file (docs/chart.md, "Release size", says why not a zip): 539 KB of job and a ~637 KB release when this was
written, so a growing job package or a stray file fails here, not at a user's install.
"""

from __future__ import annotations

import base64
import gzip
import json
import tarfile
from pathlib import Path

import pytest
import yaml
from chart_helpers import REPO, helm, profile_commands

OBJECT_LIMIT = 1024 * 1024
"""The API server's limit on a Secret's or ConfigMap's data (bytes)."""
JOB_BUDGET = OBJECT_LIMIT * 3 // 4
"""What the job ConfigMap may use of that limit."""
RELEASE_BUDGET = OBJECT_LIMIT * 7 // 8
"""What the release Secret may use of it: a job at its own budget fits, with room for values and templates."""
PACKAGE_TOP_LEVEL = {"Chart.yaml", "Chart.lock", "values.yaml", "values.schema.json", "README.md", ".helmignore",
                     "templates", "charts", "values", "job", "dashboards"}
"""Everything a package may hold at its top level: the chart, its profiles, the library subchart, the job, the
Grafana dashboard (monitoring.grafanaDashboard)."""


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("package")
    helm("package", str(REPO), "--destination", str(out))
    (tgz,) = out.glob("*.tgz")
    return tgz


def test_the_package_holds_only_the_chart_and_the_job(package):
    with tarfile.open(package) as tar:
        top_level = {Path(name).parts[1] for name in tar.getnames() if len(Path(name).parts) > 1}
    assert top_level - PACKAGE_TOP_LEVEL == set(), (
        f"{package.name} carries {sorted(top_level - PACKAGE_TOP_LEVEL)}: add them to .helmignore "
        "(benchmarks, raw runs and docs stay in the repository)")
    assert "job" in top_level and "templates" in top_level


def stored_release_bytes(release: dict) -> int:
    """Bytes of the release as helm's Secret driver stores it: base64(gzip(json), best compression)."""
    encoded = json.dumps(release, separators=(",", ":")).encode()
    return len(base64.b64encode(gzip.compress(encoded, compresslevel=9)))


def largest_files(release: dict, n: int = 5) -> list[tuple[str, int]]:
    files = release["chart"].get("files") or []
    return sorted(((f["name"], len(f["data"])) for f in files), key=lambda kv: -kv[1])[:n]


@pytest.mark.parametrize("args", profile_commands().values(), ids=profile_commands().keys())
def test_a_release_of_the_package_fits_in_its_secret(package, args):
    release = json.loads(helm("install", "exp1", str(package), "--namespace", "experiments",
                              "--dry-run=client", "--output", "json", *args).stdout)
    size = stored_release_bytes(release)
    assert size <= RELEASE_BUDGET, (f"the stored release is {size:,} bytes, over the budget of {RELEASE_BUDGET:,} "
                            f"(limit {OBJECT_LIMIT:,}); largest chart files (base64): {largest_files(release)}")


def test_the_job_configmap_fits_its_budget(package):
    release = json.loads(helm("install", "exp1", str(package), "--dry-run=client", "--output", "json").stdout)
    (job_files,) = [doc for doc in yaml.safe_load_all(release["manifest"])
                    if doc and doc["kind"] == "ConfigMap" and doc["metadata"]["name"].endswith("-job")]
    size = sum(len(value.encode()) for value in job_files["data"].values())
    assert size <= JOB_BUDGET, f"the job ConfigMap holds {size:,} bytes, over the budget of {JOB_BUDGET:,}"

