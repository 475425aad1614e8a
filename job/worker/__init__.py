"""What runs in each training process: `train` (the entry and the loop), `build` before the first step, `finish`
after the last, the loop's `parts`; rooms `model/`, `checkpoint/`, `evaluation/` (docs/architecture.md). Imports
the floors below it, never `driver`."""
