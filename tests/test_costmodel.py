"""The cost model: E(k) against an enumeration of outcomes, T(n) and D(k) arithmetic, the
draft-cost fit, T(n) measurement, and the bridge to real runs: E(γ) from a run's
conditional acceptances is that run's τ."""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Sequence

import pytest
import torch
from conftest import TINY_VOCAB, perturbed_copy, tiny_model
from transformers import PreTrainedModel

from specmtp.cache import CachedModel
from specmtp.config import GenerationConfig, SamplingConfig
from specmtp.costmodel import (
    CostModel,
    conditional_acceptance,
    expected_tokens,
    fit_draft_cost,
    measure_verify_costs,
)
from specmtp.decode import SpecDecoder
from specmtp.draft_model_drafter import DraftModelDrafter
from specmtp.drafters import Drafter, NgramDrafter, Outcome, Proposal
from specmtp.errors import SpecMTPError
from specmtp.tree import TokenTree

PROMPT = [5, 17, 3, 88, 41, 5, 17, 3, 60, 2]


# --- E(k) --------------------------------------------------------------------------------


def enumerated_expected_tokens(alphas: Sequence[float], k: int) -> float:
    """The slow reference: every one of the 2^k accept/reject outcomes of the k draft
    positions, each position passing independently with probability α_i (so α_i is also
    its pass rate given the earlier ones passed). A round keeps the leading passes, plus
    the next token. Positions without an α never pass."""
    alpha = [alphas[i] if i < len(alphas) else 0.0 for i in range(k)]
    total = 0.0
    for outcome in itertools.product((True, False), repeat=k):
        probability = math.prod(
            a if passed else 1 - a for a, passed in zip(alpha, outcome, strict=True)
        )
        kept = next((i for i, passed in enumerate(outcome) if not passed), k)
        total += probability * (kept + 1)
    return total


@pytest.mark.parametrize(
    "alphas", [(0.9, 0.6, 0.3, 0.8), (1.0, 1.0, 0.5), (0.0, 0.9, 0.9), (0.25,), ()]
)
@pytest.mark.parametrize("k", range(7))
def test_expected_tokens_matches_enumeration(alphas: tuple[float, ...], k: int) -> None:
    assert expected_tokens(alphas, k) == pytest.approx(enumerated_expected_tokens(alphas, k))


def test_expected_tokens_simple_cases() -> None:
    assert expected_tokens([0.7, 0.7], 0) == 1.0  # plain decoding: one token a round
    assert expected_tokens([1.0] * 5, 5) == 6.0  # all drafts plus the bonus
    assert expected_tokens([0.0] * 5, 5) == 1.0
    # Conditional, not marginal: draft 2 counts only when draft 1 passed too.
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)


# --- CostModel ---------------------------------------------------------------------------


def test_target_s_reads_measurements_and_extends_the_last_slope() -> None:
    cost = CostModel((1.0, 1.5, 2.5))
    assert [cost.target_s(n) for n in (1, 2, 3)] == [1.0, 1.5, 2.5]
    assert cost.target_s(4) == pytest.approx(3.5)  # slope 1.0 per token from n = 2 -> 3
    assert cost.target_s(6) == pytest.approx(5.5)
    # A falling last step (CPU shapes) is not extended downwards: flat instead.
    assert CostModel((1.0, 3.0, 2.0)).target_s(5) == 2.0
    assert CostModel((2.0,)).target_s(9) == 2.0  # one measurement: no slope to extend
    with pytest.raises(ValueError):
        cost.target_s(0)


def test_draft_round_and_speedup_arithmetic() -> None:
    cost = CostModel((1.0, 1.2, 1.4, 1.6), draft_fixed_s=0.3, draft_per_token_s=0.2)
    assert cost.draft_s(0) == 0.0  # plain decoding drafts nothing, not even the fixed part
    assert cost.draft_s(3) == pytest.approx(0.3 + 3 * 0.2)
    assert cost.round_s(0) == 1.0
    assert cost.round_s(3) == pytest.approx(0.9 + 1.6)  # draft 3, verify [last, *3 drafts]
    assert cost.round_s(3, verified=2) == pytest.approx(0.9 + 1.2)  # e.g. a tree's node count
    # Speedup: tokens per second of k over plain decoding's 1 token per T(1).
    alphas = [0.8, 0.5, 0.5]
    assert cost.speedup(alphas, 0) == 1.0
    assert cost.speedup(alphas, 2) == pytest.approx((1 + 0.8 + 0.4) * 1.0 / (0.7 + 1.4))
    assert cost.speedup(alphas, 2, verified=4) == pytest.approx(2.2 / (0.7 + 1.6))


