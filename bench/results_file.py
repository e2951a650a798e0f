"""Where every benchmark leaves its figures: bench/results/NAME.json, and stdout."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def write_results(name: str, results: dict) -> None:
    out = Path(__file__).parent / "results" / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    json.dump(results, sys.stdout, indent=2)
    print()
