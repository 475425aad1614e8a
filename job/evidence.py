"""Evidence about a run: what it ran on, how its GPUs talked, and what it produced.

Everything here answers "can I trust and reproduce this run?" and is written down in
``run.json`` at the top of the run directory ``<storage_path>/<run name>/``.

Sections (top to bottom):

1. NCCL transport   -- ask NCCL to log (``enable_nccl_debug``), read its logs back
                      (``read_nccl_logs``) and turn them into a small dict
                      (``parse_nccl_transport``); ``gloo_transport`` for CPU runs.
2. Environment      -- ``worker_environment``: host, accelerators, driver/CUDA/NCCL and
                      package versions of one worker process.
3. Image digest     -- ``pod_image``: the image digest Kubernetes actually pulled, read from
                      the pod's own Pod object.
4. Preflight        -- ``run_preflight``: all_reduce/all_gather bandwidth on every worker,
                      environment + transport gathered to rank 0, ``check_expectations``.
5. Run record       -- ``start_record`` / ``update_record`` / ``finish_record`` write ``run.json``.
6. Compare          -- ``compare_records`` / ``compare_main`` (``python -m job compare A B``).

How the training loop uses it (every worker runs ``train_loop``)::

    from job import evidence

    # (every rank) BEFORE the first collective -- NCCL reads NCCL_DEBUG* once, when it creates
    # its first communicator, and PyTorch creates communicators lazily at the first collective.
    evidence.enable_nccl_debug(nccl_log_dir)          # a LOCAL dir, e.g. /tmp/nccl-logs

    # (every rank) after torch.distributed is initialised and the CUDA device is set
    pre = evidence.run_preflight(cfg.preflight, device, log_dir=nccl_log_dir)
    #   -> full dict on rank 0, None elsewhere; raises PreflightError on ALL ranks when an
    #      expectation fails (rank 0's exception carries .result for the run record).

    # (rank 0 only) right after preflight
    record = evidence.start_record(run_dir, config=cfg_dict, config_text=cfg_yaml,
                                   run_name=name, seed=cfg.seed, preflight=pre,
                                   runtime_env=runtime_env_additions)
    # (rank 0 only) once the data and tokenizer are built
    evidence.update_record(run_dir, record, dataset=fingerprint, tokenizer_sha256=tok_hash)
    # (rank 0 only) at the very end, or in the except branch with status="failed"
    evidence.finish_record(run_dir, record, status="succeeded", evaluation=task_results,
                           checkpoints={"dir": ckpt_dir, "latest": step_dir},
                           export={"path": export_dir})

Nothing in sections 1-3 and 5-6 needs a GPU, Kubernetes or network access: each falls back
to ``"unknown"`` plus a ``reason`` instead of raising.
"""

from __future__ import annotations

import argparse
import collections
import datetime as _dt
import glob
import hashlib
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
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any, Iterable, Mapping

RUN_RECORD = "run.json"
METRICS_FILE = "metrics.jsonl"
SCHEMA_VERSION = 1
UNKNOWN = "unknown"

# ---------------------------------------------------------------------------------------------
# 1. NCCL transport
# ---------------------------------------------------------------------------------------------

#: Subsystems we ask NCCL to log. INIT and NET give the version, the network plugin, its
#: devices and the per-channel "via ..." lines; GRAPH adds the topology search result
#: ("type NVL/PIX"), the only line that says NVLink in plain words; ENV echoes NCCL_* settings.
NCCL_DEBUG_SUBSYS = "INIT,NET,GRAPH,ENV"

#: Order in which intra-node paths are listed (fastest first).
INTRA_NODE_ORDER = ("nvls", "nvlink", "p2p", "shm", "net", "socket")

#: Values ``preflight.expect.transport`` understands.
NET_KINDS = ("efa", "ib", "roce", "socket")
INTRA_KINDS = ("nvlink", "nvls", "p2p", "shm")


def nccl_debug_env(log_dir: str) -> dict[str, str]:
    """Environment variables that make NCCL write its INFO log to one file per process.

    ``NCCL_DEBUG_FILE`` uses NCCL's own placeholders: ``%h`` = hostname, ``%p`` = pid, so
    every worker process writes ``<log_dir>/nccl.<host>.<pid>.log``. ``log_dir`` must be a
    local directory (NCCL opens the file itself). The values only take effect if they are in
    ``os.environ`` before NCCL creates its first communicator in this process -- see
    :func:`enable_nccl_debug`.
    """
    return {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": NCCL_DEBUG_SUBSYS,
        "NCCL_DEBUG_FILE": os.path.join(log_dir, "nccl.%h.%p.log"),
    }


def enable_nccl_debug(log_dir: str) -> dict[str, str]:
    """Create ``log_dir`` and put :func:`nccl_debug_env` into ``os.environ``; return it.

    Call on every worker before its first collective. PyTorch creates NCCL communicators
    lazily (at the first collective on a group), unless ``init_process_group`` was given
    ``device_id=`` (eager init) -- in that case call this before ``init_process_group``, or
    set the same variables through the Ray runtime env ``env_vars``. Setting them after NCCL
    has initialised is silently ignored, and :func:`worker_transport` then says so.
    """
    os.makedirs(log_dir, exist_ok=True)
    values = nccl_debug_env(log_dir)
    os.environ.update(values)
    return values


def nccl_log_files(log_dir: str, *, pid: int | None = None, hostname: str | None = None) -> list[str]:
    """Paths of NCCL debug logs in ``log_dir``, optionally only those of one host and/or pid."""
    host_part = glob.escape(hostname) if hostname else "*"
    pid_part = str(pid) if pid is not None else "*"
    return sorted(glob.glob(os.path.join(glob.escape(log_dir), f"nccl.{host_part}.{pid_part}.log")))


