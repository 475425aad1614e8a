"""The chart against a live control plane: what a real API server accepts and what the KubeRay operator makes of it.

`scripts/k8s-up.sh up` starts etcd, kube-apiserver, kube-controller-manager (garbage collector, volume binder),
kube-scheduler, kwok (simulated nodes; Pods turn Running and Ready, Job Pods Succeeded) and the KubeRay operator
out of cluster, all on loopback and built from the Go module proxy on first use (a missing binary is built, never
skipped; `scripts/test.sh` builds them in a leg of their own). This module starts it once and stops it at the end.

The nodes are kwok's: one CPU node and two GPU nodes shaped like g6.12xlarge (4 `nvidia.com/gpu`, 1 EFA device,
the GPU taint), so every profile's Pods can be scheduled. Each release gets its own namespace and a
PersistentVolume pre-bound to its claim (no provisioner here). No Ray runs in a simulated Pod, so a RayJob gets as
far as the operator takes it without a Ray head; docs/chart.md "Live control plane" lists the states reached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from chart_helpers import REPO, helm, names_field, profile_commands
from servers import oci_registry, static_http
from kubernetes import client, config
from kubernetes.dynamic import DynamicClient
from kubernetes.utils import parse_quantity

from job import __version__ as chart_version

UP = REPO / "scripts" / "k8s-up.sh"
INVALID = REPO / "tests" / "fixtures" / "invalid-values"
DIGEST = "sha256:" + "0123456789abcdef" * 4
GPU_NODE = {"node.kubernetes.io/instance-type": "g6.12xlarge"}
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
# What a release may leave in its namespace after `helm uninstall`, besides its kept claim: what Kubernetes
# itself puts in every namespace.
NAMESPACE_DEFAULTS = {"ConfigMap": {"kube-root-ca.crt"}, "ServiceAccount": {"default"}}


def wait_until(what: str, probe: Callable[[], object], done: Callable[[object], bool] = bool,
               timeout_s: float = 90, interval_s: float = 0.5):
    """The first value of `probe()` that is `done`; fails naming `what` and the last value seen after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if done(value):
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}; last seen: {value!r}")
        time.sleep(interval_s)


@dataclass
class ControlPlane:
    kubeconfig: Path
    state: Path
    server: str  # host:port of the API server
    core: client.CoreV1Api
    batch: client.BatchV1Api
    custom: client.CustomObjectsApi
    networking: client.NetworkingV1Api

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return helm("--kubeconfig", str(self.kubeconfig), *args, check=check)

    def ray(self, plural: str, namespace: str) -> list[dict]:
        return self.custom.list_namespaced_custom_object("ray.io", "v1", namespace, plural)["items"]

    def pods(self, namespace: str, selector: str = "") -> list[client.V1Pod]:
        return self.core.list_namespaced_pod(namespace, label_selector=selector).items

    def install(self, release: str, *args: str, upgrade: bool = False) -> str:
        """`helm install` (or `upgrade`) into the namespace `t-<release>`, then a PersistentVolume pre-bound to the
        release's new claim, shaped as the claim asks (no provisioner on this control plane). The namespace."""
        namespace = f"t-{release}"
        verb = ["upgrade", "--reuse-values"] if upgrade else ["install", "--create-namespace"]
        self.helm(*verb, release, str(REPO), "--namespace", namespace, *args)
        for claim in self.core.list_namespaced_persistent_volume_claim(namespace).items:
            self.bind_volume(claim)
        return namespace

    def bind_volume(self, claim: client.V1PersistentVolumeClaim) -> None:
        name = f"pv-{claim.metadata.namespace}-{claim.metadata.name}"[:63]
        if self.core.list_persistent_volume(field_selector=f"metadata.name={name}").items:
            return
        self.core.create_persistent_volume({
            "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
            "spec": {
                "capacity": {"storage": claim.spec.resources.requests["storage"]},
                "accessModes": claim.spec.access_modes,
                "storageClassName": claim.spec.storage_class_name or "",
                "hostPath": {"path": str(self.state / "volumes" / name)},
                "claimRef": {"namespace": claim.metadata.namespace, "name": claim.metadata.name},
            },
        })

    def leftovers(self, namespace: str) -> dict[str, list[str]]:
        """Names of the objects in `namespace` that a release could have created, by kind."""
        found = {
            "RayJob": [o["metadata"]["name"] for o in self.ray("rayjobs", namespace)],
            "RayCluster": [o["metadata"]["name"] for o in self.ray("rayclusters", namespace)],
            "Pod": [o.metadata.name for o in self.core.list_namespaced_pod(namespace).items],
            "Service": [o.metadata.name for o in self.core.list_namespaced_service(namespace).items],
            "ConfigMap": [o.metadata.name for o in self.core.list_namespaced_config_map(namespace).items],
            "Secret": [o.metadata.name for o in self.core.list_namespaced_secret(namespace).items],
            "ServiceAccount": [o.metadata.name for o in self.core.list_namespaced_service_account(namespace).items],
            "Job": [o.metadata.name for o in self.batch.list_namespaced_job(namespace).items],
            "NetworkPolicy": [o.metadata.name for o in self.networking.list_namespaced_network_policy(namespace).items],
        }
        return {kind: sorted(set(names) - NAMESPACE_DEFAULTS.get(kind, set())) for kind, names in found.items()
                if set(names) - NAMESPACE_DEFAULTS.get(kind, set())}


