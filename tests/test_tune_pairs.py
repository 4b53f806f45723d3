"""`specmtp tune` for a drafter with arms (`ngram+mtp`: lookup first, the heads otherwise):
the γ pair sweep N/M, the per-arm statistics it rests on, and `best` / `auto` using it.

One tune run on the default model (γ up to 2, 2 short prompts, 10 new tokens) is shared by
the module. Measured speedups depend on the machine: only the search's structure and the
profile's consistency with its own measurements are checked.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import run_captured, run_cli

from specmtp import tune_pairs
from specmtp.adaptive_schedule import AdaptiveGamma
from specmtp.api import SpecGenerator, gamma_settings, make_config
from specmtp.config import GenerationConfig
from specmtp.costmodel import CostModel, expected_tokens
from specmtp.drafters import LOOKUP_ARM, MODEL_ARM
from specmtp.errors import SpecMTPError
from specmtp.profile import Profile
from specmtp.stats import GenerationStats
from specmtp.tune import TuneConfig

MAX_GAMMA = 2
NEW_TOKENS = 10
# Repetitive answers, so that both arms draft: lookup finds the repeats, the heads the rest.
TRAIN_PROMPTS = [
    "List the days of the week, then list them again.",
    "Count from one to ten in words, twice.",
]
GENERATE = ["generate", "List the days of the week twice.", "--chat", "--json", "--threads", "1"]


def last_json(out: str) -> dict[str, Any]:
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, Path]:
    """stdout, stderr and profile path of one tune run with ngram+mtp."""
    root = tmp_path_factory.mktemp("tune_pairs")
    (root / "train").mkdir()
    (root / "train" / "p.jsonl").write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in TRAIN_PROMPTS)
    )
    path = root / "out" / "p.json"
    code, out, err = run_captured(
        "tune", "--prompts", str(root / "train"), "--draft", "ngram+mtp", "--max-gamma",
        str(MAX_GAMMA), "--limit", "2", "--max-new-tokens", str(NEW_TOKENS), "--out", str(path),
        "--threads", "1",
    )  # fmt: skip
    assert code == 0, err
    return out, err, path


@pytest.fixture
def profile(tuned: tuple[str, str, Path]) -> Profile:
    return Profile.load(tuned[2])


def test_coordinate_search_over_pairs(tuned: tuple[str, str, Path], profile: Profile) -> None:
    """First the model rounds' γ with the lookup rounds' at the default γ (capped by
    max-gamma), then the lookup rounds' γ at the fastest model γ of the first pass."""
    pairs = [(row["gamma"], row["model_gamma"]) for row in profile.sweep]
    assert pairs[0] == (0, 0)  # plain decoding
    held = min(GenerationConfig().gamma, MAX_GAMMA)
    first = [(held, m) for m in range(1, MAX_GAMMA + 1)]
    assert pairs[1 : 1 + MAX_GAMMA] == first
    by_pair = {(r["gamma"], r["model_gamma"]): r for r in profile.sweep}
    fastest_model = max(first, key=lambda p: by_pair[p]["measured_speedup"])[1]
    second = [
        (n, fastest_model) for n in range(1, MAX_GAMMA + 1) if (n, fastest_model) not in first
    ]
    assert pairs[1 + MAX_GAMMA :] == second
    assert profile.meta["pair_search"] == {
        "lookup_gamma_while_model_varies": held,
        "model_gamma_while_lookup_varies": fastest_model,
    }
    assert profile.meta["num_prompts"] == 2
    best = max(profile.sweep[1:], key=lambda row: row["measured_speedup"])
    assert (profile.best_gamma, profile.model_gamma) == (best["gamma"], best["model_gamma"])
    out, err, path = tuned
    lines = out.strip().splitlines()
    assert lines[0].split() == ["N/M", "predicted", "measured", "tokens/s", "τ"]
    assert [line.split()[0] for line in lines[2 : 2 + len(pairs)]] == [f"{n}/{m}" for n, m in pairs]
    assert f"best γ pair {profile.best_gamma}/{profile.model_gamma} (lookup/model)" in lines
    assert "[2/2] model γ: tokens/s by N/M 0/0:" in err
    assert f"[2/2] lookup γ (model γ {fastest_model}): tokens/s by N/M 0/0:" in err
    assert path.with_suffix(".png").read_bytes().startswith(b"\x89PNG")


