"""`specmtp tune` and its profiles: the sweep, the file, and `--gamma auto/best` using it.

One tune run on the default model (n-gram draft, γ up to 2, 2 short prompts) is shared by
the tests of this module. Measured speedups depend on the machine: only their presence,
sign and consistency with the profile's own cost model are checked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_captured, run_cli

from specmtp.api import AUTO_MAX_GAMMA
from specmtp.costmodel import expected_tokens
from specmtp.errors import SpecMTPError
from specmtp.profile import Profile, default_profile_path, find_profile, weights_fingerprint
from specmtp.tune import TuneConfig

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_GAMMA = 2
NEW_TOKENS = 10
TRAIN_PROMPTS = [
    "List the days of the week, then list them again.",
    "Count from one to ten in words.",
    "Repeat the word apple five times.",
]
GENERATE = ["generate", "Name the days of the week.", "--chat", "--json", "--threads", "1"]


def last_json(out: str) -> dict[str, Any]:
    return json.loads(out.strip().splitlines()[-1])


def assert_one_line_error(code: int, out: str, err: str, message: str) -> None:
    assert code == 2, err
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("specmtp: error: ")
    assert message.lower() in lines[0].lower()


def write_train_prompts(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in TRAIN_PROMPTS)
    )
    return folder


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, Path, Path]:
    """stdout, stderr, profile path and plot path of one tune run."""
    root = tmp_path_factory.mktemp("tune")
    train = write_train_prompts(root / "train")
    profile, plot = root / "out" / "p.json", root / "out" / "p.png"
    code, out, err = run_captured(
        "tune", "--prompts", str(train), "--draft", "ngram", "--max-gamma", str(MAX_GAMMA),
        "--limit", "2", "--max-new-tokens", str(NEW_TOKENS), "--out", str(profile),
        "--plot", str(plot), "--threads", "1",
    )  # fmt: skip
    assert code == 0, err
    return out, err, profile, plot


@pytest.fixture
def profile(tuned: tuple[str, str, Path, Path]) -> Profile:
    return Profile.load(tuned[2])


def test_tune_prints_the_sweep_and_writes_the_profile(
    tuned: tuple[str, str, Path, Path], profile: Profile
) -> None:
    out, err, path, plot = tuned
    lines = out.strip().splitlines()
    assert lines[0].split() == ["γ", "predicted", "measured", "tokens/s", "τ"]
    assert [line.split()[0] for line in lines[2 : 3 + MAX_GAMMA]] == ["0", "1", "2"]
    assert lines[-2] == f"profile: {path}; plot: {plot}"
    assert last_json(out) == json.loads(path.read_text())
    assert profile.to_dict() == json.loads(path.read_text())
    assert plot.read_bytes().startswith(PNG_MAGIC)
    assert "[2/2] tokens/s by γ 0:" in err


def test_profile_contents(profile: Profile) -> None:
    assert (profile.target, profile.draft) == ("default", "ngram")
    assert profile.max_gamma == MAX_GAMMA
    assert all(0.0 <= a <= 1.0 for a in profile.alphas)
    # T(n) up to the largest verify pass: at least max_gamma + 1 tokens
    assert len(profile.cost_model.verify_s) >= MAX_GAMMA + 1
    assert all(t > 0 for t in profile.cost_model.verify_s)
    assert profile.cost_model.draft_fixed_s >= 0 and profile.cost_model.draft_per_token_s >= 0
    assert profile.cost_model.catch_up_per_token_s == 0.0  # lookup has no cache to catch up
    assert profile.meta["num_prompts"] == 2
    assert profile.meta["max_new_tokens"] == NEW_TOKENS
    assert profile.meta["torch_threads"] == 1
    assert profile.meta["kernel_layout"] in ("out-major", "in-major")  # measured with the plan


def test_sweep_and_best_gamma(profile: Profile) -> None:
    sweep = profile.sweep
    assert [row["gamma"] for row in sweep] == list(range(MAX_GAMMA + 1))
    assert sweep[0]["predicted_speedup"] == 1.0 and sweep[0]["measured_speedup"] == 1.0
    for row in sweep:
        assert row["predicted_speedup"] > 0 and row["measured_speedup"] > 0
        assert row["tokens_per_s"] > 0
    cost = profile.cost_model
    for row in sweep[1:]:
        assert row["mean_accepted_tokens"] >= 1.0
        # The prediction is E(γ) from the profile's α, times T(1), over a round's time: T(n)
        # averaged over the verify sizes n = 1..γ+1 that occurred (n-gram lookup may draft
        # fewer than asked), plus the drafter's time, allowed up to one T(1).
        g = row["gamma"]
        costs = [cost.target_s(n) for n in range(1, g + 2)]
        gain = expected_tokens(profile.alphas, g) * cost.target_s(1)
        assert gain / (max(costs) + cost.target_s(1)) <= row["predicted_speedup"]
        assert row["predicted_speedup"] <= gain / min(costs) * 1.001
    fastest = max(sweep[1:], key=lambda row: row["measured_speedup"])
    assert profile.best_gamma == fastest["gamma"]
    assert 1 <= profile.best_gamma <= MAX_GAMMA


def test_generate_auto_starts_from_the_profile(
    capfd: pytest.CaptureFixture[str], tuned: tuple[str, str, Path, Path]
) -> None:
    argv = [*GENERATE, "--draft", "ngram", "--gamma", "auto", "--profile", str(tuned[2])]
    code, out, err = run_cli(capfd, *argv, "--max-new-tokens", "8")
    assert code == 0, err
    assert "no tuning profile" not in err
    stats = last_json(out)
    assert len(stats["accept_histogram"]) == MAX_GAMMA + 1  # the profile's largest γ
    assert max(int(g) for g in stats["requested_gammas"]) <= MAX_GAMMA


def test_generate_best_uses_the_profiles_gamma(
    capfd: pytest.CaptureFixture[str], tuned: tuple[str, str, Path, Path], profile: Profile
) -> None:
    argv = [*GENERATE, "--draft", "ngram", "--gamma", "best", "--profile", str(tuned[2])]
    code, out, err = run_cli(capfd, *argv, "--max-new-tokens", "8")
    assert code == 0, err
    stats = last_json(out)
    assert len(stats["acceptance_per_position"]) == profile.best_gamma
    # a fixed γ: the first round asks for it, none asks for more
    assert max(int(g) for g in stats["requested_gammas"]) == profile.best_gamma


def test_auto_without_a_profile_says_so(
    capfd: pytest.CaptureFixture[str], no_profiles: Path
) -> None:
    argv = [*GENERATE, "--draft", "ngram", "--gamma", "auto", "--max-new-tokens", "4"]
    code, out, err = run_cli(capfd, *argv)
    assert code == 0, err
    assert err.startswith("specmtp: no tuning profile for default with ngram")
    assert len(last_json(out)["accept_histogram"]) == AUTO_MAX_GAMMA + 1


def test_bench_best_and_auto_use_the_default_profile(
    capfd: pytest.CaptureFixture[str], profile: Profile, no_profiles: Path
) -> None:
    """A profile at the pair's default path is what `ngram@best` and `ngram@auto` start from."""
    profile.save(default_profile_path("default", "ngram"))
    code, out, err = run_cli(
        capfd, "bench", "--prompts", "random:1x8", "--draft", "ngram@best",
        "--draft", "ngram@auto", "--max-new-tokens", "6", "--warmup", "0", "--threads", "1",
    )  # fmt: skip
    assert code == 0, err
    report = last_json(out)
    best, auto = report["methods"]["ngram@best"], report["methods"]["ngram@auto"]
    assert best["schedule"] == f"fixed:{profile.best_gamma}"
    assert len(best["acceptance_per_position"]) == profile.best_gamma
    assert auto["schedule"] == "adaptive"
    assert len(auto["acceptance_per_position"]) == profile.max_gamma
    assert report["gamma_sweep"] == {
        "ngram@best": list(profile.sweep),
        "ngram@auto": list(profile.sweep),
    }


