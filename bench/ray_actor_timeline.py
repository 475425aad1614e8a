#!/usr/bin/env python3
"""Where Ray Train's startup time goes, from a Ray session's logs.

For each actor: when the GCS registered it (its creation was asked for), when its worker process started, and
when the GCS had it created (its `__init__` done), in seconds from the first registration. Ray Train starts its
controller, then from there the actors it needs; the rows show which waited on which. Then the controller's
own account of starting the worker group (its `[Worker Group Initialization]` lines, at the same clock).

    python bench/ray_actor_timeline.py [/tmp/ray/session_latest/logs]
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from datetime import datetime

STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
ACTOR = re.compile(r"actor_id=([0-9a-f]+)")


def stamp(line: str) -> float | None:
    match = STAMP.match(line)
    return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if match else None


def main() -> int:
    logs = sys.argv[1] if len(sys.argv) > 1 else "/tmp/ray/session_latest/logs"
    registered, created = {}, {}
    with open(os.path.join(logs, "gcs_server.out")) as f:
        for line in f:
            if "Registering actor" in line and (m := ACTOR.search(line)):
                registered.setdefault(m.group(1), stamp(line))
            elif "Finished creating actor" in line and (m := ACTOR.search(line)):
                created.setdefault(m.group(1), (stamp(line), "OK" in line.split("Status:")[-1][:4]))
    rows = []
    for core_log in glob.glob(os.path.join(logs, "python-core-worker-*.log")):
        pid = core_log.rsplit("_", 1)[-1].removesuffix(".log")
        with open(core_log) as f:
            text = f.read()
        actor = re.search(r"Creating actor actor_id=([0-9a-f]+)", text)
        if not actor:
            continue
        names = glob.glob(os.path.join(logs, f"worker-*-{pid}.out"))
        name = "?"
        if names:
            with open(names[0]) as f:
                found = re.search(r":actor_name:(\S+)", f.read(4096))
            name = found.group(1) if found else "?"
        rows.append((name, registered.get(actor.group(1)), stamp(text), created.get(actor.group(1), (None, False))[0]))
    times = [t for row in rows for t in row[1:] if t is not None]
    if not times:
        print(f"no actors found in {logs}")
        return 1
    zero = min(times)
    show = lambda t: f"{t - zero:>9.1f}" if t is not None else f"{'-':>9}"  # noqa: E731
    print(f"{'actor':<32}{'asked':>9}{'process':>9}{'ready':>9}")
    for name, *marks in sorted(rows, key=lambda r: r[1] or 0):
        print(f"{name:<32}" + "".join(show(t) for t in marks))
    for controller_log in glob.glob(os.path.join(logs, "train", "ray-train-sys-controller-*.log")):
        with open(controller_log) as f:
            for line in f:
                record = json.loads(line)
                if "[Worker Group Initialization]" in record.get("message", ""):
                    message = record["message"].split("]", 1)[1].split("\n")[0].strip()
                    print(f"{show(record['timestamp_ns'] / 1e9)}  controller: {message}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
