"""Where a benchmark's figures go: one JSON file, and beside it the plot drawn from the same results."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def write_report(stem: Path, results: dict, plot: Callable[[dict, Path], None] | None = None) -> None:
    """Write `results` to stem.json and, given `plot`, the figure to stem.png; say what was written."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    if plot is None:
        print(f"wrote {stem}.json")
        return
    plot(results, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and {stem}.png")