def kwok_node(name: str, capacity: dict, labels: dict | None = None, taints: tuple = ()) -> dict:
    """A Node that kwok manages (the annotation its `--manage-nodes-with-annotation-selector` picks)."""
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
                     "labels": {"kubernetes.io/hostname": name, "type": "kwok", **(labels or {})}},
        "spec": {"taints": list(taints)},
        "status": {"capacity": {"pods": "110", **capacity}, "allocatable": {"pods": "110", **capacity}},
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, helm_home) -> ControlPlane:
    state = tmp_path_factory.mktemp("k8s")
    env = {**os.environ, "K8S_STATE": str(state)}
    up = subprocess.run(["bash", str(UP), "up"], env=env, capture_output=True, text=True)
    try:
        if up.returncode != 0:
            logs = "\n".join(f"== {log.name}\n{log.read_text()[-2000:]}" for log in sorted(state.glob("logs/*.log")))
            pytest.fail(f"scripts/k8s-up.sh up failed ({up.returncode}):\n{up.stderr[-4000:]}\n{logs}")
        api = config.new_client_from_config(str(state / "kubeconfig"))
        server = api.configuration.host.removeprefix("https://")
        plane = ControlPlane(state / "kubeconfig", state, server, client.CoreV1Api(api), client.BatchV1Api(api),
                             client.CustomObjectsApi(api), client.NetworkingV1Api(api))
        plane.core.create_node(kwok_node("cpu-0", {"cpu": "32", "memory": "128Gi"}))
        for i in range(2):
            plane.core.create_node(kwok_node(f"gpu-{i}", {"cpu": "48", "memory": "192Gi", "nvidia.com/gpu": "4",
                                                           "vpc.amazonaws.com/efa": "1"}, GPU_NODE, (GPU_TAINT,)))
        wait_until("kwok to make the nodes Ready", lambda: all(
            any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or ())
            for node in plane.core.list_node().items))
        yield plane
    finally:
        subprocess.run(["bash", str(UP), "down"], env=env, capture_output=True)


