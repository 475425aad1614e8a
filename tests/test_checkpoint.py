"""Checkpoints, exact resume, fault tolerance and the checked export, on 2 CPU Ray Train workers.

One uninterrupted reference run (module fixture) is compared with runs that lose a worker (SIGKILL from
outside, or the fault-injection switch), fail and are re-run under the same name, or resume on fewer workers:
after every resume the per-step losses must equal the reference's and no more than one checkpoint interval may
be recomputed.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, tiny_run_config
from job import config as config_lib
from job import storage
from job.common import checkpoints
from job.driver import launch
from job.records import run_record
from job.worker.checkpoint import resume, staging, writer

MAX_STEPS = 20
EVERY = 4


def _config(tmp_path: Path, name: str, **sections) -> config_lib.RunConfig:
    raw = tiny_run_config(tmp_path, name=name, **sections)
    raw["train"].update({"max_steps": MAX_STEPS, "warmup_steps": 2, **sections.get("train", {})})
    raw["logging"] = {"every_steps": 1}
    raw.setdefault("checkpoint", {}).setdefault("every_steps", EVERY)
    raw["checkpoint"].setdefault("export", False)
    # Synchronous saves: each checkpoint is complete before training goes on, so where a run resumes is exact;
    # the asynchronous path has its own drill below (and in test_pretrained.py).
    raw["checkpoint"].setdefault("async_save", False)
    return config_lib.load_dict(raw)


def _run(cfg: config_lib.RunConfig, fails: bool = False) -> str:
    run_dir = launch.run_directory(cfg)
    error = launch.run_with_ray(cfg, launch.prepare(cfg, run_dir))
    assert bool(error) == fails, error
    return run_dir


def _records(run_dir: str, kind: str) -> list[dict]:
    with open(f"{run_dir}/metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if r.get("kind") == kind]


def _losses(run_dir: str) -> dict[int, float]:
    train = _records(run_dir, "train")
    steps = [r["step"] for r in train]
    assert len(steps) == len(set(steps)), f"duplicated steps in metrics.jsonl: {steps}"
    return {r["step"]: r["loss"] for r in train}


def _final_weights(run_dir: str) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = f"{run_dir}/final.pt"
    dcp_to_torch_save(f"{run_dir}/{checkpoints.step_dir(MAX_STEPS)}", out)
    return torch.load(out, weights_only=False)["model"]


def _assert_same_training(run_dir: str, reference: str, atol: float = 1e-6) -> None:
    losses, expected = _losses(run_dir), _losses(reference)
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    for step, loss in expected.items():
        assert losses[step] == pytest.approx(loss, rel=0, abs=atol), f"step {step}"
    got, want = _final_weights(run_dir), _final_weights(reference)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=atol * 10, msg=key)


@pytest.fixture(scope="module")
def reference(ray_cluster, tmp_path_factory):
    """The uninterrupted run (with its export) every resumed run must reproduce."""
    cfg = _config(tmp_path_factory.mktemp("ref"), "reference", checkpoint={"export": True},
                  eval={"sample_prompt": "The for statement", "sample_tokens": 8})
    return _run(cfg)


def test_reference_run_layout(reference):
    steps = [(s, ok) for s, _, ok in checkpoints.list_checkpoints(reference)]
    assert steps == [(16, True), (20, True)], "keep_last=2 complete checkpoints, older ones deleted by Ray"
    state = json.load(open(f"{reference}/checkpoint_00000020/train_state.json"))
    assert state["step"] == 20 and state["world_size"] == 2
    assert state["data"]["micro_batch_index"] == 20
    assert sorted(os.listdir(f"{reference}/checkpoint_00000020/rng")) == ["rank00000.pt", "rank00001.pt"]
    assert sorted(os.listdir(f"{reference}/checkpoint_00000020/checksums")) == ["rank00000.json", "rank00001.json"]
    assert checkpoints.verify(f"{reference}/checkpoint_00000020") == []
    assert not os.path.exists(f"{reference}/{checkpoints.RAY_SNAPSHOT}"), "checkpoints are not reported to Ray"
    assert not _records(reference, "resume")


@pytest.mark.image_set
def test_sigkill_worker_resumes_exactly(reference, tmp_path):
    """A worker process SIGKILLed from outside mid-run: Ray restarts the group from the latest checkpoint."""
    cfg = _config(tmp_path, "killed", scaling={"num_workers": 2, "max_failures": 1})
    run_dir = launch.run_directory(cfg)
    killed = {}

    def kill_rank1_mid_run():
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                steps = [r["step"] for r in _records(run_dir, "train")]
                pid = int(Path(run_dir, "workers", "rank1.pid").read_text())
            except (OSError, ValueError):
                steps = []
            # Past a complete checkpoint (saves are asynchronous: one completes some steps after its own).
            complete = checkpoints.latest_complete(run_dir)
            if steps and steps[-1] >= EVERY + 1 and complete:
                os.kill(pid, signal.SIGKILL)
                killed.update(step=steps[-1], pid=pid, complete=int(complete.rsplit("_", 1)[-1]))
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=kill_rank1_mid_run, daemon=True)
    watcher.start()
    _run(cfg)
    watcher.join()
    assert killed and killed["step"] < MAX_STEPS, "the worker was killed before the run ended"
    (resume,) = _records(run_dir, "resume")
    assert resume["step"] % EVERY == 0 and resume["step"] >= killed["complete"], f"{killed}, {resume}"
    assert not resume["skipped"] or resume["skipped"][0]["reason"].startswith("incomplete"), resume
    assert int(Path(run_dir, "workers", "rank1.pid").read_text()) != killed["pid"], "rank 1 is a new process"
    _assert_same_training(run_dir, reference)


def test_fault_injection_recovers_in_run(reference, tmp_path):
    cfg = _config(tmp_path, "injected", scaling={"num_workers": 2, "max_failures": 1},
                  debug={"fail_at_step": 7, "fail_rank": 1})
    run_dir = _run(cfg)
    (resume,) = _records(run_dir, "resume")
    assert resume["step"] == 4 and resume["data_exact"] and resume["lr_schedule_changes"] == {}
    assert os.path.exists(f"{run_dir}/faults/step7-rank1")
    _assert_same_training(run_dir, reference)


def test_worker_killed_during_an_async_write_resumes_from_the_previous_checkpoint(reference, tmp_path):
    """With asynchronous saves, the save of step 8 cannot be complete when rank 1 dies at the start of step 9 (it
    completes at a later log step once written, or at the next save; step 8's log ran before it), while the one of
    step 4 was completed before step 8's save began."""
    cfg = _config(tmp_path, "async", scaling={"num_workers": 2, "max_failures": 1},
                  checkpoint={"async_save": True}, debug={"fail_at_step": 9, "fail_rank": 1})
    run_dir = _run(cfg)
    (resume,) = _records(run_dir, "resume")
    assert resume["step"] == 4 and resume["data_exact"]
    _assert_same_training(run_dir, reference)
    # Every completed save is recorded, also one completed when the next save began.
    assert [r["step"] for r in _records(run_dir, "checkpoint")] == [4, 8, 12, 16, 20]


@pytest.mark.image_set
def test_failed_job_rerun_with_same_name_resumes(reference, tmp_path):
    """No retries left: the job fails; re-running it (a retried RayJob, a restarted driver) continues it."""
    cfg = _config(tmp_path, "retried", debug={"fail_at_step": 10, "fail_rank": 0})
    run_dir = _run(cfg, fails=True)
    # Checkpoint 8 completes asynchronously: by step 10 it may still be in flight (then 4 is the latest).
    latest = int(checkpoints.latest_complete(run_dir).rsplit("_", 1)[-1])
    assert latest in (4, 8)
    _run(cfg)  # a new driver: the workers find the run's newest usable checkpoint in its directory
    (resume,) = _records(run_dir, "resume")
    assert resume["step"] == latest
    _assert_same_training(run_dir, reference)
    # The run record is this attempt's, resumed from that step, and remembers the failed attempt before it.
    record = run_record.load_record(run_dir)
    assert record["status"] == "succeeded" and record["extra"]["resumed_from"]["step"] == latest
    # Rank 0 was SIGKILLed, so its attempt's record was closed by the driver: failed, the worker lost.
    [attempt] = record["previous_attempts"]
    assert attempt["status"] == "failed"
    assert (attempt["error"]["class"], attempt["error"]["reason"]) == ("infrastructure", "worker_lost")
    # ... and what it reached is read back from its metrics: its last logged step and when it was last seen.
    assert attempt["steps"] == 9 and attempt["ended_at"] >= attempt["started_at"]
    # An interrupted save of 8 included, older checkpoints are pruned.
    assert [s for s, _, _ in checkpoints.list_checkpoints(run_dir)] == [16, 20]


def test_corrupt_latest_checkpoint_resumes_from_the_previous_exactly(reference, tmp_path):
    """Drill "corrupt a shard" end to end: random bytes inside the final checkpoint of a copy of the reference
    run; re-running it resumes from checkpoint 16 (the skipped one and why recorded), and steps 17-20 train
    exactly as the reference's did."""
    copy = tmp_path / "runs" / "reference"
    shutil.copytree(reference, copy, ignore=shutil.ignore_patterns("export", "final.pt"))
    _corrupt(f"{copy}/checkpoint_00000020/__1_0.distcp")
    cfg = _config(tmp_path, "reference")
    _run(cfg)
    [resume] = _records(str(copy), "resume")
    assert resume["step"] == 16 and resume["data_exact"]
    [skipped] = resume["skipped"]
    assert skipped["step"] == 20 and skipped["reason"].startswith("__1_0.distcp (written by rank 1): content differs")
    assert run_record.load_record(str(copy))["extra"]["resumed_from"]["skipped"] == [skipped]
    _assert_same_training(str(copy), reference)
    assert [(s, ok) for s, _, ok in checkpoints.list_checkpoints(str(copy))] == [(16, True), (20, True)]


def test_unplaceable_worker_group_is_refused_before_fit(ray_cluster, tmp_path):
    """3 workers of 1 CPU on the 2-CPU test cluster: refused at once, instead of Ray waiting forever."""
    cfg = _config(tmp_path, "too-many", scaling={"num_workers": 3})
    with pytest.raises(config_lib.ConfigError, match="scaling.num_workers: 3 workers of {CPU 1} each cannot be "
                                                      "placed: this Ray cluster can hold at most 2"):
        launch.connect_ray(cfg)


def test_worker_capacity_counts_whole_workers_per_node():
    need = {"CPU": 2.0, "GPU": 1.0}
    nodes = [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 3.0, "GPU": 4.0}, {"CPU": 16.0}]
    assert launch.worker_capacity(need, nodes, None) == 3  # 2 + 1 + 0 (no GPU)
    assert launch.worker_capacity(need, nodes, [({"CPU": 8.0, "GPU": 4.0}, 4)]) == 16  # the autoscaler's maximum
    assert launch.worker_capacity(need, nodes, [({"CPU": 8.0, "GPU": 4.0}, -1)]) is None  # no maximum


