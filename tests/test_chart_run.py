"""Render -> run: the cpu-smoke profile's RayJob, executed the way its head pod would run it.

The test renders the chart, materializes every ConfigMap volume of the head pod at its mount path under a
temporary root, gives a local Ray cluster and the entrypoint the environment the Ray container gets (downward
API values filled in, paths mapped under the root), runs the RayJob entrypoint against that cluster, and checks
the run lands where the chart's storage values say. The runs claim is mounted at a temporary `storage.mountPath`
(set through the chart's own value), standing in for the PersistentVolumeClaim.
"""

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from chart_helpers import by_kind, one, render

from job.records.environment import job_sha256

RELEASE = "smoke"
NAMESPACE = "experiments"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_cores(quantity) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def kubelet_config_map(target: Path, data: dict[str, str], items: list[dict] | None) -> None:
    """A ConfigMap volume as the kubelet writes it (its atomic writer): the files, at their item paths (else under
    their keys), in a timestamped directory that `..data` links to, and each top-level name a link into
    `..data`."""
    files = {item["path"]: data[item["key"]] for item in items} if items else dict(data)
    stamped = target / "..2026_01_01_00_00_00.000000001"
    for path, text in files.items():
        (stamped / path).parent.mkdir(parents=True, exist_ok=True)
        (stamped / path).write_text(text)
    (target / "..data").symlink_to(stamped.name)
    for name in {path.split("/")[0] for path in files}:
        (target / name).symlink_to(f"..data/{name}")


