"""What a worker runs on: the inventory of one worker process (`worker_environment`) and the image digest
Kubernetes really pulled for its pod (`pod_image`). The preflight gathers every worker's; `run_record` keeps them.

Nothing here needs a GPU, Kubernetes or network access: a value that cannot be known is `"unknown"` plus a
`reason`, not an exception.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
from typing import TYPE_CHECKING, Any, Mapping

from .. import PACKAGE_DIR, __version__
from ..common import kubeapi

if TYPE_CHECKING:
    import torch

UNKNOWN = "unknown"

# ---------------------------------------------------------------------------------------------
# The worker process
# ---------------------------------------------------------------------------------------------

_VERSIONED = ("torch", "ray", "transformers", "datasets", "numpy", "fsspec", "pyyaml")


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def installed_packages() -> dict[str, str]:
    """`{normalised distribution name: version}` of everything importable, sorted by name."""
    packages = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata.get("Name")
        if name:
            packages[re.sub(r"[-_.]+", "-", name).lower()] = dist.version
    return dict(sorted(packages.items()))


def _ray_runtime_env() -> dict:
    """The job's runtime env as Ray reports it to this worker; `{}` outside a Ray worker (torchrun, tests)."""
    ray = sys.modules.get("ray")  # never import Ray here: a torchrun worker does not have it initialised
    if ray is None or not ray.is_initialized():
        return {}
    try:
        return dict(ray.get_runtime_context().runtime_env)
    except Exception:  # an older or partial Ray: the inventory must not fail the run
        return {}


def _requirements(spec) -> list[str]:
    """The requirements of a runtime env `pip`/`uv` entry (a list or `{"packages": [...]}`; a file path as given)."""
    if isinstance(spec, Mapping):
        spec = spec.get("packages") or []
    return [spec] if isinstance(spec, str) else [str(r) for r in spec]


def runtime_env_additions(runtime_env: Mapping | None = None, *, site_packages: str | None = None) -> dict:
    """What the job's Ray runtime env asked of this worker, and what it installed at the worker's start.

    Ray installs `pip`/`uv` requirements the image does not satisfy into a virtualenv over the image's packages,
    whose site-packages is the worker interpreter's: one found there was installed at start. `runtime_env` and
    `site_packages` default to this worker's (tests pass both). Returns:

        {"requested": {runtime env keys, Ray's internal `_`-keys left out},
         "requirements": ["s3fs==2026.4.0", ...],
         "packages": {name: {"requirement", "version", "installed_at_start"}},
         "installed_at_start": bool}
    """
    runtime_env = _ray_runtime_env() if runtime_env is None else runtime_env
    requested = {k: v for k, v in runtime_env.items() if not str(k).startswith("_")}
    requirements = [r for key in ("pip", "uv") if requested.get(key) for r in _requirements(requested[key])]
    site_packages = os.path.realpath(site_packages or sysconfig.get_paths()["purelib"])
    added = {}
    for requirement in requirements:
        match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip())
        if not match or requirement.strip().startswith(("-", ".", "/")):  # an option, a path: nothing to look up
            continue
        name = re.sub(r"[-_.]+", "-", match.group(0)).lower()
        try:
            dist = importlib.metadata.distribution(name)
            version = dist.version
            here = os.path.realpath(str(dist.locate_file("")))
            installed = here == site_packages or here.startswith(site_packages + os.sep)
        except importlib.metadata.PackageNotFoundError:
            version, installed = "not installed", False
        added[name] = {"requirement": requirement, "version": version, "installed_at_start": installed}
    return {"requested": requested, "requirements": requirements, "packages": added,
            "installed_at_start": any(p["installed_at_start"] for p in added.values()) or bool(requested.get("conda"))}


def job_version() -> str:
    """`job.__version__`: the chart's version, which ships it."""
    return __version__


JOB_FILE_SUFFIXES = (".py", ".json")
"""The job package's files: the chart ships these and nothing else."""


