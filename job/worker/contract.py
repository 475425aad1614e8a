"""The contract between the driver and the training loop: what the driver hands every worker (`LoopConfig`) and
what the loop asks of its launcher (`Launcher`). Both sides import it, neither the other for it."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .. import config as config_lib
from .. import signals

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass
class LoopConfig:
    """What `launch.prepare` hands every worker's `train.train_loop` (as a plain dict under Ray Train:
    `launch.ray_loop_config`)."""

    cfg: config_lib.RunConfig
    """The resolved run config (local paths made absolute: `launch.resolve_paths`)."""
    run_dir: str
    """The run directory, `<storage_path>/<name>` (`launch.run_directory`)."""
    started_at: float
    """When the driver started (epoch seconds): the start of the run's time accounting (`metrics.Timeline`)."""
    startup: dict[str, float] = dataclasses.field(default_factory=dict)
    """When each startup step ended (epoch seconds, in order): the driver's `imports`, `checks` (config,
    packages, storage and model), `ray` (Ray connected or started) and `prepare` (data sources checked, run
    directory ready); then, added in each Ray Train worker, `workers` (Ray Train has started the worker group
    and entered this worker's loop function)."""
    tokenizer_json: str | None = None
    """The tokenizer the driver trained (`model.train_tokenizer_vocab`), serialised, as the workers may not share
    a filesystem with the driver; None: the workers load `model.tokenizer` (or `model.path`'s)."""
    mlflow_run_id: str | None = None
    """The run's MLflow run (`tracking.start`), which rank 0 logs its metrics to; None without
    `logging.mlflow.tracking_uri`."""


class Launcher:
    """What the loop asks of the launcher that started its process, never which one it is: device and process
    group, progress bar, final report, preemption, a stopped driver's request. One per worker process (`launch.RayLauncher`,
    `launch.TorchrunLauncher`)."""

    def setup_device(self, use_gpu: bool) -> torch.device:
        """This worker's device, with the process group created (before the first collective)."""
        raise NotImplementedError

    def progress_style(self, setting: str) -> str | None:
        """`metrics.progress_style` for `logging.progress_bar` `setting`, on the stream the bar is drawn on."""
        raise NotImplementedError

    def report(self, metrics: dict) -> None:
        """Tells the launcher the worker's last metrics, once the run is complete."""

    def preempted(self) -> bool:
        """Whether this worker was asked to stop for a preemption: a SIGTERM to its process
        (`signals.catch_preemption`); a flag read, cheap enough for any step."""
        return signals.preemption_signalled()

    def stop_requested(self) -> int | None:
        """The signal that stopped the driver, once it asked the ranks to save and end (`signals.StopRequest`), else
        None; a flag read, cheap enough for any step. None here: torchrun has no driver to ask."""
        return None
