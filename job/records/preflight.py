"""Whether the workers' collectives are fast enough and use the expected transport: the preflight.

`run_preflight` measures all_reduce/all_gather bandwidth on every worker, gathers each worker's inventory
(`environment.worker_environment`) and transport (`nccl.worker_transport`) to rank 0 and checks them against
`preflight.expect` (`check_expectations`); `PreflightError` on every rank when an expectation fails.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from ..config import ExpectConfig, PreflightConfig
from .environment import worker_environment
from .nccl import worker_transport

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

# Values `preflight.expect.transport` understands.
NET_KINDS = ("efa", "ib", "roce", "socket")
INTRA_KINDS = ("nvlink", "nvls", "p2p", "shm")


class PreflightError(RuntimeError):
    """Preflight expectations not met, raised on every rank: `failures` the reasons, `result` the preflight dict on
    rank 0 (None elsewhere)."""

    def __init__(self, failures: list[str], result: dict | None = None):
        super().__init__("preflight failed:\n  - " + "\n  - ".join(failures))
        self.failures = failures
        self.result = result

    def __reduce__(self):
        # Ray pickles a worker's exception to hand it to the driver; the default would rebuild it from the
        # message alone, as if that string were the list of failures.
        return type(self), (self.failures, self.result)


def bus_bandwidth_factor(op: str, n: int) -> float:
    """nccl-tests' factor from algorithm bandwidth (algbw = S / t, S the full buffer's bytes) to bus bandwidth, what
    each rank's link carries, comparable to the hardware peak at any rank count (doc/PERFORMANCE.md): all_reduce
    2(n-1)/n (n-1 additions and n assignments per element over n links); all_gather (n-1)/n, S its gathered output.
    """
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op == "all_gather":
        return (n - 1) / n
    raise ValueError(f"unknown collective {op!r}")


def _sync(device: torch.device) -> None:
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)


def _time_collective(op: str, size_bytes: int, group: ProcessGroup | None, n: int, device: torch.device, iters: int,
                     warmup: int) -> dict:
    """Time one collective on `group`; returns figures of the slowest rank (MAX of times)."""
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


def _bench_group(group: ProcessGroup | None, n: int, device: torch.device, sizes_mib: list[int], iters: int,
                 warmup: int) -> dict:
    return {op: [_time_collective(op, int(s * 2**20), group, n, device, iters, warmup) for s in sizes_mib]
            for op in ("all_reduce", "all_gather")}


def run_preflight(cfg: PreflightConfig, device: torch.device, *, log_dir: str | None = None,
                  hostname: str | None = None) -> dict | None:
    """Measure collectives on all ranks, collect every worker's evidence on rank 0, check it.

    A collective: call on EVERY rank, after `torch.distributed` is initialised (NCCL with the CUDA device set, gloo
    on CPU) and after `nccl.enable_nccl_debug` if NCCL's logs should give the transport. `device`: where tensors
    live; `log_dir`: the NCCL log dir (ignored for gloo); `hostname`: this rank's node identity (tests simulate
    several nodes), default `socket.gethostname()`.

    A network or gloo `expect.transport` is checked first, after one small all-reduce (the network NCCL chose is then
    in its log), and fails before any timing. Then times all_reduce and all_gather at every size across all ranks,
    and with several nodes also within each node of more than one rank (a subgroup per host); gathers environment
    and transport to rank 0, which runs `check_expectations` and broadcasts the verdict, so every rank returns or
    raises `PreflightError` together.
    Sizes are nccl-tests' full buffer S; bandwidths GB/s (1e9 bytes/s) of the slowest rank. Returns the result
    on rank 0 (backend, world_size, nodes, hosts, sizes_mib, iters, warmup, dtype, all_ranks, intra_node,
    intra_node_skipped, workers, expect, failures, duration_s), None elsewhere.
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

    # One small all-reduce first: NCCL creates its communicator and logs the network it chose, so a wrong network
    # (`preflight.expect.transport`) fails now, before the bandwidth sweep (tens of seconds at 1 GiB).
    import torch

    dist.all_reduce(torch.zeros(1, device=device))
    worker = {"rank": rank, "hostname": host, "environment": environment,
              "transport": worker_transport(backend, log_dir)}
    result = _on_rank_0({"backend": backend, "world_size": world, "nodes": len(by_host), "hosts": by_host,
                         "sizes_mib": sizes, "iters": iters, "warmup": warmup, "dtype": "float32",
                         "units": "GB/s (1e9 bytes/s); busbw as nccl-tests doc/PERFORMANCE.md", "all_ranks": None,
                         "intra_node": {}, "intra_node_skipped": None, "expect": dataclasses.asdict(cfg.expect)},
                        worker, started)
    if cfg.expect.transport in (*NET_KINDS, "gloo"):
        _check(result, dataclasses.replace(cfg.expect, min_busbw_gbps=None))

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

    worker["transport"] = worker_transport(backend, log_dir)  # with the intra-node communicators' lines now
    worker["intra_node"] = intra
    result = _on_rank_0(result, worker, started)
    if result is not None:
        result.update(all_ranks=all_ranks, intra_node_skipped=skipped,
                      intra_node={h: next(w["intra_node"] for w in result["workers"] if w["rank"] == ranks[0])
                                  for h, ranks in by_host.items() if len(ranks) > 1 and len(by_host) > 1})
        for w in result["workers"]:
            w.pop("intra_node", None)
    _check(result, cfg.expect)
    return result


def _on_rank_0(result: dict | None, worker: dict, started: float) -> dict | None:
    """`result` on rank 0 with every rank's `worker` gathered into its `workers` and its duration so far; None
    elsewhere (collective)."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(worker, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    return {**result, "workers": gathered, "duration_s": round(time.perf_counter() - started, 3)}


def _check(result: dict | None, expect: ExpectConfig) -> None:
    """Rank 0 checks `result` against `expect` and every rank learns the verdict: each raises `PreflightError`
    together, or returns (collective)."""
    import torch.distributed as dist

    failures: list[str] = []
    if result is not None:
        try:
            failures = check_expectations(result, expect)
        except Exception as exc:  # never leave the other ranks waiting for the verdict
            failures = [f"preflight internal error on rank 0: {exc!r}"]
        result["failures"] = failures
    verdict = [failures]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise PreflightError(verdict[0], result)


def _ranks_text(ranks: list[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)} ranks)"


def check_expectations(result: dict, expect: ExpectConfig) -> list[str]:
    """One message per expectation of `expect` the preflight `result` misses, naming the setting, what was
    measured, on which ranks and the NCCL log line it came from.

    A network kind (`efa`, `ib`, `socket`; `roce`: `ib` on RoCE ports) must be every rank's `net`, the network
    NCCL selected even if a single-node run sends nothing over it; an intra-node kind must be in `intra_node` of
    every rank that shares its node; `gloo` must be every rank's backend. `min_busbw_gbps` applies to the
    all-ranks all_reduce at the largest size.
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
