"""Evaluation in the workers: held-out loss (`heldout`), task scores by greedy generation (`task`), and the
decoder both the task and the export's check use (`generate`)."""
