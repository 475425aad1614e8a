"""The driver: resolve the run, prepare what every worker shares, and start the workers.

Two launchers run the same `train.train_loop`: Ray Train (default; the cluster at `RAY_ADDRESS`, else an embedded
single-node Ray), or torchrun (`torchrun --nproc-per-node N -m job --config run.yaml`, for benchmarks and debugging
without Ray). The loop never asks which: it calls the `Launcher` built here.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import threading
import time
from typing import TYPE_CHECKING

from .. import config as config_lib
from .. import signals, storage
from ..commands import report
from ..common import checkpoints, exports, sources
from ..common.presets import config_fields
from ..common.terminal import is_terminal, progress_style
from ..records import failures, run_record, tracking
from ..rules import is_hub_source
from ..worker.contract import Launcher, LoopConfig
from . import watch

if TYPE_CHECKING:
    import torch

# The training loop (the model, FSDP2, the compiler) is imported where a worker runs it: the driver only launches
# it, and those imports took ~5 of its ~10 s on 2 cores. torch itself is imported only where torchrun's processes
# use it, so that the head's data staging (`staging`, which needs this module's paths) starts without it.


class ClusterLost(RuntimeError):
    """The driver lost Ray Train's controller (its node or the Ray cluster gone): `infrastructure`/`cluster_lost`,
    the Ray error its cause."""


def resolve_paths(cfg: config_lib.RunConfig) -> config_lib.RunConfig:
    """The config with local paths (`file://` too) made absolute, as the workers do not share the driver's working
    directory; model and tokenizer paths only where they exist locally (else they are hub ids)."""
    cfg = copy.deepcopy(cfg)

    def local(path: str | None) -> bool:
        return (path is not None and not storage.is_remote(path) and not is_hub_source(path)
                and not path.startswith("builtin:"))

    def absolute(path: str) -> str:
        return os.path.abspath(storage.local_path(path))

    if local(cfg.storage_path):
        cfg.storage_path = absolute(cfg.storage_path)
    if cfg.checkpoint.resume not in ("auto", "never") and local(cfg.checkpoint.resume):
        cfg.checkpoint.resume = absolute(cfg.checkpoint.resume)
    for source in (cfg.data.train, cfg.data.validation):
        if source is not None and local(source.path):
            source.path = absolute(source.path)
    for field in ("path", "tokenizer"):
        value = getattr(cfg.model, field)
        if local(value) and os.path.exists(storage.local_path(value)):
            setattr(cfg.model, field, absolute(value))
    return cfg


def run_directory(cfg: config_lib.RunConfig) -> str:
    """`<storage_path>/<name>`, with a local storage path made an absolute OS path (Ray requires it)."""
    base = cfg.storage_path
    if not storage.is_remote(base):
        base = os.path.abspath(storage.local_path(base))
    return f"{base.rstrip('/')}/{cfg.name}"


def check_before_start(cfg: config_lib.RunConfig, run_dir: str) -> None:
    """What the config alone cannot show, checked before any data is read or worker started: the run directory
    is writable and the model's config takes the settings. One `ConfigError` lists every problem by field."""
    errors = _storage_problems(run_dir) + _model_problems(cfg)
    if errors:
        raise config_lib.ConfigError(*errors)


def _storage_problems(run_dir: str) -> list[str]:
    """Create the run directory and write a probe file: bad storage fails here, named, not in the first save."""
    probe = storage.join(run_dir, f".write-probe-{os.getpid()}")  # one per process: torchrun's all check at once
    try:
        fs, path = storage.filesystem(run_dir)
        fs.makedirs(path, exist_ok=True)
        storage.write_atomic(probe, b"probe\n")  # some bytes: a full disk still creates an empty file
        storage.remove(probe)
    except Exception as e:  # OSError locally; object stores raise their own (credentials, missing bucket)
        return [f"storage_path: cannot create and write the run directory {run_dir} ({type(e).__name__}: {e})"]
    return []


