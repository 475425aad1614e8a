#!/usr/bin/env bash
# The GPU benchmark as run on the lent 2-GPU machine (see docs/device.md and docs/performance.md).
#   bench/device-bench.sh 1gpu [VARIANTS_GPU0 VARIANTS_GPU1]   one-GPU variants, one queue per GPU in parallel
#   bench/device-bench.sh 2gpu [VARIANTS]                       FSDP across both GPUs; torchrun vs Ray Train
#   bench/device-bench.sh gsm8k                                 real data on 2 GPUs under Ray Train: Qwen2.5-1.5B
#       architecture (random init, BPE tokenizer trained on GSM8K), preflight, held-out and task eval; GSM8K
#       must be carried in .devdata/gsm8k/ (cp ../shared/data/gsm8k/*.jsonl .devdata/gsm8k/)
#   bench/device-bench.sh gsm8k-throughput [MICRO_BATCHES]      the same packed data, training only (24 steps,
#       step 20 profiled) at each micro-batch (default "4 16"): throughput and device idle of real-data steps
#   bench/device-bench.sh gsm8k-values [--set KEY=VALUE ...]    values/gsm8k.yaml end to end as the chart renders
#       it: carry the rendered manifests in .devdata/gsm8k-render.yaml (from the repo root, here:
#       helm template gsm8k . -f values/gsm8k.yaml --set run.data.train=.devdata/gsm8k/train.jsonl \
#         --set run.data.validation=.devdata/gsm8k/test.jsonl > .devdata/gsm8k-render.yaml);
#       the run config is read from its ConfigMap as the kubelet mounts it, and only what needs the hub (the
#       pretrained model) or the cluster (storage) is overridden, plus the --set arguments given (e.g.
#       --set scaling.num_workers=2 on two GPUs)
#   bench/device-bench.sh issue19 [VARIANTS]                     ONE GPU, one table against both peers (issue 19): the
#       HF Trainer plain and with Liger's kernels, our best bf16 (best-cudnn) and FP8 (rowwise), micro-batch 4 then 8
#       (default: hf,hf-liger,best-cudnn,best-fp8,hf-liger-b8,best-b8-cudnn,best-b8-fp8), all within BUDGET seconds
#       (default 450; variants in order, what does not fit is skipped, so the call ends before 8 minutes); the runs
#       go to /dev/shm when it has room for a checkpoint. Carry .whl (with liger-kernel and torchao).
#   bench/device-bench.sh lora [VARIANTS]                       ONE GPU (issue 45): the LoRA job end to end (examples/lora-e2e.yaml),
#       then LoRA against the Trainer + peft, the full fine-tune and the 7B shape (docs/lora.md). Carry .whl (with peft).
#   bench/device-bench.sh qlora [VARIANTS]                      ONE GPU (issue 52): the NF4 candidates on a 7B layer's
#       projections (bench/nf4_candidates.py), then QLoRA at the 7B shape against the Trainer + peft + bitsandbytes
#       4-bit (and with Liger), our and the Trainer's bf16 LoRA of that shape, and the 32B shape, 8 steps each within
#       BUDGET seconds (default 420; last, if time is left, our 7B QLoRA without compile). Carry .whl (with peft,
#       bitsandbytes, liger-kernel, torchao).
#   bench/device-bench.sh issue31 [VARIANTS]                     ONE GPU: issue 31's levers (one GPU without FSDP2, clipping
#       in the fused step) alone and together against the code before them, beside HF + Liger and torchtitan,
#       micro-batch 4 then 8, within BUDGET seconds (default 540). Carry .whl, .titan and .devdata/trees.
#   bench/device-bench.sh layers [ARGS]                        ONE GPU: issue 19's kernel levers on the decoder layers
#       alone (bench/layers.py ARGS): SDPA/cuDNN, FlashAttention-4, quack's and Liger's SwiGLU, one table.
#       Carry .whl; the CuTe-DSL bundle must be in /tmp/cute-parts (bench/device-env.sh, device_cute_install).
# Results (JSON rows and logs) go to $OUT (the device tool's output folder) or /tmp/bench-out. BENCH_ARGS adds
# arguments to every benchmark call, e.g. BENCH_ARGS="--profile-step 12 --timeout 400".
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/device-env.sh || exit 1
out=${OUT:-/tmp/bench-out}
mkdir -p "$out"
bench=(python3 bench/benchmark.py --preset qwen2.5-1.5b --seq-len 4096 --timeout 280 ${BENCH_ARGS:-})
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0), 'x', torch.cuda.device_count())"
# No hub access here: the reference architecture (random init) with a BPE tokenizer trained on the run's data
hub_free=(--set storage_path=/tmp/runs --set model.preset=qwen2.5-1.5b --set model.train_tokenizer_vocab=8192)
# examples/gsm8k.yaml on the GPUs
gsm8k=(--config examples/gsm8k.yaml "${hub_free[@]}"
  --set data.train.path=.devdata/gsm8k/train.jsonl --set data.validation.path=.devdata/gsm8k/test.jsonl
  --set scaling.use_gpu=true --set train.seq_len=1024 --set parallel.compile=true --set train.loss_chunk_size=4096)
