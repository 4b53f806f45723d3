"""Schedules compared per group: adaptive γ against the best fixed γ and Hugging Face's
heuristic, from a bench result (issue 5's claims, checked group by group).

For every drafter the bench ran at several schedules (`ngram@1`, `ngram@2`, `ngram@auto`,
`ngram@hf`, ...), and for every group of prompts and overall: the fastest fixed γ, the
adaptive schedule's speedup as a fraction of it, and as a fraction of the heuristic's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specmtp.report_values import group_field, groups_of, num

OVERALL = "all prompts"
WITHIN = 0.95  # "within 5% of the best fixed γ"


@dataclass(frozen=True)
class ScheduleRow:
    drafter: str
    group: str
    best_fixed: str  # the method name of the fastest fixed γ
    best_fixed_speedup: float
    auto_speedup: float
    hf_speedup: float | None

    @property
    def auto_vs_best(self) -> float:
        return self.auto_speedup / self.best_fixed_speedup

    @property
    def auto_vs_hf(self) -> float | None:
        return None if self.hf_speedup is None else self.auto_speedup / self.hf_speedup


def _is_fixed(schedule: str) -> bool:
    """N, or N/M (lookup and model rounds of an ngram+SPEC drafter)."""
    return all(part.isdigit() for part in schedule.split("/", 1))


def _families(methods: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    """drafter -> {schedule: method name}, for drafters with an adaptive run and a fixed one."""
    families: dict[str, dict[str, str]] = {}
    for name in methods:
        drafter, at, schedule = name.rpartition("@")
        if at and not drafter.startswith("hf-"):
            families.setdefault(drafter, {})[schedule] = name
    return {d: runs for d, runs in families.items() if "auto" in runs and any(map(_is_fixed, runs))}


def _speedup(m: dict[str, Any], group: str) -> float | None:
    return num(m.get("speedup")) if group == OVERALL else num(group_field(m, group, "speedup"))


def schedule_rows(methods: dict[str, dict[str, Any]]) -> list[ScheduleRow]:
    rows = []
    for drafter, runs in _families(methods).items():
        fixed = [
            name
            for schedule, name in runs.items()
            # `best` runs the tuning profile's fixed γ (or pair); the result records which
            if _is_fixed(schedule) or str(methods[name].get("schedule", "")).startswith("fixed")
        ]
        for group in [OVERALL, *groups_of(methods)]:
            speeds = {name: _speedup(methods[name], group) for name in fixed}
            known = {name: s for name, s in speeds.items() if s}
            auto = _speedup(methods[runs["auto"]], group)
            if not known or not auto:
                continue
            best = max(known, key=known.__getitem__)
            hf = _speedup(methods[runs["hf"]], group) if "hf" in runs else None
            rows.append(ScheduleRow(drafter, group, best, known[best], auto, hf or None))
    return rows


def schedule_summary(rows: list[ScheduleRow]) -> list[str]:
    """Per drafter: in how many groups adaptive is within 5% of the best fixed γ, and at
    least as fast as the heuristic."""
    lines = []
    for drafter in dict.fromkeys(r.drafter for r in rows):
        groups = [r for r in rows if r.drafter == drafter and r.group != OVERALL]
        within = sum(r.auto_vs_best >= WITHIN for r in groups)
        versus = [r for r in groups if r.auto_vs_hf is not None]
        faster = sum(r.auto_vs_hf >= 1.0 for r in versus if r.auto_vs_hf is not None)
        line = f"{drafter}: adaptive within 5% of the best fixed γ in {within}/{len(groups)} groups"
        if versus:
            line += f", at least as fast as the heuristic in {faster}/{len(versus)}"
        lines.append(line)
    return lines
