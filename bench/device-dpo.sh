#!/usr/bin/env bash
# Issue 53's evidence on the lent GPU machine (docs/preference.md, "Evidence"); logs and results go to $OUT.
#   bench/device-dpo.sh learn [ARGS]   bench/dpo_learning.py: SFT (values/gsm8k.yaml) -> pairs from its export ->
#                                      DPO(+NLL) from it, GSM8K exact match at each stage, one table. Needs the
#                                      prepared weights in /tmp/models/$MODEL (docs/device.md's parts, then
#                                      bench/device-finetune.sh prepare; MODEL=qwen2.5-coder-1.5b) and GSM8K in
#                                      .devdata/gsm8k/; carry .whl and .devdata. ARGS go to the script (e.g. --stages
#                                      sft, then --stages pairs,dpo in the next call while the machine is warm).
#   bench/device-dpo.sh peer [ARGS]    bench/dpo_peer.py: ours against TRL's DPOTrainer (peft, Liger), full and LoRA,
#                                      one table; nothing but .whl carried (trl is in it: bench/device-wheels.sh).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-/tmp/dpo-out}
mkdir -p "$out"
source bench/device-env.sh || exit 1
case "${1:-}" in
  learn)
    python3 bench/dpo_learning.py --model "/tmp/models/${MODEL:-qwen2.5-coder-1.5b}" --data .devdata/gsm8k \
      --workdir /tmp/dpo-runs --out "$out/learning.json" "${@:2}" 2>&1 | grep -v '%|' | tee "$out/learning.txt"
    rc=${PIPESTATUS[0]}
    for stage in sft pairs dpo; do
      cp "/tmp/dpo-runs/$stage.log" "$out/" 2>/dev/null
      cp "/tmp/dpo-runs/$stage/metrics.jsonl" "$out/$stage-metrics.jsonl" 2>/dev/null
    done
    cp /tmp/dpo-runs/pairs/pairs.json "$out/" 2>/dev/null
    head -c 20000 /tmp/dpo-runs/pairs/pairs.jsonl > "$out/pairs-head.jsonl" 2>/dev/null
    exit "$rc" ;;
  peer)
    python3 bench/dpo_peer.py --out "$out/peer.json" "${@:2}" 2>&1 | grep -v '%|' | tee "$out/peer.txt"
    exit "${PIPESTATUS[0]}" ;;
  *)
    echo "usage: $0 learn [ARGS] | peer [ARGS]" >&2
    exit 2 ;;
esac
