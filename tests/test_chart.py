"""The Helm chart at the repository root: lint, render, validate every object, reject bad values, package.

Needs the pinned helm (scripts/install-helm.sh) and ../shared/kuberay-crds/; no Kubernetes API server.
"""

import json
import re
import shutil
import subprocess
import sys
import tarfile

import jsonschema
import pytest
import yaml

from chart_helpers import (
    REPO,
    by_kind,
    helm,
    one,
    profile_commands,
    render,
    render_error,
    run_config,
    validate,
)

from job import __version__ as job_version
from job.config import json_schema, load_dict

PROFILE_COMMANDS = profile_commands()
# Every combination shown in the profiles' comments, plus the chart's own modes.
COMBINATIONS = {
    "defaults": [],
    **PROFILE_COMMANDS,
    "warm cluster": ["--set", "rayCluster.create=true"],
    "warm cluster with Kueue": ["--set", "rayCluster.create=true", "--set", "kueue.queueName=team-a"],
    "Kueue": ["--set", "kueue.queueName=team-a"],
    "s3 storage with credentials": ["--set", "storage.uri=s3://bucket/runs", "--set", "storage.existingSecret=s3-creds"],
    "existing claim, digest, deadlines": [
        "--set", "storage.existingClaim=shared-runs",
        "--set", "image.digest=sha256:" + "a" * 64,
        "--set", "rayJob.activeDeadlineSeconds=86400", "--set", "rayJob.preRunningDeadlineSeconds=1800",
    ],
    "deletion rules": ["-f", "tests/fixtures/deletion-rules.yaml"],
    "HTTPMode": ["--set", "rayJob.submissionMode=HTTPMode"],
    "SidecarMode": ["--set", "rayJob.submissionMode=SidecarMode"],
}
INVALID_VALUES = sorted((REPO / "tests" / "fixtures" / "invalid-values").glob("*.yaml"))
SCHEMA = json.loads((REPO / "values.schema.json").read_text())


def ray_pod_specs(objects):
    """(group, pod template) of every Ray pod: head and worker groups, of the RayJob or the RayCluster."""
    for obj in objects:
        if obj["kind"] not in ("RayJob", "RayCluster"):
            continue
        spec = obj["spec"].get("rayClusterSpec") if obj["kind"] == "RayJob" else obj["spec"]
        if spec:
            yield "head", spec["headGroupSpec"]
            for group in spec["workerGroupSpecs"]:
                yield group["groupName"], group


def test_profiles_start_with_their_install_command():
    for profile in sorted((REPO / "values").glob("*.yaml")):
        first = profile.read_text().splitlines()[0]
        assert first.startswith("# helm install "), f"{profile.name}: first line must give its install command"
    assert {name.split(":")[0] for name in PROFILE_COMMANDS} == {p.name for p in (REPO / "values").glob("*.yaml")}


@pytest.mark.parametrize("args", COMBINATIONS.values(), ids=COMBINATIONS.keys())
def test_lint_strict(args):
    helm("lint", "--strict", ".", *args)


@pytest.mark.parametrize("args", COMBINATIONS.values(), ids=COMBINATIONS.keys())
def test_every_rendered_object_is_valid(args):
    objects = render(*args)
    assert {o["kind"] for o in objects} >= {"RayJob", "ConfigMap", "ServiceAccount", "Role", "RoleBinding", "Pod"}
    for obj in objects:
        validate(obj)
    # The rendered run config is one the job accepts.
    load_dict(run_config(objects))


@pytest.mark.parametrize("values_file", INVALID_VALUES, ids=[p.stem for p in INVALID_VALUES])
def test_invalid_values_are_rejected_naming_the_field(values_file):
    header = values_file.read_text().splitlines()[0]
    assert header.startswith("# expect: ") and len(header) > len("# expect: "), "first line: # expect: <message>"
    assert header.removeprefix("# expect: ") in render_error("-f", str(values_file.relative_to(REPO)))


def test_validation_catches_unknown_fields():
    rayjob = one(render(), "RayJob")
    rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["bogus"] = 1
    with pytest.raises(AssertionError, match="bogus"):
        validate(rayjob)


# ---------------------------------------------------------------------------------------------------------------------
# values.schema.json and values.yaml in step with each other and with the job's config schema
# ---------------------------------------------------------------------------------------------------------------------


