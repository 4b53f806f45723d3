"""`specmtp bench` end to end on the default model: the report, its passes, and its errors.

Two bench runs are shared by the tests of this module (each takes tens of seconds): a greedy
run of our methods and Hugging Face's prompt lookup, and a run with a sampled pass, repeats,
a context-length sweep and a written report. Numbers that depend on the machine's speed are
only checked for presence and sign.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import run_captured, run_cli

from specmtp.api import AUTO_MAX_GAMMA
from specmtp.bench import typical_context
from specmtp.bench_results import PromptRun
from specmtp.bench_runners import build_runner, verify_rows
from specmtp.cli import main
from specmtp.config import GenerationConfig
from specmtp.models import load_model
from specmtp.stats import GenerationStats

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SUITE = "mt_bench"  # the prompt file's folder: results are grouped by SUITE/category
QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Repeat this: red, green, blue.", "x"]},
    {"question_id": 2, "category": "math", "turns": ["What is 2 + 2? Explain briefly."]},
    {"question_id": 3, "category": "coding", "turns": ["Write a Python function add(a, b)."]},
]
GROUPS = [f"{SUITE}/writing", f"{SUITE}/math", f"{SUITE}/coding", "random"]
NEW_TOKENS = 10
OURS = ["ngram", "ngram@hf", "ngram@auto", "ngram@guard:2"]
SCHEDULES = {
    "ar": "plain",
    "ngram": "fixed:4",
    "ngram@hf": "heuristic",
    "ngram@auto": "adaptive",
    "ngram@guard:2": "guarded:2",
    "hf-prompt-lookup": "fixed:4",
    "hf-plain": "plain",
}
HF = ["hf-prompt-lookup", "hf-plain"]  # Hugging Face's own generate(), stock kernels
PROGRESS = ("loading target ", "preparing ", "kernel plan ", "warming up ")
FAST = ["--max-new-tokens", str(NEW_TOKENS), "--warmup", "0", "--threads", "1"]


def write_questions(folder: Path) -> Path:
    path = folder / SUITE / "question.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def assert_one_line_error(code: int, out: str, err: str, message: str) -> None:
    """Exit 2 and one error line, last; before it at most the bench's progress lines."""
    assert code == 2, err
    assert out == ""
    *before, last = err.strip().splitlines()
    assert last.startswith("specmtp: error: "), err
    assert message.lower() in last.lower()
    assert all(line.startswith(PROGRESS) for line in before), err


@pytest.fixture(scope="module")
def questions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_questions(tmp_path_factory.mktemp("prompts"))


@pytest.fixture(scope="module")
def greedy(questions: Path) -> tuple[str, str, dict[str, Any]]:
    """Greedy bench: 3 questions and a random prompt; 4 of our schedules, HF's lookup and
    HF's plain generate."""
    drafts = [flag for spec in [*OURS, *HF] for flag in ("--draft", spec)]
    code, out, err = run_captured(
        "bench", "--prompts", str(questions), "--prompts", "random:1x12", *drafts, *FAST
    )
    assert code == 0, err
    return out, err, json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sampled(
    questions: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, str, dict[str, Any], Path]:
    """A greedy pass plus one at 0.8, repeated twice, a 64-token context sweep, a report."""
    out_dir = tmp_path_factory.mktemp("report")
    code, out, err = run_captured(
        "bench", "--prompts", str(questions), "--limit", "2", "--draft", "ngram",
        "--temperatures", "0.8", "--repeats", "2", "--context", "64", "--context-prompts", "1",
        "--out", str(out_dir), *FAST,
    )  # fmt: skip
    assert code == 0, err
    return out, err, json.loads(out.strip().splitlines()[-1]), out_dir


def test_table_first_json_last(greedy: tuple[str, str, dict[str, Any]]) -> None:
    out, err, report = greedy
    lines = out.strip().splitlines()
    assert lines[0].split()[:3] == ["method", "latency", "s"]
    assert [line.split()[0] for line in lines[2:-1]] == ["ar", *OURS, *HF]
    assert set(report) == {
        "methods", "by_temperature", "context_sweep", "gamma_sweep", "cost_model", "config",
        "plain_step",
    }  # fmt: skip
    # progress goes to stderr: [i/n] GROUP QUESTION_ID METHOD: ...
    assert f"[3/4] {SUITE}/coding 3 ngram@auto: {NEW_TOKENS} tokens in " in err
    assert "[4/4] random 1 hf-prompt-lookup: " in err
    assert "[4/4] random 1 hf-plain: " in err


