"""Bench and tune reports: Markdown tables, PNG plots and the raw JSON, from plain dicts.

The inputs are the bench's JSON result and the tune profile rather than live objects, so a
report can be rendered again from a saved `result.json`. Only `methods` and `config` are
required: any other section may be missing or empty and any number may be null. A null
prints as "-" in tables and is skipped in plots; a table or plot with no data is left out.

matplotlib is imported inside the plotting functions so that `import specmtp` never pays for
it, and every figure is a `Figure` on its own Agg canvas: no pyplot state, no display needed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MIB = float(1 << 20)
DPI = 120
# Used when the bench's config does not carry its own definition under the same key.
DEFINITIONS = {
    "speedup": "tokens/s of the method / tokens/s of the baseline, both measured in this run",
    "mean_accepted_tokens": "tokens committed per target verify round (the baseline has 1)",
    "efficiency": "accepted draft tokens / drafted tokens",
    "predicted_speedup": "the speedup the cost model T(n) predicts from the measured acceptance",
}
GAMMA, ALPHA, TAU = (
    "\N{GREEK SMALL LETTER GAMMA}",
    "\N{GREEK SMALL LETTER ALPHA}",
    "\N{GREEK SMALL LETTER TAU}",
)
PREDICTED = {"linestyle": "--", "marker": "o"}
MEASURED = {"linestyle": "-", "marker": "s"}
TIME_PARTS = (("draft_s", "draft", "C1"), ("verify_s", "verify", "C0"), ("other_s", "other", "C7"))


# ---- values: everything from the dict goes through these, so nulls and junk never crash


def _num(value: Any) -> float | None:
    """A finite number as a float, else None: null, NaN and stray types all mean 'no data'."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _scaled(value: Any, factor: float) -> float | None:
    x = _num(value)
    return None if x is None else x * factor


def _times(value: Any) -> str | None:
    x = _num(value)
    return None if x is None else f"{x:.2f}x"


def _fixed(value: Any) -> str | None:
    x = _num(value)
    return None if x is None else f"{x:.2f}"


def _methods(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: _dict(m) for name, m in _dict(result.get("methods")).items()}


def _groups(methods: dict[str, dict[str, Any]]) -> list[str]:
    """Every group any method reports, in first-seen order."""
    seen: dict[str, None] = {}
    for m in methods.values():
        seen.update(dict.fromkeys(_dict(m.get("per_group"))))
    return list(seen)


def _group_field(m: dict[str, Any], group: str, key: str) -> Any:
    return _dict(_dict(m.get("per_group")).get(group)).get(key)


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
        if (_num(m.get("greedy_mismatches")) or 0) > 0
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
        rows[-1] += [m.get("new_tokens"), _num(m.get("latency_s")), _num(m.get("tokens_per_s"))]
        rows[-1] += [_times(m.get("speedup")), _fixed(m.get("mean_accepted_tokens"))]
        rows[-1] += [m.get("greedy_mismatches"), _fixed(m.get("efficiency"))]
        rows[-1] += [_times(m.get("predicted_speedup"))]
    # the method list itself is worth a table even when every number is null
    return _table(header, rows, labels=0)


def _timing_table(methods: dict[str, dict[str, Any]]) -> str:
    header = ["method", "TTFT ms", "TPOT ms", *(f"{label} s" for _, label, _ in TIME_PARTS)]
    rows = [
        [n, _scaled(m.get("ttft_s"), 1e3), _scaled(m.get("tpot_s"), 1e3)]
        + [_num(m.get(key)) for key, _, _ in TIME_PARTS]
        for n, m in methods.items()
    ]
    return _table(header, rows)


def _memory_table(methods: dict[str, dict[str, Any]]) -> str:
    rows = [
        [n, _scaled(m.get("peak_rss_bytes"), 1 / MIB), _scaled(m.get("kv_cache_bytes"), 1 / MIB)]
        for n, m in methods.items()
    ]
    return _table(["method", "peak RSS MiB", "KV-cache MiB"], rows)


def _acceptance_table(methods: dict[str, dict[str, Any]]) -> str:
    series = {
        n: [_num(a) for a in _list(m.get("acceptance_per_position"))] for n, m in methods.items()
    }
    series = {n: s for n, s in series.items() if any(a is not None for a in s)}
    depth = max((len(s) for s in series.values()), default=0)
    rows = [[n, *s, *[None] * (depth - len(s))] for n, s in series.items()]
    return _table(["method", *(f"position {i + 1}" for i in range(depth))], rows)


