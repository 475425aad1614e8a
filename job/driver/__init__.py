"""The driver (`python -m job [run]`): `main` checks the config and holds the run, `launch` prepares what every
worker shares and starts them under Ray Train or torchrun, `watch` holds the run lease and turns a stop signal
into a cancelled record. Imports anything below it."""