def test_every_method_is_lossless(greedy: tuple[str, str, dict[str, Any]]) -> None:
    methods = greedy[2]["methods"]
    assert list(methods) == ["ar", *OURS, *HF]
    ar = methods["ar"]
    assert ar["speedup"] == 1.0 and ar["mean_accepted_tokens"] == 1.0
    for name, m in methods.items():
        assert m["greedy_mismatches"] == 0, name
        assert m["new_tokens"] == ar["new_tokens"], name
        ar_tokens = [p["new_tokens"] for p in ar["per_prompt"]]
        assert [p["new_tokens"] for p in m["per_prompt"]] == ar_tokens, name
        assert [p["question_id"] for p in m["per_prompt"]] == [1, 2, 3, 1], name
        assert m["tokens_per_s"] > 0 and m["latency_s"] > 0, name


def test_cost_model_prediction_for_ours_only(greedy: tuple[str, str, dict[str, Any]]) -> None:
    report = greedy[2]
    methods = report["methods"]
    for name in ["ar", *OURS]:
        m = methods[name]
        assert isinstance(m["predicted_speedup"], float) and m["predicted_speedup"] > 0, name
        assert isinstance(m["efficiency"], float) and m["efficiency"] > 0, name
        assert m["efficiency"] == pytest.approx(m["speedup"] / m["predicted_speedup"], rel=1e-3)
        assert m["mean_accepted_tokens"] >= 1.0, name
    # Plain decoding, one T(1) per token, against plain decoding's T(1): exactly 1.
    ar_rounds = sum(methods["ar"]["requested_gammas"].values())
    assert ar_rounds == methods["ar"]["new_tokens"]
    assert methods["ar"]["predicted_speedup"] == 1.0
    for hf in (methods[name] for name in HF):
        assert hf["predicted_speedup"] is None and hf["efficiency"] is None
        assert hf["mean_accepted_tokens"] is None and hf["acceptance_per_position"] == []
    assert set(report["cost_model"]["verify_s"]) >= {"1", "2"}
    assert all(t > 0 for t in report["cost_model"]["verify_s"].values())
    # T(1) as timed, against ar's own steps: its forward time over its rounds.
    check = report["plain_step"]
    assert check["ar_step_s"] == pytest.approx(methods["ar"]["verify_s"] / ar_rounds, rel=1e-2)
    assert check["ratio"] == pytest.approx(check["timed_t1_s"] / check["ar_step_s"], rel=1e-3)
    # ar's pace: its own steps over that T(1); ours have one too, Hugging Face's none
    assert methods["ar"]["target_pace"] == pytest.approx(1 / check["ratio"], rel=1e-2)
    assert all(methods[name]["target_pace"] > 0 for name in OURS)
    assert all(methods[name]["target_pace"] is None for name in HF)


def test_latency_and_memory(greedy: tuple[str, str, dict[str, Any]]) -> None:
    for name, m in greedy[2]["methods"].items():
        assert m["ttft_s"] > 0 and m["tpot_s"] >= 0, name
        assert m["ttft_s"] <= max(p["latency_s"] for p in m["per_prompt"]), name
        assert m["peak_rss_bytes"] > 0, name
    for name in ["ar", *OURS]:
        assert greedy[2]["methods"][name]["kv_cache_bytes"] > 0, name
    for name in HF:
        assert greedy[2]["methods"][name]["kv_cache_bytes"] is None  # not ours to see


def test_per_group(greedy: tuple[str, str, dict[str, Any]]) -> None:
    for name, m in greedy[2]["methods"].items():
        assert list(m["per_group"]) == GROUPS, name
        assert {g["num_prompts"] for g in m["per_group"].values()} == {1}
        assert all(g["tokens_per_s"] > 0 for g in m["per_group"].values())
    ar_groups = greedy[2]["methods"]["ar"]["per_group"]
    assert {g["speedup"] for g in ar_groups.values()} == {1.0}


