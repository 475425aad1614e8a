"""The job package's import graph: no circle, and imports point one way between its folders
(docs/architecture.md). Every import of a job module counts, wherever it stands (a function body, an
`if TYPE_CHECKING:` block): a function-local import is no way around a circle. The floors under the workers import
neither torch nor transformers, and a job module is imported inside a function only to keep a process's start
short, saying so."""

import ast
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).resolve().parent.parent / "job"

LAYERS = {"job.driver": 5, "job.worker": 4, "job.commands": 3, "job.records": 2, "job.common": 1}
"""A module may import its own folder and the folders below it; the shared modules (`job.config`, `job.storage`,
`job.packages`, `job.signals`, `job` itself) are layer 0, and the command line (`job.__main__`) is above all."""


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = JOB) -> dict[str, set[str]]:
    """Module -> the job modules it imports (a `from package import name` names the module `package.name` when
    there is one, else the package)."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    edges.add(target if target in modules else base)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph`, as the modules along it, or None."""
    state = {}  # module -> "open" while on the path, "done" after

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target] if target in path else [module, target]
            if target not in state and (found := visit(target, path + [target])):
                return found
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module, [module])):
            return found
    return None


def layer(module: str) -> int:
    if module == "job.__main__":
        return len(LAYERS) + 1
    return next((n for prefix, n in LAYERS.items() if module == prefix or module.startswith(prefix + ".")), 0)


def test_the_job_package_has_no_import_circle():
    found = cycle(import_graph())
    assert found is None, "import circle: " + " -> ".join(found)


def test_imports_point_down_the_layers():
    upward = sorted(f"{module} imports {target}" for module, targets in import_graph().items() for target in targets
                    if layer(target) > layer(module))
    assert not upward, "imports against the layers (driver > worker > records > shared): " + "; ".join(upward)


def test_the_graph_sees_function_local_and_type_checking_imports(tmp_path):
    package = tmp_path / "job"
    (package / "inner").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "inner" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .inner import b\n")
    (package / "inner" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import c\n")
    (package / "c.py").write_text("def f():\n    from . import a\n")
    graph = import_graph(package)
    assert graph["job.a"] == {"job.inner.b"} and graph["job.inner.b"] == {"job.c"} and graph["job.c"] == {"job.a"}
    assert cycle(graph) == ["job.a", "job.inner.b", "job.c", "job.a"]


def test_the_floors_under_the_workers_import_no_torch():
    """What the command line's readers and the driver's checks import stays light: `python -m job runs` starts in
    well under a second, and the driver checks a run before it imports what training needs."""
    light = sorted(m for m in import_graph() if layer(m) <= LAYERS["job.commands"])
    code = ("import sys\n" + "".join(f"import {m}\n" for m in light)
            + "print(' '.join(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=JOB.parent, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing {', '.join(light)} imports {out.stdout.strip()}"


def test_a_job_module_is_imported_in_a_function_only_to_keep_a_start_short():
    """Such an import is the one way a module reaches a heavier one late; each says why on its line."""
    unexplained = []
    for path in JOB.rglob("*.py"):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.ImportFrom) and (inner.level or (inner.module or "").startswith("job")):
                        line = lines[inner.lineno - 1]
                        if "start" not in line.partition("#")[2]:
                            unexplained.append(f"{path.relative_to(JOB.parent)}:{inner.lineno}: {line.strip()}")
    assert not unexplained, "function-local imports of job modules that do not say why: " + "; ".join(unexplained)
