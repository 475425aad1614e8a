"""Faults injected on purpose, for tests and failure drills: `debug.fail_at_step` (`FaultInjection`, one hook the
loop calls at each step's start), and the worker pid files a drill picks a process to kill by (`write_pid`)."""

from __future__ import annotations

import errno
import os
import signal
import time

from .. import config as config_lib
from .. import storage
from .checkpoint.writer import Checkpointer


def write_pid(run_dir: str, rank: int) -> None:
    """`<run>/workers/rank<r>.pid` (local storage only), so a drill can kill a chosen worker process."""
    if not storage.is_remote(run_dir):
        storage.write_atomic(storage.join(run_dir, "workers", f"rank{rank}.pid"), str(os.getpid()).encode())


LOGGED_LOSS_FACTOR = {"loss_spike": 10.0, "nan": float("nan")}
"""The `debug.fail_mode`s that change the rank's logged loss from their step on, by this factor."""


def maybe_fail(cfg: config_lib.RunConfig, step: int, rank: int, run_dir: str, in_write: bool = False) -> float | None:
    """`debug.fail_at_step`: the chosen rank fails at the step as `debug.fail_mode` says, once per run name (`kill`,
    `exception`, `hang` at the step's start; `disk_full` in its checkpoint write, `in_write`). Returns the logged
    loss's factor when `loss_spike` or `nan` fires, else None."""
    d = cfg.debug
    if d.fail_at_step != step or d.fail_rank != rank or in_write != (d.fail_mode == "disk_full"):
        return None
    marker = storage.join(run_dir, "faults", f"step{step}-rank{rank}")
    if storage.exists(marker):
        return None
    storage.write_atomic(marker, f"{time.time()}\n".encode())
    print(f"debug.fail_at_step: rank {rank} (pid {os.getpid()}) fails at step {step} ({d.fail_mode})", flush=True)
    if d.fail_mode in LOGGED_LOSS_FACTOR:
        return LOGGED_LOSS_FACTOR[d.fail_mode]
    if d.fail_mode == "exception":
        raise RuntimeError(f"debug.fail_at_step: injected failure at step {step} on rank {rank}")
    if d.fail_mode == "disk_full":
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (debug.fail_mode: disk_full)")
    while d.fail_mode == "hang":  # before the step's first collective, in which the other ranks then wait
        time.sleep(60)
    os.kill(os.getpid(), signal.SIGKILL)


class FaultInjection:
    """`debug.fail_at_step` in one worker: `at_step` at each step's start; a `disk_full` fault armed in the
    checkpointer's write (`Checkpointer.injected_write_error`)."""

    def __init__(self, cfg: config_lib.RunConfig, rank: int, run_dir: str, checkpointer: Checkpointer):
        self.cfg, self.rank, self.run_dir = cfg, rank, run_dir
        self.logged_loss_factor = 1.0
        """This rank's logged loss is multiplied by it from a `loss_spike` or `nan` fault's step on."""
        if cfg.debug.fail_mode == "disk_full":
            checkpointer.injected_write_error = lambda step: maybe_fail(cfg, step, rank, run_dir, in_write=True)

    def at_step(self, step: int) -> float:
        """Fires the fault due at `step`'s start on this rank, if any; returns `logged_loss_factor`."""
        self.logged_loss_factor = maybe_fail(self.cfg, step, self.rank, self.run_dir) or self.logged_loss_factor
        return self.logged_loss_factor
