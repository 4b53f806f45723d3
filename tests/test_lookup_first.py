"""Prompt lookup first, a model drafter otherwise (`ngram+SPEC`): which drafter drafts each
round, that the fallback keeps in step, and that output stays the target's own."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, hf_greedy, perturbed_copy, tiny_model
from test_decode_tree import TREE
from test_mtp_drafter import PROMPT, trained_heads

from specmtp.adaptive_schedule import AdaptiveGamma, GuardedGamma
from specmtp.api import build_drafter, gamma_settings
from specmtp.bench_results import arm_summary
from specmtp.config import GenerationConfig, SamplingConfig
from specmtp.costmodel import CostModel
from specmtp.decode import SpecDecoder
from specmtp.draft_model_drafter import DraftModelDrafter
from specmtp.drafters import (
    LOOKUP_ARM,
    MODEL_ARM,
    LookupFirstDrafter,
    NgramDrafter,
    Outcome,
    Proposal,
)
from specmtp.errors import SpecMTPError
from specmtp.models import LoadedModel
from specmtp.mtp_drafter import MTPDrafter
from specmtp.schedule import HeuristicGamma, RoundRecord

GREEDY = SamplingConfig()


class SpyDrafter(NgramDrafter):
    """Proposes a fixed token; records what it was asked and told."""

    def __init__(self) -> None:
        super().__init__()
        self.name = "spy"
        self.proposed: list[int] = []  # context lengths it drafted for
        self.observed: list[int] = []  # context lengths it was told about
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        self.proposed.append(context.shape[1])
        return Proposal(torch.full((1, k), 42), None)

    def observe(self, outcome: Outcome) -> None:
        self.observed.append(outcome.context.shape[1])


def test_lookup_drafts_on_a_two_token_match_and_the_fallback_otherwise() -> None:
    spy = SpyDrafter()
    drafter = LookupFirstDrafter(spy)
    assert drafter.name == "ngram+spy"
    # "2 3" occurred before, followed by 7 8: lookup drafts, the fallback is not asked.
    found = drafter.propose(torch.tensor([[1, 2, 3, 7, 8, 2, 3]]), 2, GREEDY, None)
    assert found.tokens.tolist() == [[7, 8]]
    assert spy.proposed == []
    # Only the last token ("3") occurred before: a one-token match is not enough.
    missed = drafter.propose(torch.tensor([[1, 3, 5, 9, 3]]), 2, GREEDY, None)
    assert missed.tokens.tolist() == [[42, 42]]
    assert spy.proposed == [5]
    assert (drafter.lookup_rounds, drafter.fallback_rounds) == (1, 1)
    # The fallback hears every outcome, whoever drafted, and every reset.
    drafter.observe(Outcome(torch.tensor([[1, 2, 3]]), 1, None))
    drafter.reset()
    assert spy.observed == [3] and spy.resets == 1


def test_longer_lookup_windows_are_tried_first() -> None:
    drafter = LookupFirstDrafter(SpyDrafter(), max_ngram=3)
    # "2 3" last occurred at index 5 (then 9), "1 2 3" at index 0 (then 4): the longer wins.
    context = torch.tensor([[1, 2, 3, 4, 0, 2, 3, 9, 1, 2, 3]])
    assert drafter.propose(context, 1, GREEDY, None).tokens.tolist() == [[4]]


@pytest.mark.parametrize("fallback", ["perturbed", "mtp-chain", "mtp-tree"])
def test_greedy_output_is_the_targets_own(fallback: str) -> None:
    target = tiny_model("llama", seed=0)
    if fallback == "perturbed":
        inner = DraftModelDrafter(perturbed_copy(target, scale=0.5, seed=3), vocab_size=TINY_VOCAB)
    else:
        heads = trained_heads(target, "sequential", steps=30)
        inner = MTPDrafter(heads, tree=TREE if fallback == "mtp-tree" else None)
    drafter = LookupFirstDrafter(inner)
    decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
    # A prompt that repeats itself, so that lookup finds matches in some rounds.
    prompt = PROMPT * 3
    result = decoder.generate(prompt, GenerationConfig(max_new_tokens=48, gamma=3))
    assert result.tokens == hf_greedy(target, prompt, 48)
    assert drafter.lookup_rounds > 0 and drafter.fallback_rounds > 0
    assert result.stats.accepted_tokens > 0


def test_specs(default_model: LoadedModel) -> None:
    drafter, vocab = build_drafter("ngram:4+mtp", default_model)
    assert isinstance(drafter, LookupFirstDrafter)
    assert isinstance(drafter.fallback, MTPDrafter)
    assert drafter.lookup.max_ngram == 4 and drafter.lookup.min_ngram == 2
    assert drafter.name == "ngram+mtp" and drafter.needs_target_hidden
    assert vocab == build_drafter("mtp", default_model)[1]
    for bad in ("ngram+", "ngram:1+mtp", "ngram:x+mtp", "ngram+ngram", "ngramz+mtp"):
        with pytest.raises(SpecMTPError, match="bad draft spec"):
            build_drafter(bad, default_model)


class ArmRecorder(LookupFirstDrafter):
    """Records, per round, the arm that drafted, the γ it was asked and what was accepted."""

    def __init__(self, fallback: SpyDrafter) -> None:
        super().__init__(fallback)
        self.rounds: list[list] = []  # [arm, k, accepted]

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        self.rounds.append([self.next_arm(context), k, None])
        return super().propose(context, k, sampling, generator)

    def observe(self, outcome: Outcome) -> None:
        super().observe(outcome)
        self.rounds[-1][2] = outcome.num_accepted


def _recorded_run(config: GenerationConfig) -> tuple[ArmRecorder, list[int], list[int]]:
    target = tiny_model("llama", seed=0)
    drafter = ArmRecorder(SpyDrafter())  # the model arm always drafts token 42: rejected
    decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
    prompt = PROMPT * 3
    result = decoder.generate(prompt, config)
    return drafter, result.tokens, hf_greedy(target, prompt, config.max_new_tokens)


def test_a_gamma_pair_gives_lookup_and_model_rounds_their_own_fixed_gamma() -> None:
    drafter, tokens, reference = _recorded_run(
        GenerationConfig(max_new_tokens=64, gamma=5, model_gamma=1)
    )
    assert tokens == reference
    asked = {arm: [k for a, k, _ in drafter.rounds if a == arm] for arm in (LOOKUP_ARM, MODEL_ARM)}
    assert asked[LOOKUP_ARM] and asked[MODEL_ARM]
    assert set(asked[MODEL_ARM]) == {1}
    assert asked[LOOKUP_ARM][0] == 5 and max(asked[LOOKUP_ARM]) == 5  # less only at the end


def test_stats_count_each_arms_rounds() -> None:
    target = tiny_model("llama", seed=0)
    drafter = ArmRecorder(SpyDrafter())
    decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
    stats = decoder.generate(PROMPT * 3, GenerationConfig(max_new_tokens=48, gamma=3)).stats
    for arm in (LOOKUP_ARM, MODEL_ARM):
        rounds = [(k, accepted) for a, k, accepted in drafter.rounds if a == arm]
        # The last round may draft nothing (the budget is spent): counted, never proposed.
        assert stats.arm_counts[arm][0] - len(rounds) in (0, 1)
        assert stats.arm_counts[arm][2] == sum(accepted for _, accepted in rounds)
    assert sum(c[0] for c in stats.arm_counts.values()) == stats.rounds
    assert sum(c[1] for c in stats.arm_counts.values()) == stats.drafted_tokens
    summary = arm_summary([stats, stats])
    lookup = stats.arm_counts[LOOKUP_ARM]
    assert summary[LOOKUP_ARM]["rounds"] == 2 * lookup[0]
    assert summary[LOOKUP_ARM]["mean_accepted_tokens"] == round(1 + lookup[2] / lookup[0], 4)


def test_each_arm_runs_its_own_heuristic_schedule() -> None:
    drafter, tokens, reference = _recorded_run(
        GenerationConfig(max_new_tokens=64, gamma=2, model_gamma=3, schedule="heuristic")
    )
    assert tokens == reference
    # Replay Hugging Face's +2 / -1 per arm; the last rounds may be cut by the token budget.
    expected = {LOOKUP_ARM: HeuristicGamma(2), MODEL_ARM: HeuristicGamma(3)}
    checked = 0
    for arm, k, accepted in drafter.rounds[:-2]:
        assert k == expected[arm].gamma, drafter.rounds
        expected[arm].update(RoundRecord(k, k, accepted, k + 1, 0.0, 0.0))
        checked += 1
    arms = {arm for arm, _, _ in drafter.rounds[:-2]}
    assert checked >= 6 and arms == {LOOKUP_ARM, MODEL_ARM}


def test_adaptive_schedules_per_arm_keep_greedy_output() -> None:
    drafter, tokens, reference = _recorded_run(
        GenerationConfig(max_new_tokens=64, gamma=6, schedule="adaptive")
    )
    assert tokens == reference
    assert {arm for arm, _, _ in drafter.rounds} == {LOOKUP_ARM, MODEL_ARM}


def test_guarded_schedules_per_arm_draft_their_own_gamma_or_nothing() -> None:
    """Each arm has its own guard: the lookup arm drafts its γ or nothing, the model arm
    its own. (Whether a guard switches an arm off depends on T(n): on the tiny model a
    verify of 4 tokens costs about one of 1, so even the always-rejected model arm's
    drafts are not predicted to lose; tests/test_schedule.py checks the switching.)"""
    config = GenerationConfig(max_new_tokens=64, gamma=2, model_gamma=3, schedule="guarded")
    drafter, tokens, reference = _recorded_run(config)
    assert tokens == reference
    rounds = drafter.rounds[:-2]  # the last rounds may be cut by the token budget
    asked = {arm: {k for a, k, _ in rounds if a == arm} for arm in (LOOKUP_ARM, MODEL_ARM)}
    assert asked == {LOOKUP_ARM: {2}, MODEL_ARM: {3}}
    target, drafter = tiny_model("llama", seed=0), LookupFirstDrafter(SpyDrafter())
    decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
    cost = CostModel((0.04, 0.042, 0.044, 0.046))
    lookup = decoder.schedules.for_arm(config, LOOKUP_ARM, cost)
    model = decoder.schedules.for_arm(config, MODEL_ARM, cost)
    assert isinstance(lookup, GuardedGamma) and isinstance(model, GuardedGamma)
    assert (lookup.max_gamma, model.max_gamma) == (2, 3)


def test_the_lookup_arm_learns_its_own_draft_cost() -> None:
    target = tiny_model("llama", seed=0)
    drafter = LookupFirstDrafter(SpyDrafter())
    decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
    cost = CostModel((0.04, 0.042, 0.044), draft_fixed_s=0.002, draft_per_token_s=0.005)
    config = GenerationConfig(gamma=2, schedule="adaptive")
    lookup = decoder.schedules.for_arm(config, LOOKUP_ARM, cost)
    model = decoder.schedules.for_arm(config, MODEL_ARM, cost)
    assert isinstance(lookup, AdaptiveGamma) and isinstance(model, AdaptiveGamma)
    assert lookup.cost.draft_s(2) == 0 and lookup.learn_draft
    assert model.cost.draft_s(2) == cost.draft_s(2) and not model.learn_draft


def test_a_gamma_pair_needs_a_drafter_with_arms() -> None:
    target = tiny_model("llama", seed=0)
    decoder = SpecDecoder(target, drafter=NgramDrafter(), vocab_size=TINY_VOCAB, context_length=256)
    with pytest.raises(SpecMTPError, match="needs an ngram\\+SPEC drafter"):
        decoder.generate(PROMPT, GenerationConfig(gamma=3, model_gamma=1))
    with pytest.raises(SpecMTPError, match="gamma must be >= 1"):
        GenerationConfig(gamma=3, model_gamma=0)


def test_gamma_pairs_parse() -> None:
    assert gamma_settings("4/1") == {"schedule": "fixed", "gamma": 4, "model_gamma": 1}
    assert gamma_settings("3") == {"schedule": "fixed", "gamma": 3}
    assert gamma_settings("guard:3") == {"schedule": "guarded", "gamma": 3}
    assert gamma_settings("guard:4/1") == {"schedule": "guarded", "gamma": 4, "model_gamma": 1}
    for bad in ("4/", "/1", "4/x", "4/1/2", "guard:", "guard:auto", "guard:guard:2"):
        with pytest.raises(SpecMTPError, match="N/M"):
            gamma_settings(bad)


def test_one_lookup_serves_next_arm_and_propose(monkeypatch: pytest.MonkeyPatch) -> None:
    drafter = LookupFirstDrafter(SpyDrafter())
    calls: list[int] = []
    match = drafter.lookup.match
    monkeypatch.setattr(drafter.lookup, "match", lambda ids: calls.append(1) or match(ids))
    context = torch.tensor([[1, 2, 3, 7, 8, 2, 3]])
    assert drafter.next_arm(context) == LOOKUP_ARM
    assert drafter.propose(context, 2, GREEDY, None).tokens.tolist() == [[7, 8]]
    assert len(calls) == 1
    drafter.propose(context.clone(), 2, GREEDY, None)  # another tensor: looked up again
    assert len(calls) == 2
