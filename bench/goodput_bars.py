#!/usr/bin/env python3
"""Where several runs' wall time went, side by side: one stacked bar per run, from each run.json's time accounting
(`time.phases_s`, the same phases in the same order and colours on every bar), goodput beside each.

    python bench/goodput_bars.py --out docs/img/goodput.png "run 45 (before)=bench/runs/...-run.json" ...

Each argument is `LABEL=PATH` (a run directory or its run.json), drawn top to bottom in the order given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from job.commands.report import load_pyplot  # noqa: E402


def read_time(path: str) -> dict:
    """The `time` section of a run record (`path`: the file, or the run directory holding run.json)."""
    if os.path.isdir(path):
        path = os.path.join(path, "run.json")
    with open(path) as f:
        time = json.load(f).get("time")
    if not time or not time.get("phases_s"):
        raise SystemExit(f"goodput_bars: {path} has no time accounting (time.phases_s)")
    return time


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=PATH")
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    runs = []
    for item in args.runs:
        label, sep, path = item.partition("=")
        if not sep:
            parser.error(f"{item!r}: expected LABEL=PATH")
        runs.append((label, read_time(path)))
    phases = list(dict.fromkeys(name for _, time in runs for name in time["phases_s"]))
    plt = load_pyplot()
    palette = plt.get_cmap("tab20").colors
    colours = {name: palette[(2 * i) % 20 + (2 * i) // 20] for i, name in enumerate(phases)}

    fig, ax = plt.subplots(figsize=(9, 0.55 * len(runs) + 1.5))
    for row, (label, time) in enumerate(runs):
        left = 0.0
        for name in phases:
            seconds = time["phases_s"].get(name, 0.0)
            if seconds > 0:
                ax.barh([row], [seconds], left=left, color=colours[name], label=name if row == 0 else None,
                        edgecolor="white", linewidth=0.5)
                if seconds >= 8:
                    ax.text(left + seconds / 2, row, f"{seconds:.0f}", ha="center", va="center", fontsize=7)
                left += seconds
        ax.text(left + 1, row, f"{time['wall_s']:.0f} s, goodput {time['goodput']:.0%}", va="center", fontsize=8)
    ax.set_yticks(range(len(runs)), [label for label, _ in runs], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the driver started (run.json time.phases_s)")
    ax.set_xlim(0, max(time["wall_s"] for _, time in runs) * 1.25)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[name]) for name in phases]
    ax.legend(handles, phases, ncol=6, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.4 / len(runs)))
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"goodput_bars: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
