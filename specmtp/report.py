"""Bench and tune reports: Markdown tables, PNG plots and the raw JSON, from plain dicts.

The inputs are the bench's JSON result and the tune profile rather than live objects, so a
report can be rendered again from a saved `result.json`. Only `methods` and `config` are
required: any other section may be missing or empty and any number may be null. A null
prints as "-" in tables and is skipped in plots; a table or plot with no data is left out.

The plots are in plots.py; the safe readers of the dicts in report_values.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from specmtp.plots import write_plots
from specmtp.report_values import (
    GAMMA,
    MIB,
    TAU,
    TIME_PARTS,
    as_dict,
    as_list,
    group_field,
    groups_of,
    methods_of,
    num,
    scaled,
)  # fmt: skip
from specmtp.schedule_report import schedule_rows, schedule_summary

# Used when the bench's config does not carry its own definition under the same key.
DEFINITIONS = {
    "speedup": "tokens/s of the method / tokens/s of the baseline, both measured in this run",
    "mean_accepted_tokens": "tokens committed per target verify round (the baseline has 1)",
    "efficiency": "accepted draft tokens / drafted tokens",
    "predicted_speedup": "the speedup the cost model T(n) predicts from the measured acceptance",
}


def times(value: Any) -> str | None:
    x = num(value)
    return None if x is None else f"{x:.2f}x"


def fixed(value: Any) -> str | None:
    x = num(value)
    return None if x is None else f"{x:.2f}"


# ---- Markdown


def _format_float(x: float) -> str:
    if math.isnan(x):
        return "-"
    if x == 0 or math.isinf(x):
        return "0" if x == 0 else str(x)
    size = abs(x)
    if size >= 1000:
        return f"{x:.0f}"
    if size >= 100:
        return f"{x:.1f}"
    if size >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}" if size >= 0.01 else f"{x:.2e}"


def format_cell(value: Any) -> str:
    """One table cell: None is "-", floats get digits by size, text has `|` escaped."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return _format_float(value)
    # a raw `|` would end the cell, a newline the row
    return str(value).replace("|", "\\|").replace("\n", " ")