def test_schedules_and_requested_gammas(greedy: tuple[str, str, dict[str, Any]]) -> None:
    methods = greedy[2]["methods"]
    assert {name: m["schedule"] for name, m in methods.items()} == SCHEDULES
    asked = {
        name: {int(g): n for g, n in m["requested_gammas"].items()} for name, m in methods.items()
    }
    assert asked["ar"] == {0: methods["ar"]["new_tokens"]}
    # Fixed γ 4 and the heuristic's start: every prompt's first round asks 4.
    for name in ("ngram", "ngram@hf"):
        assert asked[name][4] >= 4, name
    assert max(asked["ngram"]) == 4
    assert max(asked["ngram@auto"]) <= AUTO_MAX_GAMMA  # no profile: the default largest γ
    assert len(methods["ngram@auto"]["acceptance_per_position"]) == AUTO_MAX_GAMMA
    assert len(methods["ngram"]["acceptance_per_position"]) == 4
    assert asked["hf-prompt-lookup"] == asked["hf-plain"] == {}


def test_config(greedy: tuple[str, str, dict[str, Any]], questions: Path) -> None:
    config = greedy[2]["config"]
    assert config["drafts"] == [*OURS, *HF]
    assert config["prompts"] == [str(questions), "random:1x12"]
    assert config["num_prompts"] == 4
    assert config["max_new_tokens"] == NEW_TOKENS
    assert config["temperatures"] == [0.0]
    assert config["warmup"] == 0 and config["repeats"] == 1 and config["torch_threads"] == 1
    # the measured kernel plan: a strategy per row count 1..8 and a weight layout
    assert set(config["kernel_plan"]) == {str(n) for n in range(1, 9)}
    assert config["kernel_layout"] in ("out-major", "in-major")
    assert config["row_invariant"] is None  # float32 takes the measured fastest kernels
    assert config["row_invariant_attention"] is None
    assert greedy[2]["by_temperature"].keys() == {"0.0"}
    assert greedy[2]["context_sweep"] == [] and greedy[2]["gamma_sweep"] == {}


def test_second_temperature_pass(sampled: tuple[str, str, dict[str, Any], Path]) -> None:
    out, _, report, _ = sampled
    assert report["config"]["temperatures"] == [0.0, 0.8]
    by_t = report["by_temperature"]
    assert list(by_t) == ["0.0", "0.8"]
    assert {n: m["speedup"] for n, m in by_t["0.0"].items()} == {
        n: m["speedup"] for n, m in report["methods"].items()
    }
    assert [m["greedy_mismatches"] for m in by_t["0.0"].values()] == [0, 0]
    assert [m["greedy_mismatches"] for m in by_t["0.8"].values()] == [None, None]
    assert all(m["new_tokens"] > 0 and m["tokens_per_s"] > 0 for m in by_t["0.8"].values())
    assert "\ntemperature 0.8:\nmethod " in out


def test_repeats_run_every_method_again(sampled: tuple[str, str, dict[str, Any], Path]) -> None:
    _, err, report, _ = sampled
    assert report["config"]["repeats"] == 2
    # two passes (temperatures 0.0 and 0.8), each running the prompt twice
    assert err.count(f"[1/2] {SUITE}/writing 1 ngram: ") == 4
    assert err.count(f"[2/2] {SUITE}/math 2 ar: ") == 4


def test_context_sweep(sampled: tuple[str, str, dict[str, Any], Path]) -> None:
    out, err, report, _ = sampled
    [point] = report["context_sweep"]
    assert point["context_tokens"] == 64
    assert point["prompt_tokens"] >= 64  # the chat template adds a few
    assert list(point["methods"]) == ["ar", "ngram"]
    assert [m["greedy_mismatches"] for m in point["methods"].values()] == [0, 0]
    assert point["methods"]["ngram"]["speedup"] > 0
    assert "context 64 tokens: ar 1.00x, ngram " in out
    assert f"[1/1] {SUITE}/writing 1 ngram: " in err


