"""NCCL transport evidence: which network and intra-node paths NCCL really used.

NCCL chooses its transports at run time (EFA through aws-ofi-nccl, InfiniBand or RoCE, sockets; NVLink, NVLS, P2P
or shared memory within a node) and says so only in its debug log, which this module has NCCL write and turns into
a small dict. `preflight.run_preflight` gathers every worker's; `run_record` keeps them. Nothing here needs a GPU
or network access: a missing log gives `net=None` plus a `reason`.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
from typing import Mapping

# INIT and NET: version, network plugin, devices, per-channel "via ..." lines; GRAPH: the topology search
# ("type NVL/PIX"), the only line that says NVLink in plain words; ENV echoes NCCL_* settings.
NCCL_DEBUG_SUBSYS = "INIT,NET,GRAPH,ENV"

# Order in which intra-node paths are listed (fastest first).
INTRA_NODE_ORDER = ("nvls", "nvlink", "p2p", "shm", "net", "socket")


def nccl_debug_env(log_dir: str) -> dict[str, str]:
    """Environment variables that make NCCL write its INFO log to one file per process.

    `<log_dir>/nccl.<host>.<pid>.log` (NCCL's `%h`, `%p`); `log_dir` must be local (NCCL opens the file). See
    `enable_nccl_debug` for when they take effect.
    """
    return {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": NCCL_DEBUG_SUBSYS,
        "NCCL_DEBUG_FILE": os.path.join(log_dir, "nccl.%h.%p.log"),
    }


def enable_nccl_debug(log_dir: str) -> dict[str, str]:
    """Create `log_dir` and put `nccl_debug_env` into `os.environ`; return it.

    Call on every worker before its first collective: PyTorch creates communicators lazily, unless
    `init_process_group` got `device_id=` (then call this before it, or set the variables in the Ray runtime env).
    Set after NCCL initialised, they are silently ignored, and `worker_transport` says so.
    """
    os.makedirs(log_dir, exist_ok=True)
    values = nccl_debug_env(log_dir)
    os.environ.update(values)
    return values


def nccl_log_files(log_dir: str, *, pid: int | None = None, hostname: str | None = None) -> list[str]:
    """Paths of NCCL debug logs in `log_dir`, optionally only those of one host and/or pid."""
    host_part = glob.escape(hostname) if hostname else "*"
    pid_part = str(pid) if pid is not None else "*"
    return sorted(glob.glob(os.path.join(glob.escape(log_dir), f"nccl.{host_part}.{pid_part}.log")))


def read_nccl_logs(log_dir: str, *, pid: int | None = None, hostname: str | None = None) -> str:
    """Concatenated text of the matching NCCL debug logs (`""` when there are none)."""
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
    """Split a raw log line into (level, message) dropping the `host:pid:tid [dev]` prefix."""
    m = _RE_MESSAGE.search(line)
    if m:
        return m.group(1), m.group(2).strip()
    return "", line.strip()


def _net_kind(plugin: str | None, provider: str | None) -> str | None:
    """Map NCCL's network name (`Using network X` / `via NET/X/..`) to a short kind."""
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
    """Which transports NCCL really used, from `NCCL_DEBUG=INFO` output: stdout captures (with or without
    `[1,3]<stdout>:` or timestamp prefixes) or `NCCL_DEBUG_FILE` files, of one or several processes. Returns:

        {
          "backend": "nccl", "nccl_version": "2.21.5+cuda12.4" | None,
          "net": "efa" | "ib" | "socket" | "<plugin name>" | None,  # the inter-node network selected
                                               # ("Using network X"); for aws-ofi-nccl, the libfabric provider
          "net_plugin": "Libfabric" | "AWS Libfabric" | "IB" | "IBext_v8" | "Socket" | None,
          "net_provider": "efa" | None,        # OFI only
          "net_link_layer": "IB" | "RoCE" | None,  # NET/IB only
          "net_devices": ["mlx5_0:1/IB", ...] | ["eth0:10.0.0.1"] | [PCI ids of EFA NICs],
          "net_nic_count": int | None,         # OFI: "found N nics"
          "net_used": bool, "gdrdma": bool,    # some channel went "via NET/...", some used GPUDirect RDMA
          "intra_node": ["nvls","nvlink","p2p","shm","net"],  # subset, fastest first
          "p2p_modes": ["P2P/CUMEM/read", ...],
          "nodes": int | None, "local_ranks": int | None,  # the "comm ... nNodes" line
          "channels": {"P2P/CUMEM/read": 8, "NET/IB/0/GDRDMA": 4, ...},  # count per "via"
          "bootstrap": "eth0:10.0.0.1<0>" | None, "connected": bool,  # "Connected all rings"
          "net_line": str | None,              # the line that decided "net"
          "warnings": [at most 10 NCCL WARN messages], "lines": [at most 40 evidence messages],
        }

    `intra_node`: `p2p` for a channel via `P2P/...` (CUDA IPC, cuMem, direct pointer), `shm` via `SHM/...`
    (host memory), `nvls` when NVLink SHARP multicast is available or NVLS channels are set up, `nvlink` when
    the topology search says type `NVL`, the topology dump shows `NVL[..]` links, NVLS is in use, or P2P runs
    in `/read` mode (NCCL's default only over NVLink); `net` when a single-node communicator routes via `NET/...`.
    """
    scan = _LogScan()
    for raw in log_text.splitlines():
        scan.read(raw)
    result = _transport_template("nccl")
    result.update(nccl_version=scan.nccl_version, net_provider=scan.provider, net_nic_count=scan.nic_count,
                  net_used=scan.net_used, gdrdma=scan.gdrdma, intra_node=_intra_node_paths(scan),
                  p2p_modes=scan.p2p_modes, nodes=scan.nodes, local_ranks=scan.local_ranks,
                  channels=dict(scan.channels.most_common(20)), bootstrap=scan.bootstrap, connected=scan.connected,
                  warnings=scan.warnings, lines=scan.lines)
    result.update(_selected_network(scan))
    return result


def _transport_template(backend: str) -> dict:
    """Every key of a transport entry (see `parse_nccl_transport`), with nothing found yet."""
    return {
        "backend": backend,
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


@dataclasses.dataclass
class _LogScan:
    """What NCCL's log lines say, read one line at a time; `_selected_network` decides the network from it."""

    nccl_version: str | None = None
    plugins: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """`Using network X` lines per plugin name, and the first such line of each."""
    plugin_line: dict = dataclasses.field(default_factory=dict)
    provider: str | None = None
    provider_line: str | None = None
    nic_count: int | None = None
    ofi_nics: list = dataclasses.field(default_factory=list)
    ib_devices: list = dataclasses.field(default_factory=list)
    ib_line: str | None = None
    socket_devices: list = dataclasses.field(default_factory=list)
    socket_line: str | None = None
    bootstrap: str | None = None
    channels: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Channels per `via` transport."""
    net_via: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Channels per network name in `via NET/<name>/..`."""
    net_used: bool = False
    gdrdma: bool = False
    net_channels_single_node: bool = False
    intra: set = dataclasses.field(default_factory=set)
    p2p_modes: list = dataclasses.field(default_factory=list)
    nodes: int | None = None
    local_ranks: int | None = None
    connected: bool = False
    warnings: list = dataclasses.field(default_factory=list)
    lines: list = dataclasses.field(default_factory=list)
    """Evidence lines, message part only (cut at 240 characters), each once, at most 40."""
    kept: set = dataclasses.field(default_factory=set)
    """The whole messages `lines` holds."""

    def keep(self, msg: str) -> None:
        if msg not in self.kept and len(self.lines) < 40:
            self.kept.add(msg)
            self.lines.append(msg[:240])

    def read(self, raw: str) -> None:
        level, msg = _message(raw)
        if level == "WARN":
            if len(self.warnings) < 10:
                self.warnings.append(msg[:240])
            return
        self._read_info(msg)
        if (m := _RE_NVLS_CHANNELS.search(msg)) and int(m.group(1)) > 0:
            self.intra.update(("nvls", "nvlink"))
            self.keep(msg)

    def _read_info(self, msg: str) -> None:
        """The one kind of evidence an INFO message carries (the first pattern that matches)."""
        if (m := _RE_VERSION.search(msg)) and not self.nccl_version:
            self.nccl_version = m.group(1)
            self.keep(msg)
        elif m := _RE_USING_NETWORK.search(msg):
            self.plugins[m.group(1)] += 1
            self.plugin_line.setdefault(m.group(1), msg)
            self.keep(msg)
        elif m := _RE_OFI_PROVIDER.search(msg):
            self.provider = self.provider or m.group(1)
            self.provider_line = self.provider_line or msg
            if c := _RE_OFI_NIC_COUNT.search(msg):
                self.nic_count = int(c.group(1))
            self.keep(msg)
        elif m := _RE_OFI_NIC.search(msg):
            if m.group(1) not in self.ofi_nics:
                self.ofi_nics.append(m.group(1))
        elif m := _RE_IB_USING.search(msg):
            devices = _RE_DEVICE_TOKEN.findall(m.group(1))
            if devices:  # NCCL >= 2.28 prints "NET/IB : Using [RO]; OOB .." even with no HCA
                self.ib_line = self.ib_line or msg
                self.ib_devices.extend(d for d in devices if d not in self.ib_devices)
                self.keep(msg)
        elif m := _RE_SOCKET_USING.search(msg):
            self.socket_line = self.socket_line or msg
            for dev in _RE_DEVICE_TOKEN.findall(m.group(1)):
                dev = re.sub(r"<\d+>$", "", dev)
                if dev not in self.socket_devices:
                    self.socket_devices.append(dev)
            self.keep(msg)
        elif m := _RE_BOOTSTRAP.search(msg):
            self.bootstrap = self.bootstrap or m.group(1)
        elif m := _RE_CHANNEL.search(msg):
            self._read_channel(m.group(6), msg)
        elif m := _RE_GRAPH_TYPE.search(msg):
            if m.group(1) == "NVL":
                self.intra.add("nvlink")
            self.keep(msg)
        elif _RE_TOPO_NVLINK.search(msg):
            self.intra.add("nvlink")
            self.keep(msg)
        elif _RE_NVLS_AVAILABLE.search(msg):
            self.intra.update(("nvls", "nvlink"))
            self.keep(msg)
        elif m := _RE_COMM.search(msg):
            n_nodes, n_local = int(m.group(2)), int(m.group(3))
            if self.nodes is None or n_nodes > self.nodes:
                self.nodes, self.local_ranks = n_nodes, n_local
            self.keep(msg)
        elif "Connected all rings" in msg:
            self.connected = True
            self.keep(msg)

    def _read_channel(self, via: str, msg: str) -> None:
        """A `Channel .. via X` line: a network channel, or an intra-node path (P2P, SHM)."""
        if via not in self.channels:
            self.keep(msg)  # one example line per distinct transport
        self.channels[via] += 1
        if nm := _RE_NET_VIA.match(via):
            self.net_via[nm.group(1)] += 1
            self.net_used = True
            self.gdrdma = self.gdrdma or "GDRDMA" in via
            if self.nodes == 1:
                self.net_channels_single_node = True
        elif via.startswith("P2P/"):
            self.intra.add("p2p")
            if via not in self.p2p_modes:
                self.p2p_modes.append(via)
            if via.endswith("/read"):
                self.intra.add("nvlink")
        elif via.startswith("SHM"):
            self.intra.add("shm")


def _intra_node_paths(scan: _LogScan) -> list[str]:
    """The intra-node paths seen, fastest first; `net` when a single-node communicator routes channels via NET."""
    paths = set(scan.intra)
    if scan.net_channels_single_node or (scan.nodes == 1 and scan.net_used):
        paths.add("net")
    return [k for k in INTRA_NODE_ORDER if k in paths]


def _selected_network(scan: _LogScan) -> dict:
    """The `net*` keys of the network NCCL selected: from its "Using network X" line, else the "via NET/X/.."
    channels, else which NET/* module initialised (plugin > IB > Socket, NCCL's own preference)."""
    plugin, line = None, None
    if scan.plugins:
        plugin = scan.plugins.most_common(1)[0][0]
        line = scan.plugin_line[plugin]
    elif scan.net_via:
        plugin = scan.net_via.most_common(1)[0][0]
    elif scan.provider:
        plugin = "Libfabric"
    elif scan.ib_devices:
        plugin = "IB"
    elif scan.socket_devices:
        plugin = "Socket"
    kind = _net_kind(plugin, scan.provider)
    out = {"net_plugin": plugin, "net": kind, "net_line": line}
    if kind == "ib":
        layers = {d.split("/")[1] for d in scan.ib_devices if "/" in d}
        out.update(net_devices=scan.ib_devices, net_line=scan.ib_line or line,
                   net_link_layer="RoCE" if layers == {"RoCE"} else ("IB" if layers else None))
    elif kind == "socket":
        out.update(net_devices=scan.socket_devices, net_line=scan.socket_line or line)
    elif scan.provider:
        out.update(net_devices=scan.ofi_nics, net_line=scan.provider_line or line)
    return out


def gloo_transport() -> dict:
    """Transport entry for the gloo backend (CPU runs and tests), keys as `parse_nccl_transport`'s.

    Gloo reaches every peer, local or not, over TCP on `GLOO_SOCKET_IFNAME` (default: the hostname's address), so
    `net` and `intra_node` are socket.
    """
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    line = f"gloo: TCP sockets on {iface or 'the interface of the hostname address'}"
    entry = _transport_template("gloo")
    entry.update(net="socket", net_plugin="gloo", net_devices=[iface] if iface else [], net_used=True,
                 intra_node=["socket"], connected=True, net_line=line, lines=[line])
    return entry


def worker_transport(backend: str, log_dir: str | None = None, *, pid: int | None = None) -> dict:
    """Transport entry of this worker process, for the process-group `backend` in use.

    `gloo_transport`, or `parse_nccl_transport` of its NCCL log in `log_dir` (call after a collective); without a
    log, `net` is None and `reason` says why.
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
    """One line for humans, e.g. `nccl 2.21.5: net=efa (Libfabric, 4 NICs, GDRDMA); intra-node=nvlink,p2p`."""
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
