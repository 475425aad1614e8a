"""The chart's job in real Pods: `helm install` to SUCCEEDED on a real kubelet, asserting on what the run wrote.

`scripts/k8s-up.sh up --real-node` starts the control plane and one real node (containerd + runc, the CNI bridge,
kubelet, kube-proxy, CoreDNS) in a network namespace of its own (scripts/k8s-node.sh), with the KubeRay operator out
of cluster; `scripts/k8s-image.sh import` puts the CPU test image (the image set's versions) into the node's
containerd. The profile is ci/real-pods-values.yaml: a head and two worker pods, one Ray Train worker each, so gloo
crosses pods. Each release's claim is a hostPath PersistentVolume under the state dir, so the tests read run.json,
metrics and checkpoints as the pods wrote them.

Opt in with RAY_FINETUNE_REAL_PODS=1 (needs root: network namespaces, mounts, cgroups); otherwise skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from chart_helpers import REPO
from kubernetes import client, config
from test_k8s_live import ControlPlane, wait_until

UP = REPO / "scripts" / "k8s-up.sh"
IMAGE = REPO / "scripts" / "k8s-image.sh"
PROFILE = ("-f", str(REPO / "ci" / "real-pods-values.yaml"), "-f", str(REPO / "ci" / "real-pods-image.yaml"))
IMAGE_REF = "localhost/ray-finetune-test:image-set"
STEPS = 12

pytestmark = pytest.mark.skipif(os.environ.get("RAY_FINETUNE_REAL_PODS") != "1",
                                reason="real Pods need root and the test image: set RAY_FINETUNE_REAL_PODS=1")


class Node(ControlPlane):
    def bind_volume(self, claim: client.V1PersistentVolumeClaim) -> None:
        super().bind_volume(claim)
        # The pods run as uid 1000; a hostPath directory is used as it is found.
        path = self.volume(claim.metadata.namespace, claim.metadata.name)
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o777)

    def volume(self, namespace: str, claim: str) -> Path:
        return self.state / "volumes" / f"pv-{namespace}-{claim}"[:63]

    def run_dir(self, release: str) -> Path:
        return self.volume(f"t-{release}", f"{release}-ray-finetune-runs") / release

    def record(self, release: str) -> dict:
        return json.loads((self.run_dir(release) / "run.json").read_text())

    def metrics(self, release: str, kind: str) -> list[dict]:
        path = self.run_dir(release) / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return [r for r in rows if r["kind"] == kind]

    def job_status(self, namespace: str) -> dict:
        jobs = self.ray("rayjobs", namespace)
        return jobs[0].get("status", {}) if jobs else {}

    def containers(self) -> list[str]:
        """The node's containers, as containerd has them (the CRI's namespace)."""
        return subprocess.run(["ctr", "--address", str(self.state / "containerd" / "containerd.sock"),
                               "--namespace", "k8s.io", "containers", "ls", "-q"],
                              capture_output=True, text=True, check=True).stdout.split()

    def diagnose(self, namespace: str) -> str:
        """The RayJob's status, the namespace's events and the end of every Pod's log: why a run did not end well."""
        lines = [f"RayJob status: {self.job_status(namespace)}"]
        for event in self.core.list_namespaced_event(namespace).items:
            lines.append(f"event {event.involved_object.kind}/{event.involved_object.name}: {event.reason}: {event.message}")
        for pod in self.pods(namespace):
            for container in pod.spec.containers:
                try:
                    log = self.core.read_namespaced_pod_log(pod.metadata.name, namespace, container=container.name,
                                                            tail_lines=40)
                except client.ApiException as e:
                    log = f"(no log: {e.reason})"
                lines.append(f"== {pod.metadata.name}/{container.name} ({pod.status.phase})\n{log}")
        return "\n".join(lines)

    def wait_for_job_end(self, namespace: str, timeout_s: float = 900) -> dict:
        try:
            return wait_until("the RayJob to end", lambda: self.job_status(namespace),
                              done=lambda s: s.get("jobDeploymentStatus") in ("Complete", "Failed"),
                              timeout_s=timeout_s, interval_s=3)
        except pytest.fail.Exception:
            print(self.diagnose(namespace))
            raise