def brute_best_gamma(cost: CostModel, alphas: Sequence[float], max_gamma: int) -> int:
    """Simulated tokens per second of every k, from the enumerated E(k); smallest k on ties."""
    rates = [enumerated_expected_tokens(alphas, k) / cost.round_s(k) for k in range(max_gamma + 1)]
    return min(k for k, rate in enumerate(rates) if rate >= max(rates) - 1e-12)


@pytest.mark.parametrize(
    ("alphas", "draft_per_token_s", "want"),
    [
        ([0.9, 0.9, 0.2, 0.2], 0.1, 2),  # an interior optimum: position 3 rarely passes
        ([0.95] * 6, 0.05, 6),  # cheap and accurate: draft as much as allowed
        ([0.0] * 6, 0.1, 0),  # never accepted: drafting never pays
        ([0.0] * 6, 0.0, 0),  # free but useless drafts tie with plain decoding: prefer 0
        ([0.3] * 6, 0.5, 0),  # accepted sometimes, but too expensive
    ],
)
def test_best_gamma_is_the_argmax(alphas: list[float], draft_per_token_s: float, want: int) -> None:
    flat = CostModel((1.0,) * 7, draft_per_token_s=draft_per_token_s)
    assert brute_best_gamma(flat, alphas, 6) == want  # the reference agrees with the hand value
    assert flat.best_gamma(alphas, 6) == want
    rising = CostModel(tuple(1 + 0.1 * n for n in range(7)), draft_per_token_s=draft_per_token_s)
    assert rising.best_gamma(alphas, 6) == brute_best_gamma(rising, alphas, 6)
    assert flat.best_gamma(alphas, 1) == min(want, 1)  # never above max_gamma


def test_scaled_multiplies_target_and_draft_costs() -> None:
    cost = CostModel((1.0, 1.2, 1.3), draft_fixed_s=0.1, draft_per_token_s=0.5)
    slow = cost.scaled(target=2.0, draft=3.0)
    assert slow.verify_s == pytest.approx((2.0, 2.4, 2.6))
    assert (slow.draft_fixed_s, slow.draft_per_token_s) == pytest.approx((0.3, 1.5))
    # A machine slower in both alike predicts the same speedups; a slower target alone makes
    # drafting relatively cheaper, so it pays to draft more.
    alphas = [0.9, 0.8, 0.7]
    for k in range(4):
        both = cost.scaled(target=2.0, draft=2.0).speedup(alphas, k)
        assert both == pytest.approx(cost.speedup(alphas, k))
    assert cost.best_gamma(alphas, 3) == 2
    assert cost.scaled(target=10.0).best_gamma(alphas, 3) == 3


def test_to_dict_from_dict_round_trip() -> None:
    cost = CostModel((0.001, 0.0015, 0.002, 0.0031), draft_fixed_s=0.0002, draft_per_token_s=1e-4)
    data = json.loads(json.dumps(cost.to_dict()))  # as stored in a profile file
    assert data["verify_s"] == {"1": 0.001, "2": 0.0015, "3": 0.002, "4": 0.0031}
    assert CostModel.from_dict(data) == cost
    # Draft costs are optional: a T(n)-only model.
    assert CostModel.from_dict({"verify_s": {"2": 0.2, "1": 0.1}}) == CostModel((0.1, 0.2))


@pytest.mark.parametrize(
    "data",
    [
        {},
        None,
        {"verify_s": {}},
        {"verify_s": [0.1, 0.2]},
        {"verify_s": {"1": 0.1, "3": 0.3}},  # a gap at n = 2
        {"verify_s": {"0": 0.1, "1": 0.2}},
        {"verify_s": {"one": 0.1}},
        {"verify_s": {"1": "fast"}},
        {"verify_s": {"1": 0.1, "2": 0.0}},
        {"verify_s": {"1": 0.1}, "draft_fixed_s": -1.0},
        {"verify_s": {"1": 0.1}, "draft_per_token_s": "cheap"},
    ],
)
def test_from_dict_refuses_bad_data(data: object) -> None:
    with pytest.raises(SpecMTPError):
        CostModel.from_dict(data)  # type: ignore[arg-type]