def _looks_numeric(cell: str) -> bool:
    """A formatted number such as "12", "-0.5", "1.23x" or "1.23x (2.46)"; "-" is no data."""
    return cell == "-" or cell.lstrip("+-")[:1].isdigit()


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table, padded to line up as plain text; a column of numbers (past
    the first, which names the row) is right-aligned so that digits line up."""
    cells = [[format_cell(c) for c in header]]
    for i, row in enumerate(rows):
        if len(row) != len(header):
            raise ValueError(f"row {i} has {len(row)} cells, the header {len(header)}")
        cells.append([format_cell(c) for c in row])
    columns = list(zip(*cells, strict=True))
    widths = [max(3, *map(len, column)) for column in columns]
    right = [j > 0 and all(map(_looks_numeric, column[1:])) for j, column in enumerate(columns)]
    rule = ["-" * (w - 1) + (":" if r else "-") for w, r in zip(widths, right, strict=True)]
    lines = []
    for row in [cells[0], rule, *cells[1:]]:
        padded = [
            c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right, strict=True)
        ]
        lines.append("| " + " | ".join(padded) + " |")
    return "\n".join(lines)


def _table(header: Sequence[str], rows: list[list[Any]], *, labels: int = 1) -> str:
    """The table, or "" when no row has a value past its first `labels` columns."""
    if not any(cell is not None for row in rows for cell in row[labels:]):
        return ""
    return markdown_table(header, rows)


def _section(title: str, table: str, image: str | None = None, note: str = "") -> str:
    """A `## title` section, or "" when it has neither a table nor an image (a note alone
    says nothing)."""
    if not table and not image:
        return ""
    parts = [p for p in (table, note, image and f"![{title}]({image})") if p]
    return f"## {title}\n\n" + "\n\n".join(parts)


def _config_value(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return ", ".join(str(v) for v in value) or None
    if isinstance(value, dict):
        return json.dumps(value, default=str)
    # str() keeps a setting as given (0.7, not the table's 0.700)
    return None if value is None else str(value)


def _definitions(config: dict[str, Any], baseline: str) -> str:
    def define(key: str) -> str:
        given = config.get(key)
        return given if isinstance(given, str) and given else DEFINITIONS[key]

    return (
        f"**Definitions.** Baseline: `{baseline}` (plain decoding). "
        f"*speedup* = {define('speedup')}. *{TAU}* (mean accepted tokens) = "
        f"{define('mean_accepted_tokens')}. *efficiency* = {define('efficiency')}. "
        f"*predicted* = {define('predicted_speedup')}. *mismatches* = prompts whose greedy "
        f'output differs from `{baseline}`\'s (must be 0; "-" when sampling).'
    )


def _mismatch_note(methods: dict[str, dict[str, Any]]) -> str:
    bad = [
        f"{n} ({m['greedy_mismatches']})"
        for n, m in methods.items()
        if (num(m.get("greedy_mismatches")) or 0) > 0
    ]
    return (
        f"> **Warning:** greedy outputs differ from the baseline: {', '.join(bad)}." if bad else ""
    )


def _main_table(methods: dict[str, dict[str, Any]]) -> str:
    header = ["method", "schedule", "prompts", "new tokens", "latency s", "tokens/s"]
    header += ["speedup", TAU, "mismatches", "efficiency", "predicted"]
    rows = []
    for name, m in methods.items():
        runs = m.get("per_prompt")
        rows.append([name, m.get("schedule"), len(runs) if isinstance(runs, list) else None])
        rows[-1] += [m.get("new_tokens"), num(m.get("latency_s")), num(m.get("tokens_per_s"))]
        rows[-1] += [times(m.get("speedup")), fixed(m.get("mean_accepted_tokens"))]
        rows[-1] += [m.get("greedy_mismatches"), fixed(m.get("efficiency"))]
        rows[-1] += [times(m.get("predicted_speedup"))]
    # the method list itself is worth a table even when every number is null
    return _table(header, rows, labels=0)


def _timing_table(methods: dict[str, dict[str, Any]]) -> str:
    header = ["method", "TTFT ms", "TPOT ms", *(f"{label} s" for _, label, _ in TIME_PARTS)]
    rows = [
        [n, scaled(m.get("ttft_s"), 1e3), scaled(m.get("tpot_s"), 1e3)]
        + [num(m.get(key)) for key, _, _ in TIME_PARTS]
        for n, m in methods.items()
    ]
    return _table(header, rows)


def _memory_table(methods: dict[str, dict[str, Any]]) -> str:
    rows = [
        [n, scaled(m.get("peak_rss_bytes"), 1 / MIB), scaled(m.get("kv_cache_bytes"), 1 / MIB)]
        for n, m in methods.items()
    ]
    return _table(["method", "peak RSS MiB", "KV-cache MiB"], rows)


def _acceptance_table(methods: dict[str, dict[str, Any]]) -> str:
    series = {
        n: [num(a) for a in as_list(m.get("acceptance_per_position"))] for n, m in methods.items()
    }
    series = {n: s for n, s in series.items() if any(a is not None for a in s)}
    depth = max((len(s) for s in series.values()), default=0)
    rows = [[n, *s, *[None] * (depth - len(s))] for n, s in series.items()]
    return _table(["method", *(f"position {i + 1}" for i in range(depth))], rows)


def _speedup_tau(m: dict[str, Any], group: str) -> str | None:
    speedup = times(group_field(m, group, "speedup"))
    tau = fixed(group_field(m, group, "mean_accepted_tokens"))
    return f"{speedup} ({tau})" if speedup and tau else speedup


def _group_table(methods: dict[str, dict[str, Any]]) -> str:
    if not methods:
        return ""
    baseline, *drafts = methods
    rows = []
    for g in groups_of(methods):
        counts = [group_field(m, g, "num_prompts") for m in methods.values()]
        prompts = next((c for c in counts if c is not None), None)
        tokens_per_s = num(group_field(methods[baseline], g, "tokens_per_s"))
        rows.append([g, prompts, tokens_per_s, *(_speedup_tau(methods[n], g) for n in drafts)])
    header = ["group", "prompts", f"{baseline} tokens/s", *(f"{n} speedup ({TAU})" for n in drafts)]
    return _table(header, rows, labels=2)


def _schedule_table(methods: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """Adaptive γ against the best fixed γ and the heuristic, per group; and the counts."""
    rows = schedule_rows(methods)
    header = ["drafter", "group", f"best fixed {GAMMA}", "its speedup", "adaptive"]
    header += ["adaptive / best", "heuristic", "adaptive / heuristic"]
    table = [
        [r.drafter, r.group, r.best_fixed, times(r.best_fixed_speedup), times(r.auto_speedup),
         fixed(r.auto_vs_best), times(r.hf_speedup), fixed(r.auto_vs_hf)]
        for r in rows
    ]  # fmt: skip
    note = "\n".join(f"- {line}" for line in schedule_summary(rows))
    return _table(header, table, labels=3), note


def _temperature_table(result: dict[str, Any]) -> str:
    header = ["temperature", "method", "tokens/s", "speedup", TAU, "efficiency", "mismatches"]
    rows = []
    for t, per_method in as_dict(result.get("by_temperature")).items():
        for name, raw in as_dict(per_method).items():
            m = as_dict(raw)
            rows.append([str(t), name, num(m.get("tokens_per_s")), times(m.get("speedup"))])
            rows[-1] += [fixed(m.get("mean_accepted_tokens")), fixed(m.get("efficiency"))]
            rows[-1] += [m.get("greedy_mismatches")]
    return _table(header, rows, labels=2)


def _context_table(result: dict[str, Any]) -> str:
    header = ["context tokens", "prompt tokens", "method", "tokens/s", "speedup", "TTFT ms"]
    header += ["KV-cache MiB", "peak RSS MiB", TAU]
    rows = []
    for point in map(as_dict, as_list(result.get("context_sweep"))):
        for name, raw in as_dict(point.get("methods")).items():
            m = as_dict(raw)
            rows.append([point.get("context_tokens"), point.get("prompt_tokens"), name])
            rows[-1] += [num(m.get("tokens_per_s")), times(m.get("speedup"))]
            rows[-1] += [scaled(m.get("ttft_s"), 1e3), scaled(m.get("kv_cache_bytes"), 1 / MIB)]
            rows[-1] += [scaled(m.get("peak_rss_bytes"), 1 / MIB)]
            rows[-1] += [fixed(m.get("mean_accepted_tokens"))]
    return _table(header, rows, labels=3)


def _gamma_table(result: dict[str, Any]) -> str:
    """One row per sweep point; a tree profile's points are node budgets (its γ is the
    tree's depth), so tree sweeps add a "tree nodes" column."""
    raw = as_dict(result.get("gamma_sweep"))
    sweeps = {name: [as_dict(p) for p in as_list(points)] for name, points in raw.items()}
    trees = any("budget" in p for points in sweeps.values() for p in points)
    rows = []
    for name, points in sweeps.items():
        for p in points:
            speedups = [times(p.get(f"{key}_speedup")) for key in ("predicted", "measured")]
            budget = [p.get("budget")] if trees else []
            rows.append([name, *budget, p.get("gamma"), *speedups])
    header = ["method", *(["tree nodes"] if trees else []), GAMMA, "predicted", "measured"]
    return _table(header, rows, labels=len(header) - 2)


