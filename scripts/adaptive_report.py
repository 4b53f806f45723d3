"""Summarise a saved bench result: per group, the adaptive schedule against the best fixed γ
and against Hugging Face's +2/-1 schedule, for each drafter benchmarked as DRAFT@N,
DRAFT@auto and DRAFT@hf (the report's "Schedules by group" section, from specmtp's
schedule_report, for results written before the report had it).

    python scripts/adaptive_report.py bench-out/main/result.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specmtp.report_values import methods_of
from specmtp.schedule_report import schedule_rows, schedule_summary


def main(path: str) -> None:
    rows = schedule_rows(methods_of(json.loads(Path(path).read_text())))
    print("drafter, group, best fixed (speedup), adaptive, adaptive/best, hf, adaptive/hf")
    for r in rows:
        hf = "-" if r.hf_speedup is None else f"{r.hf_speedup:5.2f}x {r.auto_vs_hf:5.2f}"
        print(f"{r.drafter:8s} {r.group:28s} {r.best_fixed:10s} {r.best_fixed_speedup:5.2f}x"
              f"  {r.auto_speedup:5.2f}x {r.auto_vs_best:5.2f}  {hf}")  # fmt: skip
    print("\n".join(schedule_summary(rows)))


if __name__ == "__main__":
    main(sys.argv[1])
