"""What a run leaves and how it is read back: the run record (`evidence`, its schema beside it), how a run ended
(`failures`), the run lease (`lease`), what it ran on (`environment`, `nccl`, `preflight`), MLflow (`tracking`),
and the readers: the run index (`runs`), `report`, `compare`. Imports only the shared modules (no torch at import):
the driver, the workers and the command line all use it."""