def test_run_schema_is_generated_from_the_job_config():
    assert SCHEMA["properties"]["run"] == json_schema(), "run scripts/gen-values-schema.py"
    subprocess.run([sys.executable, "scripts/gen-values-schema.py", "--check"], cwd=REPO, check=True)


def test_schema_is_strict_throughout():
    def walk(node, path):
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node:
                assert node.get("additionalProperties") is False, f"{path}: additionalProperties must be false"
            for key, value in node.items():
                walk(value, f"{path}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}/{i}")

    walk(SCHEMA, "")


def test_values_yaml_matches_the_schema():
    values = yaml.safe_load((REPO / "values.yaml").read_text())
    jsonschema.Draft7Validator(SCHEMA).validate(values)

    # Every key of values.yaml is described in the schema (not only allowed), and every chart value the schema
    # describes has a default in values.yaml.
    def compare(value, schema, path):
        if not (isinstance(value, dict) and "properties" in schema):
            return
        assert set(value) <= set(schema["properties"]), f"{path}: not in the schema: {set(value) - set(schema['properties'])}"
        for key, sub in value.items():
            compare(sub, schema["properties"][key], f"{path}.{key}")

    compare(values, SCHEMA, "values")
    chart_keys = set(SCHEMA["properties"]) - {"raylib"}
    assert chart_keys == set(values), f"schema and values.yaml differ: {chart_keys ^ set(values)}"


def test_every_value_is_documented():
    """helm-docs style: every value has a `# --` comment; a parent of documented keys needs none, and the
    contents of a documented value (e.g. efa.env's variables) are part of it. run: is documented by its schema."""
    lines = (REPO / "values.yaml").read_text().splitlines()
    documented_ancestors = []  # (indent, documented) of the keys enclosing the current line
    for i, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z][\w-]*):", line)
        if not match:
            continue
        indent = len(match.group(1))
        while documented_ancestors and documented_ancestors[-1][0] >= indent:
            documented_ancestors.pop()
        comments = []
        for above in reversed(lines[:i]):
            if not above.strip().startswith("#"):
                break
            comments.append(above.strip())
        documented = any(c.startswith("# --") for c in comments) or match.group(2) == "run"
        following = next((l for l in lines[i + 1 :] if l.strip() and not l.strip().startswith("#")), "")
        is_parent = re.match(r"^\s*[A-Za-z][\w-]*:", following) and len(following) - len(following.lstrip()) > indent
        inside_documented = any(d for _, d in documented_ancestors)
        assert documented or inside_documented or is_parent, f"values.yaml:{i + 1} {line.strip()}: no '# --' comment"
        documented_ancestors.append((indent, documented or inside_documented))


def test_default_run_config_loads_in_the_job():
    values = yaml.safe_load((REPO / "values.yaml").read_text())
    load_dict({**values["run"], "name": "check"})
    assert load_dict(run_config(render())).name == "exp1"


def test_runtime_env_pins_match_requirements():
    pins = {l.split("==")[0]: l for l in (REPO / "requirements.txt").read_text().splitlines() if "==" in l}
    values = yaml.safe_load((REPO / "values.yaml").read_text())
    for requirement in values["runtimeEnv"]["pip"]:
        assert pins[requirement.split("==")[0]] == requirement


# ---------------------------------------------------------------------------------------------------------------------
# What the objects say
# ---------------------------------------------------------------------------------------------------------------------


def test_run_config_is_derived_from_release_storage_and_worker_groups():
    config = run_config(render("-f", "values/synthetic.yaml", "-f", "values/eks-g6-efa.yaml", release="exp7"))
    assert config["name"] == "exp7"
    assert config["storage_path"] == "/mnt/runs"
    assert config["scaling"] | {"max_failures": 0} == {
        "num_workers": 8, "use_gpu": True, "cpus_per_worker": 11, "max_failures": 0
    }
    # The hardware profile, given last, fits the fastest workload settings into 24 GB L4s.
    assert (config["train"]["micro_batch_size"], config["train"]["loss_chunk_size"]) == (1, 1024)
    assert config["parallel"]["compile"] and config["parallel"]["reshard_after_forward"]
    assert run_config(render("--set", "storage.uri=s3://b/p"))["storage_path"] == "s3://b/p"
    cpu = run_config(render("-f", "values/cpu-smoke.yaml"))["scaling"]
    assert (cpu["num_workers"], cpu["use_gpu"], cpu["cpus_per_worker"]) == (2, False, 1)
    named = run_config(render("--set", "run.name=shared-run", "--set", "run.scaling.num_workers=1"))
    assert named["name"] == "shared-run" and named["scaling"]["num_workers"] == 1


