"""The docs' references resolve: every raw file they cite under `bench/runs/` exists, `bench/runs/` holds nothing they
do not cite (older runs' files live in git history), and every relative Markdown link points at a file."""

import itertools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "bench" / "runs"
DOCS = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# `bench/runs/NAME` with `*` and `{a,b}` patterns; `COMMIT:bench/runs/...` (a file in git history) is not a citation.
CITED = re.compile(r"(?<![:\w])bench/runs/([^\s`'\"()\[\]<>]+)")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def expand_braces(pattern: str) -> list[str]:
    """`a{1,2}b{x,y}` → `a1bx a1by a2bx a2by`, as a shell expands it."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
    return ["".join(combination) for combination in itertools.product(*choices)]


def citations() -> list[tuple[str, str]]:
    """(doc, pattern) for every `bench/runs/` file pattern the docs cite."""
    return [(doc.relative_to(REPO).as_posix(), match.group(1).rstrip(".,;:"))
            for doc in DOCS for match in CITED.finditer(doc.read_text())
            if match.group(1).rstrip(".,;:")]


def test_every_cited_raw_file_exists():
    missing = [f"{doc}: bench/runs/{pattern}" for doc, pattern in citations()
               if not all(any(RUNS.glob(name)) for name in expand_braces(pattern))]
    assert citations() and not missing, f"cited but not in bench/runs/: {missing}"


def test_bench_runs_holds_only_cited_files():
    cited = {path for _, pattern in citations() for name in expand_braces(pattern) for path in RUNS.glob(name)}
    uncited = sorted(path.name for path in RUNS.iterdir() if path not in cited)
    assert not uncited, f"in bench/runs/ but cited by no doc (cite it, or leave it to git history): {uncited}"


def test_every_relative_markdown_link_resolves():
    broken = [f"{doc.relative_to(REPO)}: {target}" for doc in DOCS for target in LINK.findall(doc.read_text())
              if "://" not in target and not target.startswith("mailto:") and not (doc.parent / target).exists()]
    assert not broken, f"links to missing files: {broken}"


CODE_PATH = re.compile(r"(?<![\w/.-])((?:job|scripts|templates|bench|tests|examples|values)/[\w./-]*\w)")
"""A repository path the docs cite: `job/records/run_record.py`, `scripts/gen-values-schema.py`, `examples/`."""
JOB_PATH = re.compile(r"(?<![\w/.-])((?:worker|records|driver|common|commands)/[\w/]*\w\.py)")
"""A module cited by its path in the package: `worker/metrics.py`."""


def test_every_cited_repository_path_exists():
    """A moved or renamed module leaves no doc pointing at where it was."""
    missing = sorted({f"{doc.relative_to(REPO)}: {path}" for doc in DOCS for path in CODE_PATH.findall(doc.read_text())
                      if not path.startswith("bench/runs/") and not (REPO / path).exists()}
                     | {f"{doc.relative_to(REPO)}: {path}" for doc in DOCS for path in JOB_PATH.findall(doc.read_text())
                        if not (REPO / "job" / path).exists()})
    assert not missing, f"cited but not in the repository: {missing}"