def _speedup_tau(m: dict[str, Any], group: str) -> str | None:
    speedup = _times(_group_field(m, group, "speedup"))
    tau = _fixed(_group_field(m, group, "mean_accepted_tokens"))
    return f"{speedup} ({tau})" if speedup and tau else speedup


def _group_table(methods: dict[str, dict[str, Any]]) -> str:
    if not methods:
        return ""
    baseline, *drafts = methods
    rows = []
    for g in _groups(methods):
        counts = [_group_field(m, g, "num_prompts") for m in methods.values()]
        prompts = next((c for c in counts if c is not None), None)
        tokens_per_s = _num(_group_field(methods[baseline], g, "tokens_per_s"))
        rows.append([g, prompts, tokens_per_s, *(_speedup_tau(methods[n], g) for n in drafts)])
    header = ["group", "prompts", f"{baseline} tokens/s", *(f"{n} speedup ({TAU})" for n in drafts)]
    return _table(header, rows, labels=2)


def _temperature_table(result: dict[str, Any]) -> str:
    header = ["temperature", "method", "tokens/s", "speedup", TAU, "efficiency", "mismatches"]
    rows = []
    for t, per_method in _dict(result.get("by_temperature")).items():
        for name, raw in _dict(per_method).items():
            m = _dict(raw)
            rows.append([str(t), name, _num(m.get("tokens_per_s")), _times(m.get("speedup"))])
            rows[-1] += [_fixed(m.get("mean_accepted_tokens")), _fixed(m.get("efficiency"))]
            rows[-1] += [m.get("greedy_mismatches")]
    return _table(header, rows, labels=2)


def _context_table(result: dict[str, Any]) -> str:
    header = ["context tokens", "prompt tokens", "method", "tokens/s", "speedup", "TTFT ms"]
    header += ["KV-cache MiB", "peak RSS MiB", TAU]
    rows = []
    for point in map(_dict, _list(result.get("context_sweep"))):
        for name, raw in _dict(point.get("methods")).items():
            m = _dict(raw)
            rows.append([point.get("context_tokens"), point.get("prompt_tokens"), name])
            rows[-1] += [_num(m.get("tokens_per_s")), _times(m.get("speedup"))]
            rows[-1] += [_scaled(m.get("ttft_s"), 1e3), _scaled(m.get("kv_cache_bytes"), 1 / MIB)]
            rows[-1] += [_scaled(m.get("peak_rss_bytes"), 1 / MIB)]
            rows[-1] += [_fixed(m.get("mean_accepted_tokens"))]
    return _table(header, rows, labels=3)


def _gamma_table(result: dict[str, Any]) -> str:
    rows = []
    for name, points in _dict(result.get("gamma_sweep")).items():
        for p in map(_dict, _list(points)):
            speedups = [_times(p.get(f"{key}_speedup")) for key in ("predicted", "measured")]
            rows.append([name, p.get("gamma"), *speedups])
    return _table(["method", GAMMA, "predicted", "measured"], rows, labels=2)


def _cost_table(result: dict[str, Any]) -> str:
    times = {}
    for n, t in _dict(_dict(result.get("cost_model")).get("verify_s")).items():
        if str(n).isdigit() and _num(t) is not None:
            times[int(n)] = float(t)
    t1 = times.get(1)
    rows = [[n, t * 1e3, t / t1 if t1 else None] for n, t in sorted(times.items())]
    return _table(["tokens verified n", "T(n) ms", "T(n) / T(1)"], rows)


def render_markdown(
    result: dict[str, Any], *, command: str | None = None, images: Collection[str] = ()
) -> str:
    """The report text; `images` names the PNGs written beside it, which it links to."""
    methods, config = _methods(result), _dict(result.get("config"))
    config_rows = [[k, _config_value(v)] for k, v in config.items()]

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
        _section("Speedup by group", _group_table(methods), link("speedup_by_group.png")),
        _section("By temperature", _temperature_table(result)),
        _section("Context length", _context_table(result), link("context.png")),
        _section(f"Speedup vs {GAMMA}", _gamma_table(result), link("speedup_vs_gamma.png")),
        _section("Cost model: target forward time T(n)", _cost_table(result)),
    ]
    return "\n\n".join(p for p in parts if p) + "\n"


# ---- plots: each returns the path it wrote, or None when it had no data to draw


def _figure(width: float, height: float, ncols: int = 1) -> tuple[Figure, list[Axes]]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, list(fig.subplots(1, ncols, squeeze=False)[0])