def test_trainer_has_no_placement_group_cleaner():
    """Under CPU starvation Ray's cleaner took the live controller for dead and removed its placement group."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    trainer = launch.trainer_class(TorchTrainer, "/nowhere")(lambda config: None, scaling_config=ScalingConfig(num_workers=1))
    callbacks = trainer._create_default_callbacks()
    assert callbacks and not any(isinstance(cb, PlacementGroupCleanerCallback) for cb in callbacks)
    assert any(isinstance(cb, PlacementGroupCleanerCallback) for cb in TorchTrainer(
        lambda config: None, scaling_config=ScalingConfig(num_workers=1))._create_default_callbacks())


def test_resume_never_refuses_an_existing_run(reference, tmp_path):
    cfg = config_lib.load_dict({**tiny_run_config(tmp_path), "name": os.path.basename(reference),
                                "storage_path": os.path.dirname(reference), "checkpoint": {"resume": "never"}})
    with pytest.raises(checkpoints.ResumeRefused, match=f"resume: never, but run {reference} already has"):
        checkpoints.check_before_start(cfg, launch.run_directory(cfg))
    fresh = config_lib.load_dict({**tiny_run_config(tmp_path), "name": "new", "checkpoint": {"resume": "never"}})
    checkpoints.check_before_start(fresh, launch.run_directory(fresh))  # a new name starts


def test_resume_two_workers_onto_one_and_back(reference, tmp_path):
    """DCP reshards the 2-worker FSDP2 checkpoint onto 1 worker, which trains unwrapped (`parallel.fsdp: auto`),
    and that worker's checkpoint back onto 2 FSDP2 workers; with grad_accum 2 on the one worker the global
    batches are the same blocks, so the losses continue the reference's (up to float summation order)."""
    cfg = _config(tmp_path, "one-worker", scaling={"num_workers": 1}, train={"grad_accum_steps": 2},
                  checkpoint={"resume": f"{reference}/checkpoint_00000016", "every_steps": 2})
    one = _run(cfg)
    (start,) = _records(one, "start")
    assert start["world_size"] == 1 and not start["sharded"]
    (resume,) = _records(one, "resume")
    assert resume["step"] == 16 and resume["saved_world_size"] == 2
    assert resume["micro_batch_index"] == 32 and resume["data_exact"]
    two = _run(_config(tmp_path, "two-workers", checkpoint={"resume": f"{one}/checkpoint_00000018"}))
    (start,) = _records(two, "start")
    assert start["world_size"] == 2 and start["sharded"]
    (resume,) = _records(two, "resume")
    assert resume["step"] == 18 and resume["saved_world_size"] == 1 and resume["data_exact"]
    expected = _losses(reference)
    for run_dir, steps in ((one, range(17, 21)), (two, range(19, 21))):
        losses = _losses(run_dir)
        assert sorted(losses) == list(steps)
        for step in losses:
            assert losses[step] == pytest.approx(expected[step], abs=1e-4), f"{run_dir} step {step}"


