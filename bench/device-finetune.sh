#!/usr/bin/env bash
# The pretrained GSM8K fine-tune on the lent GPU machine (docs/device.md "Carrying the pretrained weights",
# results in docs/finetune-gsm8k.md). The GGUF weights are larger than one call carries, so they travel in parts,
# one call each, into /tmp/gguf/ (docs/device.md "Carrying the pretrained weights"); then:
#   bench/device-finetune.sh prepare MODEL    join /tmp/gguf/part.*, then scripts/prepare_model.py --gguf (sha256
#                                               checked) writes /tmp/models/MODEL (bf16 safetensors + tokenizer)
#   bench/device-finetune.sh run [--set K=V]  values/gsm8k.yaml as the chart renders it: the run config is read from
#                                               the ConfigMap in .devdata/gsm8k-render.yaml (rendered here with
#                                               --set run.model.path=/tmp/models/MODEL and the data under .devdata/);
#                                               only storage is overridden, plus the --set arguments (e.g. the drill
#                                               --set debug.fail_at_step=180: the worker SIGKILLs itself, Ray restarts
#                                               it, the run resumes from its last complete checkpoint).
#                                               Env: NAME=gsm8k (the run's name), RENDER=.devdata/gsm8k-lora-render.yaml
#                                               another rendered profile (default .devdata/gsm8k-render.yaml), KEEP_RUNS=1 keeps the other runs
#                                               and the runs' compile cache (/tmp/runs/.compile_cache), FRESH_LOCAL_CACHE=1
#                                               empties the local compile caches first (a fresh pod's view).
#                                               JOB_TREE=DIR runs the job package exported there from another
#                                               commit (an A/B on one machine, e.g. .devdata/trees/before).
#                                               Ray Train's startup, actor by actor, goes to ray-startup.txt
#                                               (bench/ray_actor_timeline.py)
#   bench/device-finetune.sh pair RENDER:NAME RENDER:NAME   two rendered profiles back to back (LoRA beside QLoRA,
#                                               docs/lora.md), each as `run` does with its files in $OUT/NAME, then
#                                               both summaries
#   bench/device-finetune.sh task-eval [ARGS]   bench/task_eval.py on that run config (one table)
#   bench/device-finetune.sh parity [RECIPES] [--set K=V]   FP8 loss parity (issue 19): the same run config, 200 steps,
#                                               once in bf16 and once per float8 recipe (default "none,rowwise"), held-out
#                                               loss every 50 steps, no task eval, export or intermediate checkpoints;
#                                               prints the two-row table (bench/fp8_parity.py). ~2.5-3 min per run at
#                                               ~48k tokens/s; RECIPES "none" then "rowwise" in two calls also works
#                                               (a finished run is not repeated while the machine stays warm)
# Carry .whl (bench/device-wheels.sh) for prepare, run and parity.
# Logs and results go to $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-/tmp/finetune-out}
mkdir -p "$out"
# The run config as the kubelet mounts it: the ConfigMap's run.yaml in the carried render ($RENDER).
run_config() {
  python3 -c 'import sys, yaml
run = [d["data"]["run.yaml"] for d in yaml.safe_load_all(sys.stdin) if d and d["kind"] == "ConfigMap" and "run.yaml" in d["data"]]
open("/tmp/run.yaml", "w").write(run[0])' <"${RENDER:-.devdata/gsm8k-render.yaml}"
}
case "${1:-}" in
  prepare)
    source bench/device-env.sh || exit 1
    cat /tmp/gguf/part.* > "/tmp/gguf/$2.gguf" && rm -f /tmp/gguf/part.*
    python3 scripts/prepare_model.py "$2" --out /tmp/models --gguf "/tmp/gguf/$2.gguf" 2>&1 | grep -v '%|' | tail -n 3
    ls -la "/tmp/models/$2" ;;
  run)
    source bench/device-env.sh || exit 1
    run_config || exit 1
    name=${NAME:-gsm8k}
    if [[ ${KEEP_RUNS:-0} == 1 ]]; then rm -rf "/tmp/runs/$name"; else rm -rf /tmp/runs; fi
    [[ ${FRESH_LOCAL_CACHE:-0} == 1 ]] && rm -rf /tmp/torchinductor_* ~/.triton/cache
    tree=${JOB_TREE:-.}  # another commit's job package (`git archive COMMIT job | tar -x -C DIR`) runs from DIR
    [[ $tree != . ]] && ln -sfn "$PWD/.devdata" "$tree/.devdata"  # the run config's data paths are relative
    (cd "$tree" && python3 -m job --config /tmp/run.yaml --set storage_path=/tmp/runs --set "name=$name" "${@:2}") \
      >"$out/run.log" 2>&1
    echo "exit $?"
    cp /tmp/run.yaml "/tmp/runs/$name/run.json" "/tmp/runs/$name/metrics.jsonl" "$out/"
    cp "/tmp/runs/$name/export/acceptance.json" "$out/" 2>/dev/null
    python3 bench/finetune_summary.py "$out/run.log" "/tmp/runs/$name" | tee "$out/summary.txt"
    python3 bench/ray_actor_timeline.py > "$out/ray-startup.txt" 2>&1 ;;
  pair)
    for spec in "${@:2}"; do
      OUT="$out/${spec#*:}" RENDER="${spec%%:*}" NAME="${spec#*:}" bash "$0" run
    done
    for spec in "${@:2}"; do echo "== ${spec#*:}"; cat "$out/${spec#*:}/summary.txt"; done ;;
  task-eval)
    source bench/device-env.sh || exit 1
    run_config || exit 1
    python3 bench/task_eval.py --config /tmp/run.yaml "${@:2}" 2>&1 | grep -v '%|'
    exit "${PIPESTATUS[0]}" ;;
  parity)
    source bench/device-env.sh || exit 1
    run_config || exit 1
    recipes=none,rowwise; [[ "${2:-}" != --* && -n "${2:-}" ]] && { recipes=$2; shift; }
    # A tmpfs with room for a checkpoint (~18 GB each, deleted once read) writes it in seconds instead of ~20 s.
    storage=/tmp/parity; [ "$(df --output=avail -BG /dev/shm 2>/dev/null | tail -n 1 | tr -dc 0-9)" -ge 40 ] 2>/dev/null \
      && storage=/dev/shm/parity
    python3 bench/fp8_parity.py --config /tmp/run.yaml --recipes "$recipes" --steps 200 --eval-every 50 \
      --storage "$storage" "${@:2}" 2>&1 | tee "$out/parity.txt"
    rc=${PIPESTATUS[0]}; cp "$storage"/parity-*.log "$out/" 2>/dev/null
    for d in "$storage"/parity-*/; do cp "$d/metrics.jsonl" "$out/$(basename "$d")-metrics.jsonl" 2>/dev/null; done
    exit "$rc" ;;
  *)
    echo "usage: $0 prepare MODEL | run [--set KEY=VALUE ...] | task-eval [ARGS] | parity [RECIPES] [--set KEY=VALUE ...]" >&2
    exit 2 ;;
esac
