"""The chart's job in real Pods: `helm install` to SUCCEEDED on a real kubelet, asserting on what the run wrote.

`scripts/k8s-up.sh up --real-node` starts the control plane and one real node (containerd + runc, the CNI bridge,
kubelet, kube-proxy, CoreDNS, the NetworkPolicy controller: kube-network-policies, or kube-router's firewall where
the kernel has no nft `queue`) in a network namespace of its own
(scripts/k8s-node.sh), with the KubeRay operator out of cluster; `scripts/k8s-image.sh import` puts the CPU test
image (the image set's versions) into the node's containerd. The profile is ci/real-pods-values.yaml: a head and
two worker pods, one Ray Train worker each, so gloo crosses pods. Each release's claim is a hostPath
PersistentVolume under the state dir, so the tests read run.json, metrics and checkpoints as the pods wrote them.

They need root (network namespaces, mounts, cgroups): scripts/test.sh runs them as root (its REAL_PODS=auto) by
setting RAY_FINETUNE_REAL_PODS=1; a pytest run without it skips them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
from chart_helpers import REPO
from kubernetes import client, config
from test_k8s_live import ControlPlane, wait_until

UP = REPO / "scripts" / "k8s-up.sh"
IMAGE = REPO / "scripts" / "k8s-image.sh"
PROFILE = ("-f", str(REPO / "ci" / "real-pods-values.yaml"), "-f", str(REPO / "ci" / "real-pods-image.yaml"))
IMAGE_REF = "localhost/ray-finetune-test:image-set"
# The main release's steps: enough that a worker Pod deleted after its first checkpoint dies mid-run.
STEPS = 400
# The main release's second failure, after the deleted worker's: rank 1 killed at this step (a lost worker).
KILLED_AT = 200
# What operators watch (docs/chart.md "Watching a run"), asked of the main release: its RayJob's annotations and
# Events, the PodMonitor (the node's API server has prometheus-operator's CRD) and the Grafana dashboard.
WATCHED = ("--set", "monitoring.podMonitor.enabled=true", "--set", "monitoring.grafanaDashboard.enabled=true")
ANNOTATION = "ray-finetune/"
# What a job ran on and KubeRay deletes by the chart's rules once it ends (with the RayJob itself).
RUN_KINDS = {"RayJob", "RayCluster", "Pod", "Job", "Service"}
# The endings' releases: one worker, small CPU requests (three fit on the node's 2 CPUs at once), a short TTL.
TTL_S = 5
SMALL = ("--set", "worker.replicas=1", "--set", "head.cpu=200m", "--set", "worker.cpu=300m",
         "--set", f"rayJob.ttlSecondsAfterFinished={TTL_S}",
         "--set-json", 'rayJob.submitterResources={"requests": {"cpu": "100m", "memory": "256Mi"}, '
                       '"limits": {"cpu": "100m", "memory": "512Mi"}}')

pytestmark = pytest.mark.skipif(os.environ.get("RAY_FINETUNE_REAL_PODS") != "1",
                                reason="real Pods need root: set RAY_FINETUNE_REAL_PODS=1 (scripts/test.sh does as root)")


class Node(ControlPlane):
    def bind_volume(self, claim: client.V1PersistentVolumeClaim) -> None:
        super().bind_volume(claim)
        # The pods run as uid 1000; a hostPath directory is used as it is found.
        path = self.volume(claim.metadata.namespace, claim.metadata.name)
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o777)

    def volume(self, namespace: str, claim: str) -> Path:
        return self.state / "volumes" / f"pv-{namespace}-{claim}"[:63]

    def run_dir(self, release: str, run: str | None = None) -> Path:
        """The directory of `run` (default: the release's own, named after it) on the release's claim."""
        return self.volume(f"t-{release}", f"{release}-ray-finetune-runs") / (run or release)

    def record(self, release: str, run: str | None = None) -> dict:
        return json.loads((self.run_dir(release, run) / "run.json").read_text())

    def metrics(self, release: str, kind: str) -> list[dict]:
        path = self.run_dir(release) / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return [r for r in rows if r["kind"] == kind]

    def job_status(self, namespace: str) -> dict:
        jobs = self.ray("rayjobs", namespace)
        return jobs[0].get("status", {}) if jobs else {}

    def log(self, pod: str, namespace: str) -> str:
        """A Pod's log as it is (the client's default decoding turns a log that parses as JSON into a repr)."""
        return self.core.read_namespaced_pod_log(pod, namespace, _preload_content=False).data.decode()

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

    def install_long_run(self, release: str, steps: int, checkpoint_every: int, *args: str) -> tuple[str, dict]:
        """`helm install` of the profile over `steps` steps, a checkpoint every `checkpoint_every`, held-out loss at
        the first and last step only; returns once the run has a complete checkpoint on the claim: (namespace, that
        checkpoint's record), the moment to break something mid-run."""
        namespace = self.install(release, *PROFILE, "--set", f"run.train.max_steps={steps}",
                                 "--set", f"run.checkpoint.every_steps={checkpoint_every}",
                                 "--set", f"run.eval.every_steps={steps}", *args)
        saved = wait_until("a complete checkpoint", lambda: self.metrics(release, "checkpoint"),
                           timeout_s=600, interval_s=1)
        return namespace, saved[0]

    def story(self, namespace: str, rayjob: dict) -> list[tuple[str, str, str]]:
        """The driver's Events on `rayjob` (what `kubectl describe rayjob` lists), in the order they happened:
        (type, reason, message)."""
        events = [e for e in self.core.list_namespaced_event(namespace).items
                  if e.involved_object.uid == rayjob["metadata"]["uid"] and e.reporting_component == "ray-finetune-driver"]
        return [(e.type, e.reason, e.message) for e in sorted(events, key=lambda e: e.event_time)]

    def scrape(self, namespace: str, pod: str) -> dict[str, float]:
        """The run's gauges on a Ray pod's metrics port (KubeRay's `metrics`, 8080), read through the API server's
        proxy: `{series with its labels: value}` of the `ray_finetune_*` lines."""
        text = self.core.connect_get_namespaced_pod_proxy_with_path(
            f"{pod}:8080", namespace, "metrics", _preload_content=False, _request_timeout=10).data.decode()
        return {m[1]: float(m[2]) for m in re.finditer(r"^(ray_finetune_\w+\{[^}]*\}) (\S+)$", text, re.M)}

    def wait_for_job_end(self, namespace: str, timeout_s: float = 900, interval_s: float = 3,
                         watch=None) -> dict:
        """The RayJob's status once it ended; `watch()` is called at each look before (what a run shows live)."""
        def look() -> dict:
            if watch:
                watch()
            return self.job_status(namespace)

        try:
            return wait_until("the RayJob to end", look,
                              done=lambda s: s.get("jobDeploymentStatus") in ("Complete", "Failed"),
                              timeout_s=timeout_s, interval_s=interval_s)
        except pytest.fail.Exception:
            print(self.diagnose(namespace))
            raise

    def ran_on(self, namespace: str) -> dict[str, list[str]]:
        """What the release's job ran on that is still there (`RUN_KINDS`)."""
        return {kind: names for kind, names in self.leftovers(namespace).items() if kind in RUN_KINDS}

    def nothing_left_after_ttl(self, namespace: str, ended: float, ttl_s: float = TTL_S) -> None:
        """Nothing the job ran on is left `ttl_s` + 60 s after it ended (`ended`, monotonic seconds)."""
        wait_until(f"nothing the job of {namespace} ran on left {ttl_s} + 60 s after it ended",
                   lambda: self.ran_on(namespace), done=lambda left: not left,
                   timeout_s=max(ended + ttl_s + 60 - time.monotonic(), 0), interval_s=2)

    def events(self, namespace: str, reason: str) -> list[str]:
        """The messages of the Events on the namespace's RayJob with `reason`."""
        return [e.message for e in self.core.list_namespaced_event(namespace).items
                if e.involved_object.kind == "RayJob" and e.reason == reason]


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


class Finished(NamedTuple):
    release: str
    namespace: str
    victim: str  # the worker Pod deleted mid-run
    saved: dict  # the first complete checkpoint, before which the victim was not deleted
    workers: set[str]  # the worker Pods Running at the end
    annotated: list[dict]  # the RayJob's annotations, as seen during the run
    scraped: list[dict]  # the head Pod's ray_finetune_* series, as scraped during the run


@pytest.fixture(scope="module")
def finished(node) -> Finished:
    """One release of the profile run to its end, a worker Pod deleted (`kubectl delete pod`) once the run has a
    complete checkpoint, and rank 1 killed at step `KILLED_AT` of the resumed attempt (`run.debug`; a third
    attempt resumes it: `scaling.max_failures` 2): enough steps that the run cannot end before, so one cluster
    start serves the install, the worker's loss, what the operators watch, `helm test`, the upgrade and the
    uninstall. While it runs, its RayJob's annotations and the head's metrics port are read at every look."""
    release = "run"
    namespace, saved = node.install_long_run(release, STEPS, 10, *WATCHED, "--set", "run.scaling.max_failures=2",
                                             "--set", f"run.debug.fail_at_step={KILLED_AT}", "--set", "run.debug.fail_rank=1")
    victim = node.pods(namespace, "ray.io/node-type=worker")[0].metadata.name
    node.core.delete_namespaced_pod(victim, namespace)
    annotated, scraped = [], []

    def watch() -> None:
        (rayjob,) = node.ray("rayjobs", namespace)
        annotated.append({k: v for k, v in (rayjob["metadata"].get("annotations") or {}).items() if k.startswith(ANNOTATION)})
        for head in node.pods(namespace, "ray.io/node-type=head"):
            with contextlib.suppress(Exception):  # the head or its agent not serving (yet): the next look
                scraped.append(node.scrape(namespace, head.metadata.name))

    status = node.wait_for_job_end(namespace, watch=watch)
    assert status.get("jobStatus") == "SUCCEEDED", node.diagnose(namespace)
    workers = {p.metadata.name for p in node.pods(namespace, "ray.io/node-type=worker")
               if p.status.phase == "Running" and not p.metadata.deletion_timestamp}
    return Finished(release, namespace, victim, saved, workers, annotated, scraped)


def test_install_runs_the_job_to_success_across_two_worker_pods(node, finished):
    record = node.record(finished.release)
    assert record["status"] == "succeeded", record.get("error")
    assert len(finished.workers) == 2 and {w["hostname"] for w in record["workers"]} == finished.workers, \
        "one training worker in each worker Pod"
    assert record["image"]["reference"] == IMAGE_REF
    assert record["image"]["digest"].startswith("sha256:") and record["image"]["consistent"], record["image"]
    evals = {r["step"]: r["eval_loss"] for r in node.metrics(finished.release, "eval")}
    assert list(evals) == [0, STEPS] and evals[STEPS] < evals[0] - 0.1, evals
    assert record["export"]["ok"], record["export"]
    assert (node.run_dir(finished.release) / "export" / "_VALID").exists() or record["export"]["export_dir"]


def test_a_deleted_worker_pod_is_survived_by_resuming(node, finished):
    """The fixture's worker Pod deleted mid-run: KubeRay replaces the Pod, Ray Train (scaling.max_failures: 1)
    restarts the worker group on it, and the run resumes from its last complete checkpoint in the same RayJob;
    the record's workers are the restarted group's."""
    assert finished.victim not in finished.workers, "the deleted worker Pod replaced"
    record = node.record(finished.release)
    resume, killed = node.metrics(finished.release, "resume")  # after the deleted Pod, after the killed rank
    # rank 1 dies as step KILLED_AT begins: the third attempt resumes from the last checkpoint before it
    assert finished.saved["step"] <= resume["step"] < killed["step"] < KILLED_AT, (finished.saved, resume, killed)
    assert record["extra"]["resumed_from"]["step"] == killed["step"], record["extra"]


def test_the_rayjobs_annotations_follow_the_run(node, finished):
    """docs/chart.md "Watching a run": during the run the RayJob's annotations advance with the step; at its end
    they say it succeeded at the last step, with its held-out loss and run directory."""
    steps = [int(a[ANNOTATION + "step"].split("/")[0]) for a in finished.annotated if ANNOTATION + "step" in a]
    assert len(set(steps)) >= 2 and max(steps) > steps[0], finished.annotated  # (a resume goes back a little)
    (rayjob,) = node.ray("rayjobs", finished.namespace)
    notes = rayjob["metadata"]["annotations"]
    assert notes[ANNOTATION + "state"] == "succeeded" and notes[ANNOTATION + "step"] == f"{STEPS}/{STEPS}", notes
    assert notes[ANNOTATION + "run-dir"] == f"/mnt/runs/{finished.release}" and ANNOTATION + "eval-loss" in notes


def test_the_head_pods_metrics_port_has_the_runs_numbers(node, finished):
    """The run's gauges, read during the run through the API server's proxy from the head's metrics port (where the
    PodMonitor points Prometheus): labelled with the run's name, the step advancing, the phases' times there."""
    scraped = [v for s in finished.scraped for k, v in s.items()
               if k.startswith("ray_finetune_step{") and f'run="{finished.release}"' in k]
    assert len(set(scraped)) >= 2 and max(scraped) > scraped[0], finished.scraped[-3:]
    assert any(k.startswith("ray_finetune_phase_seconds{") for s in finished.scraped for k in s)


def test_the_rayjobs_events_tell_the_runs_story_in_order(node, finished):
    """After the run, the driver's Events on the RayJob (`kubectl describe rayjob`) in order: started, checkpoints,
    evaluations, each failure with its class as the reason (the deleted worker's preemption, the killed rank's lost
    worker) followed by the resume, the export, success."""
    (rayjob,) = node.ray("rayjobs", finished.namespace)
    story = node.story(finished.namespace, rayjob)
    reasons = [reason for _, reason, _ in story]
    errors = [a["error"] for a in node.record(finished.release)["previous_attempts"]]
    assert [e["reason"] for e in errors] == ["preempted", "worker_lost"], errors
    assert reasons[0] == "Started" and reasons[-1] == "Succeeded", story
    first, last = reasons.index("Resumed"), len(reasons) - 1 - reasons[::-1].index("Resumed")
    assert (reasons[first - 1], reasons[last - 1]) == ("Preempted", "WorkerLost") and reasons.count("Resumed") == 2
    assert reasons.index("CheckpointSaved") < first < last < reasons.index("ExportAccepted"), story
    assert reasons.count("Evaluated") == 2 and reasons.index("Evaluated") < first, story  # step 0 and the last
    assert [kind for kind, reason, _ in story if reason in ("Preempted", "WorkerLost")] == ["Warning", "Warning"]
    assert f"worker_lost at step {errors[1]['step']}" in story[reasons.index("WorkerLost")][2], story


def test_helm_test_passes_against_the_finished_run(node, finished):
    release, namespace = finished.release, finished.namespace
    result = node.helm("test", release, "--namespace", namespace, "--logs", "--timeout", "300s", check=False)
    assert result.returncode == 0, result.stderr[-3000:] + node.diagnose(namespace)
    assert '"status": "succeeded"' in result.stdout, "the test Pod prints the run's run.json"


def test_upgrade_of_a_finished_run_replaces_the_rayjob_which_finds_the_run_complete(node, finished):
    """docs/chart.md "RayJob name and upgrades": `helm upgrade` with a changed value is a new RayJob (the old one and
    its cluster deleted) for the same run name; docs/checkpoints.md: a finished run is not trained again, its driver
    says so and exits 0, so the new RayJob SUCCEEDED and the run's record is left as it was."""
    release, namespace = finished.release, finished.namespace
    (before,) = node.ray("rayjobs", namespace)
    record_before = node.record(release)
    node.install(release, "--set", "run.train.lr=1.0e-3", upgrade=True)
    (after,) = wait_until("the old RayJob gone and one new one", lambda: node.ray("rayjobs", namespace),
                          done=lambda jobs: len(jobs) == 1 and jobs[0]["metadata"]["uid"] != before["metadata"]["uid"])
    assert after["metadata"]["name"] != before["metadata"]["name"], "a changed value is a new RayJob name"
    status = node.wait_for_job_end(namespace)
    assert status.get("jobStatus") == "SUCCEEDED", node.diagnose(namespace)
    (submitter,) = [p for p in node.pods(namespace, f"batch.kubernetes.io/job-name={after['metadata']['name']}")
                    if p.status.phase == "Succeeded"]
    log = node.log(submitter.metadata.name, namespace)
    assert f"/{release} is already complete" in log and "Nothing to train" in log, log[-3000:]
    assert node.record(release) == record_before, "the finished run's record untouched"


def test_uninstall_leaves_no_pod_container_or_job(node, finished, tmp_path):
    """Nothing of the release is left but its claim, where the run is, with the logs of every attempt: the
    driver's output (what the submitter showed) beside the workers' tracebacks, which `report` reads."""
    release, namespace = finished.release, finished.namespace
    node.helm("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "120s")
    wait_until(f"nothing of {release} left in {namespace}", lambda: node.leftovers(namespace),
               done=lambda left: not left, timeout_s=120)
    wait_until("no container left on the node", node.containers, done=lambda ids: not ids, timeout_s=150, interval_s=3)
    assert node.core.list_namespaced_persistent_volume_claim(namespace).items, "the runs claim is kept"
    run_dir = node.run_dir(release)
    record = json.loads((run_dir / "run.json").read_text())
    logs = run_dir / Path(record["logs"]).relative_to(f"/mnt/runs/{release}")
    driver = (logs / "driver.log").read_text()
    assert "# resolved config" in driver and f"run directory: /mnt/runs/{release}" in driver, driver[-2000:]
    assert "(RayTrainWorker pid=" in driver, "the workers' output, as the driver forwarded it"
    assert "debug.fail_at_step: rank 1" in driver, "the killed rank's last line, as the driver forwarded it"
    # A rank that raised leaves its traceback (rank 0's gloo error, when the killed rank's loss reaches it before
    # Ray Train stops the group: not every time)
    tracebacks = sorted(p.name for p in logs.glob("rank*.log"))
    upgraded = sorted(p for p in (run_dir / "logs").iterdir() if p != logs)  # the upgrade's driver
    assert upgraded and "is already complete" in (upgraded[-1] / "driver.log").read_text()
    report = subprocess.run([sys.executable, "-m", "job", "report", str(run_dir), "--no-plots", "--out", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    text = (tmp_path / "report.md").read_text()
    assert f"- `{logs.name}/`: driver.log (" in text and all(f"{name} (" in text for name in tracebacks), tracebacks
    assert f"The end of `{upgraded[-1].name}/driver.log`" in text and "Nothing to train" in text


def test_warm_cluster_runs_two_jobs_one_after_the_other_on_the_same_head(node):
    """`rayCluster.create`: the release's RayCluster outlives its jobs. The chart's RayJob runs first; a second
    RayJob, the chart's with another name and run (`--set name=...` on the entrypoint), runs on the same cluster
    after it, as another team's job would: both SUCCEEDED, on the same head Pod, and neither deletes the cluster.
    The first run's disk fills in its save at step 6 (`run.debug`): its RayJob's Events tell it, `DiskFull` the
    reason, then the resume; the second job's driver leaves the chart's RayJob alone (it is not its submission)."""
    release, second_run = "warm", "warm-second"
    namespace = node.install(release, *PROFILE, "--set", "rayCluster.create=true",
                             "--set", "run.debug.fail_at_step=6", "--set", "run.debug.fail_mode=disk_full")
    (first,) = node.ray("rayjobs", namespace)
    second = {"apiVersion": "ray.io/v1", "kind": "RayJob",
              "metadata": {"name": f"{first['metadata']['name']}-2", "labels": first["metadata"]["labels"]},
              "spec": {**first["spec"], "entrypoint": f"{first['spec']['entrypoint']} --set name={second_run} "
                                                      "--set debug.fail_at_step=null"}}
    try:
        status = node.wait_for_job_end(namespace)
        assert status.get("jobStatus") == "SUCCEEDED", node.diagnose(namespace)
        first = node.custom.get_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", first["metadata"]["name"])
        told = [(kind, reason) for kind, reason, _ in node.story(namespace, first)]
        assert ("Warning", "DiskFull") in told and told[told.index(("Warning", "DiskFull")) + 1] == ("Normal", "Resumed")
        assert told[-1] == ("Normal", "Succeeded") and told.count(("Normal", "Succeeded")) == 1, told
        (head,) = node.pods(namespace, "ray.io/node-type=head")
        node.custom.create_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", second)
        status = wait_until("the second RayJob to end", lambda: node.custom.get_namespaced_custom_object(
            "ray.io", "v1", namespace, "rayjobs", second["metadata"]["name"]).get("status", {}),
            done=lambda s: s.get("jobDeploymentStatus") in ("Complete", "Failed"), timeout_s=600, interval_s=3)
        assert status.get("jobStatus") == "SUCCEEDED", node.diagnose(namespace)
        assert [p.metadata.uid for p in node.pods(namespace, "ray.io/node-type=head")] == [head.metadata.uid], \
            "the second job ran on the first one's head"
        for run in (release, second_run):
            assert node.record(release, run)["status"] == "succeeded", run
        assert [r for _, r, _ in node.story(namespace, first)].count("Started") == 1, "the second job told nothing"
    finally:  # a failure here must not leave the warm cluster holding the node's CPU for the tests after it
        with contextlib.suppress(client.ApiException):  # not created yet
            node.custom.delete_namespaced_custom_object("ray.io", "v1", namespace, "rayjobs", second["metadata"]["name"])
        node.helm("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "120s")
    wait_until(f"nothing of {release} left in {namespace}", lambda: node.leftovers(namespace),
               done=lambda left: not left, timeout_s=120)


# Connects to each of the head's Ray ports and prints `<port> connected|refused|timed out` per port.
REACH = """
import socket, sys
host, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
def reach(port):
    try:
        socket.create_connection((host, port), timeout=5).close()
        return "connected"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "timed out"
for port in ports:
    print(port, reach(port))
"""
HEAD_PORTS = {"6379": "GCS", "8265": "dashboard"}


def test_network_policy_keeps_other_pods_off_the_head_while_the_run_works(node):
    """The chart's NetworkPolicy, enforced by the node's controller (kube-network-policies, or kube-router's firewall
    where nft has no `queue`): a Pod outside the release cannot open the head's GCS or dashboard port (job
    submission: code execution with the release's token and claim), while the release's own Pods still form the
    cluster and the run SUCCEEDs. The operator, out of cluster, reaches the dashboard through the API server, whose
    connections come from the node's bridge address: `networkPolicy.extraFrom` admits it. kube-network-policies drops
    the outsider's packets (its connections time out), kube-router rejects them (refused: both ports listen, so
    nothing but the policy refuses)."""
    unenforced = node.state / "NETWORK_POLICIES_UNENFORCED"
    if unenforced.exists():
        pytest.skip(f"NetworkPolicy not enforced on this node (docs/chart.md, \"Real pods\"): "
                    f"{unenforced.read_text().strip()}")
    release = "netpol"
    namespace = node.install(release, *PROFILE, "--set", "networkPolicy.enabled=true",
                             "--set-json", 'networkPolicy.extraFrom=[{"ipBlock": {"cidr": "10.244.0.1/32"}}]')
    outsider = "outsider"
    try:
        head = wait_until("the head Pod Ready", lambda: [
            p for p in node.pods(namespace, "ray.io/node-type=head")
            if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or ())],
            timeout_s=300, interval_s=2)[0]
        node.core.create_namespace({"metadata": {"name": outsider}})
        node.core.create_namespaced_pod(outsider, {"metadata": {"name": "probe"}, "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "probe", "image": IMAGE_REF, "imagePullPolicy": "Never",
                            "command": ["python", "-c", REACH, head.status.pod_ip, *HEAD_PORTS],
                            "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}}}]}})
        wait_until("the probe Pod to end", lambda: node.core.read_namespaced_pod("probe", outsider).status.phase,
                   done=lambda phase: phase in ("Succeeded", "Failed"), timeout_s=120, interval_s=2)
        reached = dict(line.split(" ", 1) for line in node.log("probe", outsider).splitlines())
        assert reached.keys() == HEAD_PORTS.keys() and set(reached.values()) <= {"timed out", "refused"}, \
            f"{reached} ({HEAD_PORTS})"
        status = node.wait_for_job_end(namespace)
        assert status.get("jobStatus") == "SUCCEEDED", node.diagnose(namespace)
    finally:  # a failure here must not leave the node's CPU taken for the tests after it
        with contextlib.suppress(client.ApiException):  # not created yet
            node.core.delete_namespace(outsider)
        node.helm("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "120s")


def test_a_deleted_head_pod_is_retried_and_resumes_the_same_run(node):
    """The head Pod deleted mid-run, as a crash (grace period 0): the Ray cluster's state (GCS, the job) and the
    driver go with it. Deleted once the run has a complete checkpoint on the claim, with steps enough left that the
    attempt's workers, alive until their raylets give up on the GCS (4-30 s seen, at ~14 steps/s; Ray's
    `gcs_rpc_server_reconnect_timeout_s` is 60 s), cannot finish the run. The driver KubeRay starts again (on the
    recreated head, or with `rayJob.backoffLimit: 1` on a new cluster) takes the dead driver's lease over and resumes
    the same run from its newest complete checkpoint, and the RayJob ends SUCCEEDED."""
    release, steps = "head", 1500
    namespace, saved = node.install_long_run(release, steps, 20, "--set", "rayJob.backoffLimit=1")
    try:
        (head,) = node.pods(namespace, "ray.io/node-type=head")
        node.core.delete_namespaced_pod(head.metadata.name, namespace, grace_period_seconds=0)
        status = node.wait_for_job_end(namespace, timeout_s=1200)
        assert status.get("jobStatus") == "SUCCEEDED", node.diagnose(namespace)
        record = node.record(release)
        assert record["status"] == "succeeded" and record["run_name"] == release
        # KubeRay (docs/chart.md "RayJob name and upgrades") resubmits the job to the head it recreates (whose
        # driver watches the dead one's lease until it is stale), or retries the RayJob on a new cluster: either
        # driver takes the dead one's lease over.
        assert (record["lease"]["took_over"] or {}).get("pod") == head.metadata.name, \
            (record["lease"], record["previous_attempts"])
        (first,) = record["previous_attempts"]
        # The attempt's workers die together (the retry finds the record `running`: abandoned, driver_lost) or one
        # first, and rank 0 records its peer's gloo connection error (failed, worker_lost).
        assert (first["status"], first["error"]["reason"]) in {("abandoned", "driver_lost"), ("failed", "worker_lost")}, \
            first
        (resume,) = node.metrics(release, "resume")
        assert saved["step"] <= resume["step"] < steps, (saved, resume)
        assert record["extra"]["resumed_from"]["step"] == resume["step"] and record["extra"]["resumed_from"]["data_exact"]
    finally:  # a failure here must not leave the node's CPU taken for the tests after it
        node.helm("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "120s")


def test_an_uninstall_mid_run_saves_and_the_reinstall_resumes_there_then_leaves_nothing_at_its_ttl(node):
    """`helm uninstall` of a running job: KubeRay stops the Ray job (`ray job stop`: SIGTERM to the driver), whose
    driver has the workers save at their next log step and records the run `cancelled` at that checkpoint before it
    stops them; nothing of the job is left. The Pods' own SIGTERMs race that stop: where they reach the workers
    first, the ranks save for a preemption instead (`failed`/`preempted` at that checkpoint, seen once in three
    runs). Either way the re-install resumes from that save, trains no step twice, succeeds, and its RayJob,
    cluster, Pods and submitter Job are gone once its TTL has passed (the chart's deletion rules)."""
    release, checkpoint_every = "stop", 50
    namespace, saved = node.install_long_run(release, 3000, checkpoint_every,
                                             "--set", f"rayJob.ttlSecondsAfterFinished={TTL_S}")
    trained = lambda: max((r["step"] for r in node.metrics(release, "train")), default=0)  # noqa: E731
    wait_until("steps after the first checkpoint", trained, done=lambda step: step > saved["step"] + 5, interval_s=0.2)
    node.helm("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "120s")
    wait_until(f"nothing of {release} left in {namespace}", lambda: node.ran_on(namespace),
               done=lambda left: not left, timeout_s=120, interval_s=2)
    record = node.record(release)
    err = record["error"] or {}
    assert (record["status"], err.get("class"), err.get("reason"), err.get("exception")) in (
        ("cancelled", "cancelled", "signal", "Stopped"), ("failed", "infrastructure", "preempted", "Preempted")), record
    stopped = err["step"]
    assert stopped > saved["step"] + 5, (saved, err)  # uninstalled after those steps: the stop's own save
    assert record["checkpoints"]["latest"].endswith(f"checkpoint_{stopped:08d}"), record["checkpoints"]
    assert (node.run_dir(release) / f"checkpoint_{stopped:08d}").is_dir()

    end = stopped + 20
    namespace = node.install(release, *PROFILE, "--set", f"run.train.max_steps={end}",
                             "--set", f"run.checkpoint.every_steps={checkpoint_every}",
                             "--set", f"run.eval.every_steps={end}", "--set", f"rayJob.ttlSecondsAfterFinished={TTL_S}")
    status = node.wait_for_job_end(namespace, interval_s=1)
    ended = time.monotonic()
    assert status.get("jobStatus") == "SUCCEEDED", node.diagnose(namespace)
    record = node.record(release)
    assert record["status"] == "succeeded" and record["previous_attempts"][-1]["status"] == "cancelled"
    assert [r["step"] for r in node.metrics(release, "resume")] == [stopped]
    assert [r["step"] for r in node.metrics(release, "train")] == list(range(1, end + 1)), "each step trained once"
    node.nothing_left_after_ttl(namespace, ended)
    node.helm("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "120s")


# Each a release that ends another way, all at once on the node (`SMALL`: the three that start take 1.8 of its
# 2 CPUs; the one that cannot start holds only its head's 100m).
ENDINGS = {
    # A data source that is not there: the head's data staging says so in seconds (an Event, run.json), the driver
    # ends the run with it.
    "missing data": ("--set", "run.data.train=/mnt/runs/no-such/train.txt"),
    # A bug in training: a rank's exception at step 5, no retry.
    "failed in training": ("--set", "run.debug.fail_at_step=5", "--set", "run.debug.fail_mode=exception",
                           "--set", "run.scaling.max_failures=0"),
    # The RayJob's active deadline, while it trains: KubeRay fails the RayJob but leaves the Ray job running; its
    # deletion at the TTL stops it, and the driver has the workers save first.
    "active deadline": ("--set", "rayJob.activeDeadlineSeconds=150", "--set", "run.train.max_steps=100000",
                        "--set", "run.eval.every_steps=100000", "--set", "run.checkpoint.every_steps=100"),
    # Neither a missing image nor a request the node cannot hold hangs: the head's image is not on the node (pull
    # policy Never) and each worker asks more CPU than the node has; the RayJob fails by its pre-running deadline.
    "cannot start": ("--set", "image.tag=no-such-tag", "--set", "head.cpu=100m", "--set", "worker.cpu=3",
                     "--set", "rayJob.preRunningDeadlineSeconds=60"),
}


def test_every_failed_ending_says_why_and_leaves_nothing_after_its_ttl(node):
    """Four releases at once, each ending another way; each says why on its RayJob (and, once it ran, in
    run.json), and nothing it ran on (its RayJob, RayCluster, Pods, submitter Job, Services) is left once its TTL
    has passed: the chart's rules name `jobDeploymentStatus: Failed`, which a deadline leaves with jobStatus
    RUNNING (kuberay#5184)."""
    began = time.monotonic()
    releases = {ending: f"end-{i}" for i, ending in enumerate(ENDINGS)}
    namespaces, installed = {}, {}
    for ending, args in ENDINGS.items():
        namespaces[ending] = node.install(releases[ending], *PROFILE, *SMALL, *args)
        installed[ending] = time.monotonic()
    try:
        # The missing data path's Event within 30 s of its release's install, its record within 45
        data = namespaces["missing data"]
        (event,) = wait_until("the staging's Event on the RayJob", lambda: node.events(data, "DataStagingFailed"),
                              timeout_s=max(installed["missing data"] + 30 - time.monotonic(), 0), interval_s=1)
        assert event.startswith("run.data.train: /mnt/runs/no-such/train.txt does not exist"), event
        # the Event first, then the record (job/driver/staging.py), within seconds
        recorded = lambda: (node.run_dir(releases["missing data"]) / "run.json").exists()  # noqa: E731
        wait_until("the staging's run.json", recorded,
                   timeout_s=max(installed["missing data"] + 45 - time.monotonic(), 0), interval_s=1)
        record = node.record(releases["missing data"])
        assert (record["status"], record["error"]["class"]) == ("failed", "data") and event in record["error"]["message"]

        unstarted = namespaces["cannot start"]

        def reasons() -> dict[str, set[str]]:
            seen: dict[str, set[str]] = {}
            for pod in node.pods(unstarted):
                seen.setdefault(pod.metadata.labels.get("ray.io/node-type"), set()).update(
                    {c.state.waiting.reason for c in pod.status.container_statuses or () if c.state.waiting},
                    {c.reason for c in pod.status.conditions or () if c.reason})
            return seen

        seen = wait_until("the head's ErrImageNeverPull and the workers' Unschedulable", reasons,
                          done=lambda r: "ErrImageNeverPull" in r.get("head", ()) and "Unschedulable" in r.get("worker", ()),
                          timeout_s=60, interval_s=1)
        print(f"why the Pods did not start: {seen}")

        left = dict(namespaces)
        statuses = {}
        while left:  # each ending's TTL counts from its own end
            for ending, namespace in list(left.items()):
                status = node.job_status(namespace)
                if status.get("jobDeploymentStatus") in ("Complete", "Failed"):
                    statuses[ending] = (status, time.monotonic())
                    del left[ending]
            assert time.monotonic() < began + 900, {e: node.job_status(n) for e, n in left.items()}
            time.sleep(1)
        print({ending: status for ending, (status, _) in statuses.items()})
        for ending, (status, ended) in statuses.items():
            node.nothing_left_after_ttl(namespaces[ending], ended)

        status = statuses["missing data"][0]
        assert (status["jobDeploymentStatus"], status.get("reason"), status.get("jobStatus")) == \
            ("Failed", "AppFailed", "FAILED"), status
        assert "run.data.train: /mnt/runs/no-such/train.txt does not exist" in status.get("message", ""), status
        assert node.record(releases["missing data"]) == record, "the driver added no record"

        status = statuses["failed in training"][0]
        assert (status["jobDeploymentStatus"], status.get("reason"), status.get("jobStatus")) == \
            ("Failed", "AppFailed", "FAILED"), status
        record = node.record(releases["failed in training"])
        assert record["status"] == "failed" and "injected failure at step 5" in record["error"]["message"], record

        status = statuses["active deadline"][0]
        assert (status["jobDeploymentStatus"], status.get("reason"), status.get("jobStatus")) == \
            ("Failed", "DeadlineExceeded", "RUNNING"), status
        record = node.record(releases["active deadline"])
        assert (record["status"], record["error"]["exception"]) == ("cancelled", "Stopped"), record["error"]

        status = statuses["cannot start"][0]
        assert (status["jobDeploymentStatus"], status.get("reason")) == ("Failed", "PreRunningDeadlineExceeded"), status
    finally:  # the node's CPU free for the tests after it
        for ending, namespace in namespaces.items():
            node.helm("uninstall", releases[ending], "--namespace", namespace, "--wait", "--timeout", "120s",
                      check=False)
