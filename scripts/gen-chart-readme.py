#!/usr/bin/env python3
"""Regenerate docs/values.md, the chart's values reference, from the `# --` comments of values.yaml.

The table is helm-docs' (Key | Type | Default | Description; a `# @default -- text` line replaces the default
shown), in values.yaml order, so the comments stay the one place values are documented. docs/ stays in the
repository, not in the chart package (.helmignore).

Usage (repo root):  python3 scripts/gen-chart-readme.py           rewrite docs/values.md
                    python3 scripts/gen-chart-readme.py --check   exit 1 if it is out of date
"""

import json
import pathlib
import re
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
VALUES_PATH = ROOT / "values.yaml"
OUTPUT_PATH = ROOT / "docs" / "values.md"
KEY = re.compile(r"^(\s*)([A-Za-z][\w-]*):")


def documented_keys(text: str):
    """(dotted key, description, @default text or None) of every key with a `# --` comment, in file order."""
    lines = text.splitlines()
    parents = []  # (indent, key) enclosing the current line
    for i, line in enumerate(lines):
        match = KEY.match(line)
        if not match:
            continue
        indent, key = len(match.group(1)), match.group(2)
        while parents and parents[-1][0] >= indent:
            parents.pop()
        path = ".".join([p for _, p in parents] + [key])
        parents.append((indent, key))
        comment = []
        for above in reversed(lines[:i]):
            if not above.strip().startswith("#"):
                break
            comment.insert(0, above.strip().lstrip("#").strip())
        starts = [j for j, c in enumerate(comment) if c.startswith("--")]
        if not starts:
            continue
        block = comment[starts[-1]:]
        default = next((c.split("--", 1)[1].strip() for c in block if c.startswith("@default --")), None)
        description = " ".join(c for c in block if not c.startswith("@default")).removeprefix("--").strip()
        yield path, description, default


def type_name(value) -> str:
    for kind, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "string"), (list, "list"), (dict, "object")):
        if isinstance(value, kind):
            return name
    return "string"  # null


def table(text: str) -> str:
    values = yaml.safe_load(text)
    rows = ["| Key | Type | Default | Description |", "|-----|------|---------|-------------|"]
    for path, description, default in documented_keys(text):
        value = values
        for part in path.split("."):
            value = value[part]
        shown = default if default is not None else f"`{json.dumps(value)}`"
        rows.append(f"| {path} | {type_name(value)} | {shown.replace('|', chr(92) + '|')} | {description.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)


def rendered() -> str:
    return (
        "# ray-finetune values\n\n"
        "Generated from the `# --` comments of `values.yaml` by `scripts/gen-chart-readme.py` (helm-docs format);\n"
        "do not edit. Design and examples: [chart.md](chart.md).\n\n" + table(VALUES_PATH.read_text()) + "\n"
    )


def main() -> int:
    wanted = rendered()
    if "--check" in sys.argv[1:]:
        if not OUTPUT_PATH.exists() or OUTPUT_PATH.read_text() != wanted:
            print("docs/values.md is out of date with values.yaml: run scripts/gen-chart-readme.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT_PATH.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