def test_one_pod_template_for_head_and_workers():
    for args in (["-f", "values/eks-g6-efa.yaml"], ["--set", "rayCluster.create=true"]):
        groups = dict(ray_pod_specs(render(*args)))
        head, worker = groups["head"]["template"], groups["workers"]["template"]
        assert head["spec"]["volumes"] == worker["spec"]["volumes"]
        assert head["metadata"]["annotations"] == worker["metadata"]["annotations"]
        head_env = [e["name"] for e in head["spec"]["containers"][0]["env"]]
        assert head_env == [e["name"] for e in worker["spec"]["containers"][0]["env"]]


def test_ray_pods_get_the_job_environment_and_mounts():
    objects = render("--set", "huggingface.existingSecret=hf", "--set", "image.digest=sha256:" + "b" * 64)
    expected_image = "rayproject/ray@sha256:" + "b" * 64
    for _, group in ray_pod_specs(objects):
        spec = group["template"]["spec"]
        container = spec["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        assert set(env) >= {"JOB_CHART", "JOB_CHART_VERSION", "JOB_RELEASE", "JOB_VALUES_SHA256", "JOB_IMAGE",
                            "POD_NAME", "POD_NAMESPACE", "HF_TOKEN", "PYTHONPATH"}
        assert env["JOB_IMAGE"]["value"] == container["image"] == expected_image
        assert env["JOB_RELEASE"]["value"] == "exp1" and env["JOB_CHART"]["value"] == "ray-finetune"
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "HF_TOKEN"}
        assert re.fullmatch(r"[0-9a-f]{64}", env["JOB_VALUES_SHA256"]["value"])
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {"/opt/job/job", "/etc/job", "/mnt/runs", "/dev/shm"} <= mounts
        assert env["PYTHONPATH"]["value"] == "/opt/job"
        assert spec["serviceAccountName"] == "exp1-ray-finetune"
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    rayjob = one(objects, "RayJob")
    assert rayjob["spec"]["entrypoint"] == "python -m job --config /etc/job/run.yaml"


def test_job_code_configmap_ships_the_package():
    cm = [c for c in by_kind(render(), "ConfigMap") if "__main__.py" in c["data"]][0]
    shipped = {p.name for p in (REPO / "job").iterdir() if p.is_file() and p.suffix in (".py", ".json")}
    assert set(cm["data"]) == shipped
    for name in shipped:
        assert cm["data"][name] == (REPO / "job" / name).read_text()
    assert len(json.dumps(cm["data"])) < 900_000, "a ConfigMap holds at most 1 MiB"


def test_num_gpus_follows_the_gpu_request():
    for name, group in ray_pod_specs(render("-f", "values/eks-g6-efa.yaml")):
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert group["rayStartParams"]["num-gpus"] == str(limits.get("nvidia.com/gpu", 0))
        if name != "head":
            assert limits["vpc.amazonaws.com/efa"] == 1 and limits["nvidia.com/gpu"] == 4