def _save(fig: Figure, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)  # attach Agg explicitly: no GUI backend, whatever MPLBACKEND says
    fig.savefig(path, dpi=DPI)
    return path


def _line(ax: Axes, xs: Sequence[Any], ys: Sequence[Any], **style: Any) -> bool:
    """Plot the points where both coordinates are numbers; False when there were none."""
    points = [
        (x, y)
        for x, y in zip(map(_num, xs), map(_num, ys), strict=True)
        if x is not None and y is not None
    ]
    if points:
        ax.plot(*zip(*points, strict=True), **style)
    return bool(points)


def _no_data(ax: Axes) -> None:
    ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="0.5")


def _unit_line(ax: Axes, label: str | None = None) -> None:
    ax.axhline(1.0, color="0.4", linewidth=1, linestyle=":", label=label)


def _integer_ticks(ax: Axes) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _speedup_vs_gamma_axes(ax: Axes) -> None:
    _unit_line(ax)
    _integer_ticks(ax)
    ax.set(xlabel=f"{GAMMA} (draft tokens per round)", ylabel="speedup")
    ax.set_title(f"Speedup vs {GAMMA}")


def _colors(methods: Sequence[str]) -> dict[str, str]:
    """One colour per method, by first appearance, so a method keeps its colour across the
    plots of a report."""
    return {name: f"C{i % 10}" for i, name in enumerate(dict.fromkeys(methods))}


def _plot_groups(methods: dict[str, dict[str, Any]], path: Path) -> Path | None:
    baseline, *drafts = methods
    groups, colors = _groups(methods), _colors(methods)
    series = {n: [_num(_group_field(methods[n], g, "speedup")) for g in groups] for n in drafts}
    series = {n: s for n, s in series.items() if any(v is not None for v in s)}
    if not series:
        return None
    fig, (ax,) = _figure(max(6.0, 1.1 * len(groups) * max(1, len(series) / 2)), 4.0)
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        offset = (i - (len(series) - 1) / 2) * width
        bars = [(g + offset, v) for g, v in enumerate(values) if v is not None]
        ax.bar(*zip(*bars, strict=True), width, label=name, color=colors[name])
    _unit_line(ax, f"{baseline} (1.0x)")
    slanted = {"rotation": 30, "ha": "right"} if len(groups) > 4 else {}
    ax.set_xticks(range(len(groups)), groups, **slanted)
    ax.set(ylabel=f"speedup over {baseline}", title="Speedup by prompt group")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return _save(fig, path)


def _plot_acceptance(methods: dict[str, dict[str, Any]], path: Path) -> Path | None:
    fig, (ax,) = _figure(6.5, 4.0)
    drawn, colors = False, _colors(methods)
    for name, m in methods.items():
        rates = _list(m.get("acceptance_per_position"))
        positions = range(1, len(rates) + 1)
        drawn |= _line(ax, positions, rates, marker="o", label=name, color=colors[name])
    if not drawn:
        return None
    ax.set(xlabel="draft position", ylabel="P(accepted | drafted)", ylim=(0, 1.05))
    ax.set_title("Acceptance per draft position")
    _integer_ticks(ax)
    ax.legend(fontsize="small")
    return _save(fig, path)


def _plot_gamma(result: dict[str, Any], path: Path) -> Path | None:
    sweep = _dict(result.get("gamma_sweep"))
    colors = _colors([*_methods(result), *sweep])
    fig, (ax,) = _figure(6.5, 4.0)
    drawn = False
    for name, points in sweep.items():
        points = [_dict(p) for p in _list(points)]
        gammas = [p.get("gamma") for p in points]
        for key, style in (("predicted", PREDICTED), ("measured", MEASURED)):
            values = [p.get(f"{key}_speedup") for p in points]
            drawn |= _line(ax, gammas, values, color=colors[name], label=f"{name} {key}", **style)
    if not drawn:
        return None
    _speedup_vs_gamma_axes(ax)
    ax.legend(fontsize="small")
    return _save(fig, path)


