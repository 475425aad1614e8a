"""What runs in each training process: `train` (build, the loop, finish) and what it is built from: `data`,
`model` (with `architecture`), `loss`, `evaluate` and `generate`, `checkpoint`, `export`, `metrics`,
`compile_cache`, `watchdog`; `contract` is what the driver hands the loop and what the loop asks of it. Imports
`records` and the shared modules, never `driver`."""
