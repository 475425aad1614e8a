"""The real-pod tests' image (scripts/k8s-image.sh, docs/chart.md "Test image"), in the parts that need no root,
Debian mirror or containerd: the values overlay that points the chart at it, its OCI packaging
(scripts/oci-image.py), and its cache key. The image itself runs in the real-pod tests."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest
import yaml

from chart_helpers import REPO, by_kind, render

OVERLAY = "ci/real-pods-image.yaml"
IMAGE = "localhost/ray-finetune-test:image-set"


def test_overlay_runs_every_container_on_the_test_image_with_nothing_installed():
    overlay = yaml.safe_load((REPO / OVERLAY).read_text())
    assert set(overlay) == {"image", "rayVersion", "runtimeEnv", "extraEnv"}, "only the image's own keys"
    objects = render("-f", "values/cpu-smoke.yaml", "-f", OVERLAY)
    containers = [
        container
        for obj in objects
        for spec in _pod_specs(obj)
        for container in spec.get("initContainers", []) + spec["containers"]
    ]
    assert len(containers) >= 4, "head, worker, submitter and the helm test pod"
    assert {(c["name"], c["image"], c.get("imagePullPolicy")) for c in containers} == {
        (c["name"], IMAGE, "Never") for c in containers
    }
    (rayjob,) = by_kind(objects, "RayJob")
    # cpu-smoke's runtime `pip` list (Ray would install it in every pod, and pods reach no index) is gone: Ray reads
    # `pip: null` as no pip environment (RuntimeEnv skips None).
    assert (yaml.safe_load(rayjob["spec"].get("runtimeEnvYAML") or "{}") or {}).get("pip") is None
    assert rayjob["spec"]["rayClusterSpec"]["rayVersion"] == "2.58.0"
    ray_containers = [c for c in containers if c["name"] in ("ray-head", "ray-worker")]
    assert ray_containers and all({"name": "HOME", "value": "/tmp"} in c["env"] for c in ray_containers)


def _pod_specs(obj: dict) -> list[dict]:
    if obj["kind"] == "Pod":
        return [obj["spec"]]
    if obj["kind"] != "RayJob":
        return []
    cluster = obj["spec"]["rayClusterSpec"]
    return [
        cluster["headGroupSpec"]["template"]["spec"],
        *(group["template"]["spec"] for group in cluster["workerGroupSpecs"]),
        obj["spec"]["submitterPodTemplate"]["spec"],
    ]


@pytest.mark.skipif(shutil.which("zstd") is None, reason="zstd not installed (apt-get install -y zstd)")
def test_oci_archive_holds_each_layer_under_its_digest_and_names_both_references(tmp_path):
    layer_tars = []
    for i, files in enumerate([{"etc/os-release": b"ID=debian\n"}, {"opt/venv/x.py": b"print(1)\n" * 5000}]):
        root = tmp_path / f"root{i}"
        for name, data in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(data)
        layer_tars.append(subprocess.run(["tar", "-C", root, "-cf", "-", "."], capture_output=True, check=True).stdout)
    archive = tmp_path / "image.oci.tar"
    helper = [sys.executable, str(REPO / "scripts" / "oci-image.py")]
    for data in layer_tars:
        subprocess.run([*helper, "layer", archive], input=data, check=True)
    config = {"config": {"Cmd": ["bash"], "WorkingDir": "/workspace"}, "history": []}
    refs = ["localhost/ray-finetune-test:0123456789ab", IMAGE]
    subprocess.run([*helper, "finish", archive, json.dumps(config), *(a for r in refs for a in ("--ref", r))], check=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["image.oci.tar", "root0", "root1"], "no partial files left"

    with tarfile.open(archive) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    for name, data in members.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.removeprefix("blobs/sha256/"), name
    assert json.loads(members["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads(members["index.json"])
    assert [m["annotations"]["io.containerd.image.name"] for m in index["manifests"]] == refs
    manifest = json.loads(_blob(members, index["manifests"][0]))
    image_config = json.loads(_blob(members, manifest["config"]))
    assert image_config["config"] == config["config"]
    assert [layer["mediaType"] for layer in manifest["layers"]] == ["application/vnd.oci.image.layer.v1.tar+zstd"] * 2
    unpacked = [
        subprocess.run(["zstd", "-d", "-c"], input=_blob(members, layer), capture_output=True, check=True).stdout
        for layer in manifest["layers"]
    ]
    assert unpacked == layer_tars
    assert image_config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(t).hexdigest() for t in layer_tars]


def _blob(members: dict[str, bytes], descriptor: dict) -> bytes:
    data = members["blobs/sha256/" + descriptor["digest"].removeprefix("sha256:")]
    assert len(data) == descriptor["size"]
    return data


def test_a_build_of_the_same_inputs_is_the_cached_archive_and_new_inputs_a_new_reference(tmp_path):
    """The reference is the hash of requirements-image.txt and the build's scripts: a copy of them builds nothing
    when the archive of that hash exists, and prints another reference when the requirements change."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("requirements-image.txt", "scripts/k8s-image.sh", "scripts/oci-image.py"):
        shutil.copy(REPO / name, repo / name)
    env = {**os.environ, "K8S_CACHE": str(tmp_path / "cache"), "VENV_IMAGE": str(tmp_path / "no-venv")}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", repo / "scripts" / "k8s-image.sh", *args], env=env, capture_output=True, text=True)

    ref = run("ref").stdout.strip()
    assert ref.startswith("localhost/ray-finetune-test:") and len(ref.rsplit(":", 1)[1]) == 12
    missing = run("build")
    assert missing.returncode != 0 and "scripts/setup.sh --image" in missing.stderr, "no .venv-image: one clear line"
    archive = tmp_path / "cache" / "images" / f"ray-finetune-test-{ref.rsplit(':', 1)[1]}.oci.tar"
    archive.parent.mkdir(parents=True, exist_ok=True)
    archive.write_bytes(b"built before")
    cached = run("build")
    assert cached.returncode == 0 and cached.stdout.splitlines()[-1] == ref, cached.stderr
    assert archive.read_bytes() == b"built before"
    with open(repo / "requirements-image.txt", "a") as f:
        f.write("pyyaml==6.0.3\n")
    assert run("ref").stdout.strip() != ref
