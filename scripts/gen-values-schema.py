#!/usr/bin/env python3
"""Regenerate `properties.run` of values.schema.json from the job's own config schema.

The chart's `run:` values are the job's run config, so their schema is `job.config.json_schema()`, never
written by hand. The rest of values.schema.json (the chart's own values) is maintained by hand.

Usage (repo root):  .venv/bin/python scripts/gen-values-schema.py           rewrite values.schema.json
                    .venv/bin/python scripts/gen-values-schema.py --check   exit 1 if it is out of date
"""

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from job.config import json_schema  # noqa: E402

SCHEMA_PATH = ROOT / "values.schema.json"


def regenerated(text: str) -> str:
    schema = json.loads(text)
    schema["properties"]["run"] = json_schema()
    return json.dumps(schema, indent=2) + "\n"


def main() -> int:
    current = SCHEMA_PATH.read_text()
    wanted = regenerated(current)
    if "--check" in sys.argv[1:]:
        if current != wanted:
            print("values.schema.json: properties.run differs from job.config.json_schema(); "
                  "run scripts/gen-values-schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA_PATH.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
