"""Publishing the chart as users do: to an OCI registry and a classic chart repository, signed, and used from there.

Real servers on loopback: the OCI registry is go-containerregistry's `cmd/registry` (built from the Go module
proxy into a cache outside the repository the first time; a missing binary is built, never skipped), the classic
repository is an `index.yaml` made by `helm repo index` and served over HTTP. helm's own state (repositories,
cache, registry logins) lives in the test's temporary directory. Installs here are `--dry-run=client`: pulling,
verifying and rendering the published chart; tests/test_k8s_live.py installs and upgrades from the registry into
a live API server.
"""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml
from chart_helpers import REPO, helm
from servers import oci_registry, static_http

from job import __version__ as chart_version


@pytest.fixture(scope="module")
def registry(helm_home):
    with oci_registry() as address:
        yield address


@pytest.fixture(scope="module")
def chart_repository(tmp_path_factory, chart_package, helm_home):
    """A classic chart repository (index.yaml + package) served over HTTP on 127.0.0.1: its URL."""
    root = tmp_path_factory.mktemp("chart-repo")
    (root / chart_package.name).write_bytes(chart_package.read_bytes())
    with static_http(root) as url:
        helm("repo", "index", str(root), "--url", url)
        yield url


def installed_chart(*args: str) -> dict:
    """The chart metadata of a `helm install --dry-run=client` of the given chart reference."""
    out = helm("install", "exp1", *args, "--dry-run=client", "--output", "yaml").stdout
    return yaml.safe_load(out)["chart"]["metadata"]


def test_push_to_an_oci_registry_then_install_by_version(registry, chart_package):
    pushed = helm("push", str(chart_package), f"oci://{registry}/charts", "--plain-http")
    assert f"Pushed: {registry}/charts/ray-finetune:{chart_version}" in pushed.stdout + pushed.stderr
    metadata = installed_chart(f"oci://{registry}/charts/ray-finetune", "--version", chart_version, "--plain-http")
    assert metadata["version"] == chart_version
    missing = helm("install", "exp1", f"oci://{registry}/charts/ray-finetune", "--version", "9.9.9",
                   "--plain-http", "--dry-run=client", check=False)
    assert missing.returncode != 0 and "9.9.9" in missing.stderr


def test_a_classic_repository_lists_and_installs_the_chart(chart_repository):
    helm("repo", "add", "internal", chart_repository)
    found = helm("search", "repo", "internal/ray-finetune", "--version", chart_version, "--output", "yaml").stdout
    assert [entry["version"] for entry in yaml.safe_load(found)] == [chart_version]
    assert installed_chart("internal/ray-finetune", "--version", chart_version)["version"] == chart_version


def test_an_umbrella_chart_depends_on_the_published_chart(tmp_path, chart_repository):
    umbrella = tmp_path / "platform"
    (umbrella / "templates").mkdir(parents=True)
    (umbrella / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": "platform", "version": "1.0.0",
        "dependencies": [{"name": "ray-finetune", "version": chart_version, "repository": chart_repository}]}))
    (umbrella / "values.yaml").write_text(yaml.safe_dump({"ray-finetune": {"run": {"train": {"max_steps": 77}}}}))
    helm("dependency", "update", str(umbrella))
    assert (umbrella / "charts" / f"ray-finetune-{chart_version}.tgz").exists()
    objects = [doc for doc in yaml.safe_load_all(helm("template", "exp1", str(umbrella)).stdout) if doc]
    (run_config,) = [doc for doc in objects if doc["kind"] == "ConfigMap" and doc["metadata"]["name"].endswith("-run")]
    assert yaml.safe_load(next(iter(run_config["data"].values())))["train"]["max_steps"] == 77


@pytest.fixture(scope="module")
def signing_key(tmp_path_factory):
    """A throwaway RSA key (no passphrase) in a fresh GnuPG home, exported as the keyrings helm reads."""
    home = tmp_path_factory.mktemp("gnupg")
    env = {**os.environ, "GNUPGHOME": str(home)}
    spec = "Key-Type: RSA\nKey-Length: 2048\nName-Real: chart-ci\nName-Email: chart-ci@example.invalid\n%no-protection\n%commit\n"
    subprocess.run(["gpg", "--batch", "--gen-key"], input=spec, text=True, env=env, check=True, capture_output=True)
    secret, public = home / "secring.gpg", home / "pubring.gpg"
    secret.write_bytes(subprocess.run(["gpg", "--export-secret-keys"], env=env, check=True, capture_output=True).stdout)
    public.write_bytes(subprocess.run(["gpg", "--export"], env=env, check=True, capture_output=True).stdout)
    yield {"name": "chart-ci", "secret": str(secret), "public": str(public)}
    subprocess.run(["gpgconf", "--kill", "gpg-agent"], env=env, check=False)  # the agent gpg started for this home


def test_a_signed_package_verifies_and_a_tampered_one_is_refused(tmp_path, signing_key):
    helm("package", str(REPO), "--destination", str(tmp_path), "--sign", "--key", signing_key["name"],
         "--keyring", signing_key["secret"])
    signed = tmp_path / f"ray-finetune-{chart_version}.tgz"
    assert Path(f"{signed}.prov").exists()
    helm("verify", str(signed), "--keyring", signing_key["public"])
    installed_chart(str(signed), "--verify", "--keyring", signing_key["public"])

    tampered_dir = tmp_path / "tampered"
    with tarfile.open(signed) as tar:
        tar.extractall(tampered_dir, filter="data")
    (tampered_dir / "ray-finetune" / "values.yaml").write_text("# changed after signing\n", encoding="utf-8")
    tampered = tmp_path / "tampered" / signed.name
    with tarfile.open(tampered, "w:gz") as tar:
        tar.add(tampered_dir / "ray-finetune", arcname="ray-finetune")
    Path(f"{tampered}.prov").write_bytes(Path(f"{signed}.prov").read_bytes())
    refused = helm("verify", str(tampered), "--keyring", signing_key["public"], check=False)
    assert refused.returncode != 0 and "sha256" in refused.stderr.lower()
    refused_install = helm("install", "exp1", str(tampered), "--verify", "--keyring", signing_key["public"],
                           "--dry-run=client", check=False)
    assert refused_install.returncode != 0