def job_sha256(package_dir: str = PACKAGE_DIR) -> str:
    """sha256 of the job package's files as imported: over one `<sha256>  <path>` line per file, sorted by its path
    from the package's parent, as `find job -type f \\( -name '*.py' -o -name '*.json' \\) | LC_ALL=C sort | xargs
    sha256sum | sha256sum` prints in a checkout. Links are followed and dot-names skipped: a ConfigMap mount is
    links into the kubelet's `..data` and timestamped directories."""
    root = os.path.dirname(package_dir)
    lines = []
    for here, dirs, files in os.walk(package_dir, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if name.endswith(JOB_FILE_SUFFIXES) and not name.startswith("."):
                path = os.path.join(here, name)
                with open(path, "rb") as f:
                    lines.append((os.path.relpath(path, root), hashlib.sha256(f.read()).hexdigest()))
    manifest = "".join(f"{digest}  {path}\n" for path, digest in sorted(lines))
    return hashlib.sha256(manifest.encode()).hexdigest()


def _nvidia_driver() -> tuple[str, str]:
    """(driver version, how it was found); `("unknown", reason)` without an NVIDIA driver."""
    try:
        import pynvml  # type: ignore

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return (version.decode() if isinstance(version, bytes) else str(version)), "pynvml"
    except Exception:  # not installed, or no driver
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20, check=True)
            first = out.stdout.strip().splitlines()
            if first:
                return first[0].strip(), "nvidia-smi"
        except (OSError, subprocess.SubprocessError):
            pass
    return UNKNOWN, "no NVIDIA driver found (pynvml not importable, nvidia-smi absent or failed)"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def worker_environment(device: torch.device | None = None, *, pod: bool = True) -> dict:
    """This worker process's host, accelerators, driver and software versions. `device`: the one it trains on
    (None: CUDA if available); `pod=True` also reads the pod's image (`pod_image`, at once `unknown` outside
    Kubernetes). Returns:

        {"hostname", "pid", "platform", "python",
         "accelerator": {"type": "cuda"|"cpu", "count", "names", "memory_gib"},
         "cpu": {"model", "count", "memory_gib"},
         "driver_version", "driver_source", "cuda_version", "nccl_version",
         "versions": {"torch", "ray", "transformers", "datasets", ..., "job"},
         "packages": {name: version, ...},
         "runtime_env": {...runtime_env_additions()...},
         "pod": {...pod_image()...}}
    """
    import torch

    dev_type = getattr(device, "type", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    accel: dict[str, Any] = {"type": dev_type, "count": 0, "names": [], "memory_gib": []}
    nccl_version = None
    if dev_type == "cuda" and torch.cuda.is_available():
        accel["count"] = torch.cuda.device_count()
        for i in range(accel["count"]):
            props = torch.cuda.get_device_properties(i)
            accel["names"].append(props.name)
            accel["memory_gib"].append(round(props.total_memory / 2**30, 2))
        try:
            v = torch.cuda.nccl.version()
            nccl_version = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as exc:  # NCCL not built in
            nccl_version = f"{UNKNOWN} ({exc})"
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem = None
    try:
        cpu_count = len(os.sched_getaffinity(0))
    except AttributeError:
        cpu_count = os.cpu_count()
    driver, driver_source = _nvidia_driver()
    versions = {name: _dist_version(name) for name in _VERSIONED}
    versions["job"] = job_version()
    return {
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "accelerator": accel,
        "cpu": {"model": _cpu_model(), "count": cpu_count,
                "memory_gib": round(mem, 1) if mem else None},
        "driver_version": driver,
        "driver_source": driver_source,
        "cuda_version": torch.version.cuda,
        "nccl_version": nccl_version,
        "versions": versions,
        "packages": installed_packages(),
        "runtime_env": runtime_env_additions(),
        "pod": pod_image() if pod else {"digest": UNKNOWN, "reason": "not asked (pod=False)"},
    }


# ---------------------------------------------------------------------------------------------
# Image digest from Kubernetes
# ---------------------------------------------------------------------------------------------

_RE_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def pod_image(*, api_url: str | None = None, token_path: str | None = None, ca_path: str | None = None,
              namespace: str | None = None, pod_name: str | None = None, container: str | None = None,
              env: Mapping[str, str] | None = None, timeout: float = 5.0) -> dict:
    """The image this pod really runs, from its Pod object (`GET /api/v1/namespaces/{ns}/pods/{name}` with the
    service-account token, which needs `get` on pods: the chart's RBAC).

    Defaults: the API server, token and CA of `kubeapi.InCluster`; namespace and pod from `POD_NAMESPACE`/`POD_NAME`
    (the chart's downward API; else the namespace file and `HOSTNAME`); `container`: the first whose name contains
    `ray`, else the first. Returns `{"image", "image_id", "digest": "sha256:...", "container", "pod", "namespace",
    "node"}`, or `{"digest": "unknown", "reason"}`: never raises.
    """
    env = os.environ if env is None else env
    try:
        api = kubeapi.InCluster(api_url) if api_url else kubeapi.InCluster.from_env(env)
    except kubeapi.ApiError as exc:
        return {"digest": UNKNOWN, "reason": str(exc)}
    api.token_path = token_path or api.token_path
    api.ca_path = ca_path or (api.ca_path if api.url.startswith("https:") else None)
    namespace = namespace or kubeapi.pod_namespace(env)
    pod_name = pod_name or env.get("POD_NAME") or env.get("HOSTNAME")
    if not namespace or not pod_name:
        return {"digest": UNKNOWN, "reason": "pod namespace/name unknown (POD_NAMESPACE/POD_NAME unset)"}
    try:
        pod = api.request("GET", f"/api/v1/namespaces/{namespace}/pods/{pod_name}", timeout=timeout)
    except kubeapi.ApiError as exc:
        hint = " (the service account needs 'get' on pods)" if exc.status in (401, 403) else ""
        return {"digest": UNKNOWN, "reason": f"{exc}{hint}"}

    containers = (pod.get("spec") or {}).get("containers") or []
    if not containers:
        return {"digest": UNKNOWN, "reason": f"pod {namespace}/{pod_name} has no containers"}
    if container:
        chosen = next((c for c in containers if c.get("name") == container), None)
        if chosen is None:
            return {"digest": UNKNOWN, "reason": f"no container {container!r} in pod {namespace}/{pod_name}"}
    else:
        chosen = next((c for c in containers if "ray" in c.get("name", "")), containers[0])
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    status = next((s for s in statuses if s.get("name") == chosen.get("name")), {})
    image_id = status.get("imageID") or ""
    match = _RE_DIGEST.search(image_id) or _RE_DIGEST.search(chosen.get("image", ""))
    info = {
        "image": chosen.get("image"),
        "image_id": image_id or None,
        "digest": match.group(0) if match else UNKNOWN,
        "container": chosen.get("name"),
        "pod": pod_name,
        "namespace": namespace,
        "node": (pod.get("spec") or {}).get("nodeName"),
    }
    if not match:
        info["reason"] = "containerStatuses has no imageID yet" if not image_id else f"no sha256 in {image_id!r}"
    return info
