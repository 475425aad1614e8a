#!/usr/bin/env bash
# Download the Python wheels the GPU device machine lacks into .whl/ (git-ignored).
#
# The device image ('cuda', Python 3.12, torch 2.11 CUDA, transformers 5.x, accelerate,
# pyarrow, pandas, fsspec, pyyaml, ... see the device KINDS.md package list) has neither
# ray nor datasets. This fetches ray==2.60.0, datasets==5.2.0 and exactly those of their
# runtime dependencies (ray core + the `train` extra, datasets without extras) that the
# image does not have, for cp312 manylinux x86_64, one version each (two versions of one
# package stop the install), plus the two packages of the issue-19 benchmark: liger-kernel
# (Triton kernels for the Trainer baseline with Liger) and torchao (float8 training). The ray
# wheel is then rebuilt without ray/jars/ (Java worker, ~31 MiB) and *.js.map (dashboard
# source maps), and torchao's without its compiled kernels (_C*.so: CUTLASS/MX kernels that
# float8 training does not use; it calls torch._scaled_mm), so that everything carried to
# the device stays under its 64 MiB limit. See docs/device.md.
#
# Usage (repo root, on the dev machine, needs PyPI):  bash bench/device-wheels.sh
#
# `bash bench/device-wheels.sh cute` instead fetches the CuTe-DSL kernels of issue 19's levers into .cute/:
# FlashAttention-4 (`flash-attn-4`) and quack (GEMMs with a SwiGLU epilogue), for bench/layers.py, with NVIDIA's CuTe DSL (its CUDA-13 compiler library alone is a 92 MB wheel) and the
# small packages they need that the image lacks. 98 MB in all, over one call's 64 MiB: they are tarred and
# split into .cute/part.00 and .cute/part.01 (with .cute/whl.tar.sha256), carried in two calls and joined,
# checked and installed there by `device_cute_install` (bench/device-env.sh; docs/device.md, "CuTe-DSL kernels").
#
# `bash bench/device-wheels.sh titan` fetches torchtitan, issue 19's third peer (bench/torchtitan_baseline.py),
# into .titan/: torchtitan 0.2.2 (the release built against torch 2.11, the image's) and those of the modules it
# imports at run time that the image lacks. ~0.8 MB: carried with .whl in one call (`carry [".whl", ".titan"]`),
# installed there by `device_titan_install` (bench/device-env.sh; docs/device.md, "torchtitan").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEST=.whl

# Missing on the device, by who needs it (versions match the repo's .venv, which pip
# resolved for requirements.txt):
#   ray core:      jsonschema -> jsonschema-specifications, referencing, rpds-py
#   ray[train]:    tensorboardX, pydantic -> pydantic-core, annotated-types, typing-inspection
#   datasets:      dill, multiprocess
#   the tests' CUDA cases (python -m pytest tests/test_loss.py there): pytest -> iniconfig, pluggy, pygments
#   issue 19: liger-kernel (needs torch and triton: the image's torch brings triton), torchao (no
#   runtime dependencies; 0.18.0 is ABI-stable against torch >= 2.11, job/packages.py TORCHAO_VERSION)
#   the pretrained weights (bench/device-finetune.sh prepare): gguf, the GGUF reader (requirements-dev.txt's pin)
#   issue 45: peft (the Trainer + peft LoRA baseline, hf_trainer_baseline.py --lora-rank; its needs are in the image)
#   issue 52: bitsandbytes (the Trainer + peft QLoRA baseline, --load-in-4bit; needs torch, numpy, packaging: in the
#   image), slimmed to the CUDA 13.0 and CPU libraries (the image's torch is cu130): 43 MB -> ~4 MB
#   issue 53: trl (TRL's DPOTrainer, the DPO peer: bench/dpo_peer.py; 1.16.0 supports transformers 5, and needs
#   accelerate, datasets, jinja2, psutil: the image's and .whl's)
# Already on the device, within the bounds (versions read there 2026-11-30): click filelock
# msgpack packaging (26.3) protobuf (7.36.2) pyyaml requests attrs numpy (2.5.2) pandas
# (3.0.6) pyarrow (25.0.1; datasets needs >=24) fsspec (2026.7.0; datasets needs <=2026.9.0)
# tqdm xxhash huggingface-hub (1.33.0; datasets needs >=1.31) typing-extensions (4.16.0;
# pydantic needs >=4.16.0).
# bench/device-env.sh re-checks every Requires-Dist there and prints what is unmet.
PKGS=(
  ray==2.60.0
  datasets==5.2.0
  dill==0.4.1
  multiprocess==0.70.19
  jsonschema==4.26.0
  jsonschema-specifications==2025.9.1
  referencing==0.37.0
  rpds-py==2026.9.1
  tensorboardX==2.6.5
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  pytest==9.2.0
  iniconfig==2.3.1
  pluggy==1.7.0
  pygments==2.21.0
  liger-kernel==0.8.5
  torchao==0.18.0
  gguf==0.19.0
  peft==0.21.2
  bitsandbytes==0.50.2
  trl==1.16.0
)