def test_profile_for_another_pair_is_refused(
    capfd: pytest.CaptureFixture[str], tuned: tuple[str, str, Path, Path]
) -> None:
    argv = [*GENERATE, "--draft", "ngram:2", "--gamma", "auto", "--profile", str(tuned[2])]
    code, out, err = run_cli(capfd, *argv)
    assert_one_line_error(code, out, err, "tuned for target 'default' with draft 'ngram', not")


@pytest.mark.parametrize("role", ["target", "draft"])
def test_profile_for_other_weights_is_refused(
    capfd: pytest.CaptureFixture[str], tuned: tuple[str, str, Path, Path], tmp_path: Path,
    role: str,
) -> None:  # fmt: skip
    data = json.loads(tuned[2].read_text())
    assert set(data["meta"]["weights"]) == {"target", "draft"}
    data["meta"]["weights"][role] = "0123456789abcdef"  # as if tuned before a retraining
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    argv = [*GENERATE, "--draft", "ngram", "--gamma", "auto", "--profile", str(path)]
    code, out, err = run_cli(capfd, *argv)
    assert_one_line_error(code, out, err, f"other {role} weights (fingerprint 0123456789abcdef")


def test_weights_fingerprint_tells_trainings_apart() -> None:
    weights = [torch.randn(300, 7, generator=torch.Generator().manual_seed(0)), torch.ones(5)]
    same = [w.clone() for w in weights]
    assert weights_fingerprint(weights) == weights_fingerprint(same)
    same[0].view(-1)[64] += 1.0  # a sampled value changes (every 32nd of the 2,100)
    assert weights_fingerprint(weights) != weights_fingerprint(same)
    assert weights_fingerprint(weights) != weights_fingerprint([weights[0].reshape(7, 300)])


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "cannot read profile"), ("{", "is not json"), ("[]", "not a specmtp tuning profile")],
)
def test_unreadable_profile_is_refused(
    capfd: pytest.CaptureFixture[str], tmp_path: Path, content: str | None, message: str
) -> None:
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    argv = [*GENERATE, "--draft", "ngram", "--gamma", "best", "--profile", str(path)]
    code, out, err = run_cli(capfd, *argv)
    assert_one_line_error(code, out, err, message)


