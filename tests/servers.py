"""Servers on loopback for tests and benchmarks: an OCI registry (go-containerregistry's `cmd/registry`, built from
the Go module proxy into a cache outside the repository on first use; a missing binary is built, never skipped), a
static HTTP server (a classic `index.yaml` chart repository) and a local S3 (moto)."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REGISTRY_MODULE = "github.com/google/go-containerregistry/cmd/registry@v0.22.1"
TOOLS_BIN = Path(os.environ.get("RAY_FINETUNE_CACHE", Path.home() / ".cache" / "ray-finetune")) / "bin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{process.args} exited with {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    pytest.fail(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


@contextlib.contextmanager
def oci_registry() -> Iterator[str]:
    """An in-memory OCI registry on 127.0.0.1: its host:port."""
    binary = TOOLS_BIN / "registry"
    if not binary.exists():
        subprocess.run(["go", "install", REGISTRY_MODULE], env={**os.environ, "GOBIN": str(TOOLS_BIN)}, check=True)
    port = free_port()
    process = subprocess.Popen([str(binary), "-port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, process)
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


@contextlib.contextmanager
def http_server(handler) -> Iterator[str]:
    """`handler` (a `BaseHTTPRequestHandler` class) serving on 127.0.0.1 in a thread: its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def static_http(root: Path):
    """`root` served over HTTP on 127.0.0.1: its URL."""
    return http_server(functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root)))


@contextlib.contextmanager
def moto_s3(bucket: str = "runs") -> Iterator[dict[str, str]]:
    """A moto S3 server on 127.0.0.1 with `bucket` created: the AWS environment pointing at it."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, server)
        env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_EC2_METADATA_DISABLED": "true"}
        import boto3

        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="test",
                     aws_secret_access_key="test", region_name="us-east-1").create_bucket(Bucket=bucket)
        yield env
    finally:
        server.terminate()
        server.wait(timeout=10)


MLFLOW_SERVER = Path(__file__).resolve().parent.parent / ".venv-mlflow" / "bin" / "mlflow"
"""The tracking server's own environment (`scripts/setup.sh --dev`): full mlflow pins other versions of packages
.venv pins (pyarrow, cryptography), so the server lives apart and .venv has the client (mlflow-skinny) only."""


@contextlib.contextmanager
def mlflow_server(root: Path, port: int | None = None) -> Iterator[str]:
    """An MLflow tracking server on 127.0.0.1 (`port`, else a free one) with a SQLite store and its artifacts under
    `root`: its URL, as an `MlflowServer` (a test may stop its `.process` early, and start it again on its port)."""
    port = port or free_port()
    root.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [str(MLFLOW_SERVER), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root}/mlflow.db", "--artifacts-destination", str(root / "artifacts")],
        stdout=open(root / "server.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_port(port, process, timeout_s=120)
        yield MlflowServer(f"http://127.0.0.1:{port}", process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # uvicorn's graceful shutdown on a loaded machine
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


class MlflowServer(str):
    """A tracking server's URL, with its process, which leads its own process group (its uvicorn workers are
    children: `os.killpg` stops them all)."""

    def __new__(cls, url: str, process: subprocess.Popen):
        self = super().__new__(cls, url)
        self.process = process
        return self
