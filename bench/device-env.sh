# Source at the start of every command on the GPU device machine (repo root, `carry: [".whl"]`):
#   source bench/device-env.sh || exit 1
# Installs the carried wheels (.whl/, made by bench/device-wheels.sh) into /tmp/site, puts
# them and the repo on PYTHONPATH, and turns NVLink multicast off. See docs/device.md.

# NVLink multicast must stay off in every process on the shared host (NCCL, PyTorch
# symmetric memory, NVSHMEM): a program that uses it can take the host's GPUs out of
# service. Exported here so that every child inherits them, Ray workers included (Ray
# started locally by ray.init() in this shell passes the driver's environment on).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

if [ ! -d .whl ] || ! ls .whl/*.whl >/dev/null 2>&1; then
  echo "device-env: no .whl/*.whl here (run bench/device-wheels.sh, carry .whl)" >&2
  return 1 2>/dev/null || exit 1
fi
# Installed once per warm machine (the wheels' names and sizes as the key), then compiled to bytecode as an
# image's pip install does: without it every fresh process compiled ray's modules at first import (run 21 -> 22:
# startup 55.1 -> 41.1 s, Ray Train's worker start 31.7 -> 21.5 s).
wheels=$(ls -l .whl/*.whl | awk '{print $5, $9}')
if [[ "$(cat /tmp/site/.installed 2>/dev/null)" != "$wheels" ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "device-env: wheel install failed" >&2; return 1 2>/dev/null || exit 1; }
  python3 -m compileall -q -j 0 /tmp/site >/dev/null 2>&1
  echo "$wheels" > /tmp/site/.installed
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

# Report (not fail on) any unmet runtime requirement of what we carried and rely on,
# checked against the versions the image actually has.
python3 - <<'EOF' || true
from importlib.metadata import distribution, version, PackageNotFoundError
from packaging.requirements import Requirement
want = {"ray": {"train"}, "datasets": set(), "pydantic": set(), "pydantic-core": set(),
        "jsonschema": set(), "referencing": set(), "multiprocess": set(),
        "tensorboardX": set(), "transformers": {"torch"}, "accelerate": set(), "pytest": set(),
        "liger-kernel": set(), "torchao": set(), "trl": set()}
bad = []
for name, extras in want.items():
    try:
        reqs = distribution(name).requires or []
    except PackageNotFoundError:
        bad.append(f"{name}: not installed"); continue
    for r in map(Requirement, reqs):
        if r.marker and not any(r.marker.evaluate({"extra": e}) for e in extras | {""}):
            continue
        try:
            v = version(r.name)
        except PackageNotFoundError:
            bad.append(f"{name} needs {r}: missing"); continue
        if r.specifier and not r.specifier.contains(v, prereleases=True):
            bad.append(f"{name} needs {r}: have {v}")
print("device-env: requirements " + ("OK" if not bad else "UNMET:\n  " + "\n  ".join(bad)))
EOF

# The CuTe-DSL kernels of issue 19's levers (FlashAttention-4, quack): `bash bench/device-wheels.sh cute` here
# makes .cute/part.00 and .cute/part.01, 50 MiB each. Carry them in two calls back to back (the machine keeps /tmp
# while warm), each `carry [".cute/part.NN", ".cute/whl.tar.sha256"]` with the command
# `mkdir -p /tmp/cute-parts && cp .cute/part.NN .cute/whl.tar.sha256 /tmp/cute-parts/`. Then, in a later call,
# `device_cute_install` joins the parts, checks the sha256, installs the wheels into /tmp/cute (once per warm
# machine) and puts it on PYTHONPATH.
device_cute_install() {
  if [ ! -f /tmp/cute/.installed ]; then
    (cd /tmp/cute-parts && cat part.* > whl.tar && sha256sum -c --quiet whl.tar.sha256 && tar -xf whl.tar) \
      || { echo "device-env: the CuTe-DSL parts in /tmp/cute-parts are missing or do not match" >&2; return 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/cute \
      /tmp/cute-parts/whl/*.whl || { echo "device-env: CuTe-DSL install failed" >&2; return 1; }
    touch /tmp/cute/.installed
  fi
  # The DSL's own modules (`cutlass`) sit in a folder that its .pth file adds in a site directory; /tmp/cute is not one.
  export PYTHONPATH=/tmp/cute:/tmp/cute/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
}

# torchtitan, issue 19's third peer (bench/torchtitan_baseline.py): `bash bench/device-wheels.sh titan` here makes
# .titan/ (~0.8 MB); carry it with .whl (`carry [".whl", ".titan"]`). `device_titan_install` installs it into
# /tmp/titan (once per warm machine; torchtitan 0.2.2 and the few modules it imports that the image lacks) and puts
# it on PYTHONPATH after /tmp/site (torchtitan's qwen3 imports datasets, carried in .whl).
device_titan_install() {
  local wheels
  wheels=$(ls -l .titan/*.whl 2>/dev/null | awk '{print $5, $9}')
  [ -n "$wheels" ] || { echo "device-env: no .titan/*.whl here (bash bench/device-wheels.sh titan; carry .titan)" >&2; return 1; }
  if [[ "$(cat /tmp/titan/.installed 2>/dev/null)" != "$wheels" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/titan \
      .titan/*.whl || { echo "device-env: torchtitan install failed" >&2; return 1; }
    echo "$wheels" > /tmp/titan/.installed
  fi
  [[ ":$PYTHONPATH:" == *:/tmp/titan:* ]] || export PYTHONPATH=$PYTHONPATH:/tmp/titan
}

# Smoke test, run on demand: `device_ray_check [num_workers]`. Starts Ray locally, runs a Ray
# Train V2 TorchTrainer with one worker per GPU (gloo on CPU-only hosts), all-reduces
# rank+1 over NCCL and prints, per worker, the sum (= n(n+1)/2) and the NVLink-multicast
# variables as the worker sees them. Lines start with RESULT.
device_ray_check() {
  RAY_TRAIN_V2_ENABLED=1 python3 - "${1:-2}" <<'EOF'
import os, sys, ray, torch, torch.distributed as dist
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
n, gpu = int(sys.argv[1]), torch.cuda.is_available()
def work():
    r = dist.get_rank(); dev = f"cuda:{torch.cuda.current_device()}" if gpu else "cpu"
    t = torch.full((4,), float(r + 1), device=dev); dist.all_reduce(t); torch.cuda.synchronize() if gpu else None
    env = {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")}
    print(f"RESULT rank={r} backend={dist.get_backend()} dev={dev} allreduce={t.tolist()} env={env}", flush=True)
ray.init(include_dashboard=False)
res = TorchTrainer(work, scaling_config=ScalingConfig(num_workers=n, use_gpu=gpu),
                   run_config=RunConfig(storage_path="/tmp/ray_results")).fit()
print(f"RESULT TorchTrainer(num_workers={n}, use_gpu={gpu}) finished, error={res.error}", flush=True)
ray.shutdown()
EOF
}
