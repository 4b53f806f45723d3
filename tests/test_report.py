"""The bench report and the tune plot: tables, images and raw JSON from plain dicts."""

from __future__ import annotations

import copy
import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

from specmtp.plots import LABEL_LINE, plot_labels, plot_tune
from specmtp.report import markdown_table, render_markdown, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MIB = 1 << 20
GROUPS = ("writing", "math", "coding")
ALL_PLOTS = (
    "speedup_by_group.png",
    "acceptance_per_position.png",
    "speedup_vs_gamma.png",
    "context.png",
    "time_split.png",
)


def method(tokens_per_s: float, speedup: float, tau: float, **extra: Any) -> dict[str, Any]:
    """One method's entry, shaped like the bench's JSON."""
    groups = {
        g: {
            "num_prompts": 2,
            "tokens_per_s": tokens_per_s + i,
            "speedup": speedup + i / 10,
            "mean_accepted_tokens": tau + i / 10,
        }
        for i, g in enumerate(GROUPS)
    }
    entry = {
        "tokens_per_s": tokens_per_s,
        "speedup": speedup,
        "mean_accepted_tokens": tau,
        "greedy_mismatches": 0,
        "latency_s": 64 / tokens_per_s,
        "new_tokens": 384,
        "acceptance_per_position": [],
        "efficiency": None,
        "predicted_speedup": None,
        "ttft_s": 0.0421,
        "tpot_s": 1 / tokens_per_s,
        "peak_rss_bytes": 900 * MIB,
        "kv_cache_bytes": 12 * MIB,
        "draft_s": 0.0,
        "verify_s": 5.5,
        "other_s": 0.25,
        "schedule": "none",
        "per_group": groups,
        "per_prompt": [{}] * 6,
    }
    return {**entry, **extra}


def context_point(context: int, scale: float) -> dict[str, Any]:
    return {
        "context_tokens": context,
        "prompt_tokens": context - 3,
        "methods": {
            name: {
                "tokens_per_s": 40.0 / scale * s,
                "speedup": s,
                "ttft_s": 0.01 * scale,
                "kv_cache_bytes": int(context * kv * MIB),
                "peak_rss_bytes": 950 * MIB,
                "mean_accepted_tokens": 1 + s,
            }
            for name, s, kv in (("ar", 1.0, 0.02), ("mtp", 1.4 / scale, 0.025))
        },
    }


def by_temp(
    tokens_per_s: float,
    speedup: float,
    tau: float,
    efficiency: float | None = None,
    greedy_mismatches: int | None = None,
) -> dict[str, Any]:
    return {
        "tokens_per_s": tokens_per_s,
        "speedup": speedup,
        "mean_accepted_tokens": tau,
        "efficiency": efficiency,
        "greedy_mismatches": greedy_mismatches,
    }


def full_result() -> dict[str, Any]:
    """ar + two speculative methods, 3 groups, two temperatures, two context lengths."""
    return {
        "methods": {
            "ar": method(40.0, 1.0, 1.0),
            "mtp": method(
                49.2,
                1.23,
                2.456,
                acceptance_per_position=[0.81, 0.62, None, 0.4],
                efficiency=0.714,
                predicted_speedup=1.31,
                draft_s=1.5,
                verify_s=3.0,
                target_pace=1.25,
                schedule="fixed:4",
            ),
            "ngram": method(
                44.8,
                1.12,
                1.8,
                acceptance_per_position=[0.5, 0.25],
                efficiency=0.4,
                predicted_speedup=1.05,
                greedy_mismatches=2,
                draft_s=0.1,
                schedule="adaptive",
            ),
        },
        "by_temperature": {
            "0.0": {"ar": by_temp(40.0, 1.0, 1.0), "mtp": by_temp(49.2, 1.23, 2.4, 0.71, 0)},
            "0.7": {"ar": by_temp(39.0, 1.0, 1.0), "mtp": by_temp(42.9, 1.1, 2.0, 0.52)},
        },
        "context_sweep": [context_point(256, 1.0), context_point(1024, 2.0)],
        "gamma_sweep": {
            "mtp": [
                {"gamma": g, "predicted_speedup": p, "measured_speedup": m}
                for g, p, m in ((1, 1.1, 1.05), (2, 1.25, 1.2), (4, 1.31, None))
            ],
        },
        "cost_model": {"verify_s": {"1": 0.02, "2": 0.021, "4": 0.025}},
        "plain_step": {"timed_t1_s": 0.02, "ar_step_s": 0.025, "ratio": 0.8},
        "config": {
            "target": "default",
            "drafts": ["mtp", "ngram"],
            "num_prompts": 6,
            "max_new_tokens": 64,
            "temperatures": [0.0, 0.7],
            "seed": 0,
            "commit": "abc1234",
            "efficiency": None,
        },
    }