def test_constructor_refuses_unusable_costs() -> None:
    for verify_s in [(), (0.1, 0.0), (0.1, -0.2), (math.nan,)]:
        with pytest.raises(SpecMTPError):
            CostModel(verify_s)
    with pytest.raises(SpecMTPError):
        CostModel((0.1,), draft_per_token_s=-0.01)


# --- estimates from counts ---------------------------------------------------------------


def test_conditional_acceptance() -> None:
    assert conditional_acceptance([4, 2, 0], [2, 1, 0]) == [0.5, 0.5, None]
    with pytest.raises(ValueError):
        conditional_acceptance([4, 2], [2])


def test_fit_draft_cost_recovers_a_line() -> None:
    a, b = 0.003, 0.0012
    samples = [(k, a + b * k) for k in (1, 2, 3, 5, 8)]
    assert fit_draft_cost(samples) == pytest.approx((a, b))
    # Plain rounds (k = 0) draft nothing and say nothing about D(k).
    assert fit_draft_cost([(0, 5.0), *samples]) == pytest.approx((a, b))


def test_fit_draft_cost_refits_through_the_origin_for_a_negative_intercept() -> None:
    samples = [(1, 0.1), (2, 0.5), (3, 0.9)]
    ks = torch.tensor([[1.0], [2.0], [3.0]], dtype=torch.float64)
    seconds = torch.tensor([[0.1], [0.5], [0.9]], dtype=torch.float64)
    free = torch.linalg.lstsq(torch.cat([torch.ones_like(ks), ks], 1), seconds).solution
    assert free[0].item() < 0  # the unconstrained fit would predict negative fixed costs
    through_origin = torch.linalg.lstsq(ks, seconds).solution.item()
    assert fit_draft_cost(samples) == pytest.approx((0.0, through_origin))


def test_fit_draft_cost_degenerate_samples() -> None:
    assert fit_draft_cost([]) == (0.0, 0.0)
    assert fit_draft_cost([(0, 1.0)]) == (0.0, 0.0)
    # One k only: no line through one point, so all of it is per-token cost.
    assert fit_draft_cost([(2, 0.4), (2, 0.6)]) == pytest.approx((0.0, 0.25))


# --- measuring T(n) ----------------------------------------------------------------------


class SleepingRunner:
    """A stand-in for CachedModel whose forward over n tokens sleeps n * `per_token`
    seconds, logging where each forward started, so timings and rollbacks can be checked."""

    def __init__(self, per_token: float) -> None:
        self.per_token = per_token
        self.device = torch.device("cpu")
        self.length = 0
        self.calls: list[tuple[int, int]] = []  # (length before, tokens)

    def reset(self) -> None:
        self.length = 0

    def forward(self, tokens: torch.Tensor, *, last_only: bool = False) -> None:
        self.calls.append((self.length, tokens.shape[1]))
        time.sleep(self.per_token * tokens.shape[1])
        self.length += tokens.shape[1]

    def crop(self, length: int) -> None:
        assert length <= self.length
        self.length = length


def test_measure_verify_costs_times_each_size_after_the_prefill() -> None:
    runner = SleepingRunner(per_token=0.002)
    costs = measure_verify_costs(runner, PROMPT, max_tokens=3, repeats=2)  # type: ignore[arg-type]
    assert len(costs) == 3
    for n, seconds in enumerate(costs, 1):
        assert 0.002 * n <= seconds < 0.002 * n + 0.05
    prefill, *timed = runner.calls
    assert prefill == (0, len(PROMPT) - 1)
    # Every timed forward starts right after the prefill (each one was rolled back), and the
    # sizes are interleaved: a warm-up sweep plus `repeats` sweeps of 1, 2, 3.
    assert timed == [(len(PROMPT) - 1, n) for n in (1, 2, 3)] * 3
    assert runner.length == 0