case "${1:-1gpu}" in
  1gpu)
    CUDA_VISIBLE_DEVICES=0 "${bench[@]}" --gpus 1 --only "${2:-hf,default,no-reshard,chunked-ce}" --out "$out/gpu0.json" >"$out/gpu0.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 "${bench[@]}" --gpus 1 --only "${3:-compile,compile-no-reshard,best,best-b8}" --out "$out/gpu1.json" >"$out/gpu1.log" 2>&1 &
    wait
    tail -n 14 "$out/gpu0.log" "$out/gpu1.log" ;;
  issue19)
    # A tmpfs with room for each run's final checkpoint (~18 GB, deleted after the run) writes it in seconds.
    workdir=(); [ "$(df --output=avail -BG /dev/shm 2>/dev/null | tail -n 1 | tr -dc 0-9)" -ge 40 ] 2>/dev/null \
      && workdir=(--workdir /dev/shm)
    "${bench[@]}" --gpus 1 --budget "${BUDGET:-450}" "${workdir[@]}" --out "$out/issue19.json" \
      --only "${2:-hf,hf-liger,best-cudnn,best-fp8,hf-liger-b8,best-b8-cudnn,best-b8-fp8}" >"$out/issue19.log" 2>&1
    echo "exit $? ${workdir[*]}"; grep -v '^{' "$out/issue19.log" | tail -n 10 ;;
  lora)
    # ONE GPU (issue 45, docs/lora.md): the LoRA job end to end on the 1.5B shape (examples/lora-e2e.yaml: 30 steps,
    # saves at 10/20/30, the PEFT adapter and the merged export and their acceptance), then our LoRA against the
    # Trainer + peft (plain at micro-batch 2, where its fp32 logits fit an H100; with Liger at 4), the full
    # fine-tune, and the Qwen2.5-7B shape with LoRA. Carry .whl (with peft).
    python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m job --config examples/lora-e2e.yaml >"$out/e2e.log" 2>&1
    echo "e2e exit $?"; grep -E '"kind": "(start|checkpoint|export|time)"' "$out/e2e.log" | cut -c1-700
    du -sh /dev/shm/runs/lora-e2e/checkpoint_* /dev/shm/runs/lora-e2e/export /dev/shm/runs/lora-e2e/export/merged
    rm -rf /dev/shm/runs
    "${bench[@]}" --gpus 1 --budget "${BUDGET:-480}" --stop-after-steps --workdir /dev/shm --out "$out/lora.json" \
      --only "${2:-hf-peft-b2,best-b2-cudnn-lora,hf-peft-liger,best-cudnn-lora,best-cudnn,lora-7b}" >"$out/lora.log" 2>&1
    echo "exit $?"; grep -v '^{' "$out/lora.log" | tail -n 10 ;;
  qlora)
    python3 bench/nf4_candidates.py --iters 10 >"$out/nf4.log" 2>&1; echo "nf4 candidates exit $?"; tail -n 6 "$out/nf4.log"
    "${bench[@]}" --gpus 1 --steps 8 --budget "${BUDGET:-420}" --stop-after-steps --workdir /dev/shm --out "$out/qlora.json" \
      --only "${2:-qlora-7b,hf-qlora-7b,qlora-32b,hf-qlora-liger-7b,lora-7b,hf-peft-7b,qlora-7b-eager}" >"$out/qlora.log" 2>&1
    echo "exit $?"; grep -v '^{' "$out/qlora.log" | tail -n 8 ;;
  issue31)
    # ONE GPU: issue 31's levers alone and together (the trees of `benchmark.py`'s TREES exported here first) beside
    # the three peers, micro-batch 4 then 8; each of our runs is stopped once its last step is logged. Carry .whl,
    # .titan and .devdata/trees; the per-variant logs and profiles come back as one archive.
    device_titan_install || exit 1
    "${bench[@]}" --gpus 1 --budget "${BUDGET:-540}" --stop-after-steps --out "$out/issue31.json" --only "${2:-hf-liger,titan,\
best-cudnn-main,best-cudnn-unwrapped,best-cudnn-fsdp,best-cudnn,hf-liger-b8,titan-b8,best-b8-cudnn-main,best-b8-cudnn,hf,\
best-b8-cudnn-unwrapped,best-b8-cudnn-fsdp}" >"$out/issue31.log" 2>&1
    echo "exit $?"; df -h /dev/shm | tail -n 1
    (cd "$out" && tar czf issue31-logs.tgz issue31-*.log issue31-*.profile.txt && rm -f issue31-*.log issue31-*.profile.txt)
    grep -v '^{' "$out/issue31.log" | tail -n 16 ;;
  layers)
    device_cute_install || exit 1
    python3 -c "import flash_attn.cute, quack; from importlib.metadata import version as v; print('flash-attn-4', v('flash-attn-4'), 'quack', v('quack-kernels'), 'cutlass-dsl', v('nvidia-cutlass-dsl'))"
    python3 bench/layers.py --out "$out/layers.json" "${@:2}" 2>&1 | tee "$out/layers.log" | grep -v '^{' | tail -n 16 ;;
  2gpu)
    "${bench[@]}" --gpus 2 --only "${2:-hf,compile-no-reshard,best,best-ray}" --out "$out/gpu2.json" 2>&1 | tee "$out/gpu2.log" | tail -n 8 ;;
  gsm8k)
    python3 -m job "${gsm8k[@]}" --set train.lr=3e-4 --set train.max_steps=150 --set eval.every_steps=50 \
      --set preflight.enabled=true >"$out/gsm8k.log" 2>&1
    echo "exit $?"; cp /tmp/runs/gsm8k-local/run.json /tmp/runs/gsm8k-local/metrics.jsonl "$out/"
    grep -v '^ ' "$out/gsm8k.log" | grep '"kind"' | cut -c1-400 | tail -n 14 ;;
  gsm8k-throughput)
    for mb in ${2:-4 16}; do
      python3 -m job "${gsm8k[@]}" --set name=gsm8k-mb$mb --set train.micro_batch_size=$mb --set train.max_steps=24 \
        --set train.warmup_steps=2 --set logging.every_steps=2 --set eval.every_steps=0 --set eval.task=null \
        --set checkpoint.export=false --set checkpoint.every_steps=0 --set parallel.reshard_after_forward=false \
        --set debug.profile_step=20 \
        >"$out/gsm8k-mb$mb.log" 2>&1
      echo "micro-batch $mb: exit $?"; cp /tmp/runs/gsm8k-mb$mb/profile-step20.txt "$out/gsm8k-mb$mb.profile.txt"
      grep -v '^ ' "$out/gsm8k-mb$mb.log" | grep '"kind": "train"' | cut -c1-330 | tail -n 3
      head -n 1 "$out/gsm8k-mb$mb.profile.txt"
    done ;;
  gsm8k-values)
    python3 -c 'import sys, yaml
run = [d["data"]["run.yaml"] for d in yaml.safe_load_all(sys.stdin) if d and d["kind"] == "ConfigMap" and "run.yaml" in d["data"]]
open("/tmp/run.yaml", "w").write(run[0])' <.devdata/gsm8k-render.yaml || exit 1
    python3 -m job --config /tmp/run.yaml --set name=gsm8k-values "${hub_free[@]}" --set model.init=random \
      --set model.path=null --set scaling.cpus_per_worker=4 "${@:2}" >"$out/gsm8k-values.log" 2>&1
    echo "exit $?"; cp /tmp/run.yaml /tmp/runs/gsm8k-values/run.json /tmp/runs/gsm8k-values/metrics.jsonl "$out/"
    grep -v '^ ' "$out/gsm8k-values.log" | grep '"kind"' | cut -c1-400 | tail -n 16 ;;
esac