@pytest.fixture
def result() -> dict[str, Any]:
    return full_result()


def table_rows(text: str) -> list[list[str]]:
    """The cells of every table row in `text`, an escaped `\\|` kept inside its cell."""
    return [
        [c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
        for line in text.splitlines()
        if line.startswith("|")
    ]


def table_row(text: str, first_cell: str) -> list[str]:
    """The cells of the first table row whose first cell is `first_cell`."""
    found = [row for row in table_rows(text) if row[0] == first_cell]
    assert found, f"no row starting {first_cell!r}"
    return found[0]


def section(text: str, title: str) -> str:
    """The body of `## title`, up to the next section."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"no section {title!r}"
    return match.group(1)


def assert_png(path: Path) -> None:
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC), path
    assert len(data) > 5_000, path  # an empty canvas compresses to far less
    height, width, channels = imread(path).shape
    assert width >= 400 and height >= 300 and channels in (3, 4)


def test_full_report_writes_every_file(result: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "nested" / "run"
    paths = write_report(result, out, command="specmtp bench --out run")
    assert paths[:2] == [out / "report.md", out / "result.json"]
    assert sorted(p.name for p in paths[2:]) == sorted(ALL_PLOTS)
    for path in paths:
        assert path.is_file()
    for path in paths[2:]:
        assert_png(path)


def test_report_links_only_written_images(result: dict[str, Any], tmp_path: Path) -> None:
    write_report(result, tmp_path)
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", (tmp_path / "report.md").read_text())
    assert sorted(links) == sorted(ALL_PLOTS)
    for link in links:
        assert (tmp_path / link).is_file()  # relative to the report


def test_result_json_round_trips(result: dict[str, Any], tmp_path: Path) -> None:
    given = copy.deepcopy(result)
    write_report(result, tmp_path)
    assert json.loads((tmp_path / "result.json").read_text()) == given
    assert result == given  # the report does not touch its input


def test_main_tables_hold_the_numbers(result: dict[str, Any], tmp_path: Path) -> None:
    write_report(result, tmp_path, command="specmtp bench --out run")
    text = (tmp_path / "report.md").read_text()
    assert text.startswith("# ")
    assert "```sh\nspecmtp bench --out run\n```" in text
    assert table_row(section(text, "Configuration"), "drafts")[1] == "mtp, ngram"
    assert table_row(section(text, "Configuration"), "temperatures")[1] == "0.0, 0.7"
    results = section(text, "Results")
    # method, schedule, prompts, new tokens, latency s, tokens/s, speedup, τ, mismatches,
    # efficiency, predicted
    assert table_row(results, "mtp") == [
        "mtp",
        "fixed:4",
        "6",
        "384",
        "1.30",
        "49.20",
        "1.23x",
        "2.46",
        "0",
        "0.71",
        "1.31x",
    ]
    assert table_row(results, "ar")[6:] == ["1.00x", "1.00", "0", "-", "-"]
    assert "ngram (2)" in results  # greedy mismatches are called out
    assert "Definitions" in text and "speedup" in text.split("## Results")[0]


def test_timing_memory_and_group_tables(result: dict[str, Any], tmp_path: Path) -> None:
    write_report(result, tmp_path)
    text = (tmp_path / "report.md").read_text()
    # TTFT ms, TPOT ms, draft s, verify s, other s
    assert table_row(section(text, "Timing"), "mtp")[1:] == [
        "42.10",
        "20.33",
        "1.50",
        "3.00",
        "0.250",
    ]
    assert table_row(section(text, "Memory"), "ngram")[1:] == ["900.0", "12.00"]
    groups = section(text, "Speedup by group")
    assert table_row(groups, "group")[3:] == ["mtp speedup (τ)", "ngram speedup (τ)"]
    assert table_row(groups, "math") == ["math", "2", "41.00", "1.33x (2.56)", "1.22x (1.90)"]
    acceptance = section(text, "Acceptance")
    assert table_row(acceptance, "mtp")[1:] == ["0.810", "0.620", "-", "0.400"]
    assert table_row(acceptance, "ngram")[1:] == ["0.500", "0.250", "-", "-"]
    assert "| ar " not in acceptance  # no acceptance data, no row


def test_sweep_tables(result: dict[str, Any], tmp_path: Path) -> None:
    write_report(result, tmp_path)
    text = (tmp_path / "report.md").read_text()
    temperatures = section(text, "By temperature")
    assert [row for row in table_rows(temperatures) if row[:2] == ["0.7", "mtp"]] == [
        ["0.7", "mtp", "42.90", "1.10x", "2.00", "0.52", "-"]
    ]
    context = section(text, "Context length")
    # context tokens, prompt tokens, method, tokens/s, speedup, TTFT ms, KV MiB, RSS MiB, τ
    assert table_row(context, "1024") == [
        "1024",
        "1021",
        "ar",
        "20.00",
        "1.00x",
        "20.00",
        "20.48",
        "950.0",
        "2.00",
    ]
    gamma = section(text, "Speedup vs γ")
    assert [row for row in table_rows(gamma) if row[0] == "mtp"] == [
        ["mtp", "1", "1.10x", "1.05x"],
        ["mtp", "2", "1.25x", "1.20x"],
        ["mtp", "4", "1.31x", "-"],
    ]
    cost = section(text, "Cost model: target forward time T(n)")
    assert table_row(cost, "4") == ["4", "25.00", "1.25"]
    assert "timed for the cost model: 20.0 ms; `ar`'s steps in its timed runs: 25.0 ms" in cost
    assert "(ratio 0.80)" in cost
    assert (
        "at the timed T(n); one far from `ar`'s ran under other load" in cost
        and ": mtp 1.25." in cost
    )


def test_tree_sweeps_are_shown_by_node_budget(result: dict[str, Any], tmp_path: Path) -> None:
    # a tree profile sweeps node budgets; its γ is the tree's depth, which repeats
    result["gamma_sweep"]["mtp-tree"] = [
        {"budget": b, "gamma": d, "predicted_speedup": p, "measured_speedup": m}
        for b, d, p, m in (
            (0, 0, 1.0, 1.0),
            (1, 1, 1.2, 1.22),
            (4, 1, 1.05, 1.01),
            (8, 3, 0.9, 0.8),
        )
    ]
    paths = write_report(result, tmp_path)
    gamma = section((tmp_path / "report.md").read_text(), "Speedup vs γ")
    assert table_rows(gamma)[0] == ["method", "tree nodes", "γ", "predicted", "measured"]
    assert [row for row in table_rows(gamma) if row[0] == "mtp-tree"][1:3] == [
        ["mtp-tree", "1", "1", "1.20x", "1.22x"],
        ["mtp-tree", "4", "1", "1.05x", "1.01x"],
    ]
    assert table_row(gamma, "mtp")[1:] == ["-", "1", "1.10x", "1.05x"]
    (plot,) = [p for p in paths if p.name == "speedup_vs_gamma.png"]
    from matplotlib.image import imread

    assert imread(plot).shape[1] > 1.8 * imread(plot).shape[0]  # two panels side by side


def test_minimal_result_omits_missing_sections(tmp_path: Path) -> None:
    bare = {"tokens_per_s": None, "speedup": None, "mean_accepted_tokens": None}
    result = {"methods": {"ar": dict(bare), "mtp": dict(bare)}, "config": {}}
    paths = write_report(result, tmp_path)
    assert [p.name for p in paths] == ["report.md", "result.json"]
    text = (tmp_path / "report.md").read_text()
    assert table_row(section(text, "Results"), "mtp")[1:] == ["-"] * 10
    titles = re.findall(r"^## (.*)$", text, re.M)
    assert titles == ["Results"]
    assert "![" not in text


def test_nulls_everywhere_do_not_crash(result: dict[str, Any], tmp_path: Path) -> None:
    """Every number nulled (and a few sections empty or malformed) still renders."""

    def null_numbers(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: null_numbers(v) for k, v in value.items()}
        if isinstance(value, list):
            return [null_numbers(v) for v in value]
        return None if isinstance(value, int | float) else value

    nulled = null_numbers(result)
    nulled["gamma_sweep"] = {"mtp": []}
    nulled["by_temperature"] = {}
    nulled["context_sweep"] = None
    paths = write_report(nulled, tmp_path)
    assert [p.name for p in paths] == ["report.md", "result.json"]
    text = (tmp_path / "report.md").read_text()
    assert re.findall(r"^## (.*)$", text, re.M) == ["Configuration", "Results"]
    assert "nan" not in text.lower()


def test_partial_data_keeps_what_is_there(result: dict[str, Any], tmp_path: Path) -> None:
    result["methods"]["mtp"]["per_group"]["math"]["speedup"] = None
    result["methods"]["ngram"]["per_group"] = {}
    result["context_sweep"][1]["methods"]["mtp"]["kv_cache_bytes"] = None
    result["gamma_sweep"]["mtp"][0]["predicted_speedup"] = float("nan")
    paths = write_report(result, tmp_path)
    assert len(paths) == 2 + len(ALL_PLOTS)
    groups = section((tmp_path / "report.md").read_text(), "Speedup by group")
    assert table_row(groups, "math")[3:] == ["-", "-"]
    assert table_row(groups, "coding")[3:] == ["1.43x (2.66)", "-"]


def test_render_markdown_without_images(result: dict[str, Any]) -> None:
    text = render_markdown(result)
    assert "![" not in text and "## Speedup by group" in text


def test_plot_labels_cut_paths_and_keep_methods_apart() -> None:
    draft = "/root/.cache/specmtp/qwen2.5-coder/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    names = ["ar", f"{draft}#int8@auto", f"ngram+{draft}@3", "Org/Small-Model@2", "mtp@1"]
    labels = plot_labels(names)
    flat = {n: label.replace("\n", "") for n, label in labels.items()}
    assert flat == {
        "ar": "ar",
        f"{draft}#int8@auto": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf#int8@auto",
        f"ngram+{draft}@3": "ngram+qwen2.5-coder-0.5b-instruct-q4_k_m.gguf@3",
        "Org/Small-Model@2": "Small-Model@2",
        "mtp@1": "mtp@1",
    }
    # broken into lines before an option, never inside a name
    assert labels[f"{draft}#int8@auto"] == "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf\n#int8@auto"
    spec = "ngram+Org/Small-Model#int8#nodes=6#min-p=0.2@auto"
    lines = plot_labels([spec])[spec].splitlines()
    assert "".join(lines) == "ngram+Small-Model#int8#nodes=6#min-p=0.2@auto"
    assert len(lines) == 2 and all(len(line) <= LABEL_LINE for line in lines)
    # heads of two runs with the same folder name keep one more component each
    heads = ["mtp:/runs/a/heads@3", "mtp:/runs/b/heads@3"]
    assert plot_labels(heads) == {heads[0]: "mtp:a/heads@3", heads[1]: "mtp:b/heads@3"}
    same = ["mtp:/x/heads@3", "mtp:x/heads@3"]  # apart only by the leading slash
    assert len(set(plot_labels(same).values())) == 2


def test_long_method_names_keep_the_plots_readable(tmp_path: Path) -> None:
    """A draft given by its absolute path: the plots take short labels, so matplotlib's
    layout does not collapse (it warned and drew unreadable axes before)."""
    draft = "/root/.cache/specmtp/some-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    long = {
        f"{draft}#int8#nodes={n}@auto": m
        for n, m in (
            (6, method(44.8, 1.12, 1.8, acceptance_per_position=[0.9, 0.7], draft_s=2.0)),
            (10, method(42.0, 1.05, 1.7, acceptance_per_position=[0.8, 0.6], draft_s=2.5)),
            (16, method(39.0, 0.98, 1.2, acceptance_per_position=[0.7, 0.5], draft_s=1.0)),
        )
    }  # fmt: skip
    result = {"methods": {"ar": method(40.0, 1.0, 1.0), **long}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = write_report(result, tmp_path)
    pngs = sorted(p.name for p in paths if p.suffix == ".png")
    assert pngs == ["acceptance_per_position.png", "speedup_by_group.png", "time_split.png"]
    for path in paths[2:]:
        assert_png(path)
    assert "/root/.cache/specmtp/some-models/" in (tmp_path / "report.md").read_text()


def test_plot_tune_writes_a_png(tmp_path: Path) -> None:
    profile = {
        "target": "default",
        "draft": "mtp:4",
        "cost_model": {
            "verify_s": {"1": 0.02, "2": 0.021},
            "draft_fixed_s": 0.001,
            "draft_per_token_s": 0.002,
        },
        "alphas": [0.8, 0.6, 0.45, None],
        "sweep": [
            {
                "gamma": g,
                "predicted_speedup": 1 + g / 10,
                "measured_speedup": m,
                "tokens_per_s": None,
                "mean_accepted_tokens": None,
            }
            for g, m in ((1, 1.05), (2, 1.15), (3, None), (4, 1.3))
        ],
        "best_gamma": 4,
    }
    path = plot_tune(profile, tmp_path / "tune" / "tune.png")
    assert path == tmp_path / "tune" / "tune.png"
    assert_png(path)


def test_plot_tune_with_no_data(tmp_path: Path) -> None:
    path = plot_tune({"target": "t", "draft": "d", "sweep": [], "alphas": []}, tmp_path / "t.png")
    assert path.read_bytes().startswith(PNG_MAGIC)


def test_markdown_table_formats_cells() -> None:
    text = markdown_table(
        ["name", "value"],
        [
            ["none", None],
            ["int", 12800],
            ["big", 1234.56],
            ["mid", 123.456],
            ["one", 1.5],
            ["small", 0.12345],
            ["tiny", 0.000123],
            ["zero", 0.0],
            ["nan", float("nan")],
            ["text", "a|b"],
            ["flag", True],
        ],
    )
    cells = {row[0]: row[1] for row in table_rows(text)[2:]}
    assert cells == {
        "none": "-",
        "int": "12800",
        "big": "1235",
        "mid": "123.5",
        "one": "1.50",
        "small": "0.123",
        "tiny": "1.23e-04",
        "zero": "0",
        "nan": "-",
        "flag": "True",
        "text": "a\\|b",
    }
    lines = text.splitlines()
    assert lines[0].startswith("| name") and set(lines[1]) <= set("|-: ")
    assert len({len(line) for line in lines}) == 1  # padded to line up


def test_markdown_table_right_aligns_number_columns() -> None:
    text = markdown_table(["m", "x", "y"], [["a", 1.5, "fixed:4"], ["b", None, "x"]])
    assert text.splitlines() == [
        "| m   |    x | y       |",
        "| --- | ---: | ------- |",
        "| a   | 1.50 | fixed:4 |",
        "| b   |    - | x       |",
    ]


def test_markdown_table_rejects_ragged_rows() -> None:
    with pytest.raises(ValueError, match="row 0 has 1 cells"):
        markdown_table(["a", "b"], [[1]])


def test_import_does_not_load_matplotlib() -> None:
    import subprocess
    import sys

    code = "import sys, specmtp.report; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_drafter_arms_table(result: dict[str, Any], tmp_path: Path) -> None:
    result["methods"]["ngram"]["arms"] = {
        "lookup": {"rounds": 10, "drafted_tokens": 40, "accepted_tokens": 30,
                   "mean_accepted_tokens": 4.0},
        "model": {"rounds": 20, "drafted_tokens": 20, "accepted_tokens": 5,
                  "mean_accepted_tokens": 1.25},
    }  # fmt: skip
    write_report(result, tmp_path)
    rows = table_rows(section((tmp_path / "report.md").read_text(), "Drafter arms"))
    assert rows[2:] == [
        ["ngram", "lookup", "10", "40", "30", "0.750", "4.00"],
        ["ngram", "model", "20", "20", "5", "0.250", "1.25"],
    ]
    del result["methods"]["ngram"]["arms"]
    write_report(result, tmp_path)
    assert "## Drafter arms" not in (tmp_path / "report.md").read_text()