def test_report_files(sampled: tuple[str, str, dict[str, Any], Path]) -> None:
    _, err, report, out_dir = sampled
    assert json.loads((out_dir / "result.json").read_text()) == report
    markdown = (out_dir / "report.md").read_text()
    assert "ngram" in markdown
    pngs = sorted(out_dir.glob("*.png"))
    assert pngs
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in pngs)
    assert all(p.name in markdown for p in pngs)
    assert f"report: {out_dir / 'report.md'}" in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "holds no prompts"),
        ("\n\n", "holds no prompts"),
        ('{"turns": ["ok"]}\n{"turns": ["fine"]\n', "line 2: bad json"),
        ('{"question_id": 1, "category": "x"}\n', "line 1: unknown record with keys"),
        ('{"turns": []}\n', "'turns' must be a non-empty list"),
        ('{"turns": [""]}\n', "first turn must be a non-empty string"),
        ('{"task_id": "t", "prompt": 3}\n', "'prompt' must be a non-empty string"),
        ('["a list"]\n', "expected a json object"),
        (b"\xff\xfe\x00bad", "cannot read prompts file"),
    ],
)
def test_bad_prompt_files(
    capfd: pytest.CaptureFixture[str], tmp_path: Path, content: str | bytes, message: str
) -> None:
    path = tmp_path / "prompts.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    code, out, err = run_cli(capfd, "bench", "--prompts", str(path), "--draft", "ngram", *FAST)
    assert_one_line_error(code, out, err, message)
    assert str(path) in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prompts", "/no/such/file.jsonl"], "cannot read prompts file"),
        (["--prompts", "."], "cannot read prompts file"),
        (["--prompts", "random:0x5"], "count and length >= 1"),
        (["--prompts", "random:5"], "bad prompts spec"),
        (["--limit", "0"], "limit must be >= 1"),
        (["--per-category", "0"], "per_category must be >= 1"),
        (["--repeats", "0"], "repeats"),
        (["--warmup", "-1"], "warmup"),
        (["--temperatures", "x"], "--temperatures takes comma-separated numbers"),
        (["--temperatures", "0.7,-1"], "temperature must be >= 0"),
        (["--context", "4"], "context lengths must be >= 8"),
        (["--context", "256,x"], "--context takes comma-separated numbers"),
        (["--context-prompts", "0"], "context-prompts"),
        (["--draft", "hf-assisted"], "hf-assisted needs its assistant"),
        (["--draft", "hf-prompt-lookup:x"], "bad 'hf-prompt-lookup:x'"),
        (["--draft", "hf-prompt-lookup@auto"], "fixed γ >= 1"),
        (["--draft", "hf-beam"], "unknown hugging face method"),
        (["--draft", "hf-plain@3"], "hf-plain drafts nothing"),
        (["--draft", "hf-plain:x"], "hf-plain drafts nothing"),
        (["--draft", "ngram@zz"], "gamma must be a number, N/M, auto, best, hf or guard:N"),
        (["--draft", "ngram@guard:auto"], "gamma must be a number, N/M, auto, best, hf or"),
        (["--draft", "ngram@guard:0"], "gamma must be >= 1"),
        (["--draft", "ngram:0"], "bad n-gram draft spec"),
        (["--draft", "ngram@3/1"], "a γ pair N/M needs an ngram+SPEC drafter"),
        (["--draft", "ngram+mtp@3/0"], "the model rounds' gamma must be >= 1"),
        (["--gamma", "0"], "gamma must be >= 1"),
        (["--draft", "ar"], "each method must be named once"),
        (["--draft", "ngram", "--draft", "ngram"], "each method must be named once"),
        (["--max-memory", "10X"], "bad size '10X'"),
        (["--max-memory", "1K"], "is too small"),
    ],
)
def test_bad_bench_flags(
    capfd: pytest.CaptureFixture[str], questions: Path, flags: list[str], message: str
) -> None:
    code, out, err = run_cli(capfd, "bench", "--prompts", str(questions), *FAST, *flags)
    assert_one_line_error(code, out, err, message)


