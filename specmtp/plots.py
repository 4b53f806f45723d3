"""The bench report's PNG plots and the tune plot, from the same plain dicts as report.py.

matplotlib is imported inside the functions so that `import specmtp` never pays for it, and
every figure is a `Figure` on its own Agg canvas: no pyplot state, no display needed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specmtp.report_values import (
    ALPHA,
    GAMMA,
    MIB,
    TIME_PARTS,
    as_dict,
    as_list,
    group_field,
    groups_of,
    methods_of,
    num,
    scaled,
)  # fmt: skip

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

DPI = 120
PREDICTED = {"linestyle": "--", "marker": "o"}
MEASURED = {"linestyle": "-", "marker": "s"}
SLANT_ABOVE = 12  # axis labels with a line longer than this many characters are slanted
LABEL_LINE = 30  # a label's lines are broken at a spec's separators to about this length
# A path or Hub id inside a method's name: up to the separators of drafter specs.
_PATH = re.compile(r"[^\s:+|#@]*/[^\s:+|#@]*")
_BEFORE_SEPARATOR = re.compile(r"(?=[:+|#@])")


def plot_labels(names: Sequence[str]) -> dict[str, str]:
    """Short names for the plots' legends and axes: each path (or Hub id) in a method's name
    cut to its last components, as few as keep the names apart. A draft given as
    `/root/.cache/.../qwen2.5-coder-0.5b-instruct-q4_k_m.gguf#int8@auto` would otherwise
    squeeze the axes to nothing; the report's tables keep the full names. A label still
    longer than LABEL_LINE is broken into lines before its options (`#int8`, `@auto` ...)."""
    unique = list(dict.fromkeys(names))
    depth = 1
    while True:
        labels = {n: _shortened(n, depth) for n in unique}
        if len(set(labels.values())) == len(unique) or all(labels[n] == n for n in unique):
            return {n: _broken(label) for n, label in labels.items()}
        depth += 1


def _shortened(name: str, depth: int) -> str:
    return _PATH.sub(lambda found: _last_parts(found.group(), depth), name)


def _broken(label: str) -> str:
    lines = [""]
    for piece in _BEFORE_SEPARATOR.split(label):
        if lines[-1] and len(lines[-1]) + len(piece) > LABEL_LINE:
            lines.append("")
        lines[-1] += piece
    return "\n".join(lines)


def _widest(labels: Iterable[str]) -> int:
    return max((len(line) for label in labels for line in label.splitlines()), default=0)


def _last_parts(path: str, depth: int) -> str:
    parts = path.rstrip("/").split("/")
    return path if depth >= len(parts) else "/".join(parts[-depth:])


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
        for x, y in zip(map(num, xs), map(num, ys), strict=True)
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


def _long(labels: Iterable[str]) -> bool:
    return _widest(labels) > SLANT_ABOVE


def _legend_width(labels: Iterable[str]) -> float:
    """Inches a legend beside the axes takes, by its longest line (small font)."""
    return 0.8 + 0.075 * _widest(labels)


def _colors(methods: Sequence[str]) -> dict[str, str]:
    """One colour per method, by first appearance, so a method keeps its colour across the
    plots of a report."""
    return {name: f"C{i % 10}" for i, name in enumerate(dict.fromkeys(methods))}


def _plot_groups(methods: dict[str, dict[str, Any]], path: Path) -> Path | None:
    baseline, *drafts = methods
    groups, colors = groups_of(methods), _colors(methods)
    series = {n: [num(group_field(methods[n], g, "speedup")) for g in groups] for n in drafts}
    series = {n: s for n, s in series.items() if any(v is not None for v in s)}
    if not series:
        return None
    labels = plot_labels(list(methods))
    bars_width = max(4.5, 1.1 * len(groups) * max(1, len(series) / 2))
    fig, (ax,) = _figure(bars_width + _legend_width(labels.values()), 4.0)
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        offset = (i - (len(series) - 1) / 2) * width
        bars = [(g + offset, v) for g, v in enumerate(values) if v is not None]
        ax.bar(*zip(*bars, strict=True), width, label=labels[name], color=colors[name])
    _unit_line(ax, f"{labels[baseline]} (1.0x)")
    slanted = {"rotation": 30, "ha": "right"} if len(groups) > 4 or _long(groups) else {}
    ax.set_xticks(range(len(groups)), groups, **slanted)
    ax.set(ylabel=f"speedup over {labels[baseline]}", title="Speedup by prompt group")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return _save(fig, path)


def _plot_acceptance(methods: dict[str, dict[str, Any]], path: Path) -> Path | None:
    labels = plot_labels(list(methods))
    fig, (ax,) = _figure(4.5 + _legend_width(labels.values()), 4.0)
    drawn, colors = False, _colors(methods)
    for name, m in methods.items():
        rates = as_list(m.get("acceptance_per_position"))
        positions = range(1, len(rates) + 1)
        drawn |= _line(ax, positions, rates, marker="o", label=labels[name], color=colors[name])
    if not drawn:
        return None
    ax.set(xlabel="draft position", ylabel="P(accepted | drafted)", ylim=(0, 1.05))
    ax.set_title("Acceptance per draft position")
    _integer_ticks(ax)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return _save(fig, path)


def _plot_gamma(result: dict[str, Any], path: Path) -> Path | None:
    """Speedup against γ for chain profiles; a tree profile's sweep is over node budgets, so
    it gets its own panel with tree nodes on the x axis."""
    raw = as_dict(result.get("gamma_sweep"))
    sweep = {name: [as_dict(p) for p in as_list(points)] for name, points in raw.items()}
    trees = {n: ps for n, ps in sweep.items() if any("budget" in p for p in ps)}
    chains = {n: ps for n, ps in sweep.items() if n not in trees}
    colors = _colors([*methods_of(result), *sweep])
    labels = plot_labels(list(sweep))
    panels = [(chains, "gamma"), (trees, "budget")]
    panels = [(group, key) for group, key in panels if group]
    if not panels:
        return None
    fig, axes = _figure(6.5 * len(panels), 4.0, len(panels))
    drawn = dict.fromkeys(axes, False)
    for ax, (group, x_key) in zip(axes, panels, strict=True):
        for name, points in group.items():
            xs = [p.get(x_key) for p in points]
            for key, style in (("predicted", PREDICTED), ("measured", MEASURED)):
                values = [p.get(f"{key}_speedup") for p in points]
                label = f"{labels[name]} {key}"
                drawn[ax] |= _line(ax, xs, values, color=colors[name], label=label, **style)
        _speedup_vs_gamma_axes(ax)
        if x_key == "budget":
            ax.set(xlabel="tree nodes (0: plain decoding)", title="Speedup vs tree budget")
        ax.legend(fontsize="small") if drawn[ax] else _no_data(ax)
    return _save(fig, path) if any(drawn.values()) else None


def _plot_context(result: dict[str, Any], path: Path) -> Path | None:
    points = [as_dict(p) for p in as_list(result.get("context_sweep"))]
    names = list(dict.fromkeys(n for p in points for n in as_dict(p.get("methods"))))
    colors, labels = _colors([*methods_of(result), *names]), plot_labels(names)
    fig, (left, right) = _figure(11.0, 4.0, 2)
    xs = [p.get("context_tokens") for p in points]
    drawn = {left: False, right: False}
    for name in names:
        per_point = [as_dict(as_dict(p.get("methods")).get(name)) for p in points]
        for ax, key, scale in ((left, "speedup", 1.0), (right, "kv_cache_bytes", 1 / MIB)):
            ys = [scaled(m.get(key), scale) for m in per_point]
            drawn[ax] |= _line(ax, xs, ys, marker="o", label=labels[name], color=colors[name])
    if not any(drawn.values()):
        return None
    _unit_line(left)
    left.set(ylabel="speedup", title="Speedup vs context length")
    right.set(ylabel="KV cache, MiB", title="KV-cache size")
    contexts = sorted({x for x in map(num, xs) if x is not None and x > 0})
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
    split = {n: [num(m.get(key)) for key, _, _ in TIME_PARTS] for n, m in methods.items()}
    split = {n: parts for n, parts in split.items() if any(t is not None for t in parts)}
    if not split:
        return None
    names = plot_labels(list(split))
    fig, (ax,) = _figure(max(5.0, 1.2 * len(split) + 2), 4.0 + 0.06 * _widest(names.values()))
    bottom = [0.0] * len(split)
    for i, (_, label, color) in enumerate(TIME_PARTS):
        heights = [(parts[i] or 0.0) for parts in split.values()]
        ax.bar(range(len(split)), heights, 0.6, bottom=bottom, label=label, color=color)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    slanted = {"rotation": 30, "ha": "right"} if _long(names.values()) else {}
    ax.set_xticks(range(len(split)), [names[n] for n in split], **slanted)
    ax.set(ylabel="seconds, summed over prompts", title="Where the time goes")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return _save(fig, path)


def write_plots(result: dict[str, Any], out: Path) -> list[Path]:
    methods = methods_of(result)
    written = [
        _plot_groups(methods, out / "speedup_by_group.png") if methods else None,
        _plot_acceptance(methods, out / "acceptance_per_position.png"),
        _plot_gamma(result, out / "speedup_vs_gamma.png"),
        _plot_context(result, out / "context.png"),
        _plot_time_split(methods, out / "time_split.png"),
    ]
    return [p for p in written if p is not None]


def plot_tune(profile: dict[str, Any], path: Path) -> Path:
    """Left: predicted (dashed) and measured (solid) speedup against gamma, the best
    gamma marked; right: the acceptance alpha per draft position that the prediction used.
    A γ pair profile (lookup-first drafter) plots each arm's γ and α instead; a tree
    profile's (static tree budgets or a dynamic tree's node counts) x axis is nodes."""
    fig, (left, right) = _figure(11.0, 4.2, 2)
    if profile.get("model_gamma") is not None and profile.get("nodes") is None:
        _plot_pair_tune(profile, left, right)
    else:
        _plot_chain_tune(profile, left, right)
    target, draft = (str(profile.get(key, "?")) for key in ("target", "draft"))
    short = {n: label.replace("\n", "") for n, label in plot_labels([target, draft]).items()}
    fig.suptitle(f"target {short[target]}, draft {short[draft]}")  # one line: the width is there
    path.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, path)


def _alpha_axes(ax: Axes, title: str) -> None:
    _integer_ticks(ax)
    ax.set(
        xlabel="draft position",
        ylabel=f"{ALPHA} = P(accepted | earlier drafts accepted)",
        ylim=(0, 1.1),
    )
    ax.set_title(title)


def _plot_chain_tune(profile: dict[str, Any], left: Axes, right: Axes) -> None:
    sweep = [as_dict(p) for p in as_list(profile.get("sweep"))]
    nodes = num(profile.get("nodes"))  # a dynamic tree's node sweep
    trees = bool(profile.get("tree")) or nodes is not None  # sweeps nodes, not γ
    xs = [p.get("budget" if trees else "gamma") for p in sweep]
    drawn = False
    for key, style, color in (("predicted", PREDICTED, "C0"), ("measured", MEASURED, "C1")):
        values = [p.get(f"{key}_speedup") for p in sweep]
        drawn |= _line(left, xs, values, color=color, label=key, **style)
    _speedup_vs_gamma_axes(left)
    if nodes is not None:
        left.set(xlabel="tree nodes verified a round")
        left.set_title("Speedup vs a dynamic tree's nodes")
        best, label = nodes, "best nodes"
    elif trees:
        left.set(xlabel="tree nodes (budget)")
        left.set_title("Speedup vs tree budget")
        best, label = len(as_list(profile.get("tree"))), "best tree"
    else:
        best, label = num(profile.get("best_gamma")), f"best {GAMMA}"
    if best is not None:
        left.axvline(best, color="C2", linestyle="-.", label=f"{label} = {best:g}")
    left.legend(fontsize="small") if drawn else _no_data(left)
    alphas = [
        (i + 1, a) for i, a in enumerate(map(num, as_list(profile.get("alphas")))) if a is not None
    ]
    if alphas:
        bars = right.bar(*zip(*alphas, strict=True), 0.6, color="C0")
        right.bar_label(bars, fmt="%.2f", fontsize="small")
    else:
        _no_data(right)
    _alpha_axes(right, "Acceptance per draft position")


def _plot_pair_tune(profile: dict[str, Any], left: Axes, right: Axes) -> None:
    """A γ pair profile (lookup-first drafter): left, speedup against the model rounds' γ
    (lookup γ held) and against the lookup rounds' γ (model γ held); right, α per position
    of each arm."""
    sweep = [as_dict(p) for p in as_list(profile.get("sweep"))][1:]
    search = as_dict(profile.get("meta", {})).get("pair_search", {})
    held_lookup = num(as_dict(search).get("lookup_gamma_while_model_varies"))
    held_model = num(as_dict(search).get("model_gamma_while_lookup_varies"))
    colors = {"model": "C0", "lookup": "C1"}  # the arms of drafters.LookupFirstDrafter
    lines = [
        ("model", "model_gamma", lambda p: num(p.get("gamma")) == held_lookup),
        ("lookup", "gamma", lambda p: num(p.get("model_gamma")) == held_model),
    ]
    drawn = False
    for arm, key, keep in lines:
        color = colors[arm]
        points = sorted((p for p in sweep if keep(p)), key=lambda p: num(p.get(key)) or 0)
        xs = [p.get(key) for p in points]
        for kind, style in (("predicted", PREDICTED), ("measured", MEASURED)):
            ys = [p.get(f"{kind}_speedup") for p in points]
            label = f"{kind}, {arm} rounds' {GAMMA}"
            drawn |= _line(left, xs, ys, color=color, label=label, **style)
    _speedup_vs_gamma_axes(left)
    left.set_title(f"Speedup vs each arm's {GAMMA}, the other held")
    best = f"{profile.get('best_gamma')}/{profile.get('model_gamma')}"
    left.plot([], [], " ", label=f"best lookup/model {GAMMA} = {best}")
    left.legend(fontsize="small") if drawn else _no_data(left)
    arms = as_dict(profile.get("arm_alphas"))
    width = 0.8 / max(1, len(arms))
    for i, (arm, values) in enumerate(sorted(arms.items())):
        alphas = [(j + 1 + (i - (len(arms) - 1) / 2) * width, num(a))
                  for j, a in enumerate(as_list(values)) if num(a) is not None]  # fmt: skip
        if alphas:
            color = colors.get(arm, f"C{i + 2}")
            right.bar(*zip(*alphas, strict=True), width, color=color, label=f"{arm} rounds")
    if arms:
        right.legend(fontsize="small")
    else:
        _no_data(right)
    _alpha_axes(right, "Acceptance per draft position, by arm")
