"""What runs in each training process. `train` is the entry (`train_loop`) and the loop itself; `build` makes the
run before the first step and `finish` ends it after the last, all three sharing `run.Run`; `contract` is what the
driver hands the loop and what the loop asks of its launcher. Beside them: `data`, `model` (with `architecture`),
`loss`, `optimizer`, `schedule` (the learning rate), `evaluate`, `generate` and `task_eval`, `checkpoint` (what a
checkpoint is, its verification and resume) and `checkpoint_writer` (saving beside the steps), `faults` (injected
on purpose), `export`, `metrics`, `compile_cache`, `watchdog`. Imports `records` and the shared modules, never
`driver`."""