def uninstall_leaves_only_the_claim(cluster: ControlPlane, release: str, namespace: str) -> None:
    claims_before = {c.metadata.name for c in cluster.core.list_namespaced_persistent_volume_claim(namespace).items}
    cluster.helm("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "60s")
    # Operator-made objects go by owner references (the garbage collector), so give them time.
    wait_until(f"nothing of {release} left in {namespace}", lambda: cluster.leftovers(namespace),
               done=lambda left: not left)
    claims_after = {c.metadata.name for c in cluster.core.list_namespaced_persistent_volume_claim(namespace).items}
    assert claims_after == claims_before, "helm.sh/resource-policy: keep holds the runs claim through uninstall"


PROFILES = profile_commands()


@pytest.mark.parametrize("args", PROFILES.values(), ids=PROFILES.keys())
def test_every_profile_is_accepted_by_the_api_server(cluster, args):
    release = f"p{list(PROFILES.values()).index(args)}"
    namespace = cluster.install(release, *args)
    rendered = [o for o in map(yaml.safe_load, cluster.helm(
        "get", "manifest", release, "--namespace", namespace).stdout.split("\n---")) if o]
    stored = DynamicClient(cluster.core.api_client)
    for obj in rendered:  # every object of the release is on the server (a missing one raises NotFoundError)
        resource = stored.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        resource.get(name=obj["metadata"]["name"], namespace=namespace if resource.namespaced else None)
    (job,) = cluster.ray("rayjobs", namespace)
    assert ("RayJob", job["metadata"]["name"]) in {(o["kind"], o["metadata"]["name"]) for o in rendered}
    status = json.loads(cluster.helm("status", release, "--namespace", namespace, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed"
    uninstall_leaves_only_the_claim(cluster, release, namespace)


def test_bad_values_are_refused_before_reaching_the_server(cluster):
    for bad in sorted(INVALID.glob("*.yaml")):
        result = cluster.helm("install", "bad", str(REPO), "--namespace", "t-bad", "--create-namespace",
                              "-f", str(bad), check=False)
        assert result.returncode != 0, f"{bad.name} was installed"
        expected = bad.read_text().splitlines()[0].removeprefix("# expect: ")
        assert names_field(result.stderr, expected), f"{bad.name}: {result.stderr[-500:]}"
    namespaces = {n.metadata.name for n in cluster.core.list_namespace().items}
    assert "t-bad" not in namespaces, "a refused install must not even create its namespace"


def pod_role(pod: client.V1Pod) -> str:
    return pod.metadata.labels.get("ray.io/node-type", pod.metadata.labels.get("app.kubernetes.io/component", "?"))


def containers(pod: client.V1Pod) -> list[client.V1Container]:
    return [*(pod.spec.init_containers or ()), *pod.spec.containers]


def env_of(container: client.V1Container) -> dict[str, object]:
    return {e.name: e.value if e.value_from is None else e.value_from for e in container.env or ()}


@pytest.fixture(scope="module")
def gpu_release(cluster):
    """The reference layout (synthetic on eks-g6-efa) with a pinned digest and common labels, Pods running on
    kwok's nodes: (release, namespace)."""
    release = "gpu"
    namespace = cluster.install(release, "-f", "values/synthetic.yaml", "-f", "values/eks-g6-efa.yaml",
                                "--set", f"image.digest={DIGEST}", "--set", "commonLabels.team=ml-platform")
    wait_until("the operator's head and 2 worker Pods", lambda: sorted(map(pod_role, cluster.pods(namespace))),
               done=lambda roles: roles.count("head") == 1 and roles.count("worker") == 2)
    yield release, namespace
    uninstall_leaves_only_the_claim(cluster, release, namespace)


def test_operator_creates_the_cluster_the_chart_asks_for(cluster, gpu_release):
    """Assertions on what the operator generated from our RayJob, not on our templates."""
    release, namespace = gpu_release
    (job,) = cluster.ray("rayjobs", namespace)
    (ray_cluster,) = cluster.ray("rayclusters", namespace)
    assert ray_cluster["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    pods = cluster.pods(namespace, "ray.io/is-ray-node=yes")
    image = f"public.ecr.aws/deep-learning-containers/ray@{DIGEST}"
    run_yaml = run_config(cluster, release, namespace)
    values = json.loads(cluster.helm("get", "values", release, "--namespace", namespace, "--all", "-o", "json").stdout)
    for pod in pods:
        role = pod_role(pod)
        group = values[role]  # head, worker: the values that sized this Pod (synthetic + eks-g6-efa)
        assert pod.metadata.labels.get("team") == "ml-platform", f"{role}: commonLabels reach the operator's Pods"
        for container in containers(pod):
            assert container.image == image, f"{role}/{container.name}: the pinned digest"
        (ray,) = [c for c in pod.spec.containers if c.name.startswith("ray-")]
        env = env_of(ray)
        assert env["JOB_RELEASE"] == release and env["JOB_IMAGE"] == image
        assert env.get("RAY_AUTH_MODE") == "token", f"{role}: the operator turns on Ray token authentication"
        assert env["RAY_AUTH_TOKEN"].secret_key_ref.name == ray_cluster["metadata"]["name"]
        claims = {v.name: v.persistent_volume_claim.claim_name for v in pod.spec.volumes if v.persistent_volume_claim}
        (mount,) = [m for m in ray.volume_mounts if m.name in claims]
        assert claims[mount.name] == f"{release}-ray-finetune-runs"
        assert run_yaml["storage_path"] == mount.mount_path, "the run config writes where the claim is mounted"
        limits = ray.resources.limits
        for quantities in (ray.resources.requests, limits):
            assert {k: parse_quantity(quantities[k]) for k in ("cpu", "memory") if k in quantities} == {
                k: parse_quantity(str(group[k])) for k in ("cpu", "memory")}, f"{role}: cpu, memory (requests = limits)"
        added = set((ray.security_context.capabilities.add or ()) if ray.security_context.capabilities else ())
        if role == "worker":
            assert limits["nvidia.com/gpu"] == str(group["gpus"])
            assert limits["vpc.amazonaws.com/efa"] == str(values["efa"]["devicesPerPod"])
            assert added == {"IPC_LOCK"}, "EFA pins memory: IPC_LOCK on the GPU workers"
            assert pod.spec.node_selector == GPU_NODE
        else:
            assert "nvidia.com/gpu" not in limits and not added, "the head gets no GPU and no extra capability"
    # The NetworkPolicy selects every Ray Pod of the release.
    (policy,) = cluster.networking.list_namespaced_network_policy(namespace).items
    selector = ",".join(f"{k}={v}" for k, v in policy.spec.pod_selector.match_labels.items())
    assert {p.metadata.name for p in cluster.pods(namespace, selector)} >= {p.metadata.name for p in pods}


def test_rayjob_runs_on_simulated_nodes(cluster, gpu_release):
    """kwok runs the Pods: the cluster turns ready and the operator submits the job through its submitter Job."""
    release, namespace = gpu_release
    wait_until("every Ray Pod scheduled and Running", lambda: [
        (p.metadata.name, p.spec.node_name, p.status.phase) for p in cluster.pods(namespace, "ray.io/is-ray-node=yes")],
        done=lambda pods: len(pods) == 3 and all(node and phase == "Running" for _, node, phase in pods))
    workers = cluster.pods(namespace, "ray.io/node-type=worker")
    assert {p.spec.node_name for p in workers} == {"gpu-0", "gpu-1"}, "4 GPUs each: one worker per GPU node"
    wait_until("the RayCluster ready", lambda: cluster.ray("rayclusters", namespace)[0].get("status", {}).get("state"),
               done=lambda state: state == "ready")
    (submitter,) = wait_until("the submitter Job", lambda: cluster.batch.list_namespaced_job(namespace).items)
    template = submitter.spec.template
    assert template.metadata.labels["app.kubernetes.io/component"] == "ray-job-submitter"
    (container,) = template.spec.containers
    assert "ray job submit" in " ".join(container.command + (container.args or [])), "KubeRay filled in the command"
    assert template.spec.security_context.run_as_non_root
    (job,) = cluster.ray("rayjobs", namespace)
    assert job["status"]["jobDeploymentStatus"] == "Running"


def run_config(cluster: ControlPlane, release: str, namespace: str) -> dict:
    return yaml.safe_load(cluster.core.read_namespaced_config_map(f"{release}-ray-finetune-run", namespace)
                          .data["run.yaml"])


def replaced_rayjob(cluster: ControlPlane, namespace: str, before: dict) -> dict:
    """Waits for the RayJob that replaces `before` (one RayJob, another uid), its cluster and that cluster's Pods."""
    (after,) = wait_until("the old RayJob gone and one new one", lambda: cluster.ray("rayjobs", namespace),
                          done=lambda jobs: len(jobs) == 1 and jobs[0]["metadata"]["uid"] != before["metadata"]["uid"])
    wait_until("the operator's cluster for the new RayJob only", lambda: [
        c["metadata"]["ownerReferences"][0]["uid"] for c in cluster.ray("rayclusters", namespace)],
        done=lambda owners: owners == [after["metadata"]["uid"]])
    wait_until("the new cluster's 3 Pods", lambda: cluster.pods(namespace, "ray.io/is-ray-node=yes"),
               done=lambda pods: len(pods) == 3 and all(
                   p.metadata.labels["ray.io/cluster"] == cluster.ray("rayclusters", namespace)[0]["metadata"]["name"]
                   for p in pods))
    return after


def test_upgrade_replaces_the_rayjob_and_keeps_the_run_name(cluster, gpu_release):
    """`helm upgrade` with a changed run config: a new RayJob for the same run (it resumes); `helm rollback` brings
    back the first revision's RayJob name and config, again for the same run."""
    release, namespace = gpu_release
    (first,) = cluster.ray("rayjobs", namespace)
    run_before = run_config(cluster, release, namespace)
    cluster.install(release, "--set", "run.train.lr=7.0e-05", upgrade=True)
    run_after = run_config(cluster, release, namespace)
    assert run_after["train"]["lr"] == 7e-05 and run_after["name"] == run_before["name"]
    upgraded = replaced_rayjob(cluster, namespace, first)
    assert upgraded["metadata"]["name"] != first["metadata"]["name"], "a changed run config is a new RayJob name"

    cluster.helm("rollback", release, "1", "--namespace", namespace, "--wait", "--timeout", "60s")
    assert run_config(cluster, release, namespace) == run_before
    rolled_back = replaced_rayjob(cluster, namespace, upgraded)
    assert rolled_back["metadata"]["name"] == first["metadata"]["name"], "revision 1's run config, its RayJob name"


def test_helm_test_pod_checks_the_job_as_its_service_account(cluster, gpu_release, tmp_path):
    """`helm test` creates its Pod; its script, run here with a token of the release's ServiceAccount, makes the
    release's run ConfigMap the Pod's owner, so that `helm uninstall` (which deletes no hook) removes the Pod too,
    also once the RayJob is gone (the chart's deletion rules delete it after its job ends), and reads the RayJob."""
    release, namespace = gpu_release
    (job,) = cluster.ray("rayjobs", namespace)
    # The check waits for the job to run, which needs a Ray head: here the Pod and its script are what is tested.
    cluster.helm("test", release, "--namespace", namespace, "--timeout", "5s", check=False)
    pod = cluster.core.read_namespaced_pod(f"{release}-ray-finetune-test", namespace)
    (container,) = pod.spec.containers
    env = {k: v for k, v in env_of(container).items() if isinstance(v, str)}
    assert env["RAYJOB"] == job["metadata"]["name"] and env["TEST_POD"] == pod.metadata.name
    token = cluster.core.create_namespaced_service_account_token(
        pod.spec.service_account_name, namespace, {"spec": {"expirationSeconds": 600}}).status.token
    (tmp_path / "token").write_text(token)
    (tmp_path / "ca.crt").write_bytes((cluster.state / "pki" / "ca.crt").read_bytes())
    script = container.args[0].replace("/var/run/secrets/kubernetes.io/serviceaccount", str(tmp_path))
    host, port = cluster.server.rsplit(":", 1)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
        env={**os.environ, **env, "KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port,
             "RUN_DIR": str(tmp_path / "run"), "TIMEOUT_SECONDS": "0"})
    assert f"RayJob {job['metadata']['name']}: jobStatus=" in result.stdout, result.stderr
    assert "timed out: the job is not RUNNING" in result.stderr
    owners = cluster.core.read_namespaced_pod(pod.metadata.name, namespace).metadata.owner_references or ()
    run = cluster.core.read_namespaced_config_map(f"{release}-ray-finetune-run", namespace)
    assert [(o.kind, o.uid) for o in owners] == [("ConfigMap", run.metadata.uid)], "the test Pod owned by the release"


@pytest.mark.parametrize("cleanup", ["rules", "shutdown"])
def test_an_ended_job_is_deleted_at_its_ttl(cluster, cleanup):
    """The ephemeral mode's cleanup as KubeRay does it. With no Ray head the operator cannot read the job's status:
    once kwok finishes the submitter Pod, the RayJob fails after KubeRay's 30 s grace period (`jobDeploymentStatus:
    Failed`, its jobStatus never terminal: what the chart's rules must name, kuberay#5184). Then, by the chart's
    deletion rules, the operator deletes the RayJob itself, and with it the cluster, its Pods and the submitter Job;
    with `shutdownAfterJobFinishes` (Kueue's way) the cluster only, the RayJob and its Job staying until uninstall."""
    release = f"ttl-{cleanup}"
    namespace = cluster.install(release, "-f", "values/cpu-smoke.yaml", "--set", "rayJob.ttlSecondsAfterFinished=1",
                                *(["--set", "rayJob.shutdownAfterJobFinishes=true"] if cleanup == "shutdown" else []))
    status = wait_until("the RayJob to end", lambda: cluster.ray("rayjobs", namespace)[0].get("status", {}),
                        done=lambda s: s.get("jobDeploymentStatus") in ("Complete", "Failed"), timeout_s=120)
    assert (status["jobDeploymentStatus"], status["reason"]) == ("Failed", "JobDeploymentStatusTransitionGracePeriodExceeded")
    wait_until("the operator to delete the ended job's cluster and Pods", lambda: (
        cluster.ray("rayclusters", namespace), cluster.pods(namespace, "ray.io/is-ray-node=yes")),
        done=lambda left: left == ([], []), timeout_s=60)
    if cleanup == "rules":
        wait_until("the RayJob, its submitter Job and every Pod gone", lambda: (
            cluster.ray("rayjobs", namespace), cluster.batch.list_namespaced_job(namespace).items,
            cluster.pods(namespace)), done=lambda left: left == ([], [], []), timeout_s=60)
    else:
        assert cluster.ray("rayjobs", namespace), "the RayJob stays, with its status, until helm uninstall"
    uninstall_leaves_only_the_claim(cluster, release, namespace)


def test_warm_cluster_mode(cluster):
    release = "warm"
    namespace = cluster.install(release, "-f", "values/cpu-smoke.yaml", "--set", "rayCluster.create=true")
    (job,) = cluster.ray("rayjobs", namespace)
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": f"{release}-ray-finetune"}
    wait_until("the warm cluster ready", lambda: [c.get("status", {}).get("state")
                                                  for c in cluster.ray("rayclusters", namespace)],
               done=lambda states: states == ["ready"])
    (ray_cluster,) = cluster.ray("rayclusters", namespace)
    assert "ownerReferences" not in ray_cluster["metadata"], "the release's own cluster: the RayJob made none"
    wait_until("the submitter Job on the warm cluster", lambda: cluster.batch.list_namespaced_job(namespace).items)
    uninstall_leaves_only_the_claim(cluster, release, namespace)


def test_install_and_upgrade_from_an_oci_registry(cluster, chart_package):
    """As users do with an internal registry: push the package, install and upgrade by version from `oci://`."""
    release, namespace = "oci", "t-oci"
    with oci_registry() as registry:
        helm("push", str(chart_package), f"oci://{registry}/charts", "--plain-http")
        chart = [f"oci://{registry}/charts/ray-finetune", "--version", chart_version, "--plain-http"]
        cluster.helm("install", release, *chart, "--namespace", namespace, "--create-namespace",
                     "-f", str(REPO / "values" / "cpu-smoke.yaml"))
        (before,) = cluster.ray("rayjobs", namespace)
        cluster.helm("upgrade", release, *chart, "--namespace", namespace, "--reuse-values",
                     "--set", "run.train.max_steps=9")
    status = json.loads(cluster.helm("status", release, "--namespace", namespace, "-o", "json").stdout)
    assert (status["version"], status["info"]["status"]) == (2, "deployed")
    wait_until("the upgraded RayJob alone", lambda: [j["metadata"]["uid"] for j in cluster.ray("rayjobs", namespace)],
               done=lambda uids: len(uids) == 1 and uids != [before["metadata"]["uid"]])
    uninstall_leaves_only_the_claim(cluster, release, namespace)


def test_a_release_over_the_secret_limit_is_refused(cluster, chart_package, tmp_path):
    """Why tests/test_chart_artifact.py holds the release to a budget: Helm stores each release, files and all, in a
    Secret (base64 of gzip of JSON), and the API server refuses a Secret over 1 MiB. Here the chart carries 1.5 MB
    of incompressible bytes, as it did with its raw benchmark files before .helmignore left them out."""
    with tarfile.open(chart_package) as tar:
        tar.extractall(tmp_path, filter="data")
    chart = tmp_path / "ray-finetune"
    (chart / "padding.bin").write_bytes(os.urandom(1_500_000))  # a chart file, in no template
    result = cluster.helm("install", "big", str(chart), "--namespace", "t-big", "--create-namespace",
                          "-f", str(REPO / "values" / "cpu-smoke.yaml"), check=False)
    assert result.returncode != 0 and 'Secret "sh.helm.release.v1.big.v1" is invalid: data: Too long' in result.stderr
    assert not cluster.core.list_namespaced_secret("t-big", label_selector="owner=helm").items


def test_install_from_a_classic_repository_and_as_a_dependency(cluster, chart_package, tmp_path):
    """An index.yaml repository: install by version; and an umbrella chart that depends on the chart from it."""
    root = tmp_path / "repo"
    root.mkdir()
    (root / chart_package.name).write_bytes(chart_package.read_bytes())
    umbrella = tmp_path / "platform"
    (umbrella / "templates").mkdir(parents=True)
    with static_http(root) as url:
        helm("repo", "index", str(root), "--url", url)
        helm("repo", "add", "internal", url)
        cluster.helm("install", "classic", "internal/ray-finetune", "--version", chart_version,
                     "--namespace", "t-classic", "--create-namespace", "-f", str(REPO / "values" / "cpu-smoke.yaml"))
        (umbrella / "Chart.yaml").write_text(yaml.safe_dump({
            "apiVersion": "v2", "name": "platform", "version": "1.0.0",
            "dependencies": [{"name": "ray-finetune", "version": chart_version, "repository": url}]}))
        helm("dependency", "update", str(umbrella))
    smoke = yaml.safe_load((REPO / "values" / "cpu-smoke.yaml").read_text())
    (umbrella / "values.yaml").write_text(yaml.safe_dump({"ray-finetune": smoke}))
    cluster.helm("install", "umbrella", str(umbrella), "--namespace", "t-umbrella", "--create-namespace")
    for release, namespace in (("classic", "t-classic"), ("umbrella", "t-umbrella")):
        (job,) = cluster.ray("rayjobs", namespace)
        assert job["metadata"]["labels"]["app.kubernetes.io/instance"] == release
        uninstall_leaves_only_the_claim(cluster, release, namespace)
