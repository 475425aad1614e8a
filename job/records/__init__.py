"""What writes a run's record: the run record (`run_record`, its schema beside it), how a run ended (`failures`),
the run lease and its heartbeat (`lease`), what it ran on (`environment`, `nccl`, `preflight`), MLflow
(`tracking`). Imports only the floors below it (no torch at import): the driver, the workers and the commands
all use it."""