def read_nccl_logs(log_dir: str, *, pid: int | None = None, hostname: str | None = None) -> str:
    """Concatenated text of the matching NCCL debug logs (``""`` when there are none)."""
    parts = []
    for path in nccl_log_files(log_dir, pid=pid, hostname=hostname):
        with open(path, encoding="utf-8", errors="replace") as f:
            parts.append(f.read())
    return "\n".join(parts)


_RE_VERSION = re.compile(r"NCCL version (\d+\.\d+\.\d+\S*)")
_RE_USING_NETWORK = re.compile(r"Using network (.+?)\s*$")
_RE_OFI_PROVIDER = re.compile(r"NET/OFI Selected [Pp]rovider is ([\w;+-]+)")
_RE_OFI_NIC_COUNT = re.compile(r"NET/OFI Selected [Pp]rovider is .*?found (\d+) nics", re.I)
_RE_OFI_NIC = re.compile(r"NET/OFI NIC group \d+ device #\d+ (\S+)")
_RE_IB_USING = re.compile(r"NET/IB ?: Using (.*?)\s*(?:; OOB (\S+))?\s*$")
_RE_SOCKET_USING = re.compile(r"NET/Socket ?: Using (.*?)\s*$")
_RE_DEVICE_TOKEN = re.compile(r"\[\d+\]([^\s\[;]+)")
_RE_BOOTSTRAP = re.compile(r"Bootstrap ?: Using (\S+)")
_RE_CHANNEL = re.compile(
    r"(?:Channel|Ring) (\d+)(?:/(\d+))? : (\d+)(?:\[[0-9a-fA-Fx]+\])? -> (\d+)(?:\[[0-9a-fA-Fx]+\])?"
    r"(?: \[(send|receive)\])? via (.+?)\s*$"
)
_RE_NET_VIA = re.compile(r"^NET/(.+?)/(\d+)")
_RE_GRAPH_TYPE = re.compile(r"Pattern \d+, crossNic \d+, nChannels \d+, .*type (\w+)/(\w+)")
_RE_TOPO_NVLINK = re.compile(r"NVL\[[\d.]+\] - (?:GPU|NVS)/")
_RE_NVLS_AVAILABLE = re.compile(r"NVLS multicast support is available")
_RE_NVLS_CHANNELS = re.compile(r"(\d+) nvls channels")
_RE_COMM = re.compile(r"nRanks (\d+) nNodes (\d+) localRanks (\d+)")
_RE_MESSAGE = re.compile(r"NCCL (INFO|WARN) (.*)$")


def _message(line: str) -> tuple[str, str]:
    """Split a raw log line into (level, message) dropping the ``host:pid:tid [dev]`` prefix."""
    m = _RE_MESSAGE.search(line)
    if m:
        return m.group(1), m.group(2).strip()
    return "", line.strip()


def _net_kind(plugin: str | None, provider: str | None) -> str | None:
    """Map NCCL's network name (``Using network X`` / ``via NET/X/..``) to a short kind."""
    if not plugin:
        return provider
    name = plugin.lower()
    if "libfabric" in name or "ofi" in name:
        return provider or "ofi"  # aws-ofi-nccl: the libfabric provider is what matters (efa)
    if name.startswith("ib"):  # IB, IBext, IBext_v8 (the HPC-X / SHARP plugin)
        return "ib"
    if name.startswith("socket"):
        return "socket"
    return name  # other plugins (e.g. GPUDirectTCPX) keep their own name