def test_measure_verify_costs_on_a_tiny_model_leaves_the_cache_empty() -> None:
    model = tiny_model("llama", seed=0)
    runner = CachedModel(model, vocab_size=TINY_VOCAB)
    runner.forward(torch.tensor([PROMPT]))  # whatever was cached before is dropped
    costs = measure_verify_costs(runner, PROMPT, max_tokens=5, repeats=2)
    assert len(costs) == 5 and all(t > 0 for t in costs)
    assert runner.length == 0 and runner.cache.get_seq_length() == 0
    CostModel(costs)  # usable as is
    # The runner still decodes correctly from scratch.
    logits = runner.forward(torch.tensor([PROMPT]))
    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-4)


def test_a_tree_drafters_costs_are_timed_with_tree_forwards() -> None:
    """With a tree, n tokens are the root and the tree's first n - 1 nodes under their tree
    mask (sizes past the tree: a chain), each after the same prefill."""
    runner = CachedModel(tiny_model("llama", seed=0), vocab_size=TINY_VOCAB)
    calls: list[tuple[int, int, tuple[int, ...] | None]] = []  # (past, tokens, mask shape)
    forward = runner.forward

    def spy(tokens: torch.Tensor, **kwargs: torch.Tensor | bool | None) -> torch.Tensor:
        mask = kwargs.get("attention_mask")
        shape = None if not isinstance(mask, torch.Tensor) else tuple(mask.shape)
        calls.append((runner.length, tokens.shape[1], shape))
        return forward(tokens, **kwargs)  # type: ignore[arg-type]

    runner.forward = spy  # type: ignore[method-assign]
    tree = TokenTree(((0,), (1,), (0, 0)))
    costs = measure_verify_costs(runner, PROMPT, max_tokens=5, repeats=1, tree=tree)
    assert len(costs) == 5 and runner.length == 0
    past = len(PROMPT) - 1
    trees = [(past, n, (1, 1, n, past + n)) for n in (2, 3, 4)]
    assert calls[1:] == [(past, 1, None), *trees, (past, 5, None)] * 2  # warm-up, then timed


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "repeats"), [(PROMPT, 0, 3), (PROMPT, 4, 0), ([5], 4, 3)]
)
def test_measure_verify_costs_refuses_bad_arguments(
    prompt: list[int], max_tokens: int, repeats: int
) -> None:
    runner = CachedModel(tiny_model("llama", seed=0), vocab_size=TINY_VOCAB)
    with pytest.raises(SpecMTPError):
        measure_verify_costs(runner, prompt, max_tokens=max_tokens, repeats=repeats)


# --- the model against real runs ---------------------------------------------------------


def make_drafter(kind: str, target: PreTrainedModel) -> Drafter:
    if kind == "ngram":  # proposes fewer tokens than asked, or none, when matches run out
        return NgramDrafter()
    return DraftModelDrafter(perturbed_copy(target, scale=0.1, seed=1), vocab_size=TINY_VOCAB)


def make_decoder(kind: str, **kwargs: object) -> SpecDecoder:
    target = tiny_model("llama", seed=0)
    return SpecDecoder(
        target,
        drafter=make_drafter(kind, target),
        vocab_size=TINY_VOCAB,
        context_length=256,
        **kwargs,
    )


@pytest.mark.parametrize("kind", ["draft", "ngram"])
@pytest.mark.parametrize("gamma", [2, 4])
def test_expected_tokens_of_a_runs_acceptances_is_its_tau(kind: str, gamma: int) -> None:
    """E(γ) from the measured α_i equals the measured τ when every round asked for γ.

    Near max_new_tokens, `_draft_limit` cuts k so as not to draft past it; a cut round
    adds to the position counts unevenly, and the identity no longer holds exactly. So the
    run ends at an EOS token instead, with max_new_tokens far enough away that no round is
    cut: a round is counted whole even when EOS stops the output inside it. The assertion
    on requested_gammas checks that no round was cut.
    """
    budget = 80
    reference = make_decoder(kind).generate(PROMPT, GenerationConfig(max_new_tokens=budget))
    tokens = reference.tokens
    # The latest token to first appear well before the budget (so no round reaches it).
    stop_at = max(i for i, t in enumerate(tokens[: budget - gamma - 2]) if t not in tokens[:i])
    decoder = make_decoder(kind, eos_token_ids=[tokens[stop_at]])
    result = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=budget, gamma=gamma))
    stats = result.stats
    assert result.tokens == tokens[: stop_at + 1] and stats.finish_reason == "eos"
    assert stats.requested_gammas == {gamma: stats.rounds}  # no round was cut
    assert stats.rounds >= 5
    if kind == "ngram":  # some rounds drafted fewer than asked: those count as rejections
        assert stats.drafted_tokens < gamma * stats.rounds
    alphas = stats.conditional_acceptance
    assert all(a is not None for a in alphas)
    assert 1 < stats.mean_accepted_tokens < gamma + 1
    assert expected_tokens(alphas, gamma) == pytest.approx(stats.mean_accepted_tokens, rel=1e-12)
    # The unconditional per-position rates would not do: they overcount the product.
    marginal = [a or 0.0 for a in stats.acceptance_per_position]
    assert expected_tokens(marginal, gamma) != pytest.approx(stats.mean_accepted_tokens)


