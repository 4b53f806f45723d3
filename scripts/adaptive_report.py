"""Summarise a bench result: per group, the adaptive schedule against the best fixed γ and
against Hugging Face's +2/-1 schedule, for each drafter with DRAFT@N, DRAFT@auto, DRAFT@hf.

    python scripts/adaptive_report.py bench-out/main/result.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(path: str) -> None:
    result = json.load(open(path))
    methods = result["methods"]
    drafters: dict[str, dict[str, str]] = defaultdict(dict)
    for name in methods:
        draft, _, gamma = name.partition("@")
        if gamma and not draft.startswith("hf-"):
            drafters[draft][gamma] = name
    groups = list(methods["ar"]["per_group"])
    for draft, by_gamma in drafters.items():
        fixed = [n for g, n in by_gamma.items() if g.isdigit()]
        print(f"\n{draft}: group, best fixed (speedup), auto, auto/best, hf, auto/hf")
        for group in [*groups, "ALL"]:
            def speed(name: str) -> float:
                m = methods[name]
                return m["speedup"] if group == "ALL" else m["per_group"][group]["speedup"]
            best = max(fixed, key=speed)
            auto, hf = by_gamma.get("auto"), by_gamma.get("hf")
            row = f"  {group:28s} {best:10s} {speed(best):5.2f}x"
            if auto:
                row += f"  auto {speed(auto):5.2f}x  {speed(auto) / speed(best):5.2f}"
            if hf:
                row += f"  hf {speed(hf):5.2f}x"
                if auto:
                    row += f"  {speed(auto) / speed(hf):5.2f}"
            print(row)


if __name__ == "__main__":
    main(sys.argv[1])