def _model_problems(cfg: config_lib.RunConfig) -> list[str]:
    """Check the model's config (preset or path, with overrides): heads divide the hidden size, key/value heads
    divide the heads, `train.seq_len` is within its positions, and LoRA's targets name its linear layers."""
    try:
        arch = config_fields(cfg.model)
    except Exception as e:  # no such directory or hub id, no config.json, not JSON
        return [f"model.path: cannot read the model's config ({type(e).__name__}: {' '.join(str(e).split())[:300]})"]
    hidden, heads = arch.get("hidden_size"), arch.get("num_attention_heads")
    kv_heads = arch.get("num_key_value_heads") or heads
    errors = []
    if hidden and heads and hidden % heads and arch.get("head_dim") is None:
        errors.append(f"model.overrides: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    if heads and kv_heads and heads % kv_heads:
        errors.append(f"model.overrides: num_attention_heads {heads} is not divisible by num_key_value_heads {kv_heads}")
    positions = arch.get("max_position_embeddings")
    if positions and cfg.train.seq_len > positions:
        errors.append(f"train.seq_len: {cfg.train.seq_len} is beyond the model's max_position_embeddings ({positions})")
    if cfg.model.lora.rank and not errors:  # its layers' names: the model without weights, built in seconds
        from ..worker.model import causal_lm, lora  # transformers: here, to keep the start of other runs short

        if problem := lora.targets_problem(causal_lm.skeleton(cfg.model), cfg.model.lora):
            errors.append(problem)
    return errors


def finished(cfg: config_lib.RunConfig, run_dir: str) -> str | None:
    """What to tell the user when the run is already complete (newest checkpoint at `train.max_steps`, its export
    accepted if asked for; a pairs run's pairs written), so that a re-run starts nothing; else None."""
    if cfg.mode == "pairs":
        done = storage.join(run_dir, exports.PAIRS_RECORD)
        return (f"run {run_dir} has already written its pairs ({storage.join(run_dir, exports.PAIRS_FILE)}, counts in "
                f"{done}); choose a new run name to sample again") if storage.exists(done) else None
    latest = checkpoints.latest_complete(run_dir)
    step = int(latest.rsplit(checkpoints.PREFIX, 1)[-1]) if latest else 0
    if step < cfg.train.max_steps or (cfg.checkpoint.export and not exports.export_is_valid(run_dir, step)):
        return None
    export = f", its export accepted in {storage.join(run_dir, exports.EXPORT_DIR)}" if cfg.checkpoint.export else ""
    return (f"run {run_dir} is already complete: checkpoint {latest} is at step {step} "
            f"(train.max_steps {cfg.train.max_steps}){export}. Nothing to train. To train longer, raise "
            "train.max_steps (the run continues from this checkpoint, this export kept in exports/); to train again "
            "from scratch, choose a new run name or delete the run directory.")


def prepare(cfg: config_lib.RunConfig, run_dir: str, started_at: float | None = None,
            startup: dict[str, float] | None = None) -> LoopConfig:
    """Work done once before the workers start: check every data source, save the resolved config
    (`run_record.config_file`), start MLflow, train a tokenizer if asked.

    Returns every worker's `LoopConfig`, with `started_at` (default now) and `startup` (when each of the driver's
    startup steps ended). The resume was checked before (`checkpoints.check_before_start`, right after the lease).
    """
    started_at = time.time() if started_at is None else started_at
    if checkpoints.retire_ray_snapshot(run_dir):
        print(f"removed {checkpoints.RAY_SNAPSHOT} of an earlier version: checkpoints are found in the run "
              "directory itself", flush=True)
    # Every data source read here: a missing path, bad row or unreachable hub id fails now, naming the source.
    corpus = sources.tokenizer_corpus(cfg.data, cfg.train.seed) if cfg.data.format != "synthetic" else []
    fs, path = storage.filesystem(run_dir)
    fs.makedirs(path, exist_ok=True)
    storage.write_atomic(storage.join(run_dir, run_record.config_file(run_dir)), config_lib.to_yaml(cfg))
    loop_config = LoopConfig(cfg, run_dir, started_at)
    if cfg.logging.mlflow.tracking_uri and os.environ.get("RANK", "0") == "0":
        loop_config.mlflow_run_id = tracking.start(cfg, run_dir)
    if cfg.model.train_tokenizer_vocab:
        tokenizer = sources.train_bpe_tokenizer(corpus, cfg.model.train_tokenizer_vocab)
        # Saved for export and inspection; the workers get the JSON itself, as they may not share a filesystem.
        if not storage.is_remote(run_dir):
            tokenizer.save_pretrained(os.path.join(storage.local_path(run_dir), "tokenizer"))
        loop_config.tokenizer_json = tokenizer.backend_tokenizer.to_str()
    loop_config.startup = {**(startup or {}), "prepare": time.time()}
    return loop_config


def connect_ray(cfg: config_lib.RunConfig) -> None:
    """Connect to the Ray cluster at `RAY_ADDRESS`, or start an embedded one, and refuse (`ConfigError`) a worker
    group the cluster can never place: Ray would wait for it forever."""
    import ray

    # Workers print their metric lines themselves; Ray's print patching would print each line twice.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    if not sys.stdout.isatty():  # no colour codes around the workers' line prefixes in a log file
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), logging_level="WARNING")
        _connected.append(True)
    if not sys.stderr.isatty():  # nor around the prefixes of the workers' progress bars the driver draws there
        from ray.experimental import tqdm_ray

        tqdm_ray.instance().should_colorize = False
    need = worker_resources(cfg)
    capacity = worker_capacity(need, [n["Resources"] for n in ray.nodes() if n["Alive"]], _autoscaler_groups())
    if capacity is not None and capacity < cfg.scaling.num_workers:
        shown = ", ".join(f"{k} {v:g}" for k, v in need.items())
        raise config_lib.ConfigError(
            f"scaling.num_workers: {cfg.scaling.num_workers} workers of {{{shown}}} each cannot be placed: this "
            f"Ray cluster can hold at most {capacity} (whole workers per node, its autoscaler's maximum included); "
            "lower scaling.num_workers or scaling.cpus_per_worker, or add nodes")


