"""What the seed-spread benchmarks (algorithms.py, quickstart_recipes.py) write at the end."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(out: str | Path, results: list[dict], heading: str, table: str) -> str:
    """Write ``OUT/results.json`` and ``OUT/table.md`` (the heading, then the table); return and print the text."""
    out = Path(out)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = f"{heading}\n\n{table}\n"
    (out / "table.md").write_text(text)
    print(text)
    return text