def _cost_table(result: dict[str, Any]) -> str:
    times = {}
    for n, t in as_dict(as_dict(result.get("cost_model")).get("verify_s")).items():
        if str(n).isdigit() and num(t) is not None:
            times[int(n)] = float(t)
    t1 = times.get(1)
    rows = [[n, t * 1e3, t / t1 if t1 else None] for n, t in sorted(times.items())]
    text = _table(["tokens verified n", "T(n) ms", "T(n) / T(1)"], rows)
    check = as_dict(result.get("plain_step"))
    timed, in_runs = num(check.get("timed_t1_s")), num(check.get("ar_step_s"))
    if timed and in_runs:
        text += (
            f"\n\nPlain decoding's T(1), timed for the cost model: {timed * 1e3:.1f} ms; `ar`'s "
            f"steps in its timed runs: {in_runs * 1e3:.1f} ms (ratio {timed / in_runs:.2f}). "
            "Efficiencies move with this ratio."
        )
    paces = {
        name: num(as_dict(m).get("target_pace"))
        for name, m in as_dict(result.get("methods")).items()
    }
    if any(paces.values()):
        listed = ", ".join(f"{name} {pace:.2f}" for name, pace in paces.items() if pace)
        text += (
            "\n\nTarget pace (each method's target forwards in its runs over the same forwards "
            "at the timed T(n); one far from `ar`'s ran under other load, or its forwards cost "
            f"more in its loop than timed): {listed}."
        )
    return text


