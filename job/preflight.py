"""What a worker runs on, and whether its collectives are fast enough: the preflight.

Sections (top to bottom):

1. Environment      -- ``worker_environment``: host, accelerators, driver/CUDA/NCCL and
                      package versions of one worker process (``installed_packages``,
                      ``job_version``), and what the Ray runtime env added to it at start
                      (``runtime_env_additions``).
2. Image digest     -- ``pod_image``: the image digest Kubernetes actually pulled, read from
                      the pod's own Pod object.
3. Preflight        -- ``run_preflight``: all_reduce/all_gather bandwidth on every worker,
                      environment + transport (``nccl.worker_transport``) gathered to rank 0,
                      ``check_expectations``; ``PreflightError`` when an expectation fails.

Sections 1-2 need no GPU, Kubernetes or network access: each falls back to ``"unknown"``
plus a ``reason`` instead of raising.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import socket
import ssl
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from typing import Any, Mapping

from .config import ExpectConfig, PreflightConfig
from .nccl import worker_transport

UNKNOWN = "unknown"

#: Values ``preflight.expect.transport`` understands.
NET_KINDS = ("efa", "ib", "roce", "socket")
INTRA_KINDS = ("nvlink", "nvls", "p2p", "shm")

# ---------------------------------------------------------------------------------------------
# 1. Environment
# ---------------------------------------------------------------------------------------------

_VERSIONED = ("torch", "ray", "transformers", "datasets", "numpy", "fsspec", "pyyaml")


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def installed_packages() -> dict[str, str]:
    """``{normalised distribution name: version}`` of everything importable, sorted by name."""
    packages = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata.get("Name")
        if name:
            packages[re.sub(r"[-_.]+", "-", name).lower()] = dist.version
    return dict(sorted(packages.items()))


def _ray_runtime_env() -> dict:
    """The job's runtime env as Ray reports it to this worker; ``{}`` outside a Ray worker (torchrun, tests)."""
    ray = sys.modules.get("ray")  # never import Ray here: a torchrun worker does not have it initialised
    if ray is None or not ray.is_initialized():
        return {}
    try:
        return dict(ray.get_runtime_context().runtime_env)
    except Exception:  # an older or partial Ray: the inventory must not fail the run
        return {}


def _requirements(spec) -> list[str]:
    """The requirement strings of a runtime env ``pip``/``uv`` entry (a list, or ``{"packages": [...]}``;
    a requirements-file path stays as given)."""
    if isinstance(spec, Mapping):
        spec = spec.get("packages") or []
    return [spec] if isinstance(spec, str) else [str(r) for r in spec]