_connected: list[bool] = []  # whether `connect_ray` connected this process (not its caller, e.g. a test's Ray)


def disconnect_ray() -> None:
    """End `connect_ray`'s connection (an embedded Ray stops with it) and its forwarding of the workers' output,
    so that what the driver prints afterwards comes last."""
    import ray

    if _connected and ray.is_initialized():
        ray.shutdown()
        _connected.clear()
    close_progress_bars()
    sys.stdout.flush()


def close_progress_bars() -> None:
    """Closes the workers' progress bars the driver draws (`tqdm_ray`) that their workers never closed (a cancelled
    or failed run): drawn once more where they stand, and never again under what the driver prints next (its
    patched `print` redraws every open bar after each line). Ray's bar manager is internal: left alone if it
    differs."""
    manager = getattr(sys.modules.get("ray.experimental.tqdm_ray"), "_manager", None)
    groups = getattr(manager, "bar_groups", None)
    if not isinstance(groups, dict):
        return
    with manager.lock:
        for group in groups.values():
            for bar in list(getattr(group, "bars_by_uuid", {}).values()):
                bar.close()
            group.bars_by_uuid = {}


def worker_resources(cfg: config_lib.RunConfig) -> dict[str, float]:
    return {"CPU": cfg.scaling.cpus_per_worker, **({"GPU": 1.0} if cfg.scaling.use_gpu else {})}


