"""What the driver and the workers share, importable without torch or transformers (tests/test_imports.py keeps it
so): the run directory's checkpoints and export, data sources, architecture presets, terminal style."""
