"""Bench aggregates from hand-built statistics: every number checked against a hand count.

Three prompts; the method under test ("m") and the baseline ("ar") ran each once.

  prompt  group  m's rounds (drafted, accepted, verified, requested)  m tokens  m latencies
  A       s/a    (2,2,3,2) (2,0,3,2)                                   4         0.5 1.5 0.4
  B       s/b    (2,1,3,2) (0,0,1,0) (1,0,2,2)                         4         1.5 0.5 9.0
  C       s/a    (2,0,3,2) (2,0,3,2)                                   2         1.0

`ar` commits one token per round: 4, 4 and 2 tokens in 2.0, 2.0 and 1.0 s. m's C tokens
differ from ar's (one greedy mismatch).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specmtp.bench import summarize, uneven_pace
from specmtp.bench_results import (
    BASELINE,
    MethodResult,
    PromptRun,
    acceptance_per_position,
    mean_accepted,
    predicted_speedup,
    table,
    target_pace,
    timed_verify_s,
)
from specmtp.costmodel import CostModel
from specmtp.stats import GenerationStats

Round = tuple[int, int, int, int]  # drafted, accepted, verified, requested
PREFILL_S = 2.0
DRAFT_S_PER_ROUND = 0.1
# T(1) = 1, T(2) = 1.25, T(3) = 1.5: the verify cost of 1, 2 and 3 tokens.
COST = CostModel((1.0, 1.25, 1.5), draft_fixed_s=DRAFT_S_PER_ROUND)
PLAIN_STEP_S = 0.9  # T(1) as measured for `ar`: deliberately not COST's T(1)


def prompt_run(
    question_id: int,
    group: str,
    tokens: list[int],
    rounds: list[Round],
    latencies: list[float],
    *,
    has_rounds: bool = True,
) -> PromptRun:
    stats = GenerationStats(gamma=2)
    for drafted, accepted, verified, requested in rounds:
        stats.record_round(drafted, accepted, verified, requested)
    assert sum(accepted + 1 for _, accepted, _, _ in rounds) in (len(tokens), 0)
    stats.new_tokens = len(tokens)
    stats.prefill_s = PREFILL_S
    stats.draft_s = DRAFT_S_PER_ROUND * sum(drafted > 0 for drafted, *_ in rounds)
    stats.first_token_s = latencies[0] / 4
    stats.total_s = latencies[0]
    stats.peak_kv_bytes = 1000 * question_id
    stats.peak_rss_bytes = 5000 + question_id
    return PromptRun(question_id, group, tokens, stats, list(latencies), has_rounds)


def plain(question_id: int, group: str, tokens: list[int], latency: float) -> PromptRun:
    return prompt_run(question_id, group, tokens, [(0, 0, 1, 0)] * len(tokens), [latency])


@pytest.fixture
def baseline() -> list[PromptRun]:
    return [
        plain(1, "s/a", [1, 2, 3, 4], 2.0),
        plain(2, "s/b", [5, 6, 7, 8], 2.0),
        plain(3, "s/a", [9, 10], 1.0),
    ]


@pytest.fixture
def runs() -> list[PromptRun]:
    return [
        prompt_run(1, "s/a", [1, 2, 3, 4], [(2, 2, 3, 2), (2, 0, 3, 2)], [0.5, 1.5, 0.4]),
        prompt_run(
            2, "s/b", [5, 6, 7, 8], [(2, 1, 3, 2), (0, 0, 1, 0), (1, 0, 2, 2)], [1.5, 0.5, 9.0]
        ),
        prompt_run(3, "s/a", [9, 99], [(2, 0, 3, 2), (2, 0, 3, 2)], [1.0]),
    ]


def method(runs: list[PromptRun], baseline: list[PromptRun], **kwargs) -> MethodResult:
    return MethodResult("m", "fixed:2", runs, baseline, **{"greedy": True, **kwargs})


def test_latency_is_the_median_of_repeats(runs: list[PromptRun]) -> None:
    assert [r.latency_s for r in runs] == [0.5, 1.5, 1.0]
    assert runs[1].to_dict() == {
        "question_id": 2,
        "group": "s/b",
        "latency_s": 1.5,
        "new_tokens": 4,
        "mean_accepted_tokens": pytest.approx(4 / 3, abs=1e-4),  # 4 tokens in 3 rounds
        "tokens_per_s": pytest.approx(4 / 1.5, abs=1e-3),
    }


def test_tau_is_weighted_by_rounds(runs: list[PromptRun]) -> None:
    # 10 tokens over 7 rounds; the mean of the per-prompt τ (2, 4/3, 1) would be 13/9.
    assert mean_accepted(runs) == pytest.approx(10 / 7)
    assert mean_accepted(runs[:1]) == pytest.approx(2.0)


def test_acceptance_per_position_pools_rounds(runs: list[PromptRun]) -> None:
    # Position 1 drafted in 6 rounds, accepted in 2 (A's first, B's first);
    # position 2 drafted in 5 rounds (B's 1-token draft skips it), accepted in 1.
    assert acceptance_per_position(runs) == [pytest.approx(2 / 6), pytest.approx(1 / 5)]


def test_conditional_acceptance_counts_rounds_that_reached_a_position(
    runs: list[PromptRun],
) -> None:
    b = runs[1].stats
    assert b.position_reached == [2, 1]  # the 1-token draft was rejected at position 1
    assert b.conditional_acceptance == [0.5, 0.0]
    assert b.acceptance_per_position == [0.5, 0.0]
    a = runs[0].stats
    assert a.acceptance_per_position == [0.5, 0.5]  # position 2 drafted twice, accepted once
    assert a.conditional_acceptance == [0.5, 1.0]  # ...but reached only once, and accepted
    assert b.requested_gammas == {2: 2, 0: 1}
    assert b.verify_sizes == {3: 1, 1: 1, 2: 1}


def test_speed_and_mismatches(runs: list[PromptRun], baseline: list[PromptRun]) -> None:
    m = method(runs, baseline)
    assert m.tokens_per_s == pytest.approx(10 / 3.0)  # median latencies 0.5 + 1.5 + 1.0
    assert m.speedup == pytest.approx((10 / 3.0) / (10 / 5.0))
    assert m.greedy_mismatches == 1  # prompt C
    assert method(runs, baseline, greedy=False).greedy_mismatches is None
    assert method(baseline, baseline).greedy_mismatches == 0


def test_per_group(runs: list[PromptRun], baseline: list[PromptRun]) -> None:
    groups = method(runs, baseline).per_group()
    assert list(groups) == ["s/a", "s/b"]
    # s/a: A and C, 6 tokens in 1.5 s against ar's 6 in 3.0 s; 2 accepted in 4 rounds.
    assert groups["s/a"] == {
        "num_prompts": 2,
        "tokens_per_s": pytest.approx(4.0),
        "speedup": pytest.approx(2.0),
        "mean_accepted_tokens": pytest.approx(1.5),
    }
    # s/b: B, 4 tokens in 1.5 s against 4 in 2.0 s; 1 accepted in 3 rounds.
    assert groups["s/b"] == {
        "num_prompts": 1,
        "tokens_per_s": pytest.approx(4 / 1.5, abs=1e-3),
        "speedup": pytest.approx(2.0 / 1.5, abs=1e-4),
        "mean_accepted_tokens": pytest.approx(4 / 3, abs=1e-4),
    }


def test_predicted_speedup_against_a_hand_count(
    runs: list[PromptRun], baseline: list[PromptRun]
) -> None:
    # verify: A 2·T(3) = 3.0; B T(3) + T(1) + T(2) = 3.75; C 2·T(3) = 3.0
    # draft: 0.1 s per drafting round, 6 of them; prefill 2 s per prompt
    spec_s = 3 * PREFILL_S + 6 * DRAFT_S_PER_ROUND + (3.0 + 3.75 + 3.0)
    plain_s = 3 * PREFILL_S + 10 * PLAIN_STEP_S  # 10 tokens at ar's T(1)
    assert predicted_speedup(runs, COST, PLAIN_STEP_S) == pytest.approx(plain_s / spec_s)
    m = method(runs, baseline, cost=COST, plain_step_s=PLAIN_STEP_S)
    assert m.predicted_speedup == pytest.approx(plain_s / spec_s)
    assert m.efficiency == pytest.approx(m.speedup / (plain_s / spec_s))


def test_plain_decoding_is_predicted_at_one(baseline: list[PromptRun]) -> None:
    """One T(1) per token and nothing else: whatever the costs, the prediction is 1."""
    assert predicted_speedup(baseline, COST, COST.target_s(1)) == pytest.approx(1.0)


def test_without_a_cost_model_there_is_no_prediction(
    runs: list[PromptRun], baseline: list[PromptRun]
) -> None:
    assert method(runs, baseline).predicted_speedup is None
    assert method(runs, baseline).efficiency is None
    assert method(runs, baseline, cost=COST).efficiency is None  # no plain T(1)


def test_to_dict(runs: list[PromptRun], baseline: list[PromptRun]) -> None:
    data = method(runs, baseline, cost=COST, plain_step_s=PLAIN_STEP_S).to_dict()
    assert data["new_tokens"] == 10
    assert data["mean_accepted_tokens"] == pytest.approx(10 / 7, abs=1e-4)
    assert data["latency_s"] == pytest.approx(1.0)  # the mean of the medians
    assert data["acceptance_per_position"] == [pytest.approx(1 / 3, abs=1e-4), 0.2]
    assert data["ttft_s"] == pytest.approx((0.5 + 1.5 + 1.0) / 4 / 3, abs=1e-4)
    assert data["peak_rss_bytes"] == 5003 and data["kv_cache_bytes"] == 3000
    assert data["draft_s"] == pytest.approx(0.6)
    assert data["requested_gammas"] == {"0": 1, "2": 6}
    assert data["schedule"] == "fixed:2"
    assert data["greedy_mismatches"] == 1
    assert data["efficiency"] == pytest.approx(data["speedup"] / data["predicted_speedup"], 1e-3)
    assert [p["question_id"] for p in data["per_prompt"]] == [1, 2, 3]
    assert "per_prompt" not in method(runs, baseline).to_dict(per_prompt=False)


def test_runs_without_rounds_have_no_tau(baseline: list[PromptRun]) -> None:
    """Hugging Face's methods: tokens and timings only."""
    hf = [
        prompt_run(r.question_id, r.group, r.tokens, [], [r.latency_s / 2], has_rounds=False)
        for r in baseline
    ]
    m = method(hf, baseline)
    assert mean_accepted(hf) is None
    assert acceptance_per_position(hf) == []
    assert m.speedup == pytest.approx(2.0)
    data = m.to_dict()
    assert data["mean_accepted_tokens"] is None
    assert data["efficiency"] is None and data["predicted_speedup"] is None
    assert {g["mean_accepted_tokens"] for g in data["per_group"].values()} == {None}
    assert {p["mean_accepted_tokens"] for p in data["per_prompt"]} == {None}
    rows = table({"hf": m}).splitlines()
    assert rows[2].split()[4:7] == ["-", "0", "-"]  # τ, mismatches, efficiency


