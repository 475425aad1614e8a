"""What runs in each training process. `train` is the entry (`train_loop`) and the loop itself; `build` makes the
`trainer.Trainer` before the first step and `finish` ends the run after the last; the loop asks its `parts` after
each step; `objective` turns a batch into the loss; `contract` is what the driver hands the loop and what the
loop asks of its launcher. In rooms: `model/` (the causal LM, LoRA, sharding, the loss, the export),
`checkpoint/` (resume, the writer, staging), `evaluation/` (held-out, task, generation). Beside them: `data`,
`optimizer`, `schedule`, `metrics`, `faults`, `watchdog`, `compile_cache`. Imports the floors below it, never
`driver`."""