def parse_nccl_transport(log_text: str) -> dict:
    """Read NCCL ``NCCL_DEBUG=INFO`` output and say which transports NCCL really used.

    Works on stdout captures (with or without ``[1,3]<stdout>:`` or timestamp prefixes) and
    on ``NCCL_DEBUG_FILE`` files, of one or several processes. Returns::

        {
          "backend": "nccl",
          "nccl_version": "2.21.5+cuda12.4" | None,
          "net": "efa" | "ib" | "socket" | "<plugin name>" | None,
                      # the inter-node network NCCL selected ("Using network X"); for the
                      # aws-ofi-nccl plugin it is the libfabric provider (efa)
          "net_plugin": "Libfabric" | "AWS Libfabric" | "IB" | "IBext_v8" | "Socket" | None,
          "net_provider": "efa" | None,        # libfabric provider (OFI plugin only)
          "net_link_layer": "IB" | "RoCE" | None,  # NET/IB only: InfiniBand or RoCE ports
          "net_devices": ["mlx5_0:1/IB", ...] | ["eth0:10.0.0.1"] | [PCI ids of EFA NICs],
          "net_nic_count": int | None,         # OFI: "found N nics"
          "net_used": bool,                    # some channel really went "via NET/..."
          "gdrdma": bool,                      # some NET channel used GPUDirect RDMA
          "intra_node": ["nvls","nvlink","p2p","shm","net"],  # subset, fastest first
          "p2p_modes": ["P2P/CUMEM/read", ...],  # distinct P2P variants seen
          "nodes": int | None, "local_ranks": int | None,  # from the "comm ... nNodes" line
          "channels": {"P2P/CUMEM/read": 8, "NET/IB/0/GDRDMA": 4, ...},  # count per "via"
          "bootstrap": "eth0:10.0.0.1<0>" | None,
          "connected": bool,                   # "Connected all rings" seen
          "net_line": str | None,              # the line that decided "net" (for messages)
          "warnings": [NCCL WARN messages, at most 10],
          "lines": [the evidence lines, message part only, at most 40],
        }

    How ``intra_node`` is decided: ``p2p`` if a channel goes via ``P2P/...`` (CUDA IPC /
    cuMem / direct pointer), ``shm`` if via ``SHM/...`` (through host memory), ``nvls`` if
    NVLink SHARP multicast is available or NVLS channels are set up, ``nvlink`` if the
    topology search reports intra type ``NVL`` (GRAPH subsystem), the topology dump shows
    ``NVL[..]`` links between GPUs, NVLS is in use, or P2P runs in ``/read`` mode (NCCL only
    enables P2P read by default over NVLink). ``net`` is listed when a single-node
    communicator still routes channels via ``NET/...``.
    """
    result: dict[str, Any] = {
        "backend": "nccl",
        "nccl_version": None,
        "net": None,
        "net_plugin": None,
        "net_provider": None,
        "net_link_layer": None,
        "net_devices": [],
        "net_nic_count": None,
        "net_used": False,
        "gdrdma": False,
        "intra_node": [],
        "p2p_modes": [],
        "nodes": None,
        "local_ranks": None,
        "channels": {},
        "bootstrap": None,
        "connected": False,
        "net_line": None,
        "warnings": [],
        "lines": [],
    }
    lines: list[str] = []
    seen_lines: set[str] = set()

    def keep(msg: str) -> None:
        if msg not in seen_lines and len(lines) < 40:
            seen_lines.add(msg)
            lines.append(msg[:240])

    plugins: collections.Counter[str] = collections.Counter()
    plugin_line: dict[str, str] = {}
    net_via: collections.Counter[str] = collections.Counter()
    channels: collections.Counter[str] = collections.Counter()
    ib_devices: list[str] = []
    ib_line = socket_line = provider_line = None
    socket_devices: list[str] = []
    ofi_nics: list[str] = []
    intra: set[str] = set()
    p2p_modes: list[str] = []
    net_channels_single_node = False
    nodes = local_ranks = None

    for raw in log_text.splitlines():
        level, msg = _message(raw)
        if level == "WARN":
            if len(result["warnings"]) < 10:
                result["warnings"].append(msg[:240])
            continue
        if (m := _RE_VERSION.search(msg)) and not result["nccl_version"]:
            result["nccl_version"] = m.group(1)
            keep(msg)
        elif m := _RE_USING_NETWORK.search(msg):
            plugins[m.group(1)] += 1
            plugin_line.setdefault(m.group(1), msg)
            keep(msg)
        elif m := _RE_OFI_PROVIDER.search(msg):
            result["net_provider"] = result["net_provider"] or m.group(1)
            provider_line = provider_line or msg
            if c := _RE_OFI_NIC_COUNT.search(msg):
                result["net_nic_count"] = int(c.group(1))
            keep(msg)
        elif m := _RE_OFI_NIC.search(msg):
            if m.group(1) not in ofi_nics:
                ofi_nics.append(m.group(1))
        elif m := _RE_IB_USING.search(msg):
            devices = _RE_DEVICE_TOKEN.findall(m.group(1))
            if devices:  # NCCL >= 2.28 prints "NET/IB : Using [RO]; OOB .." even with no HCA
                ib_line = ib_line or msg
                ib_devices.extend(d for d in devices if d not in ib_devices)
                keep(msg)
        elif m := _RE_SOCKET_USING.search(msg):
            socket_line = socket_line or msg
            for dev in _RE_DEVICE_TOKEN.findall(m.group(1)):
                dev = re.sub(r"<\d+>$", "", dev)
                if dev not in socket_devices:
                    socket_devices.append(dev)
            keep(msg)
        elif m := _RE_BOOTSTRAP.search(msg):
            result["bootstrap"] = result["bootstrap"] or m.group(1)
        elif m := _RE_CHANNEL.search(msg):
            via = m.group(6)
            if via not in channels:
                keep(msg)  # one example line per distinct transport
            channels[via] += 1
            if nm := _RE_NET_VIA.match(via):
                net_via[nm.group(1)] += 1
                result["net_used"] = True
                if "GDRDMA" in via:
                    result["gdrdma"] = True
                if nodes == 1:
                    net_channels_single_node = True
            elif via.startswith("P2P/"):
                intra.add("p2p")
                if via not in p2p_modes:
                    p2p_modes.append(via)
                if via.endswith("/read"):
                    intra.add("nvlink")
            elif via.startswith("SHM"):
                intra.add("shm")
        elif m := _RE_GRAPH_TYPE.search(msg):
            if m.group(1) == "NVL":
                intra.add("nvlink")
            keep(msg)
        elif _RE_TOPO_NVLINK.search(msg):
            intra.add("nvlink")
            keep(msg)
        elif _RE_NVLS_AVAILABLE.search(msg):
            intra.update(("nvls", "nvlink"))
            keep(msg)
        elif m := _RE_COMM.search(msg):
            n_nodes, n_local = int(m.group(2)), int(m.group(3))
            if nodes is None or n_nodes > nodes:
                nodes, local_ranks = n_nodes, n_local
            keep(msg)
        elif "Connected all rings" in msg:
            result["connected"] = True
            keep(msg)
        if (m := _RE_NVLS_CHANNELS.search(msg)) and int(m.group(1)) > 0:
            intra.update(("nvls", "nvlink"))
            keep(msg)

    # Which network did NCCL select? Prefer its own "Using network X" line, then the names in
    # "via NET/X/.." channel lines, then which NET/* module initialised (plugin > IB > Socket,
    # NCCL's own order of preference).
    plugin = None
    if plugins:
        plugin = plugins.most_common(1)[0][0]
        result["net_line"] = plugin_line[plugin]
    elif net_via:
        plugin = net_via.most_common(1)[0][0]
    elif result["net_provider"]:
        plugin = "Libfabric"
    elif ib_devices:
        plugin = "IB"
    elif socket_devices:
        plugin = "Socket"
    result["net_plugin"] = plugin
    kind = _net_kind(plugin, result["net_provider"])
    result["net"] = kind
    if kind == "ib":
        result["net_devices"] = ib_devices
        layers = {d.split("/")[1] for d in ib_devices if "/" in d}
        result["net_link_layer"] = "RoCE" if layers == {"RoCE"} else ("IB" if layers else None)
        result["net_line"] = ib_line or result["net_line"]
    elif kind == "socket":
        result["net_devices"] = socket_devices
        result["net_line"] = socket_line or result["net_line"]
    elif result["net_provider"]:
        result["net_devices"] = ofi_nics
        result["net_line"] = provider_line or result["net_line"]

    if nodes == 1 and result["net_used"]:
        net_channels_single_node = True
    if net_channels_single_node:
        intra.add("net")
    result["intra_node"] = [k for k in INTRA_NODE_ORDER if k in intra]
    result["p2p_modes"] = p2p_modes
    result["nodes"], result["local_ranks"] = nodes, local_ranks
    result["channels"] = dict(channels.most_common(20))
    result["lines"] = lines
    return result


