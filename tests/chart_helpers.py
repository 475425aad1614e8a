"""Rendering and validating the Helm chart at the repository root, without a Kubernetes API server.

* `helm()` runs the pinned helm binary (`.tools/bin/helm`, or $HELM, e.g. the helm v3 of
  `HELM_MAJOR=3 scripts/install-helm.sh`); a missing binary fails the test with the command that installs it
  (CI runs scripts/install-helm.sh first).
* `render()` runs `helm template` and returns the rendered objects.
* `validate()` checks one object: core kinds with kubernetes-validate (strict, pinned Kubernetes minor),
  RayJob/RayCluster against the KubeRay v1.7.0 CRD schemas in ../shared/kuberay-crds/, a PodMonitor against
  prometheus-operator's (`scripts/k8s-up.sh monitoring-crds` fetches it from the Go module proxy), with unknown
  fields made errors.
"""

from __future__ import annotations

import functools
import os
import shlex
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CRD_DIR = REPO.parent / "shared" / "kuberay-crds"
KUBE_VERSION = "1.33.0"
CRD_FILES = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml"}


def helm_binary() -> str:
    path = os.environ.get("HELM") or str(REPO / ".tools" / "bin" / "helm")
    if not os.access(path, os.X_OK):
        pytest.fail(f"helm not found at {path}: run scripts/install-helm.sh (or set HELM to a helm v3 or v4 binary)")
    return path


def helm(*args: str, cwd: Path = REPO, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([helm_binary(), *args], cwd=cwd, capture_output=True, text=True)
    if check and result.returncode != 0:
        pytest.fail(f"helm {shlex.join(args)} failed:\n{result.stderr}")
    return result


def template_args(release: str = "exp1", chart: str = ".", args: tuple[str, ...] = ()) -> list[str]:
    return ["template", release, chart, "--namespace", "experiments", "--kube-version", KUBE_VERSION, *args]


def render(*args: str, release: str = "exp1", chart: str = ".") -> list[dict]:
    """Objects rendered by `helm template` (hooks included) for the given -f/--set arguments."""
    out = helm(*template_args(release, chart, args)).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def render_error(*args: str) -> str:
    """stderr of a `helm template` that must fail."""
    result = helm(*template_args(args=args), check=False)
    assert result.returncode != 0, f"helm template {shlex.join(args)} rendered, expected an error"
    return result.stderr


def names_field(error: str, pointer: str) -> bool:
    """Whether a helm error names the value at `pointer` ("/run/train/lr"): helm v4's schema errors give the
    JSON pointer, helm v3's the dotted path ("run.train.lr"), the chart's own `fail`s the dotted path."""
    return pointer in error or pointer.lstrip("/").replace("/", ".") in error


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict], kind: str) -> dict:
    (obj,) = by_kind(objects, kind)
    return obj


def run_config(objects: list[dict]) -> dict:
    """The run config rendered into the run ConfigMap."""
    (cm,) = [o for o in by_kind(objects, "ConfigMap") if "run.yaml" in o["data"]]
    return yaml.safe_load(cm["data"]["run.yaml"])


def profile_commands() -> dict[str, list[str]]:
    """`helm install` commands given in the values/ profile comments, as helm template arguments."""
    commands = {}
    for profile in sorted((REPO / "values").glob("*.yaml")):
        for line in profile.read_text().splitlines():
            if not line.startswith("#"):
                break
            _, sep, command = line.partition("helm install ")
            if sep:
                words = shlex.split(command)
                commands[f"{profile.name}: {command}"] = words[2:]  # after "<release> ."
    return commands


def _strict(schema):
    """A CRD structural schema with unknown fields rejected wherever properties are listed."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {k: _strict(v) for k, v in schema.items()}
    if schema.get("x-kubernetes-int-or-string"):
        schema.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
        schema.pop("type", None)
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        schema.setdefault("additionalProperties", False)
    return schema


def crd_file(kind: str) -> Path:
    if kind != "PodMonitor":
        return CRD_DIR / CRD_FILES[kind]
    fetched = subprocess.run(["bash", str(REPO / "scripts" / "k8s-up.sh"), "monitoring-crds"], capture_output=True, text=True)
    if fetched.returncode != 0:
        pytest.fail(f"scripts/k8s-up.sh monitoring-crds failed:\n{fetched.stderr[-2000:]}")
    return Path(fetched.stdout.strip()) / "monitoring.coreos.com_podmonitors.yaml"


@functools.cache
def crd_validator(kind: str) -> jsonschema.Draft7Validator:
    crd = yaml.safe_load(crd_file(kind).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))


def validate(obj: dict) -> None:
    """Raises when `obj` is not a valid object of its kind (unknown fields included)."""
    if obj["apiVersion"] in ("ray.io/v1", "monitoring.coreos.com/v1"):
        errors = sorted(crd_validator(obj["kind"]).iter_errors(obj), key=lambda e: list(e.absolute_path))
        if errors:
            raise AssertionError(
                f"{obj['kind']} {obj['metadata']['name']}:\n"
                + "\n".join(f"  {'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)
            )
    else:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