class RecordingDrafter:
    """Delegates to a drafter and logs every round as (requested k, drafted, accepted)."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.name = inner.name
        self.needs_target_hidden = False
        self.rounds: list[tuple[int, int, int]] = []
        self._asked = (0, 0)

    def reset(self) -> None:
        self.inner.reset()
        self.rounds.clear()

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        proposal = self.inner.propose(context, k, sampling, generator)
        self._asked = (k, proposal.depth)
        return proposal

    def observe(self, outcome: Outcome) -> None:
        self.rounds.append((*self._asked, outcome.num_accepted))
        self._asked = (0, 0)  # a round without drafts calls observe but not propose
        self.inner.observe(outcome)

    def weight_tensors(self) -> list[torch.Tensor]:
        return self.inner.weight_tensors()

    def kv_bytes(self) -> int:
        return self.inner.kv_bytes()

    def kv_bytes_per_token(self) -> int:
        return self.inner.kv_bytes_per_token()


@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_generation_stats_fields_match_a_recount_of_the_rounds(kind: str) -> None:
    """The heuristic schedule varies k, the end of the run cuts it, and the n-gram drafter
    drafts fewer than asked, so every counter is exercised; each is recounted here from
    the drafter's own log of the rounds."""
    decoder = make_decoder(kind)
    recorder = RecordingDrafter(decoder.drafter)
    decoder.drafter = recorder
    config = GenerationConfig(max_new_tokens=60, gamma=3, schedule="heuristic")
    result = decoder.generate(PROMPT, config)
    stats, rounds = result.stats, recorder.rounds
    assert len(rounds) == stats.rounds and len({k for k, _, _ in rounds}) > 2
    # The per-position lists grow to the deepest round: the heuristic may go past gamma.
    depth = max(config.gamma, *(d for _, d, _ in rounds))
    assert stats.gamma == depth == len(stats.position_reached)
    if kind == "ngram":
        assert any(d < k for k, d, _ in rounds)
    assert stats.position_proposed == [sum(d > i for _, d, _ in rounds) for i in range(depth)]
    assert stats.position_accepted == [sum(a > i for _, _, a in rounds) for i in range(depth)]
    # α_i's denominator: rounds that asked for position i with every earlier draft accepted
    # (a position asked for and not drafted counts as drafted and rejected).
    reached = [sum(k > i and a >= i for k, _, a in rounds) for i in range(depth)]
    assert stats.position_reached == reached
    assert stats.conditional_acceptance == [
        sum(a > i for _, _, a in rounds) / r if r else None for i, r in enumerate(reached)
    ]
    requested: dict[int, int] = {}
    sizes: dict[int, int] = {}
    for k, d, _ in rounds:
        requested[k] = requested.get(k, 0) + 1
        sizes[d + 1] = sizes.get(d + 1, 0) + 1
    assert stats.requested_gammas == requested
    assert stats.verify_sizes == sizes
    assert stats.peak_kv_bytes > 0 and stats.peak_rss_bytes > 0
    assert 0 < stats.first_token_s <= stats.total_s
    assert stats.tpot_s == pytest.approx(
        (stats.total_s - stats.first_token_s) / (stats.new_tokens - 1)
    )
    summary = stats.to_dict()
    assert summary["requested_gammas"] == dict(sorted(requested.items()))
    assert summary["peak_kv_bytes"] == stats.peak_kv_bytes