def gloo_transport() -> dict:
    """Transport entry for the gloo backend (CPU runs and CPU tests).

    Gloo has no transport choice to make: every peer, on the same host or not, is reached
    over TCP sockets on the interface ``GLOO_SOCKET_IFNAME`` (default: the address the
    hostname resolves to). So ``net`` is ``"socket"`` and ``intra_node`` is ``["socket"]``.
    Same keys as :func:`parse_nccl_transport`.
    """
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    line = f"gloo: TCP sockets on {iface or 'the interface of the hostname address'}"
    return {
        "backend": "gloo",
        "nccl_version": None,
        "net": "socket",
        "net_plugin": "gloo",
        "net_provider": None,
        "net_link_layer": None,
        "net_devices": [iface] if iface else [],
        "net_nic_count": None,
        "net_used": True,
        "gdrdma": False,
        "intra_node": ["socket"],
        "p2p_modes": [],
        "nodes": None,
        "local_ranks": None,
        "channels": {},
        "bootstrap": None,
        "connected": True,
        "net_line": line,
        "warnings": [],
        "lines": [line],
    }


def worker_transport(backend: str, log_dir: str | None = None, *, pid: int | None = None) -> dict:
    """Transport entry of this worker process, for the process-group ``backend`` in use.

    ``gloo`` -> :func:`gloo_transport`. ``nccl`` -> :func:`parse_nccl_transport` of this
    process's NCCL log in ``log_dir`` (call after at least one collective). When there is no
    log, ``net`` is ``None`` and ``reason`` says why.
    """
    if "nccl" not in backend:
        entry = gloo_transport()
        entry["backend"] = backend
        return entry
    pid = os.getpid() if pid is None else pid
    if not log_dir:
        reason = "NCCL debug logging not enabled (call enable_nccl_debug(log_dir) before the first collective)"
        return {"backend": "nccl", "net": None, "intra_node": [], "lines": [], "reason": reason}
    files = nccl_log_files(log_dir, pid=pid)
    text = read_nccl_logs(log_dir, pid=pid)
    if not text.strip():
        reason = (f"no NCCL log for pid {pid} in {log_dir} (NCCL_DEBUG* must be set before NCCL's "
                  f"first communicator; NCCL_DEBUG={os.environ.get('NCCL_DEBUG')!r})")
        return {"backend": "nccl", "net": None, "intra_node": [], "lines": [], "reason": reason}
    entry = parse_nccl_transport(text)
    entry["log_files"] = files
    return entry


def describe_transport(t: Mapping | None) -> str:
    """One line for humans, e.g. ``nccl 2.21.5: net=efa (Libfabric, 4 NICs, GDRDMA); intra-node=nvlink,p2p``."""
    if not t:
        return "unknown"
    if t.get("net") is None and t.get("reason"):
        return f"{t.get('backend', '?')}: unknown ({t['reason']})"
    head = t.get("backend", "?")
    if t.get("nccl_version"):
        head += f" {t['nccl_version']}"
    details = [p for p in (t.get("net_plugin"),) if p]
    devices = t.get("net_devices") or []
    if t.get("net_nic_count"):
        details.append(f"{t['net_nic_count']} NICs")
    elif devices:
        details.append(", ".join(devices[:4]) + (" ..." if len(devices) > 4 else ""))
    if t.get("gdrdma"):
        details.append("GDRDMA")
    net = f"net={t.get('net')}" + (f" ({'; '.join(details)})" if details else "")
    intra = ",".join(t.get("intra_node") or []) or "none"
    return f"{head}: {net}; intra-node={intra}"


# ---------------------------------------------------------------------------------------------
# 2. Environment
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
        "pod": pod_image() if pod else {"digest": UNKNOWN, "reason": "not asked (pod=False)"},
    }


# ---------------------------------------------------------------------------------------------
# 3. Image digest from Kubernetes
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
# 4. Preflight collective benchmark
# ---------------------------------------------------------------------------------------------


class PreflightError(RuntimeError):
    """Preflight expectations not met. Raised on every rank; ``failures`` lists the reasons,
    ``result`` holds the full preflight dict on rank 0 (None elsewhere)."""

    def __init__(self, failures: list[str], result: dict | None = None):
        super().__init__("preflight failed:\n  - " + "\n  - ".join(failures))
        self.failures = failures
        self.result = result


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


def _expect_dict(expect) -> dict:
    if expect is None:
        return {"transport": None, "min_busbw_gbps": None}
    if isinstance(expect, Mapping):
        return {"transport": expect.get("transport"), "min_busbw_gbps": expect.get("min_busbw_gbps")}
    return {"transport": getattr(expect, "transport", None), "min_busbw_gbps": getattr(expect, "min_busbw_gbps", None)}