def _count(value: Any) -> int | None:
    number = num(value)
    return None if number is None else int(number)


def _arm_table(methods: dict[str, dict[str, Any]]) -> str:
    """Lookup-first drafters: what each arm drafted and how much of it was accepted."""
    rows = []
    for name, m in methods.items():
        for arm, counts in as_dict(m.get("arms")).items():
            c = as_dict(counts)
            rounds, drafted, accepted = (
                _count(c.get(key)) for key in ("rounds", "drafted_tokens", "accepted_tokens")
            )
            rate = accepted / drafted if drafted and accepted is not None else None
            tau = num(c.get("mean_accepted_tokens"))
            rows.append([name, arm, rounds, drafted, accepted, rate, tau])
    header = ["method", "arm", "rounds", "drafted", "accepted", "accepted / drafted", "τ"]
    return _table(header, rows, labels=2)


def render_markdown(
    result: dict[str, Any], *, command: str | None = None, images: Collection[str] = ()
) -> str:
    """The report text; `images` names the PNGs written beside it, which it links to."""
    methods, config = methods_of(result), as_dict(result.get("config"))
    config_rows = [[k, _config_value(v)] for k, v in config.items()]
    schedules, schedule_note = _schedule_table(methods)

    def link(name: str) -> str | None:
        return name if name in images else None

    parts = [
        "# specmtp bench report",
        f"Command:\n\n```sh\n{command}\n```" if command else "",
        _section("Configuration", _table(["setting", "value"], config_rows)),
        _definitions(config, next(iter(methods), "ar")),
        _section("Results", _main_table(methods), note=_mismatch_note(methods)),
        _section("Timing", _timing_table(methods), link("time_split.png")),
        _section("Memory", _memory_table(methods)),
        _section("Acceptance", _acceptance_table(methods), link("acceptance_per_position.png")),
        _section("Drafter arms", _arm_table(methods)),
        _section("Speedup by group", _group_table(methods), link("speedup_by_group.png")),
        _section("Schedules by group", schedules, note=schedule_note),
        _section("By temperature", _temperature_table(result)),
        _section("Context length", _context_table(result), link("context.png")),
        _section(f"Speedup vs {GAMMA}", _gamma_table(result), link("speedup_vs_gamma.png")),
        _section("Cost model: target forward time T(n)", _cost_table(result)),
    ]
    return "\n\n".join(p for p in parts if p) + "\n"


def write_report(result: dict[str, Any], out: Path, *, command: str | None = None) -> list[Path]:
    """Write out/report.md, out/result.json (the dict as given) and the PNGs that have data;
    return the paths written, the report first."""
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "result.json"
    # default=str: a Path or similar left in the config must not lose the whole report
    raw.write_text(json.dumps(result, indent=2, default=str) + "\n")
    plots = write_plots(result, out)
    report = out / "report.md"
    text = render_markdown(result, command=command, images={p.name for p in plots})
    report.write_text(text, encoding="utf-8")
    return [report, raw, *plots]
