"""Schedules by group: adaptive γ against the best fixed γ and the heuristic (schedule_report)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from specmtp.report import render_markdown
from specmtp.schedule_report import OVERALL, schedule_rows, schedule_summary


def method(speedup: float, **groups: float) -> dict[str, Any]:
    return {"speedup": speedup, "per_group": {g: {"speedup": s} for g, s in groups.items()}}


METHODS = {
    "ar": method(1.0, code=1.0, chat=1.0),
    "ngram@1": method(1.20, code=1.50, chat=1.00),
    "ngram@3": method(1.25, code=1.80, chat=0.90),
    "ngram@auto": method(1.24, code=1.75, chat=0.93),
    "ngram@hf": method(1.10, code=1.80, chat=0.85),
    "mtp@2": method(1.05, code=1.10, chat=1.00),
    "mtp@auto": method(1.08, code=1.00, chat=1.02),  # no heuristic run for mtp
    "ngram+mtp@3": method(1.30, code=1.70, chat=1.00),
    "ngram+mtp@3/1": method(1.40, code=1.60, chat=1.20),  # a γ pair is a fixed schedule
    "ngram+mtp@auto": method(1.38, code=1.65, chat=1.19),
    "default@auto": method(0.9, code=0.9, chat=0.9),  # no fixed γ: nothing to compare
    "hf-assisted:default@4": method(0.8, code=0.8, chat=0.8),
}


def test_rows_pick_the_fastest_fixed_gamma_per_group() -> None:
    rows = {(r.drafter, r.group): r for r in schedule_rows(METHODS)}
    drafters = ("ngram", "mtp", "ngram+mtp")
    assert set(rows) == {(d, g) for d in drafters for g in (OVERALL, "code", "chat")}
    assert rows[("ngram+mtp", "code")].best_fixed == "ngram+mtp@3"
    assert rows[("ngram+mtp", "chat")].best_fixed == "ngram+mtp@3/1"
    code, chat = rows[("ngram", "code")], rows[("ngram", "chat")]
    assert (code.best_fixed, code.best_fixed_speedup) == ("ngram@3", 1.80)
    assert (chat.best_fixed, chat.best_fixed_speedup) == ("ngram@1", 1.00)
    assert code.auto_vs_best == pytest.approx(1.75 / 1.80)
    assert code.auto_vs_hf == pytest.approx(1.75 / 1.80)
    assert chat.auto_vs_hf == pytest.approx(0.93 / 0.85)
    assert rows[("ngram", OVERALL)].best_fixed == "ngram@3"
    assert rows[("mtp", "code")].hf_speedup is None and rows[("mtp", "code")].auto_vs_hf is None


def test_best_counts_as_fixed_by_its_recorded_schedule() -> None:
    """`DRAFT@best` is the tuning profile's fixed γ (or pair): the result says so."""
    best = method(1.45, code=1.62, chat=1.30) | {"schedule": "fixed:2/2"}
    rows = {(r.drafter, r.group): r for r in schedule_rows({**METHODS, "ngram+mtp@best": best})}
    assert rows[("ngram+mtp", "chat")].best_fixed == "ngram+mtp@best"
    assert rows[("ngram+mtp", "code")].best_fixed == "ngram+mtp@3"  # still the fastest there
    adaptive = method(1.2, code=1.2, chat=1.2) | {"schedule": "adaptive"}
    rows = {(r.drafter, r.group): r for r in schedule_rows({**METHODS, "ngram@best": adaptive})}
    assert rows[("ngram", OVERALL)].best_fixed == "ngram@3"  # not fixed: not a candidate


def test_summary_counts_groups() -> None:
    # ngram: code 0.972 (within), chat 0.93 (not); vs heuristic: code 0.97 (slower), chat faster
    # mtp: code 1.00 / 1.10 = 0.91 (not), chat 1.02 (within)
    assert schedule_summary(schedule_rows(METHODS)) == [
        "ngram: adaptive within 5% of the best fixed γ in 1/2 groups, "
        "at least as fast as the heuristic in 1/2",
        "mtp: adaptive within 5% of the best fixed γ in 1/2 groups",
        # ngram+mtp: code 1.65 / 1.70 = 0.97, chat 1.19 / 1.20 = 0.99: both within
        "ngram+mtp: adaptive within 5% of the best fixed γ in 2/2 groups",
    ]


def test_missing_numbers_skip_a_group() -> None:
    methods = {**METHODS, "ngram@auto": {"speedup": None, "per_group": {"code": {"speedup": 1.7}}}}
    groups = [r.group for r in schedule_rows(methods) if r.drafter == "ngram"]
    assert groups == ["code"]


def test_report_section() -> None:
    text = render_markdown({"config": {}, "methods": METHODS})
    assert "## Schedules by group" in text
    assert "- ngram: adaptive within 5% of the best fixed γ in 1/2 groups" in text
    rows = [re.split(r"\s*\|\s*", line.strip("| ")) for line in text.splitlines()]
    assert ["ngram", "code", "ngram@3", "1.80x", "1.75x", "0.97", "1.80x", "0.97"] in rows
    only_fixed = {"ar": METHODS["ar"], "ngram@1": METHODS["ngram@1"]}
    assert "Schedules by group" not in render_markdown({"config": {}, "methods": only_fixed})
