"""Checkpoints in the workers: resuming (`resume`), saving beside the steps (`writer`), and where a save first
copies the state (`staging`)."""