def test_evaluation_sets_are_refused(capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    prompts = write_train_prompts(tmp_path / "eval" / "mt_bench")
    code, out, err = run_cli(capfd, "tune", "--prompts", str(prompts / "prompts.jsonl"))
    assert_one_line_error(code, out, err, "is an evaluation set")
    # a component named eval, not one that merely contains the word
    TuneConfig(prompts=(tmp_path / "medieval" / "evaluation" / "p.jsonl",))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-gamma", "0"], "max-gamma must be in 1..32"),
        (["--max-gamma", "33"], "max-gamma must be in 1..32"),
        (["--limit", "0"], "limit must be >= 1"),
        (["--max-new-tokens", "0"], "max-new-tokens must be >= 1"),
    ],
)
def test_bad_tune_flags(
    capfd: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], message: str
) -> None:
    prompts = write_train_prompts(tmp_path / "train")
    code, out, err = run_cli(capfd, "tune", "--prompts", str(prompts), *flags)
    assert_one_line_error(code, out, err, message)


def test_profile_round_trip(profile: Profile) -> None:
    assert Profile.from_dict(profile.to_dict()) == profile


def _corrupt(data: dict[str, Any], path: list[str], value: Any) -> dict[str, Any]:
    data = json.loads(json.dumps(data))
    node = data
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (["version"], 1, "version 1"),
        (["version"], KeyError, "version None"),
        (["target"], KeyError, "target"),
        (["alphas"], 3, "not a specmtp tuning profile"),
        (["alphas"], ["x"], "not a specmtp tuning profile"),
        (["best_gamma"], "two", "not a specmtp tuning profile"),
        (["cost_model"], KeyError, "cost_model"),
        (["cost_model", "verify_s"], {"1": 0.1, "3": 0.2}, "cover n = 1..n"),
        (["cost_model", "verify_s"], {"1": -0.1}, "positive target costs"),
        (["cost_model", "draft_fixed_s"], -1.0, "draft costs must be >= 0"),
        (["cost_model", "catch_up_per_token_s"], -1.0, "draft costs must be >= 0"),
    ],
)
def test_corrupt_profile_data(profile: Profile, path: list[str], value: Any, message: str) -> None:
    with pytest.raises(SpecMTPError, match="(?i)" + message.replace(".", r"\.")):
        Profile.from_dict(_corrupt(profile.to_dict(), path, value))


def test_not_a_dict_is_refused() -> None:
    with pytest.raises(SpecMTPError, match="not a specmtp tuning profile"):
        Profile.from_dict(["a", "list"])  # type: ignore[arg-type]


def test_default_profile_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECMTP_CACHE", str(tmp_path))
    assert default_profile_path("default", "ngram") == tmp_path / "profiles" / "default__ngram.json"
    odd = default_profile_path("/models/my model.gguf", "ngram:2")
    assert odd.parent == tmp_path / "profiles"
    assert odd.name.startswith("models_my_model.gguf__ngram_2-") and odd.suffix == ".json"
    # specs that differ only in characters a file name cannot hold keep files of their own
    merged, first = (default_profile_path("default", d) for d in ("ngram|mtp", "ngram+mtp"))
    assert merged != first and merged.parent == first.parent == tmp_path / "profiles"
    monkeypatch.delenv("SPECMTP_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_profile_path("default", "ngram") == (
        tmp_path / "home" / ".cache" / "specmtp" / "profiles" / "default__ngram.json"
    )


def test_find_profile_looks_at_the_default_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, profile: Profile
) -> None:
    monkeypatch.setenv("SPECMTP_CACHE", str(tmp_path))
    assert find_profile("default", "ngram") is None
    profile.save(default_profile_path("default", "ngram"))
    assert find_profile("default", "ngram") == profile
    assert find_profile("default", "ngram:2") is None  # another pair's file is not used
    with pytest.raises(SpecMTPError, match="cannot read profile"):
        find_profile("default", "ngram", tmp_path / "missing.json")


@pytest.mark.parametrize(
    ("key", "value"), [("best_gamma", 0), ("best_gamma", 3), ("alphas", [1.5, 0.5])]
)
def test_out_of_range_profile_data(profile: Profile, key: str, value: Any) -> None:
    with pytest.raises(SpecMTPError):
        Profile.from_dict(_corrupt(profile.to_dict(), [key], value))