@pytest.mark.image_set
def test_export_loads_and_reproduces_eval_loss(reference, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = f"{reference}/export"
    acceptance = json.load(open(f"{export}/acceptance.json"))
    final_eval = [r for r in _records(reference, "eval") if r["step"] == MAX_STEPS][-1]["eval_loss"]
    assert acceptance["ok"] and os.path.exists(f"{export}/_VALID")
    assert acceptance["reference_eval_loss"] == final_eval
    assert acceptance["eval_loss"] == pytest.approx(final_eval, abs=1e-5)
    assert len(acceptance["generation"]["token_ids"]) == 8
    model, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert AutoTokenizer.from_pretrained(export)("The for statement")["input_ids"]
    # The exported weights are the final checkpoint's, gathered from both shards.
    final = {k.removeprefix("lm."): v for k, v in _final_weights(reference).items()}
    state = model.state_dict()
    for key, value in final.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
    # The check evaluates with the run's loss: the chunked loss (the memory-lean one) accepts the same export.
    chunked = tmp_path / "chunked"
    shutil.copytree(export, chunked)
    reference_json = json.load(open(chunked / "reference.json"))
    reference_json["config"]["train"]["loss_chunk_size"] = 100
    json.dump(reference_json, open(chunked / "reference.json", "w"))
    proc = subprocess.run([sys.executable, "-m", "job", "accept", str(chunked)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.load(open(chunked / "acceptance.json"))["eval_loss"] == pytest.approx(final_eval, abs=1e-5)
    # The check can fail: damaged weights are rejected by a fresh `python -m job accept`, without a marker.
    damaged = tmp_path / "damaged"
    shutil.copytree(export, damaged)
    os.remove(damaged / "_VALID")
    weights = load_file(damaged / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 3
    from safetensors.torch import save_file

    save_file(weights, damaged / "model.safetensors", metadata={"format": "pt"})
    proc = subprocess.run([sys.executable, "-m", "job", "accept", str(damaged)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    result = json.load(open(damaged / "acceptance.json"))
    assert not result["ok"] and "checkpoint.export_tolerance" in result["error"]


def test_acceptance_process_started_ahead_checks_what_it_is_sent(reference, tmp_path):
    """The acceptance process the run starts before writing its export: it checks the directory it is sent (and
    says where its time went), reports a failure with its stderr, and ends quietly when no check is asked of it."""
    from job.worker.model import export

    copy = tmp_path / "export"
    shutil.copytree(f"{reference}/export", copy)
    os.remove(copy / "acceptance.json")
    process = export.AcceptanceProcess()
    process.send(str(copy))  # returns at once: the check runs while the caller goes on
    assert process.wait().startswith("acceptance process exited 0")
    process.close()
    result = json.load(open(copy / "acceptance.json"))
    assert result["ok"] and set(result["timings"]) == {"load_s", "heldout_s", "generate_s"}

    failing = export.AcceptanceProcess()  # `accept`'s own one-line error on a wrong path reaches the caller
    failing.send(str(tmp_path / "missing"))
    assert failing.wait() == f"acceptance process exited 2: accept: {tmp_path / 'missing'}: no such directory\n"
    failing.close()

    unused = export.AcceptanceProcess()
    unused.close()
    assert unused._proc.returncode is not None


# ---- Single-process checks (no Ray): unreadable checkpoints, object-store paths, the torchrun layout.


def _sharded_model(cfg: config_lib.RunConfig, fsdp: str = "always"):
    """The model of `cfg` on this one process, sharded by FSDP2 (`fsdp: always`) or, with `auto`, unwrapped."""
    import dataclasses

    from torch.distributed.device_mesh import init_device_mesh

    from job.worker.model.causal_lm import CausalLMWithLoss, build_causal_lm
    from job.worker.model.parallelize import parallelize
    from job.worker.optimizer import build_optimizer

    lm = build_causal_lm(cfg.model, 512, cfg.train.seed)
    model = parallelize(CausalLMWithLoss(lm), dataclasses.replace(cfg.parallel, fsdp=fsdp),
                        init_device_mesh("cpu", (1,)), False)
    optimizer = build_optimizer(model, cfg.train)
    return model, optimizer


def _batch() -> dict:
    """A seeded micro-batch for `_sharded_model`'s 512-token vocabulary (a step gives the optimizer its state)."""
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _identity(uri: str) -> dict:
    """The run identity a checkpoint was saved with: a resume of the same run presents it unchanged."""
    return json.load(open(f"{uri}/{checkpoints.STATE}"))["identity"]


def test_unreadable_checkpoints_fail_naming_the_path(reference, tmp_path, single_process):
    # 2 workers x accum 1 -> 1 worker x accum 2: the same global batch, so the same run.
    cfg = _config(tmp_path, "broken", scaling={"num_workers": 1}, train={"grad_accum_steps": 2})
    broken = str(tmp_path / "checkpoint_00000020")
    shutil.copytree(f"{reference}/checkpoint_00000020", broken)
    identity = _identity(broken)
    model, optimizer = _sharded_model(cfg)
    assert resume.restore(broken, model, optimizer, cfg, identity)["step"] == 20  # intact: loads
    shard = f"{broken}/__1_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    # Unverified (restore alone): DCP fails, and the error carries the rank's own cause, not only its number.
    with pytest.raises(checkpoints.CheckpointError, match=f"checkpoint {broken}: cannot be read \\(rank 0: \\w+"):
        resume.restore(broken, model, optimizer, cfg, identity)
    # Verified: the truncated shard is named with the rank that wrote it.
    [problem] = checkpoints.verify(broken)
    assert problem.startswith("__1_0.distcp (written by rank 1): content differs from its checksum")
    other = _config(tmp_path, "other", scaling={"num_workers": 1},
                    model={"overrides": {"hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64}})
    model, optimizer = _sharded_model(other)
    with pytest.raises(checkpoints.CheckpointError, match=f"{reference}/checkpoint_00000020: saved for another"):
        resume.restore(f"{reference}/checkpoint_00000020", model, optimizer, other, identity)
    # An interrupted save (no _COMPLETE marker) is never resumed from, and an explicit start point is refused.
    os.remove(f"{broken}/_COMPLETE")
    assert checkpoints.list_checkpoints(str(tmp_path)) == [(20, broken, False)]
    assert checkpoints.latest_complete(str(tmp_path)) is None
    with pytest.raises(checkpoints.CheckpointError, match=f"resume: {broken}: incomplete"):
        resume.find_resume_point(_config(tmp_path, "x", checkpoint={"resume": broken}), str(tmp_path / "x"))


def _save(step: int, model, optimizer, cfg, run_dir: str, identity: dict) -> None:
    """One complete save (staged, written, finished), as the loop's checkpointer does it."""
    checkpointer = writer.Checkpointer(cfg, run_dir, torch.device("cpu"), identity)
    try:
        checkpointer.save(step, model, optimizer)
        checkpointer.finish()
    finally:
        checkpointer.close()


def _save_steps(cfg, run_dir: str, steps):
    model, optimizer = _sharded_model(cfg)
    identity = {"tokenizer": "t", "data": "d", "seq_len": cfg.train.seq_len, "seed": cfg.train.seed,
                "global_batch": cfg.train.micro_batch_size}
    for step in steps:
        _save(step, model, optimizer, cfg, run_dir, identity)
    return model, optimizer, identity


def _corrupt(path: str, seed: int = 0) -> None:
    """Random bytes over 64 bytes in the middle of a file (size unchanged), as a bad disk or copy would."""
    import random

    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(random.Random(seed).randbytes(64))


def test_corrupt_shard_is_skipped_and_never_outlives_a_good_checkpoint(tmp_path, single_process):
    """Drill "corrupt a shard": random bytes inside the newest checkpoint's .distcp. The resume names the file
    and the rank that wrote it, resumes from the newest verified checkpoint instead, marks the bad one, and
    pruning never removes the verified one; with no verified checkpoint left, the run refuses to start."""
    cfg = _config(tmp_path, "corrupt", scaling={"num_workers": 1}, checkpoint={"keep_last": 2})
    run_dir = str(tmp_path / "runs" / "corrupt")
    model, optimizer, identity = _save_steps(cfg, run_dir, (4, 8, 12))
    names = sorted(os.listdir(f"{run_dir}/checkpoint_00000012/checksums"))
    assert names == ["rank00000.json"]
    listed = json.load(open(f"{run_dir}/checkpoint_00000012/checksums/rank00000.json"))["files"]
    shards = {f for f in os.listdir(f"{run_dir}/checkpoint_00000012") if f.endswith(".distcp")}
    assert "__0_0.distcp" in shards and set(listed) == {*shards, ".metadata", "rng/rank00000.pt"}
    assert checkpoints.verify(f"{run_dir}/checkpoint_00000012") == []

    _corrupt(f"{run_dir}/checkpoint_00000012/__0_0.distcp")
    uri, skipped = resume.find_resume_point(cfg, run_dir)
    assert uri == f"{run_dir}/checkpoint_00000008"
    [(step, reason)] = [(s["step"], s["reason"]) for s in skipped]
    assert step == 12 and reason.startswith("__0_0.distcp (written by rank 0): content differs from its checksum")
    assert os.path.exists(f"{run_dir}/checkpoint_00000012/_UNUSABLE")
    assert [(s, ok) for s, _, ok in checkpoints.list_checkpoints(run_dir)] == [(8, True), (12, False)]
    # The marked checkpoint is skipped on later resumes without being read again, with the first reason.
    _, again = resume.find_resume_point(cfg, run_dir)
    assert again[0]["reason"] == f"found unusable by an earlier resume: {reason}"
    # keep_last 1: saving step 10 may delete 8, never the bad 12 in its place; saving 12 again replaces it.
    _save(10, model, optimizer, _config(tmp_path, "corrupt", scaling={"num_workers": 1},
                                                      checkpoint={"keep_last": 1}), run_dir, identity)
    assert [(s, ok) for s, _, ok in checkpoints.list_checkpoints(run_dir)] == [(10, True), (12, False)]
    _save(12, model, optimizer, cfg, run_dir, identity)
    assert [(s, ok) for s, _, ok in checkpoints.list_checkpoints(run_dir)] == [(10, True), (12, True)]

    # A latest checkpoint without its marker is skipped the same way (and recorded), not marked.
    os.remove(f"{run_dir}/checkpoint_00000012/_COMPLETE")
    uri, skipped = resume.find_resume_point(cfg, run_dir)
    assert uri.endswith("checkpoint_00000010") and skipped[0]["reason"].startswith("incomplete (no _COMPLETE")
    # Nothing usable left but complete checkpoints existed: refuse, listing each and why, with the command.
    _corrupt(f"{run_dir}/checkpoint_00000010/rng/rank00000.pt")
    with pytest.raises(checkpoints.CheckpointError) as info:
        resume.find_resume_point(cfg, run_dir)
    message = str(info.value)
    assert "none can be resumed from" in message and "rng/rank00000.pt (written by rank 0)" in message
    assert f"rm -r {run_dir}/checkpoint_*" in message


def test_failed_save_names_the_cause_and_removes_the_partial_checkpoint(tmp_path, single_process, monkeypatch):
    """Drill "fill the disk", simulated (scripts/drills.sh disk-full fills a real tmpfs): the save's ENOSPC
    surfaces as a CheckpointError naming the checkpoint, and no partial directory is left behind."""
    import errno

    cfg = _config(tmp_path, "full", scaling={"num_workers": 1})
    run_dir = str(tmp_path / "runs" / "full")
    model, optimizer, identity = _save_steps(cfg, run_dir, (4,))
    write = storage.write_atomic

    def full_disk(uri, data):
        if "/rng/" in uri:
            raise OSError(errno.ENOSPC, "No space left on device", uri)
        write(uri, data)

    monkeypatch.setattr(storage, "write_atomic", full_disk)
    with pytest.raises(checkpoints.CheckpointError) as info:
        _save(8, model, optimizer, cfg, run_dir, identity)
    assert re.fullmatch(re.escape(
        f"checkpoint {run_dir}/checkpoint_00000008: save failed (OSError: [Errno 28] No space left on device: "
        f"'{run_dir}/checkpoint_00000008/rng/rank00000.pt'); the partial checkpoint was removed; {run_dir} has ")
        + r"\d+\.\d GB free", str(info.value)), str(info.value)
    assert [s for s, _, _ in checkpoints.list_checkpoints(run_dir)] == [4]


def test_resume_refuses_another_run_naming_the_field(tmp_path, single_process):
    """Drill "change the seed and resume": each identity field that differs is named; allow_changes opts in."""
    cfg = _config(tmp_path, "same", scaling={"num_workers": 1})
    run_dir = str(tmp_path / "runs" / "same")
    model, optimizer, identity = _save_steps(cfg, run_dir, (4,))
    uri = f"{run_dir}/checkpoint_00000004"
    changed = {**identity, "seed": 1, "data": "other", "global_batch": 8}
    with pytest.raises(checkpoints.CheckpointError) as info:
        resume.restore(uri, model, optimizer, cfg, changed)
    message = str(info.value)
    assert "data: differs" in message and "train.seed: checkpoint 0, now 1" in message
    assert "global batch (train.micro_batch_size x train.grad_accum_steps x workers): checkpoint 4, now 8" in message
    assert "checkpoint.allow_changes: [data, seed, global_batch]" in message
    lenient = _config(tmp_path, "same", scaling={"num_workers": 1},
                      checkpoint={"allow_changes": ["data", "seed", "global_batch"]})
    assert resume.restore(uri, model, optimizer, lenient, changed)["step"] == 4


def test_run_identity_follows_content_not_paths():
    fingerprint = {"format": "text", "train": {"source": "/a/x.jsonl", "files": [{"path": "/a/x.jsonl", "sha256": "1"}]},
                   "validation": {"none": True}, "tokenizer": {"sha256": "t"}, "packing": True, "seq_len": 64}
    cfg = config_lib.load_dict(tiny_run_config(Path("/tmp")))
    moved = json.loads(json.dumps(fingerprint).replace("/a/", "/b/"))
    assert checkpoints.run_identity(cfg, 2, fingerprint) == checkpoints.run_identity(cfg, 2, moved)
    edited = json.loads(json.dumps(fingerprint).replace('"1"', '"2"'))
    assert checkpoints.run_identity(cfg, 2, edited)["data"] != checkpoints.run_identity(cfg, 2, fingerprint)["data"]
    assert checkpoints.run_identity(cfg, 2, fingerprint)["global_batch"] == 8


def test_torchrun_layout_on_object_storage(tmp_path, single_process):
    """The torchrun path (no Ray) on an fsspec object store: save, keep_last, resume scan, exact restore."""
    # A memory:// store lives in this process only: a writer process would write into a store of its own.
    cfg = _config(tmp_path, "mem", scaling={"num_workers": 1},
                  checkpoint={"keep_last": 2, "async_save": True, "async_writer": "thread"})
    run_dir = "memory://runs/mem"
    model, optimizer = _sharded_model(cfg)
    identity = {"tokenizer": "t", "data": "d", "seq_len": 64, "seed": 0, "global_batch": 4}
    checkpointer = writer.Checkpointer(cfg, run_dir, torch.device("cpu"), identity)
    for step in (4, 8, 12):
        rng = torch.get_rng_state()
        checkpointer.save(step, model, optimizer)  # finishes the previous save first
    assert checkpoints.latest_complete(run_dir) == f"{run_dir}/checkpoint_00000008"  # 12 is still in flight
    checkpointer.finish()
    checkpointer.close()
    assert [(s, ok) for s, _, ok in checkpoints.list_checkpoints(run_dir)] == [(8, True), (12, True)]
    assert resume.find_resume_point(cfg, run_dir) == (f"{run_dir}/checkpoint_00000012", [])
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.manual_seed(123)
    fresh_model, fresh_optimizer = _sharded_model(_config(tmp_path, "mem", scaling={"num_workers": 1},
                                                          train={"seed": 5}))
    state = resume.restore(f"{run_dir}/checkpoint_00000012", fresh_model, fresh_optimizer, cfg, identity)
    assert state["step"] == 12
    for key, value in fresh_model.state_dict().items():
        torch.testing.assert_close(value.full_tensor(), expected[key].full_tensor(), rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), rng), "RNG state restored from the checkpoint"


def _shm_free() -> int:
    try:
        st = os.statvfs(writer.SHARED_MEMORY)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


@pytest.mark.skipif(_shm_free() < 256 << 20, reason="needs /dev/shm with 256 MiB free (the writer process stages there)")
def test_writer_process_saves_what_restores_exactly_and_ends_with_the_checkpointer(tmp_path, single_process):
    """checkpoint.async_writer: process: DCP's writer process reads the staged state from shared memory and
    writes it; the checkpoint verifies and restores bit for bit, and `close` ends the process."""
    import multiprocessing

    cfg = _config(tmp_path, "proc", scaling={"num_workers": 1},
                  checkpoint={"async_save": True, "async_writer": "process"})
    run_dir = str(tmp_path / "runs" / "proc")
    model, optimizer = _sharded_model(cfg)
    identity = {"tokenizer": "t", "data": "d", "seq_len": 64, "seed": 0, "global_batch": 4}
    checkpointer = writer.Checkpointer(cfg, run_dir, torch.device("cpu"), identity)
    chosen = checkpointer.prepare(model)  # before the first step, as the loop does
    assert chosen["writer"] == "process" and chosen["bytes"] > 0
    model(**_batch())[0].backward()
    optimizer.step()
    checkpointer.save(2, model, optimizer)
    staging = checkpointer.finish()["staging"]
    assert staging["on"] == "host" and staging["populate_s"] >= 0 and "lock_s" not in staging  # no GPU: not locked
    allocated = {path: id(buffer) for path, buffer in checkpointer.stager.buffers.items()}
    model(**_batch())[0].backward()
    optimizer.step()
    checkpointer.save(4, model, optimizer)
    # Every save staged into the buffers the first one allocated, all in shared memory.
    assert {path: id(buffer) for path, buffer in checkpointer.stager.buffers.items()} == allocated
    assert all(b.is_shared() for b in checkpointer.stager.buffers.values())
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    checkpointer.finish()
    writers = multiprocessing.active_children()
    assert writers, "the write ran in a child process"
    checkpointer.close()
    for process in writers:
        process.join(timeout=30)
        assert not process.is_alive()
    uri = f"{run_dir}/checkpoint_00000004"
    assert checkpoints.verify(uri) == []
    fresh_model, fresh_optimizer = _sharded_model(_config(tmp_path, "proc", scaling={"num_workers": 1},
                                                          train={"seed": 5}))
    fresh_model(**_batch())[0].backward()
    fresh_optimizer.step()
    assert resume.restore(uri, fresh_model, fresh_optimizer, cfg, identity)["step"] == 4
    for key, value in fresh_model.state_dict().items():
        torch.testing.assert_close(value.full_tensor(), expected[key].full_tensor(), rtol=0, atol=0)


@pytest.mark.parametrize("fsdp", ["always", "auto"])
def test_a_save_staged_on_the_device_holds_its_steps_state_while_training_goes_on(tmp_path, single_process,
                                                                                  monkeypatch, fsdp):
    """Staging on the device (`choose_staging` says there is room: forced here, on CPU): the save copies the
    state and returns; the write, which copies that copy into host memory, is held until training has taken
    another step that changes every weight in place. The checkpoint still restores the saved step's state bit
    for bit, and the copy is released once the write has it."""
    import threading

    cfg = _config(tmp_path, "dev", scaling={"num_workers": 1},
                  checkpoint={"async_save": True, "async_writer": "thread"})
    run_dir = str(tmp_path / "runs" / "dev")
    model, optimizer = _sharded_model(cfg, fsdp)
    identity = {"tokenizer": "t", "data": "d", "seq_len": 64, "seed": 0, "global_batch": 4}
    monkeypatch.setattr(writer, "choose_staging", lambda device, need: {"on": "device", "bytes": need})
    stepped = threading.Event()
    real_stage = staging.HostStager.stage

    def stage_after_the_next_step(self, state_dict, after=None):
        assert stepped.wait(timeout=60)
        return real_stage(self, state_dict, after)

    monkeypatch.setattr(staging.HostStager, "stage", stage_after_the_next_step)
    checkpointer = writer.Checkpointer(cfg, run_dir, torch.device("cpu"), identity)
    model(**_batch())[0].backward()
    optimizer.step()
    checkpointer.save(4, model, optimizer)
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert not checkpointer.device_copy_released.is_set()
    model(**_batch())[0].backward()
    optimizer.step()  # in place, while the save's write waits
    changed = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert all(not torch.equal(saved[k], changed[k]) for k in saved if "weight" in k)
    stepped.set()
    checkpointer.wait_device_copy()
    assert checkpointer.device_copy is None
    staged = checkpointer.finish()["staging"]
    assert staged["on"] == "device" and staged["bytes"] == checkpointer.staging["bytes"] and staged["populate_s"] >= 0
    checkpointer.save(8, model, optimizer, last=True)  # the run's last step: the state itself, no copy held
    assert checkpointer.device_copy_released.is_set()
    checkpointer.finish()
    checkpointer.close()
    for step, expected in ((4, saved), (8, changed)):
        fresh_model, fresh_optimizer = _sharded_model(_config(tmp_path, "dev", scaling={"num_workers": 1},
                                                              train={"seed": 5}), fsdp)
        fresh_model(**_batch())[0].backward()
        fresh_optimizer.step()
        resume.restore(f"{run_dir}/checkpoint_{step:08d}", fresh_model, fresh_optimizer, cfg, identity)
        for key, value in fresh_model.state_dict().items():
            torch.testing.assert_close(value, expected[key], rtol=0, atol=0)


@pytest.mark.parametrize("writer_kind", ["process", "thread"])
def test_host_buffers_are_faulted_in_beside_the_steps_before_the_first_save(tmp_path, single_process, writer_kind):
    """`prepare_staging` (after the first step) creates the host buffers, in shared memory for the writer process,
    and the write thread faults every page of them in before any save: the first save then copies into resident
    memory (on a GPU: page-locks it, ~0.85 s per 18.5 GB, instead of ~10 s of page faults) into those buffers."""
    import ctypes
    import mmap

    if writer_kind == "process" and _shm_free() < 256 << 20:
        pytest.skip("needs /dev/shm with 256 MiB free (the writer process stages there)")
    cfg = _config(tmp_path, "reserve", scaling={"num_workers": 1},
                  checkpoint={"async_save": True, "async_writer": writer_kind})
    model, optimizer = _sharded_model(cfg)
    identity = {"tokenizer": "t", "data": "d", "seq_len": 64, "seed": 0, "global_batch": 4}
    checkpointer = writer.Checkpointer(cfg, str(tmp_path / "runs" / "reserve"), torch.device("cpu"), identity)
    checkpointer.prepare(model)
    model(**_batch())[0].backward()
    optimizer.step()
    checkpointer.prepare_staging(model, optimizer)
    assert checkpointer.staging["on"] == "host"
    checkpointer.stager.populated.result(timeout=60)
    buffers = checkpointer.stager.buffers
    assert buffers and all(b.is_shared() == (writer_kind == "process") for b in buffers.values())
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    for buffer in buffers.values():
        nbytes = buffer.numel() * buffer.element_size()
        if not nbytes:
            continue
        pages = (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        resident = ctypes.create_string_buffer(pages)
        assert buffer.data_ptr() % mmap.PAGESIZE == 0 and libc.mincore(buffer.data_ptr(), nbytes, resident) == 0
        assert all(byte & 1 for byte in resident.raw), "a page of a reserved buffer is not resident"
    reserved = {path: b.data_ptr() for path, b in buffers.items()}
    checkpointer.save(1, model, optimizer)
    staged = checkpointer.finish()["staging"]
    assert staged["populate_s"] >= 0 and staged["waited_s"] >= 0
    assert {path: b.data_ptr() for path, b in checkpointer.stager.buffers.items()} == reserved
    checkpointer.close()


def test_saves_stage_on_the_device_only_with_room_beside_the_training_peak(monkeypatch):
    """The room is the device's memory less `STAGING_HEADROOM`, what other processes hold and training's peak;
    on CPU a save always stages in host memory."""
    gb = 10**9
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (40 * gb, 100 * gb))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 50 * gb)  # 10 GB held elsewhere
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 55 * gb)
    gpu = torch.device("cuda", 0)
    assert staging.choose_staging(gpu, 30 * gb) == {"on": "device", "bytes": 30 * gb, "spare_bytes": 30 * gb}
    assert staging.choose_staging(gpu, 30 * gb + 1)["on"] == "host"
    assert staging.choose_staging(torch.device("cpu"), 1)["on"] == "host"


@pytest.mark.parametrize("fsdp", ["always", "auto"])
@pytest.mark.parametrize("parallel", [{}, {"compile": True, "activation_checkpointing": True}, {"compile": True}])
def test_the_first_saves_layout_is_known_before_the_first_step(tmp_path, single_process, monkeypatch, parallel,
                                                               fsdp):
    """`first_save_layout` before any step: exactly the tensors, shapes and dtypes a save stages after one (the
    optimizer's state predicted, not read, which would initialise it), with the wrappers' names taken off;
    sharded, and unwrapped (one worker)."""
    import functools

    from torch.distributed.checkpoint.state_dict import get_state_dict

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    model, optimizer = _sharded_model(_config(tmp_path, "layout", parallel=parallel), fsdp)
    predicted = writer.first_save_layout(model)
    assert not optimizer.state
    model(**_batch())[0].backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    assert predicted == staging.tensor_layout({"model": model_sd, "optim": optim_sd})


def test_writer_process_needs_shared_memory_room(tmp_path, single_process, monkeypatch):
    """Too little /dev/shm for the staged state: `process` stops naming the numbers and the values to change,
    `auto` takes the writer thread and says why, `thread` never looks."""
    cfg = _config(tmp_path, "shm", scaling={"num_workers": 1})
    model, optimizer = _sharded_model(cfg)
    layout = staging.tensor_layout(model.state_dict())
    need = sum(shape.numel() * dtype.itemsize for shape, dtype in layout.values())
    real_statvfs = os.statvfs

    def small_shm(path):
        st = real_statvfs(path)
        return os.statvfs_result((st.f_bsize, 4096, st.f_blocks, 10, 10, *st[5:]))  # 40 KB free

    monkeypatch.setattr(os, "statvfs", small_shm)
    group = torch.distributed.new_group(backend="gloo")
    with pytest.raises(checkpoints.CheckpointError) as info:
        writer.choose_writer("process", layout, group)
    assert str(info.value) == (
        f"checkpoint.async_writer: process: this node's 1 worker(s) stage {need / 1e9:.2f} GB of checkpoint state, "
        "and /dev/shm has 0.00 GB free. Give the pods more shared memory (the chart's shm.sizeLimit, within the "
        "pods' memory limit) or set checkpoint.async_writer: thread")
    auto = writer.choose_writer("auto", layout, group)
    assert auto["writer"] == "thread" and auto["reason"].startswith("checkpoint.async_writer: auto, and this node's")
    assert writer.choose_writer("thread", layout, group)["writer"] == "thread"
    monkeypatch.setattr(os, "statvfs", real_statvfs)
    if _shm_free() > need:
        assert writer.choose_writer("auto", layout, group)["writer"] == "process"


def test_fault_injection_settings_are_checked():
    base = tiny_run_config(Path("/tmp"))
    with pytest.raises(config_lib.ConfigError, match="debug.fail_rank"):
        config_lib.load_dict({**base, "debug": {"fail_at_step": 3, "fail_rank": 2}})
    with pytest.raises(config_lib.ConfigError, match="debug.fail_at_step"):
        config_lib.load_dict({**base, "debug": {"fail_at_step": 999}})