def runtime_env_additions(runtime_env: Mapping | None = None, *, site_packages: str | None = None) -> dict:
    """What the job's Ray runtime env asked of this worker, and what it installed when the worker started.

    Ray installs a runtime env's ``pip``/``uv`` requirements at worker start into a virtualenv over the image's
    packages: a requirement the image already satisfies is not installed again, one that is lives in that
    virtualenv's site-packages, the site-packages of the worker's interpreter. ``runtime_env``: default
    :func:`_ray_runtime_env`; ``site_packages``: default this interpreter's (tests pass both). Returns::

        {"requested": {runtime env keys, Ray's internal ``_``-keys left out},
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
    """``job.__version__`` of the package this module belongs to, or ``"unknown"``."""
    try:
        pkg = importlib.import_module(__package__) if __package__ else None
    except ImportError:
        pkg = None
    return str(getattr(pkg, "__version__", UNKNOWN))


def _nvidia_driver() -> tuple[str, str]:
    """(driver version, how it was found); ``("unknown", reason)`` without an NVIDIA driver."""
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


def worker_environment(device=None, *, pod: bool = True) -> dict:
    """Describe this worker process: host, accelerators, driver and software versions.

    ``device`` is the ``torch.device`` the worker trains on (``None``: CUDA if available).
    ``pod=True`` also reads the image digest of this pod (:func:`pod_image`; returns at once
    with ``unknown`` outside Kubernetes). Returns::

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
# 2. Image digest from Kubernetes
# ---------------------------------------------------------------------------------------------

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
_RE_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def pod_image(*, api_url: str | None = None, token_path: str | None = None, ca_path: str | None = None,
              namespace: str | None = None, pod_name: str | None = None, container: str | None = None,
              env: Mapping[str, str] | None = None, timeout: float = 5.0) -> dict:
    """Read this pod's Pod object and return the image it really runs.

    ``GET {api}/api/v1/namespaces/{ns}/pods/{name}`` with the in-cluster service-account
    token. Defaults: ``api_url`` from ``KUBERNETES_SERVICE_HOST``/``KUBERNETES_SERVICE_PORT``,
    token and CA cert from ``/var/run/secrets/kubernetes.io/serviceaccount/``, namespace and
    pod name from ``POD_NAMESPACE``/``POD_NAME`` (set by the chart through the downward API;
    fallbacks: the service-account namespace file and ``HOSTNAME``). ``container``: the
    container to report (default: the first whose name contains ``ray``, else the first).
    The service account needs ``get`` on ``pods`` (the chart's RBAC).

    Returns ``{"image", "image_id", "digest": "sha256:...", "container", "pod", "namespace",
    "node"}``; on any problem ``{"digest": "unknown", "reason": "..."}`` -- it never raises.
    """
    env = os.environ if env is None else env
    if api_url is None:
        host = env.get("KUBERNETES_SERVICE_HOST")
        if not host:
            return {"digest": UNKNOWN, "reason": "not running in Kubernetes (KUBERNETES_SERVICE_HOST unset)"}
        port = env.get("KUBERNETES_SERVICE_PORT", "443")
        api_url = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    token_path = token_path or os.path.join(SERVICE_ACCOUNT_DIR, "token")
    if ca_path is None and api_url.startswith("https:"):
        ca_path = os.path.join(SERVICE_ACCOUNT_DIR, "ca.crt")
    if not namespace:
        namespace = env.get("POD_NAMESPACE")
        ns_file = os.path.join(SERVICE_ACCOUNT_DIR, "namespace")
        if not namespace and os.path.exists(ns_file):
            with open(ns_file, encoding="utf-8") as f:
                namespace = f.read().strip()
    pod_name = pod_name or env.get("POD_NAME") or env.get("HOSTNAME")
    if not namespace or not pod_name:
        return {"digest": UNKNOWN, "reason": "pod namespace/name unknown (POD_NAMESPACE/POD_NAME unset)"}
    try:
        with open(token_path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as exc:
        return {"digest": UNKNOWN, "reason": f"no service-account token ({exc.strerror}: {token_path})"}
    url = f"{api_url.rstrip('/')}/api/v1/namespaces/{namespace}/pods/{pod_name}"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}",
                                                   "Accept": "application/json"})
    context = None
    if url.startswith("https:"):
        context = ssl.create_default_context(cafile=ca_path if ca_path and os.path.exists(ca_path) else None)
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            pod = json.load(response)
    except urllib.error.HTTPError as exc:
        hint = " (the service account needs 'get' on pods)" if exc.code in (401, 403) else ""
        return {"digest": UNKNOWN, "reason": f"HTTP {exc.code} from {url}{hint}"}
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return {"digest": UNKNOWN, "reason": f"cannot read {url}: {exc}"}

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


# ---------------------------------------------------------------------------------------------
# 3. Preflight collective benchmark
# ---------------------------------------------------------------------------------------------


class PreflightError(RuntimeError):
    """Preflight expectations not met. Raised on every rank; ``failures`` lists the reasons,
    ``result`` holds the full preflight dict on rank 0 (None elsewhere)."""

    def __init__(self, failures: list[str], result: dict | None = None):
        super().__init__("preflight failed:\n  - " + "\n  - ".join(failures))
        self.failures = failures
        self.result = result

    def __reduce__(self):
        # Ray pickles a worker's exception to hand it to the driver; the default would rebuild it from the
        # message alone, as if that string were the list of failures.
        return type(self), (self.failures, self.result)


def bus_bandwidth_factor(op: str, n: int) -> float:
    """nccl-tests' correction from algorithm to bus bandwidth (doc/PERFORMANCE.md).

    algbw = S / t (S = bytes of the full buffer, t = time of one operation). busbw is what
    each rank's link must carry, comparable to the hardware peak whatever the rank count:

    * all_reduce: every element needs n-1 additions and n assignments, 2(n-1) transfers
      over n links -> busbw = algbw * 2(n-1)/n
    * all_gather: only the assignment half -> busbw = algbw * (n-1)/n, with S the size of
      the gathered output (n * per-rank input)
    """
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op == "all_gather":
        return (n - 1) / n
    raise ValueError(f"unknown collective {op!r}")


def _sync(device) -> None:
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)


def _time_collective(op: str, size_bytes: int, group, n: int, device, iters: int, warmup: int) -> dict:
    """Time one collective on ``group``; returns figures of the slowest rank (MAX of times)."""
    import torch
    import torch.distributed as dist

    elements = max(n, (size_bytes // 4) // n * n)  # float32, divisible by the group size
    if op == "all_reduce":
        buf = torch.zeros(elements, dtype=torch.float32, device=device)

        def run():
            dist.all_reduce(buf, group=group)
    else:
        out = torch.empty(elements, dtype=torch.float32, device=device)
        inp = torch.zeros(elements // n, dtype=torch.float32, device=device)

        def run():
            dist.all_gather_into_tensor(out, inp, group=group)

    for _ in range(warmup):
        run()
    _sync(device)
    start_line = torch.zeros(1, device=device)
    dist.all_reduce(start_line, group=group)  # line everybody up before the clock starts
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - t0) / max(iters, 1)], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    seconds = float(elapsed.item())
    size = elements * 4
    algbw = size / seconds / 1e9 if seconds > 0 else 0.0
    return {"size_bytes": size, "time_us": round(seconds * 1e6, 3), "algbw_gbps": round(algbw, 4),
            "busbw_gbps": round(algbw * bus_bandwidth_factor(op, n), 4)}


def _bench_group(group, n: int, device, sizes_mib, iters: int, warmup: int) -> dict:
    return {op: [_time_collective(op, int(s * 2**20), group, n, device, iters, warmup) for s in sizes_mib]
            for op in ("all_reduce", "all_gather")}


def run_preflight(cfg: PreflightConfig, device, *, log_dir: str | None = None, hostname: str | None = None) -> dict | None:
    """Measure collectives on all ranks, collect every worker's evidence on rank 0, check it.

    Call on EVERY rank, after ``torch.distributed`` is initialised (NCCL on GPU with the CUDA
    device already set, gloo on CPU) and after :func:`nccl.enable_nccl_debug` if the transport
    should be read from NCCL's logs. Arguments:

    * ``cfg``: the run's ``preflight`` section (sizes, iterations, expectations).
    * ``device``: the ``torch.device`` tensors live on (``cuda:<local rank>`` or ``cpu``).
    * ``log_dir``: where this worker's NCCL debug log is (the dir given to
      :func:`nccl.enable_nccl_debug`); ignored for gloo.
    * ``hostname``: override this rank's node identity (tests simulate several nodes on one
      machine); default ``socket.gethostname()``.

    What it does: gathers hostnames to find nodes; times all_reduce and all_gather at every
    size across all ranks, then within each node that has >1 rank (a subgroup per host; only
    when there is more than one node, since otherwise "all ranks" already is intra-node);
    parses this worker's transport; gathers environment + transport to rank 0; rank 0 runs
    :func:`check_expectations` and broadcasts the verdict, so every rank returns or raises
    :class:`PreflightError` together. Sizes are the full buffer S of nccl-tests (all_gather:
    the gathered output); bandwidths are GB/s = 1e9 bytes/s as nccl-tests prints them, for the
    slowest rank. Returns the result dict on rank 0 (keys: backend, world_size, nodes, hosts,
    sizes_mib, iters, warmup, dtype, all_ranks, intra_node, intra_node_skipped, workers,
    expect, failures, duration_s), ``None`` on other ranks.
    """
    import torch.distributed as dist

    started = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = str(dist.get_backend())
    if "nccl" in backend and getattr(device, "type", "cpu") == "cuda":
        backend = "nccl"
    elif "gloo" in backend:
        backend = "gloo"
    sizes, iters, warmup = list(cfg.sizes_mib), cfg.iters, cfg.warmup

    environment = worker_environment(device)
    host = hostname or environment["hostname"]
    hosts: list[str] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(hosts, host)
    by_host: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        by_host.setdefault(h, []).append(r)

    all_ranks = _bench_group(None, world, device, sizes, iters, warmup)

    intra = None
    subgroups = []
    if len(by_host) > 1:
        for h, ranks in by_host.items():  # every rank creates every group, in the same order
            if len(ranks) > 1:
                group = dist.new_group(ranks)
                subgroups.append(group)
                if h == host:
                    intra = _bench_group(group, len(ranks), device, sizes, iters, warmup)
    if len(by_host) == 1:
        skipped = "single node: the all-ranks figures are the intra-node figures"
    elif all(len(r) == 1 for r in by_host.values()):
        skipped = "one rank per node: nothing to measure within a node"
    else:
        skipped = None
    for group in subgroups:
        try:
            dist.destroy_process_group(group)
        except Exception:  # best effort; the group is small
            pass

    transport = worker_transport(backend, log_dir)
    worker = {"rank": rank, "hostname": host, "environment": environment, "transport": transport,
              "intra_node": intra}
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(worker, gathered, dst=0)

    result = None
    failures: list[str] = []
    if rank == 0:
        try:
            result = {
                "backend": backend,
                "world_size": world,
                "nodes": len(by_host),
                "hosts": by_host,
                "sizes_mib": sizes,
                "iters": iters,
                "warmup": warmup,
                "dtype": "float32",
                "units": "GB/s (1e9 bytes/s); busbw as nccl-tests doc/PERFORMANCE.md",
                "all_ranks": all_ranks,
                "intra_node": {h: next(w["intra_node"] for w in gathered if w["rank"] == ranks[0])
                               for h, ranks in by_host.items() if len(ranks) > 1 and len(by_host) > 1},
                "intra_node_skipped": skipped,
                "workers": [{k: v for k, v in w.items() if k != "intra_node"} for w in gathered],
                "expect": dataclasses.asdict(cfg.expect),
            }
            failures = check_expectations(result, cfg.expect)
        except Exception as exc:  # never leave the other ranks waiting for the verdict
            failures = [f"preflight internal error on rank 0: {exc!r}"]
        if result is not None:
            result["failures"] = failures
            result["duration_s"] = round(time.perf_counter() - started, 3)
    verdict = [failures]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise PreflightError(verdict[0], result)
    return result


def _ranks_text(ranks: list[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)} ranks)"


def check_expectations(result: dict, expect: ExpectConfig) -> list[str]:
    """Compare a preflight result with ``expect``; return one message per unmet expectation.

    * ``expect.transport``:
      - ``efa`` / ``ib`` / ``socket``: every rank's transport ``net`` must be that kind
        (``roce``: ``net == "ib"`` on RoCE ports). It is the network NCCL selected, whether or
        not a single-node run sends anything over it.
      - ``nvlink`` / ``nvls`` / ``p2p`` / ``shm``: every rank that shares its node with
        another rank must list it in ``intra_node``.
      - ``gloo``: every rank's process group must be gloo (CPU runs).
    * ``expect.min_busbw_gbps``: the all-ranks all_reduce busbw at the largest size (GB/s,
      nccl-tests units) must reach it.

    Messages name the setting, the expectation, what was measured, on which ranks, and the
    NCCL log line it came from.
    """
    failures: list[str] = []
    workers = result.get("workers") or []
    wanted = expect.transport
    if wanted:
        wanted = str(wanted).lower()
        if wanted in NET_KINDS:
            observed: dict[str, list[int]] = {}
            line_for: dict[str, str] = {}
            for w in workers:
                t = w.get("transport") or {}
                got = t.get("net")
                if wanted == "roce":  # RoCE is NCCL's IB transport on Ethernet ports
                    ok = got == "ib" and t.get("net_link_layer") == "RoCE"
                    got = f"ib ({t.get('net_link_layer')})" if got == "ib" else got
                else:
                    ok = got == wanted
                if not ok:
                    key = f"{t.get('backend', 'nccl')}:{got}"
                    observed.setdefault(key, []).append(w["rank"])
                    line_for.setdefault(key, t.get("net_line") or t.get("reason") or "no evidence")
            for key, ranks in observed.items():
                backend, got = key.split(":", 1)
                failures.append(
                    f"preflight.expect.transport: expected {wanted}, {backend.upper() if backend == 'nccl' else backend} "
                    f"used {got if got != 'None' else 'an unknown network'} on ranks {_ranks_text(ranks)} ({line_for[key]})")
        elif wanted in INTRA_KINDS:
            hosts = result.get("hosts") or {}
            shared = {r for ranks in hosts.values() if len(ranks) > 1 for r in ranks}
            if not shared:
                failures.append(f"preflight.expect.transport: expected {wanted} within a node, but no node "
                                f"has more than one rank, so there is no intra-node path to check")
            missing: dict[tuple, list[int]] = {}
            for w in workers:
                if w["rank"] not in shared:
                    continue
                t = w.get("transport") or {}
                if wanted not in (t.get("intra_node") or []):
                    got = tuple(t.get("intra_node") or [])
                    missing.setdefault((t.get("backend", "nccl"), got, t.get("reason")), []).append(w["rank"])
            for (backend, got, reason), ranks in missing.items():
                what = ",".join(got) if got else "no intra-node path"
                why = f" ({reason})" if reason else ""
                backend = "NCCL" if backend == "nccl" else backend
                failures.append(f"preflight.expect.transport: expected {wanted}, {backend} used {what} "
                                f"within the node on ranks {_ranks_text(ranks)}{why}")
        elif wanted == "gloo":
            others: dict[str, list[int]] = {}
            for w in workers:
                backend = (w.get("transport") or {}).get("backend") or result.get("backend")
                if backend != "gloo":
                    others.setdefault(str(backend), []).append(w["rank"])
            for backend, ranks in others.items():
                failures.append(f"preflight.expect.transport: expected gloo, the process group uses "
                                f"{backend} on ranks {_ranks_text(ranks)}")
        else:
            failures.append(f"preflight.expect.transport: unknown value {wanted!r} "
                            f"(one of {', '.join(NET_KINDS + INTRA_KINDS + ('gloo',))})")
    floor = expect.min_busbw_gbps
    if floor is not None:
        rows = (result.get("all_ranks") or {}).get("all_reduce") or []
        n = result.get("world_size", 0)
        if n < 2 or not rows:
            failures.append(f"preflight.expect.min_busbw_gbps: expected >= {floor} GB/s, but bus bandwidth "
                            f"needs at least 2 ranks (world size {n})")
        else:
            top = max(rows, key=lambda r: r["size_bytes"])
            if top["busbw_gbps"] < float(floor):
                failures.append(
                    f"preflight.expect.min_busbw_gbps: expected all_reduce busbw >= {floor} GB/s at "
                    f"{top['size_bytes'] / 2**20:g} MiB across {n} ranks, measured {top['busbw_gbps']:.3f} GB/s")
    return failures
