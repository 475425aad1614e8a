#!/usr/bin/env bash
# Failure drills from outside, as an operator would run them, on a tiny synthetic run (2 CPU workers, embedded
# Ray): kill a worker, kill the driver, corrupt a shard, change the seed and resume, a full disk, read-only
# storage. Each drill prints PASS or FAIL with what it saw; the script exits 1 if any failed.
#
#   scripts/drills.sh [DRILL ...]     drills: kill-worker kill-driver corrupt-shard change-seed disk-full read-only
#
# disk-full and read-only mount a small tmpfs (root only; skipped otherwise). Work files: $DRILL_DIR
# (default: a new temporary directory), kept for inspection.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-.venv/bin/python}
DIR=${DRILL_DIR:-$(mktemp -d /tmp/drills.XXXXXX)}
mkdir -p "$DIR"
export HF_HUB_OFFLINE=1 RAY_TRAIN_ENABLE_PRINT_PATCH=0 RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.5 OMP_NUM_THREADS=1
failed=0

cat > "$DIR/run.yaml" <<EOF
name: drill
storage_path: $DIR/runs
model: {init: random, preset: qwen2-tiny,
        overrides: {hidden_size: 64, num_hidden_layers: 2, intermediate_size: 128, vocab_size: 512}}
data: {format: synthetic}
train: {max_steps: 12, micro_batch_size: 2, seq_len: 64, warmup_steps: 1}
scaling: {num_workers: 2, max_failures: 1}
checkpoint: {every_steps: 4, export: false}
logging: {every_steps: 1}
EOF

job() {  # job NAME [--set ...]: one run of the drill config under run name NAME; output in $DIR/NAME.log
    local name=$1; shift
    "$PY" -m job --config "$DIR/run.yaml" --set "name=$name" "$@" >>"$DIR/$name.log" 2>&1
}
run_dir() { echo "$DIR/runs/$1"; }
last_step() { "$PY" - "$1" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")] if __import__("os").path.exists(f"{sys.argv[1]}/metrics.jsonl") else []
print(max([r["step"] for r in rows if r.get("kind") == "train"], default=0))
EOF
}
wait_step() {  # wait_step RUN_DIR STEP: until the run logged STEP (at most 5 minutes)
    for _ in $(seq 600); do [ "$(last_step "$1")" -ge "$2" ] && return 0; sleep 0.5; done; return 1
}
query() { "$PY" - "$@"; }  # a Python check over the run directory; prints what it found, exits 1 if wrong
verdict() {  # verdict DRILL STATUS DETAIL
    if [ "$2" = 0 ]; then echo "PASS $1: $3"; else echo "FAIL $1: $3 (log: $DIR/$1.log)"; failed=1; fi
}

drill_kill-worker() {  # SIGKILL rank 1 mid-run: Ray restarts the group, which resumes from checkpoint 4
    job kill-worker & local pid=$!
    wait_step "$(run_dir kill-worker)" 6 && kill -9 "$(cat "$(run_dir kill-worker)/workers/rank1.pid")"
    wait $pid; local rc=$?
    out=$(query "$(run_dir kill-worker)" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
resume = [r for r in rows if r["kind"] == "resume"]
print(f"resumed at {[r['step'] for r in resume]}, finished at {max(r['step'] for r in rows if r['kind'] == 'train')}")
sys.exit(not (resume and resume[-1]["step"] == 4))
EOF
    ); verdict kill-worker $(( rc || $? )) "exit $rc, $out"
}

drill_kill-driver() {  # SIGKILL the driver and its workers (a lost head pod): re-running the same command resumes
    # (the driver alone is not enough: Ray's workers run on, and finish the run, without it)
    setsid "$PY" -m job --config "$DIR/run.yaml" --set name=kill-driver >>"$DIR/kill-driver.log" 2>&1 & local pid=$!
    wait_step "$(run_dir kill-driver)" 6 && kill -9 -- "-$pid" $(for f in "$(run_dir kill-driver)"/workers/rank*.pid; do cat "$f"; echo; done)
    wait $pid 2>/dev/null; sleep 10  # the embedded Ray's own processes notice their driver is gone and exit
    job kill-driver; local rc=$?
    out=$(query "$(run_dir kill-driver)" <<'EOF'
import json, sys
record = json.load(open(f"{sys.argv[1]}/run.json"))
attempt = record["previous_attempts"][-1]
print(f"status {record['status']}, resumed from {record['extra']['resumed_from']['step']}, previous attempt "
      f"{attempt['status']} at step {attempt['steps']}, last seen {attempt['ended_at']}")
# The killed driver could not close its record: the next start marks it abandoned (its heartbeat went stale).
sys.exit(not (record["status"] == "succeeded" and attempt["status"] == "abandoned" and attempt["steps"] >= 6))
EOF
    ); verdict kill-driver $(( rc || $? )) "exit $rc, $out"
}