def test_predictions_weigh_each_arms_expectation(profile: Profile) -> None:
    """A pair's prediction: Σ_arm (share of rounds) · E_arm(its γ), times T(1), over a round's
    time, which lies between the cheapest and the dearest verify plus at most one T(1) of
    drafting (the heads' draft is cheaper than a target step)."""
    assert set(profile.arm_alphas) <= {LOOKUP_ARM, MODEL_ARM} and profile.arm_alphas
    for alphas in profile.arm_alphas.values():
        assert len(alphas) == MAX_GAMMA and all(0.0 <= a <= 1.0 for a in alphas)
    cost = profile.cost_model
    for row in profile.sweep[1:]:
        rounds = row["arm_rounds"]
        total = sum(rounds.values())
        assert total > 0 and row["mean_accepted_tokens"] >= 1.0
        gammas = {LOOKUP_ARM: row["gamma"], MODEL_ARM: row["model_gamma"]}
        expected = sum(
            rounds[arm] / total * expected_tokens(profile.arm_alphas[arm], gammas[arm])
            for arm in rounds
        )
        costs = [cost.target_s(n) for n in range(1, max(gammas.values()) + 2)]
        gain = expected * cost.target_s(1)
        assert gain / (max(costs) + cost.target_s(1)) <= row["predicted_speedup"]
        assert row["predicted_speedup"] <= gain / min(costs) * 1.001


def test_best_and_auto_use_the_pair(
    capfd: pytest.CaptureFixture[str], tuned: tuple[str, str, Path], profile: Profile
) -> None:
    assert gamma_settings("best", profile) == {
        "schedule": "fixed", "gamma": profile.best_gamma, "model_gamma": profile.model_gamma,
    }  # fmt: skip
    argv = [*GENERATE, "--draft", "ngram+mtp", "--profile", str(tuned[2])]
    code, out, err = run_cli(capfd, *argv, "--gamma", "best", "--max-new-tokens", "12")
    assert code == 0, err
    asked = {int(g) for g in last_json(out)["requested_gammas"]}
    assert asked <= {0, profile.best_gamma, profile.model_gamma}  # 0: the last token's round
    # auto: each arm's adaptive schedule starts from that arm's α, not the pooled ones
    gen = SpecGenerator(draft="ngram+mtp", profile=profile)
    config = make_config(**gamma_settings("auto", profile))
    for arm, alphas in profile.arm_alphas.items():
        schedule = gen.decoder.schedules.for_arm(config, arm, CostModel((0.05, 0.06, 0.07)))
        assert isinstance(schedule, AdaptiveGamma)
        assert tuple(schedule.prior) == alphas[: schedule.max_gamma]
    schedule = gen.decoder.schedules.for_arm(config, "", CostModel((0.05, 0.06, 0.07)))
    assert tuple(schedule.prior) == profile.alphas  # type: ignore[attr-defined]


def test_pair_profile_round_trip_and_checks(profile: Profile) -> None:
    assert Profile.from_dict(profile.to_dict()) == profile
    data = profile.to_dict()
    for key, value, message in [
        ("model_gamma", MAX_GAMMA + 1, "model_gamma must be in 1.."),
        ("model_gamma", 0, "model_gamma must be in 1.."),
        ("arm_alphas", {"model": [0.5, 1.5]}, "the model arm's alphas must be in [0, 1]"),
        ("arm_alphas", {"model": 0.5}, "not a specmtp tuning profile"),
    ]:
        with pytest.raises(SpecMTPError, match=message.replace("[", r"\[").replace("]", r"\]")):
            Profile.from_dict({**data, key: value})
    chain = {k: v for k, v in data.items() if k not in ("model_gamma", "arm_alphas")}
    assert Profile.from_dict(chain).model_gamma is None  # profiles from before pairs still load