def worker_capacity(need: dict[str, float], nodes: list[dict], groups: list[tuple[dict, int]] | None) -> int | None:
    """How many workers of `need` the cluster can ever hold: whole workers per node, over the live `nodes` or the
    autoscaler's `groups` (resources, max count) at their maximum, whichever is larger; None for no maximum."""
    def per_node(resources: dict) -> int:
        return int(min(resources.get(k, 0.0) // v for k, v in need.items()))

    now = sum(per_node(r) for r in nodes)
    if not groups:
        return now
    if any(count < 0 for _, count in groups):
        return None
    return max(now, sum(per_node(r) * count for r, count in groups))


def _autoscaler_groups() -> list[tuple[dict, int]] | None:
    """(resources, max count) of each node group the autoscaler may start; None without one."""
    try:
        from ray._private.state import state

        config = state.get_cluster_config()
    except Exception:  # an older or a non-autoscaling cluster
        return None
    if config is None or not config.node_group_configs:
        return None
    return [(dict(g.resources), g.max_count) for g in config.node_group_configs]


class RayLauncher(Launcher):
    """A Ray Train worker: Ray Train made the process group and chose the device; the driver draws rank 0's bar;
    a thread waits on the driver's `signals.StopRequest`."""

    def __init__(self, driver_tty: bool, stop_request=None):
        self.driver_tty = driver_tty
        """Whether the driver's stderr, where the bar is drawn, is a terminal (the worker's is a log file)."""
        self._stop_signal: int | None = None
        if stop_request is not None:
            threading.Thread(target=self._await_stop, args=(stop_request,), name="job-stop-request",
                             daemon=True).start()

    def _await_stop(self, stop_request) -> None:
        import ray

        try:
            signum = ray.get(stop_request.requested.remote())
        except Exception:  # the driver and its actor gone: Ray ends this worker with them
            return
        signals.stop_catching_preemption()  # the driver ends the workers once they saved, or its wait is over
        self._stop_signal = signum

    def stop_requested(self) -> int | None:
        return self._stop_signal

    def setup_device(self, use_gpu: bool) -> torch.device:
        import ray.train.torch

        return ray.train.torch.get_device()

    def progress_style(self, setting: str) -> str | None:
        return progress_style(setting, terminal=self.driver_tty, via_ray_driver=True)

    def report(self, metrics: dict) -> None:
        import ray.train

        ray.train.report(metrics)

    def preempted(self) -> bool:
        """Also Ray Train's own signal: its controller marks every worker of a draining node (a `ray start` that got
        SIGTERM drains with reason PREEMPTION). Read from the train context: `get_preemption_info()` is a barrier."""
        try:
            from ray.train.v2._internal.execution.context import get_train_context

            marked = get_train_context().preemption_context.preemption_info is not None
        except (ImportError, AttributeError, RuntimeError):  # a Ray without preemption handling
            marked = False
        return marked or super().preempted()


class TorchrunLauncher(Launcher):
    """A torchrun process: the process group is created here; rank 0 draws its own bar; no one to report to."""

    def setup_device(self, use_gpu: bool) -> torch.device:
        import torch
        import torch.distributed as dist

        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank) if use_gpu else torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("nccl" if use_gpu else "gloo")
        signals.catch_preemption()  # torchrun forwards its SIGTERM to the workers
        return device

    def progress_style(self, setting: str) -> str | None:
        return progress_style(setting, terminal=is_terminal(sys.stderr), via_ray_driver=False)


def ray_loop_config(loop_config: LoopConfig, stop_request=None) -> dict:
    """Ray Train's `train_loop_config`: `loop_config`'s fields as a plain dict, plus `driver_tty` and the driver's
    `stop_request` (a `signals.StopRequest` actor); read back in each worker by `ray_worker_args`."""
    fields = {f.name: getattr(loop_config, f.name) for f in dataclasses.fields(loop_config)}
    return {**fields, "cfg": config_lib.to_dict(loop_config.cfg), "driver_tty": is_terminal(sys.stderr),
            "stop_request": stop_request}


def ray_worker_args(train_loop_config: dict) -> tuple[LoopConfig, RayLauncher]:
    """In a Ray worker, `train_loop`'s arguments from `ray_loop_config`'s dict."""
    fields = dict(train_loop_config)
    launcher = RayLauncher(driver_tty=fields.pop("driver_tty"), stop_request=fields.pop("stop_request", None))
    return LoopConfig(**{**fields, "cfg": config_lib.load_dict(fields["cfg"])}), launcher


def ray_train_loop(train_loop_config: dict) -> None:
    """What each Ray Train worker runs: `train.train_loop`, under a `RayLauncher`; nothing in a worker group that
    Ray Train started after the driver was stopped (a retry racing the stop)."""
    stop_request = train_loop_config.get("stop_request")
    if stop_request is not None and stop_pending(stop_request):
        return
    loop_config, launcher = ray_worker_args(train_loop_config)
    loop_config.startup["workers"] = time.time()  # Ray Train's part ends here; the training code's imports follow
    from ..worker.train import train_loop  # here, not at the top: keeps the driver's start short

    try:
        train_loop(loop_config, launcher)
    finally:
        signals.stop_catching_preemption()


def run_with_ray(cfg: config_lib.RunConfig, loop_config: LoopConfig) -> str | None:
    """Runs the workers under Ray Train; returns None on success, else the workers' error in one line each."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError, WorkerGroupError
    from ray.train.torch import TorchTrainer

    connect_ray(cfg)
    storage_path, name = loop_config.run_dir.rsplit("/", 1)
    stop_request = stop_request_actor()
    trainer = trainer_class(TorchTrainer, loop_config.run_dir)(
        ray_train_loop,
        train_loop_config=ray_loop_config(loop_config, stop_request),
        scaling_config=ScalingConfig(
            num_workers=cfg.scaling.num_workers,
            use_gpu=cfg.scaling.use_gpu,
            resources_per_worker=worker_resources(cfg),
        ),
        # Ray Train's run directory is the run's: the workers find, verify and prune its checkpoints themselves.
        run_config=RunConfig(
            name=name,
            storage_path=storage_path,
            failure_config=FailureConfig(max_failures=cfg.scaling.max_failures),
        ),
    )
    from ray.exceptions import RayActorError, RaySystemError

    this_attempt = attempt(cfg, loop_config.started_at)  # for a failure before rank 0 opened the record
    try:
        trainer.fit()
    except KeyboardInterrupt as e:  # SIGINT/SIGTERM to the driver (watch.driver_watch)
        cancelled = watch.as_cancelled(e)
        stop(trainer, stop_request, loop_config.run_dir, cancelled, this_attempt)
        raise cancelled from None
    except WorkerGroupError as e:
        messages = {rank: worker_failure(exc) for rank, exc in e.worker_failures.items()}
        lost = any(isinstance(exc, RayActorError) for exc in e.worker_failures.values())
        if e.worker_failures:
            run_record.record_group_failure(loop_config.run_dir, e.worker_failures, attempt=this_attempt)
        else:
            run_record.close_if_running(loop_config.run_dir, "failed", e, attempt=this_attempt)
        return (recorded_ending(loop_config.run_dir) + _by_message(messages)
                + (f"\n{resume_hint(loop_config.run_dir)}" if lost else ""))
    except TrainingFailedError as e:
        run_record.close_if_running(loop_config.run_dir, "failed", e, attempt=this_attempt)
        return f"{type(e).__name__}: {_one_line(e)}\n{resume_hint(loop_config.run_dir)}"
    except (RayActorError, RaySystemError) as e:  # the wait on the controller itself: its node or the cluster is gone
        lost = ClusterLost(f"Ray Train's controller is unreachable, its node or the Ray cluster gone "
                                    f"({type(e).__name__}: {_one_line(e)[:500]})")
        lost.__cause__ = e
        run_record.close_if_running(loop_config.run_dir, "failed", lost, attempt=this_attempt)
        return f"{lost}\n{resume_hint(loop_config.run_dir)}"
    return None


def recorded_ending(run_dir: str) -> str:
    """The record's error as its first line: what the workers knew (a hang, a preemption) where Ray saw only a
    lost worker."""
    error = failures.one_line(run_record.load_latest(run_dir).get("error"))
    return f"run.json: {error}\n" if error else ""


def attempt(cfg: config_lib.RunConfig, started_at: float) -> dict:
    """`run_record.close_if_running`'s `attempt`, for one that failed before rank 0 opened its record."""
    return {"started_at": started_at, "config": config_lib.to_dict(cfg), "config_text": config_lib.to_yaml(cfg),
            "run_name": cfg.name, "seed": cfg.train.seed,
            "logs": failures.attempt_logs(run_directory(cfg), started_at)}


def stop_request_actor():
    """The run's `signals.StopRequest`, a Ray actor taking no CPU, preferably on the driver's node. Ray may place it
    elsewhere (a worker's node, which a preemption takes away): it is then restarted, empty, and its calls retried,
    so that a lost node never leaves the worker groups after it a dead actor to ask (`stop_pending`)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    return ray.remote(signals.StopRequest).options(num_cpus=0, scheduling_strategy=here, max_restarts=-1,
                                                   max_task_retries=-1).remote()


def stop_pending(stop_request, timeout_s: float = 30.0) -> bool:
    """Whether the driver asked the ranks to stop before this worker group started. A request that cannot be read
    (its actor lost, restarting) counts as none, said once: a stop then still ends the workers, without their save;
    it must never fail a worker group, which Ray Train would retry as a preemption without end."""
    import ray

    try:
        return ray.get(stop_request.pending.remote(), timeout=timeout_s) is not None
    except Exception as e:
        print(f"the driver's stop request cannot be read ({type(e).__name__}): training on", flush=True)
        return False


def stop(trainer, stop_request, run_dir: str, cancelled: signals.Cancelled, this_attempt: dict) -> None:
    """A stopped driver's end of the run: it asks the ranks to save at their next log step and end
    (`signals.StopRequest`), waits for rank 0 to record that (`watch.await_stop_save`: while this attempt trains, at
    most `watch.stop_save_wait_s`; a second signal ends the wait), closes the record `cancelled` if no save closed
    it, and only then stops the workers."""
    import ray

    print(f"{cancelled}", flush=True)
    try:
        ray.get(stop_request.request.remote(cancelled.signum), timeout=10)
        watch.await_stop_save(run_dir, this_attempt["started_at"])
    except KeyboardInterrupt:
        print("a second signal: stopping the workers without waiting for their save", flush=True)
    except Exception as e:  # the request's actor unreachable: nothing to wait for
        print(f"cannot ask the workers to save ({type(e).__name__}: {_one_line(e)[:300]})", flush=True)
    run_record.close_if_running(run_dir, "cancelled", cancelled, attempt=this_attempt)
    print("stopping the workers", flush=True)
    abort(trainer)


def abort(trainer, timeout_s: float = 15.0) -> None:
    """Stop the workers through Ray Train's controller, as its Ctrl-C handler does. Without its handle the workers
    still end with the driver, which owns the controller."""
    import ray

    controller = getattr(trainer, "controller", None)
    if controller is None:
        return
    try:
        ray.get(controller.abort.remote(), timeout=timeout_s)
    except Exception:  # the controller exits once aborted: its call ends in a RayActorError
        pass


def dead_ranks(workers: list, ranks: list[int], timeout_s: float = 10.0) -> dict[int, BaseException]:
    """Those of `ranks` (indexes into a worker group's `workers`) whose actor is dead, each with Ray's error: one call
    each, which a live actor answers at once and a dead one with `RayActorError` once Ray has seen the death; one
    still unanswered after `timeout_s` counts as alive."""
    import ray
    from ray.exceptions import RayActorError

    calls = {workers[rank].actor.__ray_ready__.remote(): rank for rank in ranks}
    if not calls:
        return {}
    answered, _ = ray.wait(list(calls), num_returns=len(calls), timeout=timeout_s)
    dead = {}
    for call in answered:
        try:
            ray.get(call)
        except RayActorError as e:
            dead[calls[call]] = e
    return dead


def trainer_class(base: type, run_dir: str) -> type:
    """`base` (`TorchTrainer`) keeping its controller's handle (for `abort`) instead of installing Ray Train's SIGINT
    handler, which would end the driver with status 0 and the record left running (`watch.driver_watch` handles
    SIGINT and SIGTERM alike), with a worker callback that catches SIGTERM for a preemption save, and a worker-group
    callback that records a failed group's cause once its workers are gone, also when Ray Train retries it
    (`run_record.record_group_failure`: the retry's record would otherwise find the lost attempt's left running).

    Without Ray Train's placement-group cleaner: a detached actor that counts a state API starved of CPU as the
    controller's death and removed a live run's placement group (docs/checkpoints.md; ray-project/ray#65447). It
    matters only when the controller dies while its driver lives on; here the driver is this process, and Ray
    removes its job's placement groups when it ends. Kept as is if Ray's internals differ."""
    try:
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
        from ray.train.v2._internal.execution.callback import WorkerCallback, WorkerGroupCallback
    except ImportError:
        return base
    if not hasattr(base, "_create_default_callbacks") or not hasattr(base, "_register_sigint_handler"):
        return base

    class CatchPreemption(WorkerCallback):
        """Runs in each worker actor's main thread (signal handlers can be set only there), before the loop."""

        def after_init_train_context(self):
            signals.catch_preemption()

    class RecordGroupFailure(WorkerGroupCallback):
        """Runs in Ray Train's controller: a poll's errors are kept until the group is shut down, then recorded.

        A poll can return a survivor's error (its peer gone) while the lost rank's own poll still hangs, its death
        not yet published: then, before the shutdown, the ranks without an error are asked whether they live, so the
        record names the lost one rather than the survivor that noticed (`dead_ranks`)."""

        errors: dict | None = None

        def after_worker_group_poll_status(self, worker_group_status):
            self.errors = dict(worker_group_status.errors) or self.errors

        def before_worker_group_shutdown(self, worker_group):
            if not self.errors or failures.lost_ranks(self.errors):
                return
            try:
                workers = worker_group.get_workers()
                self.errors.update(dead_ranks(workers, [r for r in range(len(workers)) if r not in self.errors]))
            except Exception as e:  # the group's shutdown goes on; the record names the rank that failed
                print(f"cannot ask the worker group which rank died: {type(e).__name__}: {e}", file=sys.stderr,
                      flush=True)

        def after_worker_group_shutdown(self, worker_group_context):
            if self.errors:
                run_record.record_group_failure(run_dir, self.errors)
            self.errors = None

    class Trainer(base):
        controller = None

        def _create_default_callbacks(self):
            return [cb for cb in super()._create_default_callbacks()
                    if not isinstance(cb, PlacementGroupCleanerCallback)] + [CatchPreemption(), RecordGroupFailure()]

        def _register_sigint_handler(self, controller):
            self.controller = controller

    return Trainer


def worker_failure(exc: BaseException) -> str:
    """One line for a worker's failure; one whose process died is called lost."""
    from ray.exceptions import RayActorError

    if isinstance(exc, RayActorError):  # ActorDiedError included
        return f"lost: its process died (out of memory, node lost or killed) ({type(exc).__name__}: {_one_line(exc)[:300]})"
    return f"{type(exc).__name__}: {_one_line(exc)}"


def _by_message(failures: dict[int, str]) -> str:
    """`ranks 0, 1: <message>; rank 2: <other>`: ranks that failed alike are named once."""
    ranks: dict[str, list[int]] = {}
    for rank, message in sorted(failures.items()):
        ranks.setdefault(message, []).append(rank)
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {m}" for m, r in ranks.items())


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:2000]


def resume_hint(run_dir: str) -> str:
    """What re-running the same command does after a lost worker or a failed Ray Train controller."""
    latest = checkpoints.latest_complete(run_dir)
    if latest is None:
        return "the run has no complete checkpoint: re-running the same command starts it from the beginning"
    return f"re-running the same command resumes the run from its newest usable checkpoint ({latest} or older)"


def run_with_torchrun(loop_config: LoopConfig) -> None:
    import torch.distributed as dist

    from ..worker.train import train_loop  # here, not at the top: keeps the driver's start short

    try:
        train_loop(loop_config, TorchrunLauncher())
    finally:
        signals.stop_catching_preemption()
        if dist.is_initialized():
            dist.destroy_process_group()
        finish_tracking(loop_config)


def finish_tracking(loop_config: LoopConfig) -> None:
    """Ends the attempt's MLflow run (`tracking.finish`), when there is one."""
    if loop_config.mlflow_run_id:
        tracking.finish(loop_config.cfg.logging.mlflow.tracking_uri, loop_config.run_dir, loop_config.mlflow_run_id,
                        report.write_report)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ
