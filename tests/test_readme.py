"""The README's first commands, as written, in order, in a fresh clone of this commit: the demo, then the report
and the TensorBoard files it points at, on the environment the first command makes (requirements.txt: no
matplotlib, no tensorboard; the shared .venv stands in for it, with those two hidden)."""

import os
import re
import subprocess

from conftest import REPO, assert_tensorboard_matches_metrics
from job.records import run_record


def readme_commands() -> list[str]:
    """The commands of the README's first two bash blocks ("The two commands": the demo and what reads its run)."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    return [line.split("  #")[0].strip() for block in blocks[:2] for line in block.splitlines() if line.strip()]


def test_the_readmes_first_commands_run_in_order_in_a_fresh_clone(tmp_path):
    commands = readme_commands()
    assert commands[0] == "bash scripts/demo.sh" and commands[1] == ".venv/bin/python -m job report runs/local-demo"
    assert commands[2].startswith(".venv/bin/tensorboard --logdir runs/local-demo/tensorboard")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    os.symlink(REPO / ".venv", clone / ".venv")
    hidden = tmp_path / "hidden"  # `import matplotlib` / `import tensorboard` fail as if not installed
    for module in ("matplotlib", "tensorboard"):
        (hidden / module).mkdir(parents=True)
        message = f"No module named {module!r}"
        (hidden / module / "__init__.py").write_text(f"raise ImportError({message!r}, name={module!r})\n")
    env = {**os.environ, "PYTHONPATH": str(hidden), "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)

    # The demo as written, shortened to 20 steps for the suite's time.
    demo = subprocess.run([*commands[0].split(), "--set", "train.max_steps=20"], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "setup: pip install -r requirements.txt into .venv ..." in demo.stderr  # the install says what it does
    assert re.search(r"setup: \.venv ready \(\d+ s, [\d.]+G\)", demo.stderr), demo.stderr[-2000:]
    run_dir = clone / "runs" / "local-demo"
    assert f"run directory: {run_dir}" in demo.stdout

    report = subprocess.run(commands[1].split(), cwd=clone, env=env, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert report.stderr.startswith("report: no plots: matplotlib is not installed")
    text = (run_dir / "report.md").read_text()
    assert "| Status | succeeded |" in text and "**CPU run**" in text and "no plots: matplotlib" in text
    # What the third command shows (TensorBoard itself is not in this environment: read here with the test's).
    assert_tensorboard_matches_metrics(run_dir / "tensorboard", run_record.read_metrics(str(run_dir)))