def test_bad_gamma_is_an_argument_error(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--prompts", "random:1x8", "--gamma", "x"])
    assert exit_info.value.code == 2
    assert "expected a number, N/M, auto, best, hf or guard:N" in capfd.readouterr().err


def test_best_gamma_needs_a_profile(
    capfd: pytest.CaptureFixture[str], questions: Path, no_profiles: Path
) -> None:
    code, out, err = run_cli(
        capfd, "bench", "--prompts", str(questions), "--draft", "ngram@best", *FAST
    )
    assert_one_line_error(code, out, err, "gamma 'best' needs a tuning profile")
    assert not (no_profiles / "profiles").exists()


@pytest.mark.parametrize(
    ("size", "message"),
    [("1K", "max-memory 1.0 KiB is too small"), ("10X", "bad size '10X'"), ("0", "positive")],
)
def test_generate_memory_budget_errors(
    capfd: pytest.CaptureFixture[str], size: str, message: str
) -> None:
    argv = ["generate", "Hello", "--draft", "ngram", "--max-memory", size, *FAST[:2]]
    code, out, err = run_cli(capfd, *argv)
    assert_one_line_error(code, out, err, message)


def test_generate_within_a_memory_budget(capfd: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        capfd, "generate", "Hello", "--draft", "ngram", "--max-memory", "2G", "--json", *FAST[:2]
    )
    assert code == 0, err
    stats = json.loads(out.strip().splitlines()[-1])
    assert 0 < stats["new_tokens"] <= NEW_TOKENS


def test_bench_gamma_flag_sets_the_default_schedule(capfd: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        capfd, "bench", "--prompts", "random:1x8", "--draft", "ngram", "--gamma", "hf",
        "--max-new-tokens", "4", "--warmup", "0", "--threads", "1",
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["methods"]["ngram"]["schedule"] == "heuristic"


def test_context_sweep_needs_text_prompts(capfd: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        capfd, "bench", "--prompts", "random:1x8", "--draft", "ngram", "--context", "64",
        "--max-new-tokens", "2", "--warmup", "0", "--threads", "1",
    )  # fmt: skip
    assert_one_line_error(code, out, err, "context")


@pytest.mark.parametrize(
    ("methods", "rows"),
    [
        (["ar"], 1),  # plain decoding alone: the plan and layout for one row
        (["ar", "ngram@3"], 4),
        (["ar", "ngram@1", "ngram+distilled@3/5"], 6),  # the larger γ of a pair
        (["ar", "ngram+mtp@3/5"], 4),  # three heads propose 3 tokens at most
        (["ar", "mtp@auto"], 4),
        (["ar", "ngram@20"], 8),  # at most MAX_ROWS
        (["ar", "ngram@hf"], 8),  # the heuristic has no bound: every row count
        (["ar", "ngram@auto"], 8),  # the adaptive schedule's largest γ, 8 without a profile
        (["ar", "mtp-tree@2"], 8),  # a tree: its nodes
        (["ar", "hf-prompt-lookup@3"], 1),  # Hugging Face's methods run stock kernels
    ],
)
def test_the_kernel_plan_covers_the_verify_passes_to_come(methods: list[str], rows: int) -> None:
    target = load_model("default")
    runners = {m: build_runner(m, target, GenerationConfig()) for m in methods}
    assert verify_rows(runners, GenerationConfig()) == rows


def test_costs_are_timed_after_the_median_prompt_and_half_its_plain_answer() -> None:
    ids = [[1, 2, 3], [4] * 10, [5] * 5]
    plain = [
        PromptRun(i, "g", tokens, GenerationStats(gamma=1))
        for i, tokens in enumerate([[7], [8] * 6, list(range(20, 28))])
    ]
    assert typical_context(ids, plain) == [5] * 5 + [20, 21, 22, 23]


def test_stored_kernels_are_the_same_in_every_run(no_profiles: Path) -> None:
    """`--stored-kernels`: the first run measures and stores a plan, the next reads it
    (a plan measured per run can pick other kernels in each)."""
    cache = no_profiles
    (cache / "kernels").unlink(missing_ok=True)  # the session's plans: a link, not ours
    argv = ["bench", "--prompts", "random:1x12", "--draft", "ngram", "--stored-kernels", *FAST]
    configs, logs = [], []
    for _ in range(2):
        code, out, err = run_captured(*argv)
        assert code == 0, err
        configs.append(json.loads(out.strip().splitlines()[-1])["config"])
        logs.append(err)
    assert "timing this machine's kernels" in logs[0]
    assert "timing this machine's kernels" not in logs[1]
    assert [c["kernel_plan_from"] for c in configs] == ["stored", "stored"]
    assert configs[0]["kernel_plan"] == configs[1]["kernel_plan"]
    (stored,) = (cache / "kernels").glob("*.json")
    assert json.loads(stored.read_text())["by_rows"] == configs[0]["kernel_plan"]
