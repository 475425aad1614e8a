"""The head pod's data staging (the chart's init container, templates/_staging.tpl) when the run cannot start: a copy
failed or a data source the run reads is missing. KubeRay ends a RayJob only from its Ray job's end (or a
deadline), so the staging tells why at once, where people look, and lets Ray start for the driver to end the run:

* run.json `failed`/`data` with the reason (`refuse`; under the run's lease, so that a driver of the same run still
  stopping elsewhere keeps its record);
* a Warning Event `DataStagingFailed` on the RayJob (`JOB_RAYJOB`; the chart's Role lets its pods create Events);
* the driver, started in this pod, finds the refusal (`refused_here`) and exits 2 with it, adding no record: the Ray
  job fails, so does the RayJob (`AppFailed`, its message the driver's last lines), deleted at its TTL.

    python -m job.driver.staging --config run.yaml MESSAGE      (the init container, on a failure it printed)
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import time
import urllib.request
from typing import Mapping

from .. import config as config_lib
from ..common.sources import DataError
from ..records import lease as lease_lib
from ..records import run_record
from ..records.environment import SERVICE_ACCOUNT_DIR
from . import launch

EVENT_REASON = "DataStagingFailed"
RAYJOB_ENV = "JOB_RAYJOB"
"""The RayJob the Event goes on (the chart sets it in the staging container)."""


def refuse(config_path: str, message: str, env: Mapping[str, str] = os.environ) -> None:
    """Tell the RayJob the refusal `message`, then record it in run.json (unless another driver holds the run; the
    record, which names the pod's environment, takes the longer)."""
    tell_rayjob(message, env)
    cfg = launch.resolve_paths(config_lib.load(config_path))
    run_dir = launch.run_directory(cfg)
    try:
        lease = lease_lib.acquire(run_dir)
    except lease_lib.LeaseHeld as e:
        print(f"run.json not written: {e}", flush=True)
    else:
        try:
            run_record.close_if_running(run_dir, "failed", DataError(message), attempt=launch.attempt(cfg, time.time()))
            print(f"recorded in {run_dir}/run.json: failed/data", flush=True)
        finally:
            lease_lib.release(run_dir, lease)


def refused_here(run_dir: str, env: Mapping[str, str] = os.environ) -> str | None:
    """The refusal this pod's staging recorded, for its first driver: the newest record `failed`/`data` from this
    pod, with no driver's heartbeat since (a warm cluster's head runs later jobs of the run: those check for
    themselves). Read before this driver beats. None when there is none."""
    try:
        record = run_record.load_latest(run_dir)
    except (OSError, ValueError):
        return None
    error = record.get("error") or {}
    if not (env.get("POD_NAME") and record.get("pod", {}).get("name") == env["POD_NAME"]
            and record.get("status") == "failed" and error.get("class") == "data"
            and not (record.get("metrics") or {}).get("steps")):
        return None
    beat = lease_lib.read_heartbeat(run_dir)
    if beat and beat.get("at", "") >= record.get("ended_at", ""):  # ISO times in UTC, to the second
        return None
    return error.get("message", "").removeprefix("DataError: ")


def tell_rayjob(message: str, env: Mapping[str, str] = os.environ) -> None:
    """A Warning Event with `message` on the RayJob `JOB_RAYJOB` names, with its uid (`kubectl describe` matches on
    it). Said, never raised, when it cannot be posted."""
    name, namespace = env.get(RAYJOB_ENV), env.get("POD_NAMESPACE")
    host = env.get("KUBERNETES_SERVICE_HOST")
    if not (name and namespace and host):
        print(f"no Event: {RAYJOB_ENV}, POD_NAMESPACE or KUBERNETES_SERVICE_HOST unset", flush=True)
        return
    api = f"https://{host}:{env.get('KUBERNETES_SERVICE_PORT', '443')}"
    try:
        uid = _kube(api, "GET", f"/apis/ray.io/v1/namespaces/{namespace}/rayjobs/{name}")["metadata"]["uid"]
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        _kube(api, "POST", f"/api/v1/namespaces/{namespace}/events", {
            "metadata": {"name": f"{name}.{time.time_ns():x}", "namespace": namespace},
            "involvedObject": {"apiVersion": "ray.io/v1", "kind": "RayJob", "name": name, "namespace": namespace,
                               "uid": uid},
            "type": "Warning", "reason": EVENT_REASON, "message": message[:1000], "count": 1,
            "firstTimestamp": now, "lastTimestamp": now,
            "source": {"component": "ray-finetune-staging", "host": env.get("POD_NAME", "")}})
        print(f"Event {EVENT_REASON} on RayJob {namespace}/{name}", flush=True)
    except Exception as e:  # the record and the container's log still say it
        print(f"no Event on RayJob {namespace}/{name}: {type(e).__name__}: {e}", flush=True)


def _kube(api: str, method: str, path: str, body: dict | None = None) -> dict:
    """One call to the API server with the pod's service account."""
    with open(os.path.join(SERVICE_ACCOUNT_DIR, "token"), encoding="utf-8") as f:
        token = f.read().strip()
    request = urllib.request.Request(f"{api}{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    tls = ssl.create_default_context(cafile=os.path.join(SERVICE_ACCOUNT_DIR, "ca.crt"))
    with urllib.request.urlopen(request, timeout=10, context=tls) as response:
        return json.load(response)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m job.driver.staging", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the run config (the chart's /etc/job/run.yaml)")
    parser.add_argument("message", help="why the run cannot start, one line naming the value")
    args = parser.parse_args(argv)
    refuse(args.config, args.message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