def _plot_context(result: dict[str, Any], path: Path) -> Path | None:
    points = [_dict(p) for p in _list(result.get("context_sweep"))]
    names = list(dict.fromkeys(n for p in points for n in _dict(p.get("methods"))))
    colors = _colors([*_methods(result), *names])
    fig, (left, right) = _figure(11.0, 4.0, 2)
    xs = [p.get("context_tokens") for p in points]
    drawn = {left: False, right: False}
    for name in names:
        per_point = [_dict(_dict(p.get("methods")).get(name)) for p in points]
        for ax, key, scale in ((left, "speedup", 1.0), (right, "kv_cache_bytes", 1 / MIB)):
            ys = [_scaled(m.get(key), scale) for m in per_point]
            drawn[ax] |= _line(ax, xs, ys, marker="o", label=name, color=colors[name])
    if not any(drawn.values()):
        return None
    _unit_line(left)
    left.set(ylabel="speedup", title="Speedup vs context length")
    right.set(ylabel="KV cache, MiB", title="KV-cache size")
    contexts = sorted({x for x in map(_num, xs) if x is not None and x > 0})
    for ax, has_data in drawn.items():
        ax.legend(fontsize="small") if has_data else _no_data(ax)
        ax.set_xlabel("context tokens")
        if contexts and len(contexts) == len(xs):
            # sweeps double the context, so a log2 axis spaces them evenly
            ax.set_xscale("log", base=2)
            ax.set_xticks(contexts, [f"{x:g}" for x in contexts])
            ax.minorticks_off()
    return _save(fig, path)


def _plot_time_split(methods: dict[str, dict[str, Any]], path: Path) -> Path | None:
    split = {n: [_num(m.get(key)) for key, _, _ in TIME_PARTS] for n, m in methods.items()}
    split = {n: parts for n, parts in split.items() if any(t is not None for t in parts)}
    if not split:
        return None
    fig, (ax,) = _figure(max(5.0, 1.2 * len(split) + 2), 4.0)
    bottom = [0.0] * len(split)
    for i, (_, label, color) in enumerate(TIME_PARTS):
        heights = [(parts[i] or 0.0) for parts in split.values()]
        ax.bar(list(split), heights, 0.6, bottom=bottom, label=label, color=color)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set(ylabel="seconds, summed over prompts", title="Where the time goes")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return _save(fig, path)


def _write_plots(result: dict[str, Any], out: Path) -> list[Path]:
    methods = _methods(result)
    written = [
        _plot_groups(methods, out / "speedup_by_group.png") if methods else None,
        _plot_acceptance(methods, out / "acceptance_per_position.png"),
        _plot_gamma(result, out / "speedup_vs_gamma.png"),
        _plot_context(result, out / "context.png"),
        _plot_time_split(methods, out / "time_split.png"),
    ]
    return [p for p in written if p is not None]


def write_report(result: dict[str, Any], out: Path, *, command: str | None = None) -> list[Path]:
    """Write out/report.md, out/result.json (the dict as given) and the PNGs that have data;
    return the paths written, the report first."""
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "result.json"
    # default=str: a Path or similar left in the config must not lose the whole report
    raw.write_text(json.dumps(result, indent=2, default=str) + "\n")
    plots = _write_plots(result, out)
    report = out / "report.md"
    text = render_markdown(result, command=command, images={p.name for p in plots})
    report.write_text(text, encoding="utf-8")
    return [report, raw, *plots]


def plot_tune(profile: dict[str, Any], path: Path) -> Path:
    """Left: predicted (dashed) and measured (solid) speedup against gamma, the best
    gamma marked; right: the acceptance alpha per draft position that the prediction used."""
    fig, (left, right) = _figure(11.0, 4.2, 2)
    sweep = [_dict(p) for p in _list(profile.get("sweep"))]
    gammas = [p.get("gamma") for p in sweep]
    drawn = False
    for key, style, color in (("predicted", PREDICTED, "C0"), ("measured", MEASURED, "C1")):
        values = [p.get(f"{key}_speedup") for p in sweep]
        drawn |= _line(left, gammas, values, color=color, label=key, **style)
    _speedup_vs_gamma_axes(left)
    best = _num(profile.get("best_gamma"))
    if best is not None:
        left.axvline(best, color="C2", linestyle="-.", label=f"best {GAMMA} = {best:g}")
    left.legend(fontsize="small") if drawn else _no_data(left)
    alphas = [
        (i + 1, a) for i, a in enumerate(map(_num, _list(profile.get("alphas")))) if a is not None
    ]
    if alphas:
        bars = right.bar(*zip(*alphas, strict=True), 0.6, color="C0")
        right.bar_label(bars, fmt="%.2f", fontsize="small")
    else:
        _no_data(right)
    _integer_ticks(right)
    right.set(
        xlabel="draft position",
        ylabel=f"{ALPHA} = P(accepted | earlier drafts accepted)",
        ylim=(0, 1.1),
    )
    right.set_title("Acceptance per draft position")
    fig.suptitle(f"target {profile.get('target', '?')}, draft {profile.get('draft', '?')}")
    path.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, path)
