"""Summarise a bench result: per group, the adaptive schedule against the best fixed γ and
against Hugging Face's +2/-1 schedule, for each drafter benchmarked as DRAFT@N, DRAFT@auto
and DRAFT@hf.

    python scripts/adaptive_report.py bench-out/main/result.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def speedup(method: dict[str, Any], group: str) -> float:
    return method["speedup"] if group == "ALL" else method["per_group"][group]["speedup"]


def report(result: dict[str, Any]) -> list[str]:
    methods = result["methods"]
    drafters: dict[str, dict[str, str]] = defaultdict(dict)
    for name in methods:
        draft, _, gamma = name.partition("@")
        if gamma and not draft.startswith("hf-"):
            drafters[draft][gamma] = name
    lines = []
    for draft, by_gamma in drafters.items():
        fixed = [name for gamma, name in by_gamma.items() if gamma.isdigit()]
        auto, hf = by_gamma.get("auto"), by_gamma.get("hf")
        lines.append(f"\n{draft}: group, best fixed (speedup), auto, auto/best, hf, auto/hf")
        for group in [*methods["ar"]["per_group"], "ALL"]:
            best = max(fixed, key=lambda name, g=group: speedup(methods[name], g))
            top = speedup(methods[best], group)
            row = f"  {group:28s} {best:10s} {top:5.2f}x"
            if auto:
                adaptive = speedup(methods[auto], group)
                row += f"  auto {adaptive:5.2f}x  {adaptive / top:5.2f}"
            if hf:
                heuristic = speedup(methods[hf], group)
                row += f"  hf {heuristic:5.2f}x"
                if auto:
                    row += f"  {adaptive / heuristic:5.2f}"
            lines.append(row)
    return lines


if __name__ == "__main__":
    print("\n".join(report(json.loads(Path(sys.argv[1]).read_text()))))
