"""Tests of job/records/nccl.py (NCCL log parsing), job/records/preflight.py (preflight on gloo), job/records/environment.py (worker
inventory, pod image) and job/records/run_record.py (run record) and job/commands/compare.py."""

import copy
import datetime
import http.server
import importlib.metadata
import json
import os
import socket
import time
from pathlib import Path

import jsonschema
import pytest
from servers import http_server

from job.commands import compare
from job.config import ExpectConfig
from job.records import environment as environment_lib
from job.records import nccl, preflight, run_record

FIXTURES = Path(__file__).parent / "fixtures" / "nccl"
SCHEMA = json.loads(Path(run_record.schema_path()).read_text())
DIGEST_RAY = "sha256:" + "ab" * 32
DIGEST_SIDECAR = "sha256:" + "cd" * 32


def validate(record):
    jsonschema.Draft202012Validator(SCHEMA).validate(record)


# --- NCCL log parsing --------------------------------------------------------------------------

EXPECTED = {
    "efa": dict(net="efa", net_plugin="Libfabric", net_provider="efa", nccl_version="2.21.5+cuda12.4",
                net_devices=["0000:52:00.0", "0000:63:00.0", "0000:74:00.0", "0000:85:00.0"], net_nic_count=4,
                net_used=True, gdrdma=True, intra_node=["nvls", "nvlink", "p2p"], nodes=2, local_ranks=8,
                net_line="NET/OFI Selected Provider is efa (found 4 nics)"),
    "ib": dict(net="ib", net_plugin="IB", net_provider=None, net_link_layer="IB", nccl_version="2.19.3+cuda12.3",
               net_devices=["mlx5_0:1/IB", "mlx5_1:1/IB"], net_used=True, gdrdma=True,
               intra_node=["nvlink", "p2p"], p2p_modes=["P2P/IPC/read"], nodes=2, local_ranks=4),
    "socket": dict(net="socket", net_plugin="Socket", nccl_version="2.20.5+cuda12.4", net_devices=["eth0:10.0.0.1"],
                   net_used=True, gdrdma=False, intra_node=["shm"], nodes=2, local_ranks=2,
                   net_line="NET/Socket : Using [0]eth0:10.0.0.1<0>"),
    # Single node: NCCL still selects a network (Socket here) but no channel goes through it.
    "nvlink": dict(net="socket", net_used=False, nccl_version="2.27.3+cuda12.9", intra_node=["nvlink", "p2p"],
                   p2p_modes=["P2P/CUMEM/read"], nodes=1, local_ranks=8, gdrdma=False),
    # Real NCCL 2.28.9 on 2x H200: Hopper P2P has no "/read", so NVLink shows only in GRAPH lines;
    # "NET/IB : Using [RO]" is printed although IB failed to initialise.
    "h200_nvlink_real": dict(net="socket", net_plugin="Socket", net_used=False, nccl_version="2.28.9+cuda13.0",
                             net_devices=["eth0:192.0.2.2"], intra_node=["nvlink", "p2p"], p2p_modes=["P2P/CUMEM"],
                             nodes=1, local_ranks=2, net_line="NET/Socket : Using [0]eth0:192.0.2.2<0>"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_parse_fixture(name):
    result = nccl.parse_nccl_transport((FIXTURES / f"{name}.log").read_text())
    for key, value in EXPECTED[name].items():
        assert result[key] == value, (name, key)
    assert result["backend"] == "nccl"
    assert result["connected"] is True
    # Evidence lines are the messages without the host:pid:tid prefix, and include the version line.
    assert any(line.startswith("NCCL version") for line in result["lines"])
    assert not any("NCCL INFO" in line for line in result["lines"])
    assert not any(line.startswith("NET/IB : Using [RO]") for line in result["lines"])


def test_parse_roce_plugin_and_old_formats():
    roce = nccl.parse_nccl_transport(
        "h:1:2 [0] NCCL INFO NET/IB : Using [0]mlx5_10:1/RoCE [1]mlx5_11:1/RoCE [RO]; OOB enp220s0np0:11.1.128.136<0>\n"
        "h:1:2 [0] NCCL INFO Using network IB\n")
    assert (roce["net"], roce["net_link_layer"], roce["net_devices"]) == ("ib", "RoCE", ["mlx5_10:1/RoCE", "mlx5_11:1/RoCE"])
    sharp = nccl.parse_nccl_transport(
        "NET/IB : Using [0]ibp0:1/IB/SHARP [1]ibp1:1/IB/SHARP [RO]; OOB eth0:10.7.147.73<0>\nUsing network IBext_v8\n"
        "h:1:2 [1] NCCL INFO Channel 09/0 : 33[1] -> 41[1] [send] via NET/IBext_v8/4\n")
    assert (sharp["net"], sharp["net_plugin"], sharp["net_used"]) == ("ib", "IBext_v8", True)
    # mpirun-prefixed, pre-2.7 "Ring" lines, aws-ofi-nccl's own INFO format, no "Using network" line.
    old = nccl.parse_nccl_transport(
        "[1,7]<stdout>:ip-1:2:3 [7] NCCL INFO Ring 00 : 7 -> 8 [send] via NET/AWS Libfabric/0\n"
        "[1,26]<stdout>:ip-2:4:5 [2] NCCL INFO Ring 00 : 26[2] -> 30[6] via P2P/IPC\n"
        "INFO: Function: ofi_init Line: 686: NET/OFI Selected Provider is efa\n")
    assert (old["net"], old["net_plugin"], old["intra_node"]) == ("efa", "AWS Libfabric", ["p2p"])
    assert nccl.parse_nccl_transport("")["net"] is None
    warn = nccl.parse_nccl_transport("h:1:1 [0] NCCL WARN NET/OFI Couldn't find any optimal provider\n")
    assert warn["warnings"] == ["NET/OFI Couldn't find any optimal provider"]


def test_selected_network_prefers_nccls_own_line_then_channels_then_initialised_modules():
    scan = nccl._LogScan(ib_devices=["mlx5_0:1/IB"], socket_devices=["eth0:10.0.0.1"], ib_line="NET/IB : Using ..")
    assert nccl._selected_network(scan) == {"net_plugin": "IB", "net": "ib", "net_line": "NET/IB : Using ..",
                                            "net_devices": ["mlx5_0:1/IB"], "net_link_layer": "IB"}
    scan.net_via["Socket"] = 2
    assert nccl._selected_network(scan)["net"] == "socket"
    scan.plugins["Libfabric"], scan.plugin_line["Libfabric"], scan.provider = 1, "Using network Libfabric", "efa"
    assert nccl._selected_network(scan) == {"net_plugin": "Libfabric", "net": "efa", "net_line": "Using network Libfabric",
                                            "net_devices": []}


def test_gloo_entry_has_every_key_of_an_nccl_entry():
    assert list(nccl.gloo_transport()) == list(nccl.parse_nccl_transport(""))


def test_nccl_debug_env_and_log_reader(tmp_path, monkeypatch):
    env = nccl.nccl_debug_env(str(tmp_path))
    assert env["NCCL_DEBUG"] == "INFO"
    assert set(env["NCCL_DEBUG_SUBSYS"].split(",")) >= {"INIT", "NET"}
    assert env["NCCL_DEBUG_FILE"] == str(tmp_path / "nccl.%h.%p.log")
    for key in env:
        monkeypatch.delenv(key, raising=False)
    log_dir = tmp_path / "logs"
    nccl.enable_nccl_debug(str(log_dir))
    assert os.environ["NCCL_DEBUG_FILE"].startswith(str(log_dir)) and log_dir.is_dir()
    # Two processes' logs: the reader returns only the asked-for pid's file.
    (log_dir / "node-a.ignored").write_text("x")
    (log_dir / "nccl.node-a.111.log").write_text((FIXTURES / "efa.log").read_text())
    (log_dir / "nccl.node-a.222.log").write_text((FIXTURES / "socket.log").read_text())
    assert nccl.nccl_log_files(str(log_dir)) == [str(log_dir / "nccl.node-a.111.log"),
                                                       str(log_dir / "nccl.node-a.222.log")]
    assert nccl.worker_transport("nccl", str(log_dir), pid=222)["net"] == "socket"
    assert nccl.worker_transport("nccl", str(log_dir), pid=111)["net"] == "efa"
    missing = nccl.worker_transport("nccl", str(log_dir), pid=333)
    assert missing["net"] is None and "no NCCL log for pid 333" in missing["reason"]
    gloo = nccl.worker_transport("gloo", str(log_dir))
    assert (gloo["backend"], gloo["net"], gloo["intra_node"]) == ("gloo", "socket", ["socket"])


def _worker(rank, transport, **t):
    return {"rank": rank, "hostname": t.pop("host", "n0"), "environment": {},
            "transport": {"backend": "nccl", "net": transport, "intra_node": [], **t}}


def test_check_expectations_messages():
    socket_line = "NET/Socket : Using [0]eth0:10.0.0.1<0>"
    result = {"world_size": 3, "backend": "nccl", "hosts": {"n0": [0, 1], "n1": [2]},
              "workers": [_worker(0, "socket", net_line=socket_line, intra_node=["p2p"]),
                          _worker(1, "socket", net_line=socket_line, intra_node=["p2p"]),
                          _worker(2, "efa", host="n1", net_line="NET/OFI Selected Provider is efa")],
              "all_ranks": {"all_reduce": [{"size_bytes": 2**20, "busbw_gbps": 50.0},
                                           {"size_bytes": 2**30, "busbw_gbps": 12.5}]}}
    assert preflight.check_expectations(result, ExpectConfig()) == []
    assert preflight.check_expectations(result, ExpectConfig(transport="efa")) == [
        f"preflight.expect.transport: expected efa, NCCL used socket on ranks 0,1 ({socket_line})"]
    assert preflight.check_expectations(result, ExpectConfig(transport="p2p", min_busbw_gbps=10)) == []
    [nvl] = preflight.check_expectations(result, ExpectConfig(transport="nvlink"))
    assert "expected nvlink" in nvl and "ranks 0,1" in nvl  # rank 2 is alone on its node
    [bw] = preflight.check_expectations(result, ExpectConfig(min_busbw_gbps=100))
    assert bw == ("preflight.expect.min_busbw_gbps: expected all_reduce busbw >= 100 GB/s at 1024 MiB "
                  "across 3 ranks, measured 12.500 GB/s")
    [bad] = preflight.check_expectations(result, ExpectConfig(transport="carrier-pigeon"))
    assert "unknown value 'carrier-pigeon'" in bad
    [gl] = preflight.check_expectations(result, ExpectConfig(transport="gloo"))
    assert gl.startswith("preflight.expect.transport: expected gloo") and "ranks 0,1,2" in gl


def test_bus_bandwidth_factors():
    assert preflight.bus_bandwidth_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert preflight.bus_bandwidth_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert preflight.bus_bandwidth_factor("all_reduce", 1) == 0.0


# --- Preflight on gloo, in real processes --------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _preflight_worker(rank, world, port, out_dir, hostnames, bad_expect):
    """One spawned rank: a passing preflight, then one whose expectations cannot be met."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ.pop("KUBERNETES_SERVICE_HOST", None)
    import torch
    import torch.distributed as dist

    from job.config import ExpectConfig, PreflightConfig
    from job.records import preflight

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    out = {}
    try:
        host = hostnames[rank] if hostnames else None
        result = preflight.run_preflight(PreflightConfig(sizes_mib=[1], iters=3, warmup=1), torch.device("cpu"),
                                         hostname=host)
        out["result"] = result
        try:
            preflight.run_preflight(PreflightConfig(sizes_mib=[1], iters=1, warmup=0, expect=ExpectConfig(**bad_expect)),
                                    torch.device("cpu"), hostname=host)
            out["error"] = None
        except preflight.PreflightError as exc:
            out["error"] = str(exc)
            out["failures"] = exc.failures
            out["error_has_result"] = exc.result is not None
            out["error_measured"] = exc.result is not None and exc.result["all_ranks"] is not None
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out, default=str))


def _spawn(world, tmp_path, hostnames, bad_expect, timeout=240):
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_preflight_worker, args=(world, _free_port(), str(tmp_path), hostnames, bad_expect),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                pytest.fail(f"preflight workers still running after {timeout}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def test_preflight_two_gloo_ranks(tmp_path):
    outs = _spawn(2, tmp_path, None, {"transport": "efa", "min_busbw_gbps": 1e9})
    result = outs[0]["result"]
    assert outs[1]["result"] is None  # only rank 0 gets the result
    assert (result["backend"], result["world_size"], result["nodes"]) == ("gloo", 2, 1)
    assert "single node" in result["intra_node_skipped"] and result["intra_node"] == {}
    assert result["failures"] == []
    assert (result["iters"], result["warmup"], result["expect"]) == (3, 1, {"transport": None, "min_busbw_gbps": None})
    for op, factor in (("all_reduce", 1.0), ("all_gather", 0.5)):  # 2(n-1)/n and (n-1)/n at n=2
        [row] = result["all_ranks"][op]
        assert row["size_bytes"] == 2**20
        assert row["time_us"] > 0 and row["algbw_gbps"] > 0
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * factor, rel=1e-3, abs=1e-4)
    assert [w["rank"] for w in result["workers"]] == [0, 1]
    for w in result["workers"]:
        assert (w["transport"]["backend"], w["transport"]["net"]) == ("gloo", "socket")
        assert w["transport"]["net_devices"] == ["lo"]
        assert w["environment"]["packages"]["torch"].startswith("2.")
        assert w["environment"]["pod"]["digest"] == "unknown"
    # The impossible expectation fails on BOTH ranks, with the same message; a wrong network before any timing.
    assert outs[0]["error"] == outs[1]["error"]
    assert outs[0]["error_has_result"] and not outs[1]["error_has_result"] and not outs[0]["error_measured"]
    assert outs[1]["failures"] == ["preflight.expect.transport: expected efa, gloo used socket on ranks 0,1 "
                                   "(gloo: TCP sockets on lo)"]


def test_preflight_intra_node_subgroup(tmp_path):
    """Three ranks posing as two nodes (node-a: 0,1; node-b: 2): node-a is measured on its own."""
    outs = _spawn(3, tmp_path, ["node-a", "node-a", "node-b"], {"transport": "nvlink"})
    result = outs[0]["result"]
    assert result["nodes"] == 2 and result["hosts"] == {"node-a": [0, 1], "node-b": [2]}
    assert list(result["intra_node"]) == ["node-a"] and result["intra_node_skipped"] is None
    [row] = result["intra_node"]["node-a"]["all_reduce"]
    assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 1.0, rel=1e-3, abs=1e-4)  # group of 2
    [row] = result["all_ranks"]["all_reduce"]
    assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 4 / 3, rel=1e-3, abs=1e-4)  # world of 3
    assert all(o["failures"] == ["preflight.expect.transport: expected nvlink, gloo used socket within the node "
                                 "on ranks 0,1"] for o in outs)


# --- Environment, pod image, run record ----------------------------------------------------------

def test_worker_environment_cpu(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    import torch

    env = environment_lib.worker_environment(torch.device("cpu"))
    assert env["hostname"] == socket.gethostname()
    assert env["accelerator"] == {"type": "cpu", "count": 0, "names": [], "memory_gib": []}
    import job

    # The distribution's version: PyPI's CUDA wheel says 2.13.0 where torch.__version__ says 2.13.0+cu130.
    assert env["versions"]["torch"] == env["packages"]["torch"] == importlib.metadata.version("torch")
    assert torch.__version__.split("+")[0] == env["versions"]["torch"].split("+")[0]
    assert env["versions"]["job"] == getattr(job, "__version__", "unknown")
    assert env["driver_version"] == "unknown" and env["driver_source"]
    assert env["pod"] == {"digest": "unknown", "reason": "not running in Kubernetes (KUBERNETES_SERVICE_HOST unset)"}


def _fake_distribution(site_packages: Path, name: str, version: str) -> None:
    info = site_packages / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.fixture
def runtime_env_install(tmp_path, monkeypatch):
    """A worker whose Ray runtime env asked for `added-pkg==1.2.3` (installed at start into the runtime env's
    site-packages) and `pyyaml` (already in the image's), plus env_vars; Ray's internal keys are left out."""
    site = tmp_path / "runtime-env-site-packages"
    _fake_distribution(site, "added-pkg", "1.2.3")
    monkeypatch.syspath_prepend(str(site))
    runtime_env = {"pip": {"packages": ["added-pkg==1.2.3", "PyYAML"], "pip_check": False},
                   "env_vars": {"NCCL_DEBUG": "WARN"}, "_ray_commit": "abc"}
    return environment_lib.runtime_env_additions(runtime_env, site_packages=str(site))


def test_runtime_env_additions_tell_installed_from_image_packages(runtime_env_install):
    import yaml

    assert runtime_env_install == {
        "requested": {"pip": {"packages": ["added-pkg==1.2.3", "PyYAML"], "pip_check": False},
                      "env_vars": {"NCCL_DEBUG": "WARN"}},
        "requirements": ["added-pkg==1.2.3", "PyYAML"],
        "packages": {"added-pkg": {"requirement": "added-pkg==1.2.3", "version": "1.2.3", "installed_at_start": True},
                     "pyyaml": {"requirement": "PyYAML", "version": yaml.__version__, "installed_at_start": False}},
        "installed_at_start": True}
    # On the image alone (no runtime env, or one the image satisfies) nothing is installed at start.
    nothing = environment_lib.runtime_env_additions({"pip": ["PyYAML"], "uv": ["missing-pkg>=1"]}, site_packages="/nowhere")
    assert not nothing["installed_at_start"] and nothing["packages"]["missing-pkg"]["version"] == "not installed"
    assert environment_lib.runtime_env_additions({})["requirements"] == []


POD = {
    "kind": "Pod",
    "metadata": {"name": "ft-worker-0", "namespace": "ml"},
    "spec": {"nodeName": "ip-10-0-1-11",
             "containers": [{"name": "log-shipper", "image": "fluent/fluent-bit:3.1"},
                            {"name": "ray-worker", "image": "rayproject/ray:2.60.0-gpu"}]},
    "status": {"containerStatuses": [
        {"name": "log-shipper", "imageID": f"docker.io/fluent/fluent-bit@{DIGEST_SIDECAR}"},
        {"name": "ray-worker", "imageID": f"docker.io/rayproject/ray@{DIGEST_RAY}"}]},
}


@pytest.fixture
def fake_api(tmp_path):
    """A Kubernetes API stand-in on 127.0.0.1 serving one Pod to the right bearer token."""
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            if self.headers.get("Authorization") != "Bearer test-token":
                self.send_error(401)
            elif self.path != "/api/v1/namespaces/ml/pods/ft-worker-0":
                self.send_error(404)
            else:
                body = json.dumps(POD).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    token = tmp_path / "token"
    token.write_text("test-token\n")
    with http_server(Handler) as url:
        yield {"url": url, "token": str(token), "seen": seen}


def test_pod_image_from_fake_api(fake_api, tmp_path):
    env = {"POD_NAMESPACE": "ml", "POD_NAME": "ft-worker-0"}
    info = environment_lib.pod_image(api_url=fake_api["url"], token_path=fake_api["token"], env=env)
    assert info["digest"] == DIGEST_RAY  # the ray container, not the sidecar listed first
    assert (info["image"], info["container"], info["node"]) == ("rayproject/ray:2.60.0-gpu", "ray-worker", "ip-10-0-1-11")
    assert info["image_id"] == f"docker.io/rayproject/ray@{DIGEST_RAY}"
    assert fake_api["seen"] == ["/api/v1/namespaces/ml/pods/ft-worker-0"]
    side = environment_lib.pod_image(api_url=fake_api["url"], token_path=fake_api["token"], env=env, container="log-shipper")
    assert side["digest"] == DIGEST_SIDECAR

    other = environment_lib.pod_image(api_url=fake_api["url"], token_path=fake_api["token"],
                               env={"POD_NAMESPACE": "ml", "POD_NAME": "nope"})
    assert other["digest"] == "unknown" and other["reason"].startswith("HTTP 404")
    bad_token = tmp_path / "bad"
    bad_token.write_text("wrong")
    denied = environment_lib.pod_image(api_url=fake_api["url"], token_path=str(bad_token), env=env)
    assert "HTTP 401" in denied["reason"] and "get' on pods" in denied["reason"]
    no_token = environment_lib.pod_image(api_url=fake_api["url"], token_path=str(tmp_path / "absent"), env=env)
    assert no_token["digest"] == "unknown" and "no service-account token" in no_token["reason"]
    assert environment_lib.pod_image(env={})["reason"] == "not running in Kubernetes (KUBERNETES_SERVICE_HOST unset)"
    assert "POD_NAME" in environment_lib.pod_image(api_url=fake_api["url"], env={"HOSTNAME": ""})["reason"]


CHART_ENV = {"JOB_CHART": "ray-finetune", "JOB_CHART_VERSION": "0.1.0", "JOB_RELEASE": "demo",
             "JOB_VALUES_SHA256": "f" * 64, "JOB_IMAGE": "rayproject/ray:2.60.0-gpu",
             "POD_NAME": "ft-head-0", "POD_NAMESPACE": "ml"}


def test_run_record_with_fake_kubernetes(fake_api, tmp_path):
    env = {"POD_NAMESPACE": "ml", "POD_NAME": "ft-worker-0"}
    pods = [environment_lib.pod_image(api_url=fake_api["url"], token_path=fake_api["token"], env=env)]
    run_dir = tmp_path / "runs" / "demo"
    record = run_record.start_record(str(run_dir), config={"train": {"lr": 1e-4}}, config_text="train:\n  lr: 0.0001\n",
                                   seed=3, pods=pods, env=CHART_ENV)
    validate(record)
    on_disk = json.loads((run_dir / "run.json").read_text())
    assert on_disk == json.loads(json.dumps(record))
    assert on_disk["image"]["digest"] == DIGEST_RAY and on_disk["image"]["consistent"] is True
    assert on_disk["image"]["reference"] == "rayproject/ray:2.60.0-gpu" and "reason" not in on_disk["image"]
    assert on_disk["chart"] == {"name": "ray-finetune", "version": "0.1.0", "release": "demo",
                                "values_sha256": "f" * 64, "unknown_reasons": {}}
    assert on_disk["pod"] == {"name": "ft-head-0", "namespace": "ml"}


def _metrics(run_dir, scale=1.0):
    rows = [{"kind": "start", "params": 1000}]
    for step in range(1, 11):
        rows.append({"kind": "train", "step": step, "loss": 3.0 - 0.1 * step, "lr": 1e-4, "grad_norm": 1.0,
                     "tokens_per_s": 2000.0 * scale, "tokens_per_s_per_device": 1000.0 * scale,
                     "mfu": 0.4 * scale, "peak_mem_gib": 10.0 + step / 10})
        if step % 5 == 0:
            rows.append({"kind": "eval", "step": step, "eval_loss": {5: 2.5, 10: 2.6}[step] * scale,
                         "eval_ppl": 12.0})
    rows.append({"kind": "task_eval", "step": 10, "task": "arith", "exact_match": 0.5, "n": 20})
    Path(run_dir, "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{truncated")


def test_run_record_local_run_unknowns(tmp_path, monkeypatch):
    for var in list(CHART_ENV) + ["KUBERNETES_SERVICE_HOST"]:
        monkeypatch.delenv(var, raising=False)
    run_dir = tmp_path / "runs" / "local-demo"
    text = "model:\n  name_or_path: tiny\ntrain:\n  lr: 0.0001\n"
    record = run_record.start_record(str(run_dir), config={"model": {"name_or_path": "tiny"}, "train": {"lr": 1e-4}},
                                   config_text=text, seed=0)
    validate(record)
    assert record["runtime_env"] == {"requested": {}, "requirements": [], "installed_at_start": False, "packages": {},
                                     "installed_on_ranks": [], "workers_agree": True}
    assert record["run_name"] == "local-demo" and record["status"] == "running"
    assert record["config_sha256"] == __import__("hashlib").sha256(text.encode()).hexdigest()
    assert record["chart"]["name"] == "unknown"
    assert record["chart"]["unknown_reasons"]["name"] == "JOB_CHART unset (not launched by the Helm chart)"
    assert record["image"]["digest"] == "unknown"
    assert "KUBERNETES_SERVICE_HOST unset" in record["image"]["reason"] and "JOB_IMAGE unset" in record["image"]["reason"]
    assert record["pod"]["name"] == "unknown" and record["pod"]["reason"]
    assert record["transport"] == {"summary": "unknown", "per_rank": [], "evidence": [], "reason": "no preflight run"}
    assert record["packages"]["torch"] and "packages" not in record["workers"][0]["environment"]

    _metrics(run_dir)
    run_record.update_record(str(run_dir), record, dataset={"source": "tiny.jsonl", "sha256": "0" * 64},
                           tokenizer_sha256="1" * 64, typo_key=1)
    final = run_record.finish_record(str(run_dir), record, evaluation={"arith": {"exact_match": 0.5}},
                                   checkpoints={"dir": str(run_dir / "checkpoints")}, export={"path": "hf/"})
    validate(final)
    on_disk = json.loads((run_dir / "run.json").read_text())
    assert on_disk["status"] == "succeeded" and on_disk["ended_at"] and on_disk["duration_s"] >= 0
    assert on_disk["extra"] == {"typo_key": 1}
    assert on_disk["data"] == {"fingerprint": {"source": "tiny.jsonl", "sha256": "0" * 64}, "tokenizer_sha256": "1" * 64}
    m = on_disk["metrics"]
    assert (m["steps"], m["final_eval_loss"], m["best_eval_loss"], m["best_eval_step"]) == (10, 2.6, 2.5, 5)
    assert (m["tokens_per_s_per_device"], m["mfu"], m["peak_mem_gib"]) == (1000.0, 0.4, 11.0)
    assert m["task_eval"] == {"arith": {"step": 10, "exact_match": 0.5, "n": 20}}
    assert sorted(os.listdir(run_dir)) == ["metrics.jsonl", "run.json"]  # no temp files left behind

    failed = run_record.finish_record(str(run_dir), copy.deepcopy(record), status="failed", error=ValueError("boom"))
    validate(failed)
    assert failed["error"] == {"class": "unknown", "reason": "exception", "message": "ValueError: boom",
                               "exception": "ValueError", "step": None, "rank": None}
    # The schema is not vacuous: a finished record without an end time, or a bad digest, is rejected.
    for broken in ({**final, "ended_at": None}, {**final, "image": {**final["image"], "digest": "latest"}},
                   {**final, "status": "failed", "error": None}, {**final, "surprise": 1}):
        with pytest.raises(jsonschema.ValidationError):
            validate(broken)


# --- compare-runs -------------------------------------------------------------------------------

def _two_runs(tmp_path, monkeypatch):
    for var in list(CHART_ENV) + ["KUBERNETES_SERVICE_HOST"]:
        monkeypatch.delenv(var, raising=False)
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    _metrics(a_dir)
    config = {"name": "a", "train": {"lr": 1e-4, "max_steps": 10}, "data": {"source": "x"}}
    pods = [{"digest": DIGEST_RAY, "image": "img"}]
    rec = run_record.start_record(str(a_dir), config=config, config_text="x", seed=1, pods=pods,
                                env={"JOB_IMAGE": "img"}, dataset={"sha256": "0" * 64}, tokenizer_sha256="1" * 64)
    run_record.finish_record(str(a_dir), rec)
    a = run_record.load_record(str(a_dir))
    b = copy.deepcopy(a)
    b["run_name"], b["config"]["name"] = "b", "b"  # names differ in every pair of runs: ignored
    b["started_at"] = "2030-01-01T00:00:00+00:00"
    b["workers"][0]["hostname"] = "elsewhere"
    return a_dir, b_dir, a, b


def test_compare_reports_exactly_the_differences(tmp_path, monkeypatch, capsys):
    a_dir, b_dir, a, b = _two_runs(tmp_path, monkeypatch)
    b["config"]["train"]["lr"] = 2e-4
    some_pkg = sorted(b["packages"])[0]
    b["packages"][some_pkg] = "999.0"
    b["metrics"]["final_eval_loss"] = 2.0
    run_record.write_record(str(b_dir), b)

    diffs = compare.compare_records(a, b)
    assert diffs["config"] == [("train.lr", 1e-4, 2e-4)]
    assert diffs["packages"] == [(some_pkg, a["packages"][some_pkg], "999.0")]
    assert diffs["image"] == diffs["data"] == diffs["hardware"] == []
    assert diffs["results"] == [("final_eval_loss", 2.6, 2.0)]

    assert compare.main([str(a_dir), str(b_dir)]) == 1
    out = capsys.readouterr().out
    assert "config: 1 differ\n  train.lr: 0.0001 -> 0.0002" in out
    assert f"packages: 1 differ\n  {some_pkg}: {a['packages'][some_pkg]} -> 999.0" in out
    assert "image: identical" in out and "data: identical" in out and "hardware/transport: identical" in out
    assert "final_eval_loss: 2.6 -> 2.0  (-0.6, -23.1%)" in out
    assert out.rstrip().endswith("verdict: environments differ in packages, config")


def test_compare_image_run_with_runtime_install_run(tmp_path, monkeypatch, capsys, runtime_env_install):
    """The same job on the image alone and with a runtime-env install: compare shows exactly what was added."""
    for var in list(CHART_ENV) + ["KUBERNETES_SERVICE_HOST"]:
        monkeypatch.delenv(var, raising=False)
    environment = environment_lib.worker_environment(pod=False)
    assert environment["packages"]["added-pkg"] == "1.2.3"  # the fixture's distribution is importable here
    image_env = {**environment, "runtime_env": environment_lib.runtime_env_additions({}),
                 "packages": {k: v for k, v in environment["packages"].items() if k != "added-pkg"}}
    installed_env = {**environment, "runtime_env": runtime_env_install}
    runs = {}
    for name, environment in (("image", image_env), ("installed", installed_env)):
        monkeypatch.setattr(run_record, "worker_environment", lambda pod, environment=environment: environment)
        record = run_record.start_record(str(tmp_path / name), config={"name": name}, config_text="x", seed=1,
                                       pods=[{"digest": DIGEST_RAY, "image": "img"}], env={"JOB_IMAGE": "img"})
        validate(record)
        runs[name] = record
    installed = runs["installed"]["runtime_env"]
    assert (installed["installed_at_start"], installed["installed_on_ranks"]) == (True, [0])
    assert installed["packages"] == {"added-pkg": "1.2.3", "pyyaml": image_env["packages"]["pyyaml"]}
    assert runs["installed"]["workers"][0]["environment"]["runtime_env"] == runtime_env_install

    diffs = compare.compare_records(runs["image"], runs["installed"])
    assert diffs["runtime_env"] == [
        ("installed_at_start", False, True),
        ("packages.added-pkg", None, "1.2.3"),
        ("packages.pyyaml", None, image_env["packages"]["pyyaml"]),
        ("requested.env_vars.NCCL_DEBUG", None, "WARN"),
        ("requested.pip.packages", None, ["added-pkg==1.2.3", "PyYAML"]),
        ("requested.pip.pip_check", None, False)]
    assert diffs["packages"] == [("added-pkg", None, "1.2.3")]
    assert diffs["image"] == diffs["config"] == diffs["data"] == diffs["hardware"] == []
    assert compare.main([str(tmp_path / "image"), str(tmp_path / "installed")]) == 1
    out = capsys.readouterr().out
    assert "runtime env: 6 differ\n  installed_at_start: false -> true\n" in out
    assert out.rstrip().endswith("verdict: environments differ in runtime env, packages")


def test_compare_identical_and_bad_input(tmp_path, monkeypatch, capsys):
    a_dir, b_dir, a, b = _two_runs(tmp_path, monkeypatch)
    b["metrics"]["mfu"] = 0.5  # results may differ; environments are still identical
    run_record.write_record(str(b_dir), b)
    assert compare.main([str(a_dir), str(b_dir)]) == 0
    out = capsys.readouterr().out
    assert "verdict: environments identical" in out and "mfu: 0.4 -> 0.5" in out
    # Data and hardware differences are environment differences too.
    b["data"]["fingerprint"]["sha256"] = "2" * 64
    b["hardware"]["accelerators"] = {"NVIDIA H100 80GB HBM3": 8}
    diffs = compare.compare_records(a, b)
    assert [d[0] for d in diffs["data"]] == ["sha256"] and [d[0] for d in diffs["hardware"]] == ["accelerators"]

    missing = tmp_path / "missing"
    assert compare.main([str(a_dir), str(missing)]) == 2
    assert f"no run.json at {missing / 'run.json'}" in capsys.readouterr().err
    assert compare.main([str(a_dir)]) == 2


def test_record_and_compare_on_a_remote_filesystem(tmp_path, monkeypatch, capsys):
    """Non-local run dirs go through fsspec (s3:// in production; fsspec's memory:// here)."""
    fsspec = pytest.importorskip("fsspec")
    for var in list(CHART_ENV) + ["KUBERNETES_SERVICE_HOST"]:
        monkeypatch.delenv(var, raising=False)
    base = f"memory://evidence-test-{os.getpid()}"
    pods = [{"digest": "unknown", "reason": "not running in Kubernetes"}]
    for name, lr in (("a", 1e-4), ("b", 3e-4)):
        rec = run_record.start_record(f"{base}/{name}", config={"lr": lr}, config_text=f"lr: {lr}\n", pods=pods, env={})
        with fsspec.open(f"{base}/{name}/metrics.jsonl", "w") as f:
            f.write(json.dumps({"kind": "eval", "step": 1, "eval_loss": 2.0}) + "\n")
        run_record.finish_record(f"{base}/{name}", rec)
    a = run_record.load_record(f"{base}/a")
    validate(a)
    assert a["status"] == "succeeded" and a["metrics"]["final_eval_loss"] == 2.0 and a["run_name"] == "a"
    assert compare.main([f"{base}/a", f"{base}/b"]) == 1
    assert "lr: 0.0001 -> 0.0003" in capsys.readouterr().out
    assert compare.main([f"{base}/a", f"{base}/nothing"]) == 2
    assert f"no run.json at {base}/nothing/run.json" in capsys.readouterr().err


def test_job_sha256_is_the_manifest_hash_a_shell_computes(tmp_path):
    import shutil
    import subprocess

    from job import PACKAGE_DIR

    shell = subprocess.run("find job -type f \\( -name '*.py' -o -name '*.json' \\) | LC_ALL=C sort | xargs sha256sum "
                           "| sha256sum", shell=True, cwd=os.path.dirname(PACKAGE_DIR), capture_output=True, text=True,
                           check=True).stdout.split()[0]
    assert environment_lib.job_sha256() == shell
    # As the kubelet mounts it: links into `..data` and its timestamped directory, which the hash does not count twice.
    mount = tmp_path / "job"
    shutil.copytree(PACKAGE_DIR, tmp_path / "..stamped", ignore=shutil.ignore_patterns("__pycache__"))
    mount.mkdir()
    (mount / "..data").symlink_to("../..stamped")
    for name in os.listdir(tmp_path / "..stamped"):
        (mount / name).symlink_to(f"..data/{name}")
    assert environment_lib.job_sha256(str(mount)) == shell