class Pod:
    """The head pod of a rendered RayJob, materialized under `root`: mounts become directories, env a dict."""

    def __init__(self, objects: list[dict], root: Path):
        rayjob = one(objects, "RayJob")
        self.rayjob = rayjob
        self.cluster = rayjob["spec"]["rayClusterSpec"]
        template = self.cluster["headGroupSpec"]["template"]
        self.container = template["spec"]["containers"][0]
        self.root = root
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        config_maps = {c["metadata"]["name"]: c for c in by_kind(objects, "ConfigMap")}
        self.mounts = {}  # mount path in the pod -> directory here
        for mount in self.container["volumeMounts"]:
            volume = volumes[mount["name"]]
            if "configMap" in volume:
                target = root / mount["mountPath"].lstrip("/")
                kubelet_config_map(target, config_maps[volume["configMap"]["name"]]["data"],
                                   volume["configMap"].get("items"))
            elif "persistentVolumeClaim" in volume:
                target = Path(mount["mountPath"])  # the test set storage.mountPath to a temporary directory
                target.mkdir(parents=True, exist_ok=True)
            else:
                continue  # /dev/shm: the host's
            self.mounts[mount["mountPath"]] = target

    def path(self, text: str) -> str:
        """A path in the pod, as seen here."""
        for mount_path, target in self.mounts.items():
            if text == mount_path or text.startswith(mount_path.rstrip("/") + "/"):
                return str(target) + text[len(mount_path.rstrip("/")) :]
        for mount_path, target in self.mounts.items():  # a parent of mounts, e.g. PYTHONPATH=/opt/job
            if mount_path.startswith(text.rstrip("/") + "/"):
                return str(self.root / text.lstrip("/"))
        return text

    def env(self) -> dict[str, str]:
        field_values = {"metadata.name": f"{self.rayjob['metadata']['name']}-head-x7k2p", "metadata.namespace": NAMESPACE}
        env = {}
        for var in self.container["env"]:
            if "value" in var:
                env[var["name"]] = self.path(var["value"]) if var["name"] == "PYTHONPATH" else var["value"]
            else:
                env[var["name"]] = field_values[var["valueFrom"]["fieldRef"]["fieldPath"]]
        return env

    def total_cpus(self) -> int:
        """Logical CPUs of the whole Ray cluster the RayJob would get."""
        head = cpu_cores(self.container["resources"]["limits"]["cpu"])
        workers = sum(
            group["replicas"] * cpu_cores(group["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
            for group in self.cluster["workerGroupSpecs"]
        )
        return int(head + workers)


@pytest.fixture
def pod_root():
    # Short path: Ray puts unix sockets under its temp dir (108-byte limit).
    with tempfile.TemporaryDirectory(prefix="chartrun-", dir="/tmp") as root:
        yield Path(root)


@pytest.mark.image_set
def test_cpu_smoke_rayjob_runs_and_writes_where_storage_says(pod_root):
    runs = pod_root / "claim"
    objects = render("-f", "values/cpu-smoke.yaml", "--set", f"storage.mountPath={runs}", release=RELEASE)
    pod = Pod(objects, pod_root / "pod")
    pod_env = pod.env()
    # A home of its own, as the container has (no ~/.ray or caches of this machine).
    (pod_root / "home").mkdir()
    base_env = {"HOME": str(pod_root / "home"), **{k: os.environ[k] for k in ("PATH", "LANG") if k in os.environ}}
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    env = {**base_env, **pod_env, **offline}
    python_bin = str(Path(sys.executable).parent)
    env["PATH"] = f"{python_bin}:{env.get('PATH', '')}"

    # The Ray cluster: one local node with the cluster's CPUs, started with the Ray container's environment so
    # that Ray Train workers import the job package from the ConfigMap mount, as on the worker pods.
    ray_start = subprocess.Popen(
        [f"{python_bin}/ray", "start", "--head", "--block", f"--port={free_port()}", f"--num-cpus={pod.total_cpus()}",
         "--num-gpus=0", "--include-dashboard=false", f"--temp-dir={pod_root / 'ray'}", "--disable-usage-stats"],
        env=env, cwd=pod_root, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        address, output = None, []
        for line in ray_start.stdout:  # until "ray start --address='<ip>:<port>'" (printed once the node is up)
            output.append(line)
            match = re.search(r"ray start --address='([^']+)'", line)
            if match:
                address = match.group(1)
                break
        assert address, "ray start failed:\n" + "".join(output[-40:])
        threading.Thread(target=ray_start.stdout.read, daemon=True).start()  # keep draining its output

        # The RayJob entrypoint, as the job supervisor runs it on the head pod: the container env plus RAY_ADDRESS,
        # from an empty working directory (the job package comes only from the ConfigMap mount).
        entrypoint = [pod.path(word) for word in shlex.split(pod.rayjob["spec"]["entrypoint"])]
        workdir = pod_root / "workdir"
        workdir.mkdir()
        result = subprocess.run(entrypoint, env={**env, "RAY_ADDRESS": address}, cwd=workdir,
                                capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, f"entrypoint failed:\n{result.stdout[-5000:]}\n{result.stderr[-8000:]}"
    finally:
        # The cluster's processes share the session of `ray start`: end them all by its process group.
        os.killpg(ray_start.pid, signal.SIGTERM)
        try:
            ray_start.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):  # the whole group may already be gone
            os.killpg(ray_start.pid, signal.SIGKILL)

    # Where the chart's storage values say: <storage.mountPath>/<release name>/.
    run_dir = runs / RELEASE
    assert run_dir.is_dir(), f"no run directory at {run_dir}: {sorted(p.name for p in runs.iterdir())}"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert metrics, "metrics.jsonl is empty"
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "succeeded" and record["run_name"] == RELEASE
    assert record["job"]["sha256"] == job_sha256()  # the tree as mounted is this checkout's package
    # The startup phase from the entrypoint's start, by step, adding up to the phase.
    startup = record["time"]["startup_s"]
    assert list(startup) == ["imports", "checks", "ray", "prepare", "workers", "worker_imports", "preflight"]
    assert sum(startup.values()) == pytest.approx(record["time"]["phases_s"]["startup"], abs=0.01)
    # The run record carries what the chart put in the container's environment.
    assert record["chart"] == {"name": pod_env["JOB_CHART"], "version": pod_env["JOB_CHART_VERSION"],
                               "release": RELEASE, "values_sha256": pod_env["JOB_VALUES_SHA256"], "unknown_reasons": {}}
    assert record["pod"] == {"name": pod_env["POD_NAME"], "namespace": NAMESPACE}