def test_efa_switch_sets_the_nccl_environment():
    for args, expected in ((["-f", "values/eks-g6-efa.yaml"], True), ([], False)):
        for _, group in ray_pod_specs(render(*args)):
            env = {e["name"] for e in group["template"]["spec"]["containers"][0]["env"]}
            assert ({"FI_PROVIDER", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG"} <= env) is expected


def test_checksums_follow_run_config_and_code():
    def annotations(*args):
        _, head = next(ray_pod_specs(render(*args)))
        return head["template"]["metadata"]["annotations"]

    base = annotations()
    changed = annotations("--set", "run.train.max_steps=7")
    assert changed["checksum/config"] != base["checksum/config"]
    assert changed["checksum/job"] == base["checksum/job"]


def test_rayjob_name_changes_with_content_not_run_name():
    base, changed = render(), render("--set", "run.train.max_steps=7")
    assert one(base, "RayJob")["metadata"]["name"] != one(changed, "RayJob")["metadata"]["name"]
    assert run_config(base)["name"] == run_config(changed)["name"] == "exp1"
    assert one(base, "RayJob")["metadata"]["name"] == one(render(), "RayJob")["metadata"]["name"]
    long = one(render(release="a-very-long-release-name-for-an-experiment-x"), "RayJob")["metadata"]["name"]
    assert len(long) <= 47


def test_warm_cluster_is_selected_not_embedded():
    objects = render("--set", "rayCluster.create=true", "--set", "kueue.queueName=team-a")
    rayjob, cluster = one(objects, "RayJob"), one(objects, "RayCluster")
    assert "rayClusterSpec" not in rayjob["spec"] and "suspend" not in rayjob["spec"]
    assert rayjob["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert cluster["spec"]["suspend"] is True
    assert cluster["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"


def test_kueue_suspends_the_rayjob():
    rayjob = one(render("--set", "kueue.queueName=team-a"), "RayJob")
    assert rayjob["spec"]["suspend"] is True and rayjob["spec"]["shutdownAfterJobFinishes"] is True
    assert rayjob["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"


def test_storage_modes():
    assert one(render(), "PersistentVolumeClaim")["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    for args in (["--set", "storage.uri=s3://b/p"], ["--set", "storage.existingClaim=mine"]):
        assert not by_kind(render(*args), "PersistentVolumeClaim")
    _, head = next(ray_pod_specs(render("--set", "storage.existingClaim=mine")))
    claims = [v["persistentVolumeClaim"]["claimName"] for v in head["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v]
    assert claims == ["mine"]


def test_role_is_least_privilege():
    objects = render()
    rules = one(objects, "Role")["rules"]
    assert rules == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
        {"apiGroups": ["ray.io"], "resources": ["rayjobs"], "resourceNames": [one(objects, "RayJob")["metadata"]["name"]], "verbs": ["get"]},
    ]


def test_notes_give_commands_for_this_release():
    notes = helm("install", "exp1", ".", "--dry-run=client", "--namespace", "experiments").stdout
    notes = notes[notes.index("NOTES:"):]
    rayjob = one(render(), "RayJob")["metadata"]["name"]
    for command in (f"kubectl -n experiments get rayjob {rayjob} -w", f"kubectl -n experiments logs -f job/{rayjob}",
                    "helm test exp1 -n experiments --logs", "/mnt/runs/exp1/metrics.jsonl"):
        assert command in notes


# ---------------------------------------------------------------------------------------------------------------------
# Packaging
# ---------------------------------------------------------------------------------------------------------------------


def test_chart_version_tracks_the_job_package():
    chart = yaml.safe_load((REPO / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == job_version


def chart_copy(tmp_path):
    """The chart's files (as a fresh clone has them) in a temporary directory."""
    copy = tmp_path / "chart"
    copy.mkdir()
    for name in ("Chart.yaml", "Chart.lock", "values.yaml", "values.schema.json", ".helmignore"):
        shutil.copy(REPO / name, copy / name)
    for name in ("templates", "charts/raylib", "job", "values"):
        shutil.copytree(REPO / name, copy / name, ignore=shutil.ignore_patterns("__pycache__", "*.tgz"))
    return copy


def test_dependency_build_reproduces_chart_lock_offline(tmp_path):
    copy = chart_copy(tmp_path)
    helm("dependency", "build", ".", cwd=copy)
    assert (copy / "Chart.lock").read_text() == (REPO / "Chart.lock").read_text()
    helm("dependency", "update", ".", "--skip-refresh", cwd=copy)
    regenerated, committed = (yaml.safe_load((p / "Chart.lock").read_text()) for p in (copy, REPO))
    assert {k: v for k, v in regenerated.items() if k != "generated"} == {k: v for k, v in committed.items() if k != "generated"}


def test_package_contains_the_job_and_renders_the_same(tmp_path):
    helm("package", ".", "--destination", str(tmp_path))
    (package,) = tmp_path.glob("ray-finetune-*.tgz")
    with tarfile.open(package) as tar:
        names = set(tar.getnames())
    job_files = {f"ray-finetune/job/{p.name}" for p in (REPO / "job").iterdir() if p.is_file() and p.suffix in (".py", ".json")}
    assert job_files <= names
    assert "ray-finetune/charts/raylib/templates/_raycluster.tpl" in names
    assert not any(n.startswith(("ray-finetune/tests/", "ray-finetune/.tools/", "ray-finetune/.venv/")) for n in names)
    args = ("-f", "values/cpu-smoke.yaml")
    assert render(*args, chart=str(package)) == render(*args)