drill_corrupt-shard() {  # random bytes inside the final checkpoint's shard: continuing resumes from the one before
    job corrupt-shard || { verdict corrupt-shard 1 "first run failed"; return; }
    query "$(run_dir corrupt-shard)/checkpoint_00000012/__1_0.distcp" <<'EOF'
import os, random, sys
with open(sys.argv[1], "r+b") as f:
    f.seek(os.path.getsize(sys.argv[1]) // 2)
    f.write(random.Random(0).randbytes(64))
EOF
    job corrupt-shard --set train.max_steps=16; local rc=$?
    out=$(query "$(run_dir corrupt-shard)" <<'EOF'
import json, sys
resume = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl") if '"resume"' in l][-1]
print(f"resumed at {resume['step']}, skipped {[(s['step'], s['reason'][:60]) for s in resume['skipped']]}")
sys.exit(not (resume["step"] == 8 and resume["skipped"][0]["step"] == 12))
EOF
    ); verdict corrupt-shard $(( rc || $? )) "exit $rc, $out"
}

drill_change-seed() {  # another seed on the same run name: refused, naming the field
    job change-seed || { verdict change-seed 1 "first run failed"; return; }
    job change-seed --set train.seed=1 --set train.max_steps=16; local rc=$?
    grep -q "train.seed: checkpoint 0, now 1" "$DIR/change-seed.log"; local found=$?
    verdict change-seed $(( rc != 1 || found )) "exit $rc, $(grep -o 'would not continue the same run ([^)]*)' "$DIR/change-seed.log" | head -1)"
}

mount_tmpfs() {  # mount_tmpfs DIR SIZE
    mkdir -p "$1" && mount -t tmpfs -o "size=$2" tmpfs "$1" 2>/dev/null
}

drill_disk-full() {  # storage of 2 MiB: the second checkpoint does not fit; the error names the path, run.json says failed
    local mnt=$DIR/full
    mount_tmpfs "$mnt" 2m || { echo "SKIP disk-full: cannot mount a tmpfs (needs root)"; return; }
    job disk-full --set "storage_path=$mnt"; local rc=$?
    out=$(query "$mnt/disk-full" <<'EOF'
import json, os, sys
record = json.load(open(f"{sys.argv[1]}/run.json"))
partial = [d for d in os.listdir(sys.argv[1]) if d.startswith("checkpoint_") and not os.path.exists(f"{sys.argv[1]}/{d}/_COMPLETE")]
error = record["error"] or {}
print(f"run.json {record['status']} {error.get('class')}/{error.get('reason')}: {error.get('message', '')[:200]}; "
      f"partial checkpoints left: {partial}")
sys.exit(not (record["status"] == "failed" and (error.get("class"), error.get("reason")) == ("infrastructure", "disk_full")
              and "No space left" in error["message"] and sys.argv[1] in error["message"]))
EOF
    ); local checked=$?
    umount "$mnt"
    verdict disk-full $(( rc != 1 || checked )) "exit $rc, $out"
}

drill_read-only() {  # read-only storage: refused before Ray starts, exit 2, naming the path
    local mnt=$DIR/ro
    mount_tmpfs "$mnt" 1m || { echo "SKIP read-only: cannot mount a tmpfs (needs root)"; return; }
    mount -o remount,ro "$mnt"
    job read-only --set "storage_path=$mnt"; local rc=$?
    umount "$mnt"
    grep -q "config error: storage_path: cannot create and write the run directory $mnt/read-only" "$DIR/read-only.log"
    verdict read-only $(( rc != 2 || $? )) "exit $rc, $(grep -m1 'config error' "$DIR/read-only.log")"
}

drills=("$@")
[ ${#drills[@]} -gt 0 ] || drills=(kill-worker kill-driver corrupt-shard change-seed disk-full read-only)
echo "drills in $DIR"
for d in "${drills[@]}"; do "drill_$d"; done
exit $failed