def test_summarize_uses_ar_step_cost_and_each_methods_own(
    runs: list[PromptRun], baseline: list[PromptRun]
) -> None:
    ar_cost = CostModel((PLAIN_STEP_S,))
    runners = {
        BASELINE: SimpleNamespace(schedule="plain"),
        "m": SimpleNamespace(schedule="adaptive"),
        "hf": SimpleNamespace(schedule="fixed:4"),
    }
    results = summarize(
        runners,
        {BASELINE: baseline, "m": runs, "hf": baseline},
        {BASELINE: ar_cost, "m": COST},
        greedy=True,
    )
    assert [r.schedule for r in results.values()] == ["plain", "adaptive", "fixed:4"]
    assert all(r.baseline is baseline for r in results.values())
    assert results[BASELINE].predicted_speedup == pytest.approx(1.0)
    assert results["m"].predicted_speedup == pytest.approx(
        predicted_speedup(runs, COST, PLAIN_STEP_S)
    )
    assert results["hf"].predicted_speedup is None


def test_table_has_a_row_per_method(runs: list[PromptRun], baseline: list[PromptRun]) -> None:
    methods = {
        BASELINE: method(baseline, baseline),
        "m": method(runs, baseline, cost=COST, plain_step_s=PLAIN_STEP_S),
    }
    header, rule, *rows = table(methods).splitlines()
    assert header.split()[:3] == ["method", "latency", "s"]
    assert set(rule) == {"-"}
    assert [row.split()[0] for row in rows] == [BASELINE, "m"]
    m = rows[1].split()
    assert m[3] == f"{methods['m'].speedup:.2f}x"
    assert m[4] == f"{10 / 7:.2f}"
    assert m[5] == "1"  # mismatches