@pytest.fixture(scope="module")
def node(tmp_path_factory, helm_home) -> Node:
    state = tmp_path_factory.mktemp("k8s-node")
    env = {**os.environ, "K8S_STATE": str(state)}
    up = subprocess.run(["bash", str(UP), "up", "--real-node"], env=env, capture_output=True, text=True)
    try:
        if up.returncode != 0:
            logs = "\n".join(f"== {log.name}\n{log.read_text()[-2000:]}" for log in sorted(state.glob("logs/*.log")))
            pytest.fail(f"scripts/k8s-up.sh up --real-node failed ({up.returncode}):\n{up.stderr[-4000:]}\n{logs}")
        image = subprocess.run(["bash", str(IMAGE), "import", str(state / "containerd" / "containerd.sock")],
                               env=env, capture_output=True, text=True)
        if image.returncode != 0:
            pytest.fail(f"scripts/k8s-image.sh import failed ({image.returncode}):\n{image.stderr[-4000:]}")
        api = config.new_client_from_config(str(state / "kubeconfig"))
        yield Node(state / "kubeconfig", state, api.configuration.host.removeprefix("https://"),
                   client.CoreV1Api(api), client.BatchV1Api(api), client.CustomObjectsApi(api),
                   client.NetworkingV1Api(api))
    finally:
        down = subprocess.run(["bash", str(UP), "down"], env=env, capture_output=True, text=True)
        print(down.stderr)


@pytest.fixture(scope="module")
def finished(node) -> tuple[str, str, set[str]]:
    """One release of the profile run to its end: (release, namespace, its worker Pods' names)."""
    release = "run"
    namespace = node.install(release, *PROFILE)
    workers = wait_until("two worker Pods Running", lambda: {
        p.metadata.name for p in node.pods(namespace, "ray.io/node-type=worker") if p.status.phase == "Running"},
        done=lambda names: len(names) == 2, timeout_s=300, interval_s=2)
    status = node.wait_for_job_end(namespace)
    assert status.get("jobStatus") == "SUCCEEDED", node.diagnose(namespace)
    return release, namespace, workers


def test_install_runs_the_job_to_success_across_two_worker_pods(node, finished):
    release, namespace, workers = finished
    record = node.record(release)
    assert record["status"] == "succeeded", record.get("error")
    assert {w["hostname"] for w in record["workers"]} == workers, "one training worker in each worker Pod"
    assert record["image"]["reference"] == IMAGE_REF
    assert record["image"]["digest"].startswith("sha256:") and record["image"]["consistent"], record["image"]
    evals = {r["step"]: r["eval_loss"] for r in node.metrics(release, "eval")}
    assert list(evals) == [0, STEPS] and evals[STEPS] < evals[0] - 0.1, evals
    assert record["export"]["ok"], record["export"]
    assert (node.run_dir(release) / "export" / "_VALID").exists() or record["export"]["export_dir"]


def test_helm_test_passes_against_the_finished_run(node, finished):
    release, namespace, _ = finished
    result = node.helm("test", release, "--namespace", namespace, "--logs", "--timeout", "300s", check=False)
    assert result.returncode == 0, result.stderr[-3000:] + node.diagnose(namespace)
    assert '"status": "succeeded"' in result.stdout, "the test Pod prints the run's run.json"


