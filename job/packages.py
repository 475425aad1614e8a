"""Optional packages: the features that need a package a Ray training image may lack, and the one error a
missing one gives.

All else the job imports comes with `ray[train]` and torch. Five features need more:

* `s3://` storage and sources need `s3fs`, which the AWS Ray Train DLC lacks. An s3fs release requires exactly the
  fsspec of its version, so the fix names `s3fs==<the installed fsspec>`, leaving the image's fsspec in place.
* hub data sources (`hf:owner/name`) need `datasets` (in the DLC, not in stock `rayproject/ray`).
* `parallel.float8` needs `torchao`, which no Ray image ships.
* `model.lora.quantize_base` (QLoRA) needs `torchao` too (its NF4 tensor), which the chart then adds to
  `runtimeEnv.pip`.
* `logging.mlflow.tracking_uri` needs `mlflow` (`mlflow-skinny`), which the chart then adds to `runtimeEnv.pip`.

`require` imports the package where the feature uses it, or raises `MissingPackage` naming the package, the
feature and the `runtimeEnv` line that adds it; `check_config` tests every feature a config asks for, so the driver
fails at submit time, not a worker mid-run.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType

from .rules import is_hub_source

DATASETS_VERSION = "5.2.0"
"""The `datasets` pin of requirements.txt (a test keeps them equal): what the fix for a missing one installs."""
MLFLOW_VERSION = "3.17.2"
"""The `mlflow-skinny` pin of requirements-dev.txt (the client: no server, no UI), which the chart adds to
`runtimeEnv.pip` when `logging.mlflow.tracking_uri` is set (a test keeps them equal)."""
TORCHAO_VERSION = "0.18.0"
"""The `torchao` pin of requirements-dev.txt, bench/device-wheels.sh and the chart's runtime env for QLoRA (a test
keeps them equal): the first release that is ABI-stable across torch >= 2.11 (the GPU machines' 2.11 and the
image's 2.13); its NF4 tensor is plain PyTorch, so it needs none of the compiled kernels."""


class MissingPackage(ImportError):
    """A feature the run uses needs a package this Python environment lacks; the message says how to add it."""


def pip_requirement(module: str) -> str:
    """The pip requirement that adds `module` to an environment like this one (for the fix in the message)."""
    if module == "s3fs":
        try:
            return f"s3fs=={importlib.metadata.version('fsspec')}"
        except importlib.metadata.PackageNotFoundError:
            return "s3fs"
    if module == "datasets":
        return f"datasets=={DATASETS_VERSION}"
    if module == "torchao":
        return f"torchao=={TORCHAO_VERSION}"
    if module == "mlflow":
        return f"mlflow-skinny=={MLFLOW_VERSION}"
    return module


def require(module: str, feature: str) -> ModuleType:
    """`import module`, or a `MissingPackage` that names it, `feature` (what needs it) and the fix."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name != module:  # the package is there but broken (a missing dependency of its own): say so as is
            raise
        requirement = pip_requirement(module)
        raise MissingPackage(
            f"{feature} needs the Python package {module!r}, which this environment does not have. Add it to the "
            f"Ray runtime env in the chart's values, `runtimeEnv: {{pip: [\"{requirement}\"]}}` (every pod installs "
            f"it at start), or to the image; locally: pip install '{requirement}'") from None


def for_uri(uri: str) -> str | None:
    """The optional package that fsspec needs to open `uri` (`s3fs` for `s3://`), or None."""
    return "s3fs" if uri.startswith(("s3://", "s3a://")) else None


def check_config(cfg) -> None:
    """Raise `MissingPackage` for the first field of `cfg` (a `config.RunConfig`) whose feature lacks its package."""
    uris = [("storage_path", cfg.storage_path), ("checkpoint.resume", cfg.checkpoint.resume)]
    for key in ("train", "validation"):
        source = getattr(cfg.data, key)
        if source is not None:
            if is_hub_source(source.path):
                require("datasets", f"data.{key}: hub dataset {source.path}")
            uris.append((f"data.{key}", source.path))
    for key, uri in uris:
        module = for_uri(uri or "")
        if module:
            require(module, f"{key}: {uri}")
    if cfg.parallel.float8 != "none":
        require("torchao", f"parallel.float8: {cfg.parallel.float8}")
    if cfg.model.lora.quantize_base:
        require("torchao", f"model.lora.quantize_base: {cfg.model.lora.quantize_base}")
    if cfg.logging.mlflow.tracking_uri:
        require("mlflow", f"logging.mlflow.tracking_uri: {cfg.logging.mlflow.tracking_uri}")