download() {  # download DIR PACKAGE...: cp312 manylinux x86_64 wheels, no dependencies
  mkdir -p "$1"
  "$PY" -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any \
    -d "$1" "${@:2}"
}

if [ "${1:-}" = cute ]; then
  # The image has cuda-bindings, einops, protobuf and typing-extensions; the CUDA-13 libraries match its
  # torch 2.11+cu130. torch-c-dlpack-ext is optional to apache-tvm-ffi (its addons stop at torch 2.9). quack 0.6.5
  # cannot fingerprint the GEMM epilogues it builds on either DSL tried (4.8.1: a ContextVar, run 32; 4.7.1: a
  # Logger, run 33, "has no fail-closed semantic key"); FlashAttention-4 was faster and right on 4.8.1 (run 32).
  CUTE=(flash-attn-4==4.0.0b36 quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1
    nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1
    apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5)
  download .cute/whl "${CUTE[@]}"
  rm -f .cute/part.*
  tar -C .cute -cf .cute/whl.tar whl
  (cd .cute && sha256sum whl.tar > whl.tar.sha256 && split -b 52428800 -d -a 2 whl.tar part. && rm whl.tar)
  ls -l .cute/part.* && cat .cute/whl.tar.sha256
  exit 0
fi

if [ "${1:-}" = titan ]; then
  # What torchtitan 0.2.2 imports for the baseline script's path (torchtitan.train, models.qwen3): torchdata
  # (StatefulDataLoader: components/dataloader.py), tyro (its ConfigManager: config/manager.py) -> docstring-parser,
  # typeguard (-> typing-extensions, in the image). In the image already: tensorboard (components/metrics.py imports
  # torch.utils.tensorboard at the top, even with tensorboard logging off), triton (models/moe/kernels.py, imported
  # by every model), tokenizers (components/tokenizer.py), einops, pillow, fsspec, rich (only --job.print_config),
  # requests/urllib3 (torchdata's requirements); datasets (hf_datasets, imported by models.qwen3) is in .whl. Not
  # imported on this path, so left out: wandb (only metrics.enable_wandb), torchft (only fault_tolerance.enable),
  # tomli (Python >= 3.11 has tomllib), torchao (only float8/mx converters).
  TITAN=(torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1)
  download .titan "${TITAN[@]}"
  ls -l .titan
  du -ch .titan/*.whl | tail -1
  exit 0
fi

download "$DEST" "${PKGS[@]}"

# Slim the ray, torchao and bitsandbytes wheels: drop ray/jars/ and *.js.map, torchao/_C*.so,
# bitsandbytes' libraries for other CUDA versions, ROCm and XPU, and their RECORD lines (pip
# checks the hashes of the files it installs against RECORD, and files absent from the zip
# must not be listed). Rewrites in place; a second run is a no-op.
"$PY" - "$DEST"/ray-2.60.0-*.whl "$DEST"/torchao-0.18.0-*.whl "$DEST"/bitsandbytes-0.50.2-*.whl <<'EOF'
import fnmatch, os, sys, zipfile
DROP = {"ray-": lambda n: n.startswith("ray/jars/") or n.endswith(".js.map"),
        "torchao-": lambda n: fnmatch.fnmatch(n, "torchao/_C*.so"),
        "bitsandbytes-": lambda n: (fnmatch.fnmatch(n, "bitsandbytes/libbitsandbytes_*.so")
                                    and not n.endswith(("_cuda130.so", "_cpu.so")))}
for src in sys.argv[1:]:
    drop = next(rule for prefix, rule in DROP.items() if os.path.basename(src).startswith(prefix))
    with zipfile.ZipFile(src) as zin:
        if not any(drop(n) for n in zin.namelist()):
            print(f"{src}: already slim")
            continue
        tmp = src + ".tmp"
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zout:
            for info in zin.infolist():
                n = info.filename
                if drop(n):
                    continue
                data = zin.read(info)
                if n.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines(keepends=True)
                    data = "".join(l for l in lines if not drop(l.split(",", 1)[0])).encode()
                zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    os.replace(tmp, src)
    print(f"{src}: slimmed to {os.path.getsize(src) / 2**20:.1f} MiB")
EOF

# One version of each package, or the device install stops.
dups=$(ls "$DEST"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
[ -z "$dups" ] || { echo "more than one version of: $dups (remove the old ones from $DEST)" >&2; exit 1; }
ls -l "$DEST"
du -ch "$DEST"/*.whl | tail -1