def test_arm_positions_add_up_to_the_rounds() -> None:
    """Per arm, position counts follow record_round's rules, so the arms sum to the whole."""
    stats = GenerationStats(gamma=3)
    rounds = [  # arm, drafted, accepted, requested
        (LOOKUP_ARM, 3, 3, 3), (LOOKUP_ARM, 1, 1, 3), (LOOKUP_ARM, 0, 0, 3),
        (MODEL_ARM, 1, 0, 1), (MODEL_ARM, 1, 1, 1), (LOOKUP_ARM, 2, 0, 3),
    ]  # fmt: skip
    for arm, drafted, accepted, requested in rounds:
        stats.record_round(drafted, accepted, drafted + 1, requested)
        stats.record_arm(arm, drafted, accepted, requested, draft_s=0.001 * drafted)
    # lookup: position 1 reached by all 4 of its rounds (the empty one counts as a rejection
    # there), accepted by 2; position 2 reached by 2 (after an accepted first: one drafted
    # it, one stopped short), accepted by 1; position 3 reached and accepted once.
    assert stats.arm_reached[LOOKUP_ARM] == [4, 2, 1]
    assert stats.arm_accepted[LOOKUP_ARM] == [2, 1, 1]
    assert stats.arm_reached[MODEL_ARM] == [2]
    assert stats.arm_accepted[MODEL_ARM] == [1]
    for i in range(3):
        arms = (stats.arm_reached, stats.arm_accepted)
        summed = [sum(counts[arm][i] for arm in counts if i < len(counts[arm])) for counts in arms]
        assert summed == [stats.position_reached[i], stats.position_accepted[i]]
    assert stats.arm_draft_s[LOOKUP_ARM] == pytest.approx(0.006)
    assert stats.arm_draft_s[MODEL_ARM] == pytest.approx(0.002)


def test_a_real_generation_counts_every_arm_round() -> None:
    gen = SpecGenerator(draft="ngram+mtp")
    ids = gen.encode(TRAIN_PROMPTS[0], chat=True)
    stats = gen.decoder.generate(ids, make_config(max_new_tokens=24, gamma=3, model_gamma=2)).stats
    assert stats.gamma == 3
    for i in range(stats.gamma):
        for counts, whole in ((stats.arm_reached, stats.position_reached),
                              (stats.arm_accepted, stats.position_accepted)):  # fmt: skip
            assert sum(c[i] for c in counts.values() if i < len(c)) == whole[i]
    assert sum(stats.arm_draft_s.values()) == pytest.approx(stats.draft_s)


def test_the_model_gamma_stops_at_the_heads_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three MTP depths draft at most three tokens: model γ 4..6 would rerun γ 3."""
    passes: list[list[tuple[int, int]]] = []

    def fake_pass(*args: Any) -> None:  # (plain, spec, prompt_ids, config, pairs, runs, ...)
        pairs, runs = args[4], args[5]
        passes.append(list(pairs))
        for n, m in pairs:  # model γ 2 is the fastest
            runs[n, m] = [GenerationStats(gamma=max(n, m), new_tokens=10, total_s=1 + abs(m - 2))]

    monkeypatch.setattr(tune_pairs, "_pair_pass", fake_pass)
    heads = SimpleNamespace(max_depth=3)
    spec = SimpleNamespace(decoder=SimpleNamespace(drafter=SimpleNamespace(fallback=heads)))
    config = TuneConfig(prompts=(Path(__file__),), draft="ngram+mtp", max_gamma=6)
    tune_pairs.sweep_pair_runs(None, spec, [], config, print)
    assert passes == [[(4, 1), (4, 2), (4, 3)], [(1, 2), (2, 2), (3, 2), (5, 2), (6, 2)]]
