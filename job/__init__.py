"""FSDP2 fine-tuning of Hugging Face causal LMs under Ray Train, shipped by a Helm chart.

Modules, one concern each (flat, because the chart ships them in a ConfigMap): `config` (run config),
`data` (sources, packing, batches), `model` (build + FSDP2), `loss` (chunked cross-entropy), `train` (the
per-worker loop), `metrics` (MFU, metric log), `launch` (driver: Ray Train or torchrun), `__main__` (CLI).
"""

__version__ = "0.1.0"
