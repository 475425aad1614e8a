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
import os
import sys
import time
from typing import Mapping

from .. import config as config_lib
from ..common import kubeapi
from ..common.sources import DataError
from ..records import lease as lease_lib
from ..records import run_record
from . import follow, launch

EVENT_REASON = "DataStagingFailed"


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
    try:
        reporter = follow.RayJobReporter.in_cluster(env)
    except kubeapi.ApiError as e:
        print(f"no Event: {e}", flush=True)
        return
    reporter.check_submission(env)
    reporter.event("Warning", EVENT_REASON, message)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m job.driver.staging", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the run config (the chart's /etc/job/run.yaml)")
    parser.add_argument("message", help="why the run cannot start, one line naming the value")
    args = parser.parse_args(argv)
    refuse(args.config, args.message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