def test_uninstall_leaves_no_pod_container_or_job(node, finished):
    release, namespace, _ = finished
    node.helm("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "120s")
    wait_until(f"nothing of {release} left in {namespace}", lambda: node.leftovers(namespace),
               done=lambda left: not left, timeout_s=120)
    wait_until("no container left on the node", node.containers, done=lambda ids: not ids, timeout_s=150, interval_s=3)
    assert node.core.list_namespaced_persistent_volume_claim(namespace).items, "the runs claim is kept"
    assert (node.run_dir(release) / "run.json").exists(), "and the run on it"


def test_a_deleted_worker_pod_is_survived_by_resuming(node):
    """`kubectl delete pod` of a worker mid-run: Ray Train (scaling.max_failures: 1) restarts the worker group once
    KubeRay has replaced the Pod, and the run resumes from its last complete checkpoint."""
    release, steps = "resume", 400
    namespace = node.install(release, *PROFILE, "--set", f"run.train.max_steps={steps}",
                             "--set", "run.checkpoint.every_steps=10", "--set", f"run.eval.every_steps={steps}")
    saved = wait_until("a complete checkpoint", lambda: node.metrics(release, "checkpoint"),
                       timeout_s=600, interval_s=1)
    victim = node.pods(namespace, "ray.io/node-type=worker")[0].metadata.name
    node.core.delete_namespaced_pod(victim, namespace)
    status = node.wait_for_job_end(namespace)
    assert status.get("jobStatus") == "SUCCEEDED", node.diagnose(namespace)
    record = node.record(release)
    assert record["status"] == "succeeded"
    (resume,) = node.metrics(release, "resume")
    assert resume["step"] >= saved[0]["step"] and record["extra"]["resumed_from"]["step"] == resume["step"]
    node.helm("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "120s")


@pytest.mark.skip(reason="not yet seen passing: on its one run (2026-12-06) the head, deleted with its 120 s grace "
                         "period, outlived the 400 steps and the job SUCCEEDED before it went; now deleted at once, "
                         "with more steps, and unrun")
def test_a_deleted_head_pod_is_retried_and_resumes_the_same_run(node):
    """The head Pod deleted mid-run: the Ray cluster's state (GCS, the job) goes with it. With `rayJob.backoffLimit:
    1`, KubeRay retries the RayJob (a new cluster), whose driver resumes the same run from its last checkpoint."""
    release, steps = "head", 2000
    namespace = node.install(release, *PROFILE, "--set", f"run.train.max_steps={steps}",
                             "--set", "run.checkpoint.every_steps=10", "--set", f"run.eval.every_steps={steps}",
                             "--set", "rayJob.backoffLimit=1")
    saved = wait_until("a complete checkpoint", lambda: node.metrics(release, "checkpoint"),
                       timeout_s=600, interval_s=1)
    (head,) = node.pods(namespace, "ray.io/node-type=head")
    node.core.delete_namespaced_pod(head.metadata.name, namespace, grace_period_seconds=0)  # as a crash
    status = node.wait_for_job_end(namespace, timeout_s=1200)
    print(f"RayJob after the head's deletion: {status}")
    assert status.get("jobStatus") == "SUCCEEDED", node.diagnose(namespace)
    record = node.record(release)
    assert record["status"] == "succeeded" and record["run_name"] == release
    (resume,) = node.metrics(release, "resume")
    assert resume["step"] >= saved[0]["step"], resume
    assert record["previous_attempts"], "the first attempt's record kept beside the retry's"
    node.helm("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "120s")


@pytest.mark.parametrize("setting, pod_reason", [
    ("image.tag=no-such-tag", "ErrImageNeverPull"),
    ("worker.cpu=3", "Unschedulable"),
], ids=["bad-image-tag", "more-cpu-than-the-node"])
def test_a_job_that_cannot_start_fails_by_its_deadline_with_a_readable_reason(node, setting, pod_reason):
    """Neither a missing image nor a request the node cannot hold hangs: the RayJob fails once
    `rayJob.preRunningDeadlineSeconds` has passed, and the Pods say why."""
    release = "nostart-" + setting.split("=")[0].split(".")[0]
    namespace = node.install(release, *PROFILE, "--set", setting, "--set", "rayJob.preRunningDeadlineSeconds=30")
    status = node.wait_for_job_end(namespace, timeout_s=240)
    print(f"RayJob that could not start ({setting}): {status}")
    assert (status["jobDeploymentStatus"], status.get("reason")) == ("Failed", "PreRunningDeadlineExceeded"), status
    reasons = set()
    for pod in node.pods(namespace):
        reasons |= {c.state.waiting.reason for c in pod.status.container_statuses or () if c.state.waiting}
        reasons |= {c.reason for c in pod.status.conditions or () if c.reason}
    assert reasons & set(pod_reason.split("|")), reasons
    node.helm("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "120s")