def _paced(runs: list[PromptRun], cost: CostModel, pace: float) -> list[PromptRun]:
    """The runs, each one's target forwards taking `pace` times their T(n) under `cost`."""
    for run in runs:
        run.stats.verify_s = pace * timed_verify_s(run.stats, cost)
    return runs


def test_target_pace_against_a_hand_count(runs: list[PromptRun]) -> None:
    # m verified 3 tokens in 5 rounds, 1 in one, 2 in one: 5 x 1.5 + 1 + 1.25 = 9.75 s timed
    runs[0].stats.verify_s, runs[1].stats.verify_s, runs[2].stats.verify_s = 6.0, 5.0, 8.5
    assert target_pace(runs, COST) == pytest.approx(19.5 / 9.75)
    assert method(runs, runs, cost=COST).to_dict()["target_pace"] == pytest.approx(2.0)
    assert method(runs, runs).target_pace is None  # no cost model timed
    runs[0].has_rounds = False
    assert target_pace(runs, COST) is None


@pytest.mark.parametrize(("pace", "warned"), [(1.1, False), (0.9, False), (1.4, True)])
def test_a_method_whose_forwards_ran_at_another_pace_than_ars_is_flagged(
    runs: list[PromptRun], baseline: list[PromptRun], pace: float, warned: bool
) -> None:
    ar_cost = CostModel((PLAIN_STEP_S,))
    methods = {
        BASELINE: MethodResult(BASELINE, "plain", _paced(baseline, ar_cost, 2.0), baseline,
                               greedy=True, cost=ar_cost),
        "m": method(_paced(runs, COST, 2.0 * pace), baseline, cost=COST),
        "hf": MethodResult("hf", "fixed:4", baseline, baseline, greedy=True),
    }  # fmt: skip
    assert methods[BASELINE].target_pace == pytest.approx(2.0)
    assert methods["m"].target_pace == pytest.approx(2.0 * pace)
    warnings = uneven_pace(methods)
    assert len(warnings) == warned
    if warned:
        assert warnings[0].startswith("warning: m's target forwards ran at 2.80x")
        assert "ar's at 2.00x" in warnings[0] and "off by about 29%" in warnings[0]
    assert uneven_pace({"m": methods["m"]}) == []  # no baseline: nothing to compare