def run_preflight(cfg, device, *, log_dir: str | None = None, hostname: str | None = None) -> dict | None:
    """Measure collectives on all ranks, collect every worker's evidence on rank 0, check it.

    Call on EVERY rank, after ``torch.distributed`` is initialised (NCCL on GPU with the CUDA
    device already set, gloo on CPU) and after :func:`enable_nccl_debug` if the transport
    should be read from NCCL's logs. Arguments:

    * ``cfg``: has ``sizes_mib`` (list of sizes; on GPU e.g. [1, 16, 256, 1024]), ``iters``,
      ``warmup`` and ``expect`` (with ``transport``: efa|ib|roce|socket|nvlink|nvls|p2p|shm
      or None, and ``min_busbw_gbps``: float or None). Dataclass or dict.
    * ``device``: the ``torch.device`` tensors live on (``cuda:<local rank>`` or ``cpu``).
    * ``log_dir``: where this worker's NCCL debug log is (the dir given to
      :func:`enable_nccl_debug`); ignored for gloo.
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
    sizes = list(_cfg(cfg, "sizes_mib", [1, 16, 256, 1024]))
    iters, warmup = int(_cfg(cfg, "iters", 20)), int(_cfg(cfg, "warmup", 5))

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
                "expect": _expect_dict(_cfg(cfg, "expect", None)),
            }
            failures = check_expectations(result, _cfg(cfg, "expect", None))
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


def _cfg(cfg, name: str, default):
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _ranks_text(ranks: list[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)} ranks)"


def check_expectations(result: dict, expect) -> list[str]:
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
    exp = _expect_dict(expect)
    failures: list[str] = []
    workers = result.get("workers") or []
    wanted = exp["transport"]
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
    floor = exp["min_busbw_gbps"]
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


# ---------------------------------------------------------------------------------------------
# 5. Run record (run.json)
# ---------------------------------------------------------------------------------------------

#: Environment variables the chart sets, and where they land in the record.
CHART_ENV = {"name": "JOB_CHART", "version": "JOB_CHART_VERSION", "release": "JOB_RELEASE",
             "values_sha256": "JOB_VALUES_SHA256"}


def _is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name if _is_remote(base) else os.path.join(base, name)


def read_text(path: str) -> str:
    """Read a local path or an fsspec URL (``s3://...``)."""
    if _is_remote(path):
        import fsspec

        with fsspec.open(path, "r", encoding="utf-8") as f:
            return f.read()
    with open(path.removeprefix("file://"), encoding="utf-8") as f:
        return f.read()


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` so a reader never sees half a file.

    Local: a temp file in the same directory, fsync, then ``os.replace`` (atomic on POSIX).
    Remote (``s3://`` etc.) via fsspec: an object store PUT is already all-or-nothing.
    """
    if _is_remote(path):
        import fsspec

        with fsspec.open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return
    path = path.removeprefix("file://")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".run.json.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def chart_metadata(env: Mapping[str, str] | None = None) -> dict:
    """Chart name/version, release and values hash from the env vars the chart sets.

    Missing ones are ``"unknown"`` and ``unknown_reasons[field]`` says which variable was unset.
    """
    env = os.environ if env is None else env
    out: dict[str, Any] = {}
    reasons = {}
    for field, var in CHART_ENV.items():
        value = env.get(var)
        out[field] = value or UNKNOWN
        if not value:
            reasons[field] = f"{var} unset (not launched by the Helm chart)"
    out["unknown_reasons"] = reasons
    return out


def _image_section(pods: list[dict], env: Mapping[str, str]) -> dict:
    reference = env.get("JOB_IMAGE")
    digests = sorted({p.get("digest", UNKNOWN) for p in pods if p.get("digest", UNKNOWN) != UNKNOWN})
    section: dict[str, Any] = {"reference": reference or UNKNOWN, "digest": UNKNOWN, "pods": pods,
                               "consistent": len(digests) <= 1}
    reasons = []
    if not reference:
        reasons.append("JOB_IMAGE unset (not launched by the Helm chart)")
    if len(digests) == 1 and all(p.get("digest") == digests[0] for p in pods):
        section["digest"] = digests[0]
    elif len(digests) > 1:
        section["digest"] = "mixed"
        reasons.append("pods run different image digests: " + ", ".join(digests))
    else:
        unknown_reasons = sorted({p.get("reason", "no reason given") for p in pods if p.get("digest", UNKNOWN) == UNKNOWN})
        reasons.append("; ".join(unknown_reasons) or "no pod information")
        if digests:  # some known, some unknown
            section["digest"] = UNKNOWN
    if reasons:
        section["reason"] = "; ".join(reasons)
    return section


def _hardware_section(workers: list[dict], preflight: dict | None) -> dict:
    accel_count: collections.Counter[str] = collections.Counter()
    hosts: dict[str, list[int]] = {}
    for w in workers:
        env = w["environment"]
        hosts.setdefault(w.get("hostname") or env["hostname"], []).append(w["rank"])
    # Accelerators per host, counted once per host (every worker on a host sees all its GPUs).
    first_on_host = {ranks[0] for ranks in hosts.values()}
    for w in workers:
        if w["rank"] in first_on_host:
            for name in w["environment"]["accelerator"]["names"] or [w["environment"]["cpu"]["model"]]:
                accel_count[name] += 1
    e0 = workers[0]["environment"] if workers else {}
    return {
        "nodes": len(hosts),
        "world_size": len(workers),
        "hosts": hosts,
        "accelerator_type": (e0.get("accelerator") or {}).get("type"),
        "accelerators": dict(accel_count),
        "driver_versions": sorted({w["environment"]["driver_version"] for w in workers}),
        "cuda_version": e0.get("cuda_version"),
        "nccl_version": e0.get("nccl_version"),
        "from_preflight": preflight is not None,
    }


def _transport_section(workers: list[dict]) -> dict:
    per_rank = []
    for w in workers:
        t = w.get("transport") or {}
        per_rank.append({"rank": w["rank"], "backend": t.get("backend"), "net": t.get("net"),
                         "net_plugin": t.get("net_plugin"), "net_devices": t.get("net_devices") or [],
                         "intra_node": t.get("intra_node") or [], "nccl_version": t.get("nccl_version"),
                         "net_line": t.get("net_line") or t.get("reason")})
    signatures = collections.Counter(describe_transport(w.get("transport")) for w in workers)
    return {"summary": "; ".join(f"{s} [{n} ranks]" for s, n in signatures.items()) or UNKNOWN,
            "per_rank": per_rank,
            "evidence": (workers[0].get("transport") or {}).get("lines", []) if workers else []}


def start_record(run_dir: str, *, config: dict, config_text: str, run_name: str | None = None,
                 seed: int | None = None, preflight: dict | None = None, runtime_env: dict | None = None,
                 dataset: dict | None = None, tokenizer_sha256: str | None = None,
                 pods: list[dict] | None = None, env: Mapping[str, str] | None = None) -> dict:
    """Create ``<run_dir>/run.json`` with status ``running``; return the record dict.

    Call on rank 0 only, once, after :func:`run_preflight` (so hardware, transport and every
    worker's environment are known) and before training. Arguments:

    * ``run_dir``: ``<storage_path>/<run name>`` (local path or ``s3://...``).
    * ``config``: the resolved config as a plain dict; ``config_text``: its YAML text exactly
      as resolved (its sha256 is the config hash).
    * ``run_name``: default: the last path component of ``run_dir``.
    * ``seed``: the training seed.
    * ``preflight``: rank 0's return value of :func:`run_preflight` (or ``PreflightError.result``);
      ``None`` -> only this process's environment is recorded.
    * ``runtime_env``: what the launcher added to the Ray runtime env (env_vars, pip, ...).
    * ``dataset`` / ``tokenizer_sha256``: the data module's fingerprint dict and tokenizer
      hash, if already known (else pass them later to :func:`update_record`).
    * ``pods``: :func:`pod_image` results to use instead of those in ``preflight`` (tests).
    * ``env``: mapping to read the chart's env vars from (default ``os.environ``).
    """
    env = os.environ if env is None else env
    if preflight is not None:
        workers = preflight["workers"]
    else:
        workers = [{"rank": 0, "hostname": socket.gethostname(), "environment": worker_environment(pod=pods is None),
                    "transport": None}]
    if pods is None:
        pods = [w["environment"].get("pod") or {"digest": UNKNOWN, "reason": "not recorded"} for w in workers]
    packages = workers[0]["environment"]["packages"]
    worker_rows = []
    for w in workers:
        environment = dict(w["environment"])
        own = environment.pop("packages", {})
        environment["packages_differ_from_rank0"] = {
            name: own.get(name) for name in sorted(set(own) | set(packages)) if own.get(name) != packages.get(name)}
        worker_rows.append({"rank": w["rank"], "hostname": w.get("hostname"), "environment": environment})
    e0 = workers[0]["environment"]
    record = {
        "schema_version": SCHEMA_VERSION,
        "run_name": run_name or os.path.basename(run_dir.rstrip("/")),
        "run_dir": run_dir,
        "status": "running",
        "error": None,
        "started_at": _now(),
        "ended_at": None,
        "duration_s": None,
        "chart": chart_metadata(env),
        "pod": {"name": env.get("POD_NAME") or UNKNOWN, "namespace": env.get("POD_NAMESPACE") or UNKNOWN},
        "image": _image_section(pods, env),
        "job": {"version": job_version()},
        "config_sha256": hashlib.sha256(config_text.encode("utf-8")).hexdigest(),
        "config": config,
        "seed": seed,
        "runtime_env": runtime_env or {},
        "software": {"python": e0["python"], **e0["versions"], "cuda": e0["cuda_version"],
                     "nccl": e0["nccl_version"]},
        "packages": packages,
        "workers": worker_rows,
        "hardware": _hardware_section(workers, preflight),
        "transport": _transport_section(workers) if preflight is not None else
        {"summary": UNKNOWN, "per_rank": [], "evidence": [], "reason": "no preflight run"},
        "preflight": None if preflight is None else {k: v for k, v in preflight.items() if k != "workers"},
        "data": {"fingerprint": dataset, "tokenizer_sha256": tokenizer_sha256},
        "metrics": None,
        "evaluation": None,
        "checkpoints": None,
        "export": None,
        "extra": {},
    }
    if record["pod"]["name"] == UNKNOWN:
        record["pod"]["reason"] = "POD_NAME/POD_NAMESPACE unset (not running in the chart's pods)"
    write_record(run_dir, record)
    return record


_UPDATABLE = ("metrics", "evaluation", "checkpoints", "export", "seed", "runtime_env", "preflight")


def update_record(run_dir: str, record: dict, *, dataset: dict | None = None,
                  tokenizer_sha256: str | None = None, **updates) -> dict:
    """Merge ``updates`` into ``record`` and rewrite ``run.json`` (rank 0; any time mid-run).

    Known keys: ``dataset`` (fingerprint dict), ``tokenizer_sha256``, ``metrics``,
    ``evaluation``, ``checkpoints``, ``export``, ``seed``, ``runtime_env``, ``preflight``.
    Anything else is kept under ``extra`` (a typo never crashes the end of a long run).
    """
    if dataset is not None:
        record["data"]["fingerprint"] = dataset
    if tokenizer_sha256 is not None:
        record["data"]["tokenizer_sha256"] = tokenizer_sha256
    for key, value in updates.items():
        if key in _UPDATABLE:
            record[key] = value
        else:
            record.setdefault("extra", {})[key] = value
    write_record(run_dir, record)
    return record


def finish_record(run_dir: str, record: dict, *, status: str = "succeeded", error: str | BaseException | None = None,
                  metrics: dict | None = None, **updates) -> dict:
    """Close the record: status, end time, metric summary, results; rewrite ``run.json``.

    Call on rank 0 at the end of training (``status="succeeded"``) or from the ``except``
    branch (``status="failed", error=exc``). ``metrics`` defaults to
    :func:`summarize_metrics` of ``<run_dir>/metrics.jsonl``. Other keyword arguments as in
    :func:`update_record`: ``evaluation`` (task results), ``checkpoints`` (e.g.
    ``{"dir": ..., "latest": ...}``), ``export`` (e.g. ``{"path": ..., "accepted": True}``),
    ``dataset``, ``tokenizer_sha256``.
    """
    if status not in ("succeeded", "failed"):
        raise ValueError(f"status must be 'succeeded' or 'failed', not {status!r}")
    record["status"] = status
    if isinstance(error, BaseException):
        error = f"{type(error).__name__}: {error}"
    record["error"] = error
    record["ended_at"] = _now()
    try:
        start = _dt.datetime.fromisoformat(record["started_at"])
        record["duration_s"] = round((_dt.datetime.fromisoformat(record["ended_at"]) - start).total_seconds(), 1)
    except (KeyError, TypeError, ValueError):
        record["duration_s"] = None
    if metrics is None:
        try:
            metrics = summarize_metrics(read_metrics(run_dir))
        except (OSError, ValueError) as exc:
            metrics = {"reason": f"no metrics: {exc}"}
    return update_record(run_dir, record, metrics=metrics, **updates)


def write_record(run_dir: str, record: dict) -> None:
    """Write ``record`` to ``<run_dir>/run.json`` atomically (see :func:`write_text_atomic`)."""
    write_text_atomic(_join(run_dir, RUN_RECORD), json.dumps(record, indent=2, sort_keys=False, default=str) + "\n")


def load_record(run_dir: str) -> dict:
    """Read ``<run_dir>/run.json``; ``FileNotFoundError`` naming the path when absent."""
    path = _join(run_dir, RUN_RECORD)
    try:
        return json.loads(read_text(path))
    except FileNotFoundError:
        raise FileNotFoundError(f"no {RUN_RECORD} at {path}") from None


def schema_path() -> str:
    """Path of ``run_record.schema.json`` (next to this module)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_record.schema.json")


def read_metrics(run_dir: str) -> list[dict]:
    """Rows of ``<run_dir>/metrics.jsonl`` (blank or unparsable lines are skipped)."""
    rows = []
    for line in read_text(_join(run_dir, METRICS_FILE)).splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash must not hide the rest
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _median(values: list[float]) -> float | None:
    values = sorted(v for v in values if isinstance(v, (int, float)))
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def summarize_metrics(rows: Iterable[dict]) -> dict:
    """Summary of metrics.jsonl rows for the record and the report.

    Throughput and MFU are medians over the second half of the train steps (the first half
    includes compilation and warm-up); peak memory is the maximum. ``task_eval`` keeps the last
    result per task.
    """
    rows = list(rows)
    train = sorted((r for r in rows if r.get("kind") == "train"), key=lambda r: r.get("step", 0))
    evals = sorted((r for r in rows if r.get("kind") == "eval" and r.get("eval_loss") is not None),
                   key=lambda r: r.get("step", 0))
    steady = train[len(train) // 2:]
    best = min(evals, key=lambda r: r["eval_loss"]) if evals else None
    tasks: dict[str, dict] = {}
    for r in rows:
        if r.get("kind") == "task_eval" and r.get("task"):
            tasks[r["task"]] = {"step": r.get("step"), "exact_match": r.get("exact_match"), "n": r.get("n")}
    peaks = [r["peak_mem_gib"] for r in train if isinstance(r.get("peak_mem_gib"), (int, float))]
    return {
        "steps": train[-1].get("step") if train else None,
        "final_train_loss": train[-1].get("loss") if train else None,
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "final_eval_step": evals[-1].get("step") if evals else None,
        "best_eval_loss": best["eval_loss"] if best else None,
        "best_eval_step": best.get("step") if best else None,
        "tokens_per_s": _median([r.get("tokens_per_s") for r in steady]),
        "tokens_per_s_per_device": _median([r.get("tokens_per_s_per_device") for r in steady]),
        "mfu": _median([r.get("mfu") for r in steady]),
        "peak_mem_gib": max(peaks) if peaks else None,
        "task_eval": tasks,
    }


# ---------------------------------------------------------------------------------------------
# 6. Compare two runs
# ---------------------------------------------------------------------------------------------

#: Groups whose differences make two runs' environments "not identical" (exit status 1).
ENVIRONMENT_GROUPS = ("image", "packages", "config", "data", "hardware")
#: Config keys that name or place the run rather than define it (job/config.py's RunConfig.name
#: and .storage_path); ignored by default, ``--ignore-config`` replaces the list.
DEFAULT_IGNORED_CONFIG = ("name", "storage_path", "run_name", "run.name")
_RESULT_KEYS = ("final_eval_loss", "best_eval_loss", "final_train_loss", "tokens_per_s_per_device",
                "tokens_per_s", "mfu", "peak_mem_gib", "steps")


def _flatten(value, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        if not value and prefix:
            out[prefix] = {}
        return out
    return {prefix: value}


def _diff(a: Mapping, b: Mapping, ignore: Iterable[str] = ()) -> list[tuple[str, Any, Any]]:
    ignore = set(ignore)
    keys = sorted(set(a) | set(b))
    return [(k, a.get(k), b.get(k)) for k in keys if k not in ignore and a.get(k) != b.get(k)]


def _transport_signature(record: dict) -> list[str]:
    per_rank = (record.get("transport") or {}).get("per_rank") or []
    return sorted({f"{r.get('backend')}:{r.get('net')}:{'+'.join(r.get('intra_node') or [])}" for r in per_rank})


def compare_records(a: dict, b: dict, *, ignore_config: Iterable[str] = DEFAULT_IGNORED_CONFIG) -> dict:
    """Differences between two run records, grouped.

    Returns ``{"image": [...], "packages": [...], "config": [...], "data": [...],
    "hardware": [...], "results": [...]}``, each a list of ``(key, value_in_a, value_in_b)``.
    Package keys are distribution names (``None`` = not installed on that side); config and
    data keys are dotted paths. ``results`` is informational (losses, throughput, MFU) and
    never makes environments differ; hostnames, times and bandwidth figures are not compared.
    """
    img_a, img_b = a.get("image") or {}, b.get("image") or {}
    hw_a, hw_b = a.get("hardware") or {}, b.get("hardware") or {}

    def hw(record, h):
        return {"nodes": h.get("nodes"), "world_size": h.get("world_size"),
                "accelerators": h.get("accelerators"), "driver_versions": h.get("driver_versions"),
                "cuda_version": h.get("cuda_version"), "nccl_version": h.get("nccl_version"),
                "transport": _transport_signature(record)}

    def packages(record):
        out = dict(record.get("packages") or {})
        out["(python)"] = (record.get("software") or {}).get("python")
        out["(job)"] = (record.get("job") or {}).get("version")
        return out

    def config(record):
        flat = _flatten(record.get("config") or {})
        flat["(seed)"] = record.get("seed")
        return flat

    def data(record):
        d = record.get("data") or {}
        flat = _flatten(d.get("fingerprint") or {})
        flat["(tokenizer_sha256)"] = d.get("tokenizer_sha256")
        return flat

    ma, mb = a.get("metrics") or {}, b.get("metrics") or {}
    results = [(k, ma.get(k), mb.get(k)) for k in _RESULT_KEYS if ma.get(k) != mb.get(k)]
    if a.get("status") != b.get("status"):
        results.insert(0, ("status", a.get("status"), b.get("status")))
    return {
        "image": _diff({"reference": img_a.get("reference"), "digest": img_a.get("digest")},
                       {"reference": img_b.get("reference"), "digest": img_b.get("digest")}),
        "packages": _diff(packages(a), packages(b)),
        "config": _diff(config(a), config(b), ignore_config),
        "data": _diff(data(a), data(b)),
        "hardware": _diff(hw(a, hw_a), hw(b, hw_b)),
        "results": results,
    }


def _show(value, width: int = 60) -> str:
    text = "-" if value is None else (value if isinstance(value, str) else json.dumps(value, default=str))
    return text if len(text) <= width else text[: width - 3] + "..."


def _delta(a, b) -> str:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        d = b - a
        pct = f", {d / a * 100:+.1f}%" if a else ""
        return f"  ({d:+.4g}{pct})"
    return ""


def format_comparison(diffs: dict, a: dict, b: dict, name_a: str, name_b: str) -> str:
    """Concise text of :func:`compare_records` output."""
    out = [f"A: {name_a}  ({a.get('run_name')}, {a.get('status')})",
           f"B: {name_b}  ({b.get('run_name')}, {b.get('status')})"]
    labels = {"image": "image", "packages": "packages", "config": "config", "data": "data",
              "hardware": "hardware/transport", "results": "results"}
    for group, label in labels.items():
        rows = diffs[group]
        if not rows:
            note = ""
            if group == "image" and (a.get("image") or {}).get("digest") == UNKNOWN:
                note = " (digest unknown in both: cannot be verified)"
            if group != "results":
                out.append(f"{label}: identical{note}")
            continue
        out.append(f"{label}: {len(rows)} differ" if group != "results" else f"{label}:")
        for key, va, vb in rows:
            out.append(f"  {key}: {_show(va)} -> {_show(vb)}{_delta(va, vb) if group == 'results' else ''}")
    differing = [labels[g] for g in ENVIRONMENT_GROUPS if diffs[g]]
    out.append("verdict: environments differ in " + ", ".join(differing) if differing
               else "verdict: environments identical")
    return "\n".join(out)


def compare_main(argv: list[str]) -> int:
    """``python -m job compare RUN_A RUN_B [--ignore-config KEY ...]``; ``argv`` excludes "compare".

    Prints the grouped differences. Exit status: 0 environments identical (image, packages,
    config, data, hardware/transport), 1 they differ, 2 bad input (e.g. a missing run.json).
    """
    parser = argparse.ArgumentParser(prog="python -m job compare",
                                     description="Compare the run records (run.json) of two runs.")
    parser.add_argument("run_a", help="run directory (local or s3://) holding run.json")
    parser.add_argument("run_b")
    parser.add_argument("--ignore-config", action="append", default=None, metavar="KEY",
                        help=f"dotted config key to ignore (default: {', '.join(DEFAULT_IGNORED_CONFIG)})")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0
    records = []
    for path in (args.run_a, args.run_b):
        try:
            records.append(load_record(path))
        except FileNotFoundError as exc:
            print(f"compare: {exc}", file=sys.stderr)
            return 2
        except (OSError, ValueError) as exc:
            print(f"compare: cannot read {_join(path, RUN_RECORD)}: {exc}", file=sys.stderr)
            return 2
    ignore = DEFAULT_IGNORED_CONFIG if args.ignore_config is None else tuple(args.ignore_config)
    diffs = compare_records(records[0], records[1], ignore_config=ignore)
    print(format_comparison(diffs, records[0], records[1], args.run_a, args.run_b))
    return 1 if any(diffs[g] for g in ENVIRONMENT_GROUPS) else 0
