"""FSDP2 fine-tuning of Hugging Face causal LMs under Ray Train, shipped by a Helm chart.

Modules, one concern each (flat, because the chart ships them in a ConfigMap):
`config` (run config), `data` (sources, formats, packing, batches), `model` (build + FSDP2 `parallelize`),
`loss` (chunked cross-entropy), `compile_cache` (compiled code kept on the runs' storage), `train` (the
per-worker loop: build → train → finish), `evaluate` (held-out loss,
generation, task evaluation), `checkpoint` (asynchronous save, resume), `export` (the checked Hugging Face export),
`metrics` (MFU, metric log and TensorBoard files, time accounting and goodput, one-step profiler),
`tracking` (MLflow), `nccl` (transport from NCCL's log),
`environment` (worker inventory, image digest), `preflight` (bandwidth and transport checks),
`packages` (optional packages: s3fs, datasets), `evidence` (run record, compare), `runs` (the run index),
`report` (markdown and plots), `launch` (driver: Ray Train or torchrun, and the `Launcher` the loop calls), `__main__` (CLI).
"""

__version__ = "0.2.0"
