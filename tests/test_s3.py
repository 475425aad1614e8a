"""Object storage end to end: a run whose storage_path is s3://, against a local S3 server (moto on loopback).

The run writes its metrics, TensorBoard event files, run record and sharded checkpoints to the bucket; killed mid-run, the same
command resumes from the latest complete checkpoint in the bucket and finishes.
"""

import json
import os
import subprocess
import sys

import yaml

from conftest import REPO, assert_tensorboard_matches_metrics, tiny_run_config


def test_run_checkpoints_and_resumes_on_s3(tmp_path, s3_endpoint, monkeypatch):
    import s3fs

    raw = tiny_run_config(tmp_path, name="s3-run", storage_path="s3://runs/experiments",
                          train={"max_steps": 12, "warmup_steps": 2}, logging={"every_steps": 2},
                          checkpoint={"every_steps": 4, "export": False}, debug={"fail_at_step": 10, "fail_rank": 1})
    # Asynchronous writes to S3: step 4's checkpoint is complete by step 8's save at the latest; step 8's is still
    # in flight when rank 1 dies at the start of step 10 (step 8's log ran before that save), so the run resumes at 4.
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "job", "--config", str(config)]
    env = {**os.environ, **s3_endpoint, "OMP_NUM_THREADS": "1"}

    first = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode != 0, "the injected fault at step 10 should have stopped the first attempt"
    second = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-4000:]

    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint["AWS_ENDPOINT_URL"], key="test", secret="test")
    run = "runs/experiments/s3-run"
    assert fs.exists(f"{run}/checkpoint_00000012/_COMPLETE")
    rows = [json.loads(line) for line in fs.cat_file(f"{run}/metrics.jsonl").decode().splitlines()]
    (resume,) = [r for r in rows if r["kind"] == "resume"]
    assert resume["step"] == 4 and resume["checkpoint"].startswith("s3://runs/experiments/s3-run/checkpoint_00000004")
    assert [r["step"] for r in rows if r["kind"] == "train"] == [2, 4, 6, 8, 10, 12]  # steps after 4 logged once
    # The TensorBoard event files of both attempts, uploaded to the bucket and read there by TensorBoard itself (its
    # boto3 reader, `S3_ENDPOINT` naming a non-AWS endpoint, as the README says): the second attempt's purge hides
    # what the first logged past step 4, so each step's numbers appear once, as in metrics.jsonl.
    assert len(fs.ls(f"{run}/tensorboard")) == 2
    monkeypatch.setenv("S3_ENDPOINT", s3_endpoint["AWS_ENDPOINT_URL"])
    for key, value in s3_endpoint.items():
        monkeypatch.setenv(key, value)
    assert_tensorboard_matches_metrics(f"s3://{run}/tensorboard", rows)
    record = json.loads(fs.cat_file(f"{run}/run.json"))
    assert record["status"] == "succeeded" and record["run_dir"] == "s3://runs/experiments/s3-run"
    assert [a["status"] for a in record["previous_attempts"]] in (["failed"], ["interrupted"])
