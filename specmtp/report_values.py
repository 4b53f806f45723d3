"""Reading the bench's JSON result and tune profiles safely, for the report and its plots:
every value goes through these, so nulls, NaNs and stray types mean "no data", never a crash."""

from __future__ import annotations

import math
from typing import Any

MIB = float(1 << 20)
GAMMA, ALPHA, TAU = (
    "\N{GREEK SMALL LETTER GAMMA}",
    "\N{GREEK SMALL LETTER ALPHA}",
    "\N{GREEK SMALL LETTER TAU}",
)
TIME_PARTS = (("draft_s", "draft", "C1"), ("verify_s", "verify", "C0"), ("other_s", "other", "C7"))


def num(value: Any) -> float | None:
    """A finite number as a float, else None: null, NaN and stray types all mean 'no data'."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def scaled(value: Any, factor: float) -> float | None:
    x = num(value)
    return None if x is None else x * factor


def methods_of(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: as_dict(m) for name, m in as_dict(result.get("methods")).items()}


def groups_of(methods: dict[str, dict[str, Any]]) -> list[str]:
    """Every group any method reports, in first-seen order."""
    seen: dict[str, None] = {}
    for m in methods.values():
        seen.update(dict.fromkeys(as_dict(m.get("per_group"))))
    return list(seen)


def group_field(m: dict[str, Any], group: str, key: str) -> Any:
    return as_dict(as_dict(m.get("per_group")).get(group)).get(key)
