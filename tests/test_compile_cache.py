"""The compilation cache on the runs' storage: a fresh process (empty local caches) loads what another compiled
and compiles nothing again; a damaged file costs a compilation, never the run."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROGRAM = """
import json, sys
import torch
from torch._dynamo.utils import counters
from job.worker import compile_cache

uri, mode = sys.argv[1], sys.argv[2]
state = compile_cache.load(uri) if mode == "load" else None
model = torch.compile(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)))
model(torch.randn(8, 16)).sum().backward()
written = compile_cache.save(uri) if mode == "save" else None
print(json.dumps({"state": state, "written": written, "hits": counters["inductor"]["fxgraph_cache_hit"],
                  "misses": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def _run(uri: str, mode: str, local_cache: Path) -> dict:
    env = {"PATH": "/usr/bin:/bin", "TORCHINDUCTOR_CACHE_DIR": str(local_cache), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", PROGRAM, uri, mode], env=env, capture_output=True, text=True,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_fresh_process_loads_the_compiled_code_and_a_damaged_file_only_costs_a_compilation(tmp_path):
    uri = str(tmp_path / "storage" / ".compile_cache" / "key.bin")
    first = _run(uri, "save", tmp_path / "local-1")
    assert first["written"] > 0 and first["misses"] >= 2 and first["hits"] == 0  # forward and backward graphs
    second = _run(uri, "load", tmp_path / "local-2")  # another pod: nothing in its local cache
    assert second["state"]["loaded"] and second["state"]["artifacts"] > 0
    assert second["misses"] == 0 and second["hits"] == first["misses"]

    Path(uri).write_bytes(b"not a cache")
    damaged = _run(uri, "load", tmp_path / "local-3")
    assert not damaged["state"]["loaded"] and damaged["state"]["error"]
    assert damaged["misses"] == first["misses"]
