"""The benchmark: its report, its aggregates, and clean errors for bad prompt files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specmtp.bench import PromptRun, summarize_method
from specmtp.cli import main
from specmtp.stats import GenerationStats

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Repeat this: red, green, blue.", "x"]},
    {"question_id": 2, "category": "math", "turns": ["What is 2 + 2? Explain briefly."]},
    {"question_id": 3, "category": "coding", "turns": ["Write a Python function add(a, b)."]},
]


@pytest.fixture
def questions(tmp_path: Path) -> Path:
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def run_cli(capfd: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capfd.readouterr()
    return code, out, err


def test_bench_report(capfd: pytest.CaptureFixture[str], questions: Path) -> None:
    argv = ["bench", "--prompts", str(questions), "--draft", "ngram", "--max-new-tokens", "16"]
    argv += ["--threads", "1"]  # steadier on a shared machine
    code, out, err = run_cli(capfd, *argv)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0].split()[:3] == ["method", "latency", "s"]
    report = json.loads(lines[-1])
    assert set(report["methods"]) == {"ar", "ngram"}
    assert report["config"]["num_prompts"] == 3
    assert report["config"]["max_new_tokens"] == 16
    ar, ngram = report["methods"]["ar"], report["methods"]["ngram"]
    assert ar["speedup"] == 1.0
    assert ar["mean_accepted_tokens"] == 1.0
    for method in (ar, ngram):
        assert method["greedy_mismatches"] == 0
        assert method["new_tokens"] == ar["new_tokens"]
        assert method["tokens_per_s"] > 0 and method["latency_s"] > 0
        assert len(method["acceptance_per_position"]) == report["config"]["gamma"]
        assert [p["question_id"] for p in method["per_prompt"]] == [1, 2, 3]
    assert ngram["mean_accepted_tokens"] >= 1.0
    assert "[3/3] question 3 ngram" in err  # progress goes to stderr


def test_bench_sampling_repeats(capfd: pytest.CaptureFixture[str], questions: Path) -> None:
    """Sampled runs report no mismatch count; repeats reuse the seed, so outputs agree."""
    argv = ["bench", "--prompts", str(questions), "--limit", "1", "--repeats", "2"]
    flags = ["--warmup", "0", "--max-new-tokens", "8", "--temperature", "0.8", "--draft", "ngram"]
    flags += ["--threads", "1"]
    code, out, err = run_cli(capfd, *argv, *flags)
    assert code == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["config"]["num_prompts"] == 1
    assert report["config"]["repeats"] == 2
    assert report["config"]["torch_threads"] == 1
    assert all(m["greedy_mismatches"] is None for m in report["methods"].values())
    assert err.count("question 1 ngram") == 2


def _run(tokens: list[int], accepted_per_round: list[int], latency: float) -> PromptRun:
    stats = GenerationStats(gamma=2)
    for accepted in accepted_per_round:
        stats.record_round(2, accepted, verified=3, requested=2)
    stats.new_tokens = len(tokens)
    return PromptRun(0, tokens, stats, [latency, latency * 3, latency])


def test_aggregates_weight_by_rounds_and_tokens() -> None:
    baseline = [_run([1] * 4, [0] * 4, 1.0), _run([2] * 2, [0] * 2, 1.0)]
    method = [_run([1] * 4, [2, 0], 0.5), _run([9] * 2, [0, 0], 0.5)]
    result = summarize_method("m", method, baseline, greedy=True)
    assert result.mean_accepted_tokens == pytest.approx(6 / 4)  # (2 accepted + 4 rounds) / 4
    assert result.acceptance_per_position == [pytest.approx(1 / 4), pytest.approx(1 / 4)]
    assert result.latency_s == pytest.approx(0.5)  # the median of each prompt's repeats
    assert result.tokens_per_s == pytest.approx(6 / 1.0)
    assert result.speedup == pytest.approx(2.0)
    assert result.greedy_mismatches == 1
    assert summarize_method("m", method, baseline, greedy=False).greedy_mismatches is None


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "no prompts"),
        ("\n\n", "no prompts"),
        ('{"turns": ["ok"]}\n{"turns": ["fine"]\n', "line 2: bad json"),
        ('{"question_id": 1, "category": "x"}\n', "line 1: missing 'turns'"),
        ('{"turns": []}\n', "missing 'turns'"),
        ('{"turns": [""]}\n', "non-empty string"),
        ('["a list"]\n', "json object"),
        (b"\xff\xfe\x00bad", "cannot read"),
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
    code, out, err = run_cli(capfd, "bench", "--prompts", str(path))
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("specmtp: error: ")
    assert message in err.lower()


@pytest.mark.parametrize(
    "flags",
    [
        ["--prompts", "/no/such/file.jsonl"],
        ["--prompts", "."],
        ["--limit", "0"],
        ["--repeats", "0"],
        ["--warmup", "-1"],
        ["--draft", "ar"],
        ["--draft", "ngram", "--draft", "ngram"],
        ["--gamma", "0"],
    ],
)
def test_bad_bench_flags(
    capfd: pytest.CaptureFixture[str], questions: Path, flags: list[str]
) -> None:
    code, _, err = run_cli(capfd, "bench", "--prompts", str(questions), *flags)
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("specmtp: error: ")
