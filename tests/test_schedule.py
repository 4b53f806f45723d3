"""Draft-length schedules on their own (fed scripted rounds), then inside the decode loop:
greedy parity for every schedule, the adaptive schedule's measured cost model and choices,
seeded sampling, and the memory budget."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import torch
from conftest import TINY_VOCAB, hf_greedy, perturbed_copy, tiny_model
from transformers import PreTrainedModel

from specmtp import costmodel, decode, decode_schedules
from specmtp.adaptive_schedule import AdaptiveGamma, AdaptiveSettings, GuardedGamma
from specmtp.cache import CachedModel, kv_bytes_per_token, module_tensors, tensor_bytes
from specmtp.config import GenerationConfig, SamplingConfig
from specmtp.costmodel import CostModel
from specmtp.decode import SpecDecoder
from specmtp.draft_model_drafter import DraftModelDrafter
from specmtp.drafters import (
    Drafter,
    LookupFirstDrafter,
    NoMemory,
    Outcome,
    Proposal,
    drafter_catch_up,
)
from specmtp.errors import SpecMTPError
from specmtp.schedule import FixedGamma, HeuristicGamma, RoundRecord

PROMPT = [5, 17, 3, 88, 41, 5, 17, 3, 60, 2]
NEW_TOKENS = 40


def target_cost(draft_per_token_s: float = 0.0) -> CostModel:
    """T(n) = 1 + 0.05 (n - 1) seconds: a verify pass costs little more per extra token."""
    return CostModel(
        tuple(1.0 + 0.05 * (n - 1) for n in range(1, 9)), draft_per_token_s=draft_per_token_s
    )


Accept = Callable[[int, int], int]  # (round index, γ) -> drafts accepted


def drive(
    schedule: AdaptiveGamma | HeuristicGamma | FixedGamma,
    accept: Accept,
    rounds: int,
    *,
    target_speed: float = 1.0,
    draft_speed: float = 1.0,
    draft_per_token_s: float | None = None,
    limit: int = 8,
) -> list[int]:
    """Runs `rounds` scripted rounds; each takes the cost model's own times for a chain of
    the chosen γ, times the machine's speeds (or a fixed draft cost per token, for a
    schedule that learns it). Returns the γ chosen in each round."""
    cost = schedule.cost if isinstance(schedule, AdaptiveGamma) else target_cost()
    chosen = []
    for i in range(rounds):
        k = schedule.next_gamma(limit)
        chosen.append(k)
        draft_s = (
            cost.draft_s(k) * draft_speed if draft_per_token_s is None else draft_per_token_s * k
        )
        record = RoundRecord(
            k, k, accept(i, k), k + 1, draft_s, cost.target_s(k + 1) * target_speed
        )
        schedule.update(record)
    return chosen


def all_accepted(i: int, k: int) -> int:
    return k


def none_accepted(i: int, k: int) -> int:
    return 0


def first_three(i: int, k: int) -> int:
    """α_1..α_3 = 1, α_4 = 0: the best γ depends on what a draft costs."""
    return min(k, 3)


# --- fixed and heuristic -----------------------------------------------------------------


def test_fixed_gamma_is_fixed_up_to_the_limit() -> None:
    schedule = FixedGamma(4)
    assert drive(schedule, none_accepted, 5) == [4] * 5
    assert drive(schedule, all_accepted, 5) == [4] * 5
    assert [schedule.next_gamma(limit) for limit in range(7)] == [0, 1, 2, 3, 4, 4, 4]


def test_heuristic_gamma_follows_hugging_faces_rule() -> None:
    """+2 after a round that accepted all it asked for, -1 otherwise but not below 1; plain
    rounds (γ = 0, at the end of a generation) leave it alone."""
    schedule = HeuristicGamma(3)
    script = [  # (requested, accepted) -> γ afterwards, worked out by hand
        ((3, 3), 5),
        ((5, 2), 4),
        ((0, 0), 4),
        ((4, 0), 3),
        ((3, 1), 2),
        ((2, 0), 1),
        ((1, 0), 1),
        ((1, 1), 3),
    ]
    for (requested, accepted), after in script:
        assert schedule.next_gamma(99) == schedule.gamma
        schedule.update(RoundRecord(requested, requested, accepted, requested + 1, 0.1, 1.0))
        assert schedule.gamma == after
    assert schedule.next_gamma(2) == 2  # capped by the limit, without forgetting its γ
    assert schedule.gamma == 3


# --- adaptive: estimates -----------------------------------------------------------------


def test_adaptive_alphas_are_decayed_counts_with_a_prior() -> None:
    """The slow reference: each round's evidence weighted by decay^(rounds after it)."""
    settings = AdaptiveSettings()
    schedule = AdaptiveGamma(target_cost(0.1), max_gamma=4, prior=(0.9, 0.7), settings=settings)
    rounds = [(4, 4, 2), (2, 2, 2), (0, 0, 0), (4, 4, 4), (3, 3, 0), (4, 4, 1)]  # (k, drafted, acc)
    for k, drafted, accepted in rounds:
        schedule.update(RoundRecord(k, drafted, accepted, drafted + 1, 0.1 * drafted, 1.0))
    drafting = [(k, a) for k, _, a in rounds if k > 0]  # plain rounds carry no evidence
    s, given = settings.prior_strength, [0.9, 0.7]
    want: list[float] = []
    for i in range(4):
        # The given prior, the later one scaled by the first position's estimate against
        # its prior; past the given prior: the previous α.
        prior = given[i] if i < len(given) else want[-1]
        prior = prior * want[0] / given[0] if i == 1 else prior
        weights = [settings.decay ** (len(drafting) - 1 - t) for t in range(len(drafting))]
        reached = sum(w for w, (k, a) in zip(weights, drafting, strict=True) if k > i and a >= i)
        passed = sum(w for w, (k, a) in zip(weights, drafting, strict=True) if a > i)
        want.append((passed + s * prior) / (reached + s))
    assert schedule.alphas == pytest.approx(want)


def test_adaptive_counts_a_missing_draft_as_rejected() -> None:
    """A drafter that proposes fewer tokens than asked (n-gram lookup without a long enough
    match) was rejected at the first missing position; positions after it were not tried."""

    def alphas_after(requested: int, drafted: int, accepted: int) -> list[float]:
        schedule = AdaptiveGamma(target_cost(0.1), max_gamma=4)
        schedule.update(RoundRecord(requested, drafted, accepted, drafted + 1, 0.1, 1.0))
        return schedule.alphas

    # Position 1: the neutral 0.5 at guess strength g (1); later positions: the estimate of
    # the position before at strength 2: one accept gives (1 + 2p) / 3, one reject 2p / 3,
    # an untried position keeps p.
    g = AdaptiveSettings().guess_strength
    a1 = (1 + g * 0.5) / (1 + g)
    a2 = (1 + 2 * a1) / 3
    assert alphas_after(4, 2, 2) == pytest.approx([a1, a2, 2 * a2 / 3, 2 * a2 / 3])
    assert alphas_after(4, 2, 2) == alphas_after(4, 4, 2)  # as if draft 3 had been wrong
    assert alphas_after(2, 2, 2) == pytest.approx([a1, a2, a2, a2])  # none missing
    missed = g * 0.5 / (1 + g)
    assert alphas_after(4, 0, 0) == pytest.approx([missed] * 4)  # no match at all


# --- adaptive: choices -------------------------------------------------------------------


def test_adaptive_drafts_more_when_more_is_accepted() -> None:
    cost = target_cost(0.05)
    high = AdaptiveGamma(cost, max_gamma=6)
    chosen = []
    for i in range(30):
        alphas = high.alphas
        best = cost.best_gamma(alphas, 6)
        chosen += drive(high, all_accepted, 1)
        # The machine runs exactly as modelled, so each choice is the cost model's argmax
        # under the current estimates (speculating only when it beats plain decoding).
        want = best if cost.speedup(alphas, best) >= high.settings.margin else 0
        assert chosen[-1] == want, i
    assert chosen == sorted(chosen) and chosen[-1] == 6  # climbs to max_gamma, never back
    half = drive(AdaptiveGamma(cost, max_gamma=6), lambda i, k: min(k, i % 2), 30)
    none = drive(AdaptiveGamma(cost, max_gamma=6), none_accepted, 30)
    assert chosen[-1] > max(half[-10:]) >= 1
    assert max(none[-10:]) <= 1 and none[-10:].count(0) >= 8  # plain decoding but for probes


def zero_runs(chosen: list[int]) -> list[int]:
    """Lengths of the runs of plain rounds (γ = 0) that end in a round that drafts."""
    runs, length = [], 0
    for k in chosen:
        if k == 0:
            length += 1
        elif length:
            runs.append(length)
            length = 0
    return runs


def test_adaptive_falls_back_to_plain_decoding_and_probes_at_doubling_intervals() -> None:
    settings = AdaptiveSettings(first_probe=4, last_probe=16)
    schedule = AdaptiveGamma(target_cost(0.2), max_gamma=6, settings=settings)
    succeeded: list[int] = []  # the round of the one probe that succeeds, from round 45 on

    def accept(i: int, k: int) -> int:
        if i >= 45 and k == 1 and not succeeded:
            succeeded.append(i)
            return 1
        return 0

    chosen = drive(schedule, accept, 100)
    first_plain = chosen.index(0)
    assert first_plain <= 8  # gives up once its record rules out a paying draft
    assert set(chosen[first_plain:]) == {0, 1}  # from then on only plain rounds and probes
    # Plain runs of 4, 8, 16, 16 (capped at last_probe); after the successful probe back
    # to 4, 8, 16.
    assert succeeded and chosen[succeeded[0]] == 1
    assert zero_runs(chosen)[:7] == [4, 8, 16, 16, 4, 8, 16]
    # A probe needs room for one draft: with a limit of 0 it waits.
    for _ in range(settings.last_probe):
        if schedule.next_gamma(6) == 1:
            break
        schedule.update(RoundRecord(0, 0, 0, 1, 0.0, 1.0))
    assert schedule.next_gamma(6) == 1
    assert schedule.next_gamma(0) == 0


def test_adaptive_checks_with_its_probes_and_keeps_the_trees_verify_size() -> None:
    """A probe, or a round the record cannot rule out but does not predict to pay, only
    checks whether drafting pays (`checking`: a tree drafter drafts its top path alone);
    a round predicted to pay does not. A check's verify size is its top path's, not the
    tree's: it does not replace the size the tree's rounds are priced at."""
    settings = AdaptiveSettings(first_probe=4, last_probe=16)
    schedule = AdaptiveGamma(target_cost(0.2), max_gamma=1, settings=settings)
    tree_rows, path_rows = 5, 2  # a 4-node tree of depth 1, and its top path alone

    def play(accepted: int) -> tuple[int, bool]:
        k, checking = schedule.next_gamma(1), schedule.checking
        rows = 1 if not k else path_rows if checking else tree_rows
        cost = schedule.cost
        schedule.update(
            RoundRecord(k, k, accepted if k else 0, rows, cost.draft_s(k), cost.target_s(rows),
                        checking=checking and k > 0)
        )  # fmt: skip
        return k, checking

    first = play(0)
    assert first == (1, False)  # the prior predicts a tree of depth 1 to pay
    missed = [play(0) for _ in range(60)]
    fallback = [k for k, _ in missed].index(0)
    drafted = [checking for k, checking in missed[fallback:] if k]
    assert len(drafted) >= 3 and all(drafted)  # every probe a check
    assert schedule.verified[1] == tree_rows
    assert schedule.predicted_speedup(1, [1.0]) == pytest.approx(
        2
        * schedule.current_cost().target_s(1)
        / (schedule.current_cost().draft_s(1) + schedule.current_cost().target_s(tree_rows))
    )
    hits = [play(1) for _ in range(80)]  # the text turns predictable: drafting pays again
    assert hits[-10:] == [(1, False)] * 10


def test_adaptive_does_not_probe_a_drafter_that_cannot_pay() -> None:
    """Every draft accepted, but each costs as much as a target step (the target drafting
    for itself): no text makes drafting pay, so once it falls back it never probes."""
    schedule = AdaptiveGamma(target_cost(1.0), max_gamma=4)
    chosen = drive(schedule, all_accepted, 80)
    assert 0 in chosen[:3] and set(chosen[chosen.index(0) :]) == {0}
    assert not schedule.could_pay(schedule.choices(4))
    cheap = AdaptiveGamma(target_cost(0.2), max_gamma=4)
    assert cheap.could_pay(cheap.choices(4))  # 0.2 of a step per draft pays when right


def test_adaptive_backs_off_after_an_accepted_probe_that_does_not_pay() -> None:
    """After a long run of misses one accepted probe is not enough evidence that drafting
    pays: the interval still doubles (it went back to the first one after any accepted
    probe, so a drafter right at every third probe was probed every 4 rounds)."""
    settings = AdaptiveSettings(first_probe=4, last_probe=16)
    schedule = AdaptiveGamma(target_cost(0.3), max_gamma=1, settings=settings)
    chosen = drive(schedule, none_accepted, 40)
    assert zero_runs(chosen)[:2] == [4, 8] and schedule.probe_every == 16
    while schedule.next_gamma(1) == 0:
        schedule.update(RoundRecord(0, 0, 0, 1, 0.0, 1.0))
    schedule.update(RoundRecord(1, 1, 1, 2, 0.3, 1.05))  # the probe: accepted
    assert schedule.paying_gamma(schedule.choices(1)) == 0
    assert schedule.probe_every == 16
    plain = 0
    while schedule.next_gamma(1) == 0:
        schedule.update(RoundRecord(0, 0, 0, 1, 0.0, 1.0))
        plain += 1
    assert plain == 16
    # A second accepted probe tips the estimate: drafting pays again, probes reset.
    schedule.update(RoundRecord(1, 1, 1, 2, 0.3, 1.05))
    assert schedule.next_gamma(1) == 1 and schedule.probe_every == 4


def test_adaptive_keeps_drafting_when_a_run_of_misses_is_noise() -> None:
    """A drafter right 30% of the time at the first position, where 21% breaks even: six
    misses at the start of the sequence are chance. Judged on ~20 recent rounds alone, the
    schedule fell back to plain decoding, where no evidence comes in, and failed probes (70%
    of them) kept it there for 92 of 100 rounds; on the longer record with its standard
    error it keeps drafting."""

    def thirty_percent_after_six_misses(i: int, k: int) -> int:
        return min(k, int(i >= 6 and i % 10 in (0, 3, 6)))

    cost = CostModel(tuple(1.0 + 0.11 * (n - 1) for n in range(1, 9)), draft_per_token_s=0.075)
    prior = (0.56, 0.7, 0.7)  # a tuning profile's, from easier text
    schedule = AdaptiveGamma(cost, max_gamma=3, prior=prior)
    assert drive(schedule, thirty_percent_after_six_misses, 100).count(0) <= 2
    recent_only = AdaptiveSettings(long_decay=AdaptiveSettings.decay, confidence=0.0)
    trapped = AdaptiveGamma(cost, max_gamma=3, prior=prior, settings=recent_only)
    assert drive(trapped, thirty_percent_after_six_misses, 100).count(0) >= 50


def test_adaptive_learns_from_acceptance_probabilities_under_sampling() -> None:
    """A sampled round reports each reached draft's acceptance probability; the estimates
    add those up instead of the outcomes, and the longer record's standard error is that of
    their own spread (a coin's, p(1 - p), for 0/1 outcomes)."""
    settings = AdaptiveSettings()
    s, g, z = settings.prior_strength, settings.guess_strength, settings.confidence
    told = AdaptiveGamma(target_cost(0.1), max_gamma=3)
    told.update(RoundRecord(3, 3, 1, 4, 0.1, 1.0, accept_probs=(0.9, 0.2)))
    first = (0.9 + g * 0.5) / (1 + g)
    assert told.alphas[:2] == pytest.approx([first, (0.2 + s * first) / (1 + s)])
    spread = (0.81 + g * 0.5) / (1 + g) - first**2  # the neutral guess counted as 0/1 outcomes
    assert told.optimistic_alphas()[0] == pytest.approx(first + z * (spread / (1 + g)) ** 0.5)

    coin = AdaptiveGamma(target_cost(0.1), max_gamma=3)
    coin.update(RoundRecord(3, 3, 0, 4, 0.1, 1.0))  # outcomes: the first draft rejected
    first = g * 0.5 / (1 + g)
    assert coin.alphas[0] == pytest.approx(first)
    assert coin.optimistic_alphas()[0] == pytest.approx(
        first + z * (first * (1 - first) / (1 + g)) ** 0.5
    )


def test_adaptive_drafts_less_on_acceptance_probabilities_than_on_chance_hits() -> None:
    """Drafts accepted 4% of the time (random tokens at temperature 1.0): told the
    probability each round, the schedule rules drafting out as if nothing were accepted; fed
    the coin's outcomes, each chance acceptance lifts the estimate and it drafts again for
    several rounds. Over 40 seeded sequences of 64 rounds: fewer drafting rounds."""
    cost = CostModel((1.0, 1.06, 1.07, 1.08, 1.09), draft_per_token_s=0.05)

    def drafting_rounds(told: bool, seed: int) -> int:
        generator = torch.Generator().manual_seed(seed)
        schedule = AdaptiveGamma(cost, max_gamma=4, timing_feedback=False)
        drafted = 0
        for _ in range(64):
            k = schedule.next_gamma(4)
            hits = (torch.rand(k, generator=generator) < 0.04).long().cumprod(0)
            accepted = int(hits.sum())
            probs = (0.04,) * min(accepted + 1, k) if told else ()
            schedule.update(
                RoundRecord(k, k, accepted, k + 1, cost.draft_s(k), cost.target_s(k + 1),
                            accept_probs=probs)
            )  # fmt: skip
            drafted += k > 0
        return drafted

    told = sum(drafting_rounds(True, seed) for seed in range(40))
    chance = sum(drafting_rounds(False, seed) for seed in range(40))
    assert told < 0.9 * chance, (told, chance)


def test_a_measured_prior_outweighs_the_neutral_guess() -> None:
    """Without a measured prior the first position starts from 0.5 at `guess_strength`
    pseudo-rounds, fewer than a profile's prior of the same value: on drafts that all miss,
    the guess stops drafting sooner."""
    assert AdaptiveSettings().guess_strength < AdaptiveSettings().prior_strength
    cost = CostModel((1.0, 1.06, 1.07, 1.08, 1.09), draft_per_token_s=0.05)
    guessed = drive(AdaptiveGamma(cost, max_gamma=4), none_accepted, 20)
    measured = drive(AdaptiveGamma(cost, max_gamma=4, prior=(0.5,)), none_accepted, 20)
    assert guessed.index(0) < measured.index(0), (guessed, measured)


def test_adaptive_scales_later_priors_by_the_first_positions_evidence() -> None:
    """A profile tuned on easier text (α 0.6, 0.9): where this text's first position is
    accepted a third of the time, the second's prior is scaled down with it, and γ = 2 (the
    best under the profile's own 0.9) is no longer chosen."""
    cost = CostModel(tuple(1.0 + 0.1 * (n - 1) for n in range(1, 9)), draft_per_token_s=0.08)
    schedule = AdaptiveGamma(cost, max_gamma=2, prior=(0.6, 0.9))
    for i in range(30):  # one-token rounds: the second position is never reached
        schedule.update(RoundRecord(1, 1, int(i % 3 == 0), 2, 0.08, cost.target_s(2)))
    first, second = schedule.alphas
    assert first == pytest.approx(0.35, abs=0.05)
    assert second == pytest.approx(0.9 * first / 0.6)
    assert schedule.predicted_speedup(2, [first, 0.9]) > schedule.predicted_speedup(1)
    assert schedule.next_gamma(8) == 1


def test_adaptive_gives_up_when_noise_times_a_larger_verify_below_a_smaller_one() -> None:
    """A flat T(n) timed with noise (bfloat16: T(2) < T(1)) must not make a one-token draft
    look free: with a drafter that never hits, the schedule falls back to plain decoding
    (before, γ = 1 looked faster than plain decoding down to the acceptance floor that the
    prior leaves a drafter that never hits). A one-token draft costs 5% here, so it takes
    about 30 rounds for the record to rule out that it pays."""
    cost = CostModel((1.0, 0.96, 0.98, 1.0), draft_per_token_s=0.05)
    schedule = AdaptiveGamma(cost, max_gamma=3)
    chosen = drive(schedule, none_accepted, 100)
    assert 0 in chosen[:40]
    assert sum(k > 0 for k in chosen[50:]) <= 3  # probes only
    assert schedule.current_cost().target_s(2) >= schedule.current_cost().target_s(1)


def test_adaptive_follows_the_machines_speed() -> None:
    """Verify times twice the model's, with drafts twice as slow too: the same γ. A
    slower target alone makes drafts relatively cheap (longer γ); a slower drafter alone,
    dear (shorter γ)."""

    def run(**speeds: float) -> list[int]:
        return drive(AdaptiveGamma(target_cost(0.2), max_gamma=6), first_three, 30, **speeds)

    def mean_tail(chosen: list[int]) -> float:
        return sum(chosen[10:]) / len(chosen[10:])

    def mode_tail(chosen: list[int]) -> int:
        return max(set(chosen[10:]), key=chosen[10:].count)

    # Per-size verify times are learned too (T(n)'s shape moves with the context), so a
    # uniform slowdown changes the first rounds a little; it settles on the same γ.
    base = run()
    assert mode_tail(run(target_speed=2.0, draft_speed=2.0)) == mode_tail(base) == 3
    assert mean_tail(run(target_speed=2.0)) >= mean_tail(base)
    assert mean_tail(run(draft_speed=2.0)) <= mean_tail(base)


def test_adaptive_learns_the_draft_cost_when_the_model_has_none() -> None:
    free = AdaptiveGamma(target_cost(), max_gamma=6)
    dear = AdaptiveGamma(target_cost(), max_gamma=6)
    free_chosen = drive(free, first_three, 30, draft_per_token_s=0.0)
    dear_chosen = drive(dear, first_three, 30, draft_per_token_s=0.5)
    assert dear.current_cost().draft_per_token_s == pytest.approx(0.5)
    assert free.current_cost().draft_per_token_s == 0.0
    assert dear_chosen[0] == free_chosen[0]  # the same until a round has been timed
    # Past position 3 every draft fails; the free drafter keeps re-trying γ = 4 more often.
    assert sum(dear_chosen[10:]) < sum(free_chosen[10:])
    assert max(dear_chosen[10:]) <= 4 and min(free_chosen[10:]) >= 3


def self_draft_timings(schedule: AdaptiveGamma, speed: float, rounds: int) -> None:
    """Drafting rounds of the target drafting for itself (γ = 2, always accepted, a draft
    token costing a target step) on a machine `speed` times slower than the model's."""
    for _ in range(rounds):
        schedule.update(RoundRecord(2, 2, 2, 3, 2 * speed, schedule.cost.target_s(3) * speed))


def test_adaptive_moves_a_learned_draft_cost_with_the_machine() -> None:
    """The drafter's cost timed on a quiet machine, then plain rounds while another process
    makes every forward 1.5x slower: the drafter is slower too, so drafting still cannot
    pay (kept at its quiet timing, it looked 1.5x cheaper than a target step)."""
    schedule = AdaptiveGamma(CostModel(tuple(1.0 + 0.2 * n for n in range(8))), max_gamma=2)
    self_draft_timings(schedule, 1.0, 4)  # the first is the prompt's catch-up: untimed
    assert not schedule.could_pay(schedule.choices(2))
    for _ in range(40):
        schedule.update(RoundRecord(0, 0, 0, 1, 0.0, 1.5))
    cost = schedule.current_cost()
    assert cost.draft_per_token_s == pytest.approx(cost.target_s(1), rel=0.05)
    assert not schedule.could_pay(schedule.choices(2))
    # The next sequence starts from the cost at the model's speed, not at the busy one.
    assert schedule.unit_draft_s() == pytest.approx(1.0)


def test_adaptive_moves_verify_times_not_timed_lately_with_the_machine() -> None:
    """T(1) timed in plain rounds on a busy machine (2x), then drafting rounds once it is
    quiet again: T(1) follows the machine, and a draft as dear as a target step is not
    predicted to pay (kept at its busy timing, T(1) made drafting look 1.5x faster)."""
    schedule = AdaptiveGamma(CostModel(tuple(1.0 + 0.2 * n for n in range(8))), max_gamma=2)
    self_draft_timings(schedule, 1.0, 4)
    for _ in range(40):
        schedule.update(RoundRecord(0, 0, 0, 1, 0.0, 2.0))
    self_draft_timings(schedule, 1.0, 12)
    cost = schedule.current_cost()
    assert cost.target_s(1) == pytest.approx(cost.draft_per_token_s, rel=0.05)
    assert schedule.predicted_speedup(2, [1.0, 1.0]) < 0.95  # 3 / (2 + 1.4) in truth
    assert not schedule.could_pay(schedule.choices(2))


def test_adaptive_times_a_draft_against_its_own_rounds_verify_pass() -> None:
    """Plain rounds on a busy machine (2x), then drafting rounds once it is quiet again,
    timed while the speed factor still lags: the draft cost the next sequence starts from
    is a target step's (stored at the lagging speed, it was about half that, and the target
    drafting for itself looked cheap on every sequence after)."""
    schedule = AdaptiveGamma(CostModel(tuple(1.0 + 0.2 * n for n in range(8))), max_gamma=2)
    for _ in range(40):
        schedule.update(RoundRecord(0, 0, 0, 1, 0.0, 2.0))
    self_draft_timings(schedule, 1.0, 4)  # the first catches up on the plain rounds: untimed
    assert schedule.target_speed > 1.5  # still lagging
    assert schedule.unit_draft_s() == pytest.approx(1.0)


def test_adaptive_does_not_learn_draft_costs_from_catch_up_rounds() -> None:
    """A draft model's first round reads the prompt, its first after plain rounds catches
    up on them: 30x a draft's time here. Learned from those, the drafter would look too
    dear to probe ever again; its cost is learned from the other rounds only."""
    schedule = AdaptiveGamma(target_cost(), max_gamma=4)
    per_token = 0.05

    def timed(k: int, accepted: int, catch_up: float = 0.0) -> RoundRecord:
        return RoundRecord(k, k, accepted, k + 1, per_token * k + catch_up, 1.0 + 0.05 * k)

    schedule.update(timed(4, 4, catch_up=1.5))  # the first round: the prompt
    assert schedule.current_cost().draft_per_token_s == 0.0
    for _ in range(5):
        schedule.update(timed(4, 4))
    assert schedule.current_cost().draft_per_token_s == pytest.approx(per_token)
    for _ in range(3):
        schedule.update(RoundRecord(0, 0, 0, 1, 0.0, 1.0))
    schedule.update(timed(4, 0, catch_up=1.5))  # after plain rounds
    assert schedule.current_cost().draft_per_token_s == pytest.approx(per_token)
    schedule.update(timed(4, 4, catch_up=1.5))  # not after plain rounds: a real cost
    assert schedule.current_cost().draft_per_token_s > per_token


def test_adaptive_learns_a_catch_up_cost_per_token_read() -> None:
    """A catch-up round's seconds beyond its drafts, per token read, weighted by the tokens
    (a prompt read outweighs a few skipped tokens' noise); at the machine's speed. The
    first round's prompt read, before a draft's own cost is known, is priced once it is."""
    schedule = AdaptiveGamma(target_cost(), max_gamma=2)
    per_draft, per_read = 0.1, 0.02

    def timed(read: int, speed: float = 1.0) -> RoundRecord:
        seconds = (per_draft * 2 + per_read * read) * speed
        return RoundRecord(2, 2, 2, 3, seconds, 1.1 * speed, caught_up=read)

    schedule.update(timed(40))  # the prompt, before any draft was timed
    assert schedule.catch_up_s(10) == 0.0
    schedule.update(timed(0))
    assert schedule.catch_up_s(10) == pytest.approx(10 * per_read)
    for _ in range(3):
        schedule.update(timed(0))
    schedule.update(timed(40))
    assert schedule.catch_up_s(10) == pytest.approx(10 * per_read)
    assert schedule.unit_draft_s() == pytest.approx(per_draft)  # catch-ups not in it
    schedule.update(timed(2, speed=2.0))  # a 2x slower machine: the same cost per token
    assert schedule.catch_up_s(10) / schedule.target_speed == pytest.approx(10 * per_read)


def test_adaptive_drafts_only_when_the_tokens_left_repay_a_catch_up() -> None:
    """Drafting predicted 8% faster (every draft accepted, 0.9 of a target step each), after
    the draft model sat out rounds or before it has read the prompt: it starts drafting only
    when the tokens left save more than reading the skipped ones costs. The same holds for a
    probe."""
    per_draft = 0.9
    schedule = AdaptiveGamma(target_cost(), max_gamma=1, prior=[1.0])
    schedule.draft_per_token_s = per_draft
    schedule.catch_up_record = (0.5, 1.0)  # half a target step per token read
    assert schedule.predicted_speedup(1) == pytest.approx(2 / 1.95)
    assert schedule.next_gamma(40) == 1  # no catch-up: it pays
    assert schedule.next_gamma(40, catch_up=20) == 0  # saves 1 s, reading costs 10 s
    assert schedule.next_gamma(800, catch_up=20) == 1  # saves 20 s
    for _ in range(30):  # drafts that miss: it falls back to plain decoding, with probes
        k = schedule.next_gamma(40)
        schedule.update(RoundRecord(k, k, 0, k + 1, per_draft * k, 1.0 + 0.05 * k))
    assert schedule.paying_gamma(schedule.choices(1)) == 0
    while schedule.next_gamma(40) == 0:
        schedule.update(RoundRecord(0, 0, 0, 1, 0.0, 1.0))
    # A probe is due, and taken when catching up is free; not when the skipped tokens
    # cost more to read than drafting could save, even with every draft accepted.
    skipped = schedule.plain_rounds
    assert schedule.next_gamma(40, catch_up=skipped) == 0
    assert schedule.next_gamma(4000, catch_up=skipped) == 1


def test_a_probe_must_repay_the_catch_up_itself() -> None:
    """Drafts of 0.9 target steps: every draft accepted, γ 1 would be 2.6% faster and γ 3
    3.9%. After the draft model sat out 20 tokens (half a step each to read), 300 tokens
    left repay that at γ 3 but not at γ 1, the probe's length, and one accepted probe does
    not take the estimates to γ 3: no probe. With 4000 tokens left, the probe repays it."""
    per_draft = 0.9
    schedule = AdaptiveGamma(target_cost(), max_gamma=3, prior=[1.0, 1.0, 1.0])
    schedule.draft_per_token_s = per_draft
    schedule.catch_up_record = (0.5, 1.0)
    assert schedule.predicted_speedup(1, [1.0]) == pytest.approx(2 / 1.95)
    assert schedule.predicted_speedup(3, [1.0] * 3) == pytest.approx(4 / 3.85)
    for _ in range(30):  # drafts that miss: plain decoding, with probes
        k = schedule.next_gamma(300)
        schedule.update(RoundRecord(k, k, 0, k + 1, per_draft * k, 1.0 + 0.05 * k))
    while schedule.next_gamma(300) == 0:
        schedule.update(RoundRecord(0, 0, 0, 1, 0.0, 1.0))
    assert schedule.next_gamma(300) == 1  # a probe is due: taken when catching up is free
    assert schedule.next_gamma(300, catch_up=20) == 0
    assert schedule.next_gamma(4000, catch_up=20) == 1


def test_a_draft_model_counts_the_tokens_it_must_catch_up_on(target: PreTrainedModel) -> None:
    """A draft model reads what is new in the context before drafting: the prompt at first,
    nothing beyond the newest token while it drafts every round (its drafts are what it
    read), the rounds it sat out after them. A lookup-first drafter's lookup arm reads
    nothing."""
    drafter = DraftModelDrafter(perturbed_copy(target, scale=0.1, seed=1), vocab_size=TINY_VOCAB)
    context = torch.tensor([PROMPT])
    assert drafter_catch_up(drafter, context) == len(PROMPT) - 1
    drafts = drafter.propose(context, 3, SamplingConfig(), None).tokens  # [1, 3]
    for accepted in range(4):
        # A correction (not the draft at that position), or any bonus token.
        newest = (
            (drafts[:, accepted : accepted + 1] + 1) % TINY_VOCAB
            if accepted < 3
            else context[:, :1]
        )
        committed = torch.cat([context, drafts[:, :accepted], newest], 1)
        assert drafter_catch_up(drafter, committed) == 0
    other = (drafts[:, 1:2] + 1) % TINY_VOCAB
    skipped = torch.cat([context, drafts[:, :1], other, torch.tensor([[4, 9]])], 1)
    assert drafter_catch_up(drafter, skipped) == 2  # `other` and 4; 9 is the newest
    lookup_first = LookupFirstDrafter(drafter)
    assert drafter_catch_up(lookup_first, skipped) == 2  # no earlier match: the draft model
    repeat = torch.cat([skipped, torch.tensor([[5, 17]])], 1)  # 5 17 follows the prompt's
    assert drafter_catch_up(lookup_first, repeat) == 0
    assert drafter_catch_up(ScriptDrafter(PROMPT), repeat) == 0  # no cache of its own


def test_adaptive_never_exceeds_the_limit() -> None:
    eager = AdaptiveGamma(target_cost(0.05), max_gamma=6)
    drive(eager, all_accepted, 30)
    assert [eager.next_gamma(limit) for limit in range(9)] == [0, 1, 2, 3, 4, 5, 6, 6, 6]
    # Limits vary round by round: a chosen γ is never above the round's limit.
    for limit in [3, 0, 1, 6, 2, 0, 5] * 3:
        k = eager.next_gamma(limit)
        assert 0 <= k <= limit
        eager.update(RoundRecord(k, k, k, k + 1, 0.05 * k, 1.0 + 0.05 * k))


# --- guarded: a fixed γ behind the guard ------------------------------------------------


def test_guarded_drafts_its_gamma_while_drafts_pay() -> None:
    """Only γ or nothing: never a shorter draft, even when a shorter one would pay more
    (first_three: γ = 3 would be best at this draft cost, 6 still pays)."""
    schedule = GuardedGamma(target_cost(0.05), max_gamma=6)
    assert drive(schedule, first_three, 30) == [6] * 30
    assert drive(schedule, all_accepted, 10) == [6] * 10
    # Fewer than γ fit (the end of the budget): all that fit, and none when none fit.
    assert [schedule.next_gamma(limit) for limit in range(9)] == [0, 1, 2, 3, 4, 5, 6, 6, 6]


def test_guarded_falls_back_and_probes_with_its_gamma() -> None:
    """A drafter that never hits: plain rounds with probes at γ (not 1), at doubling
    intervals; when the text turns predictable, a probe succeeds and γ comes back."""
    settings = AdaptiveSettings(first_probe=4, last_probe=16)
    schedule = GuardedGamma(target_cost(0.2), max_gamma=3, settings=settings)

    def accept(i: int, k: int) -> int:
        return k if i >= 60 else 0

    chosen = drive(schedule, accept, 100)
    first_plain = chosen.index(0)
    assert first_plain <= 8
    assert set(chosen) == {0, 3}
    assert zero_runs(chosen[:60])[:4] == [4, 8, 16, 16]
    # Back to drafting once drafts are accepted: at this draft cost (D(3) = 0.6 T(1)) the
    # evidence of two accepted probes outweighs the misses before them, not of one.
    assert zero_runs(chosen[60:]) and chosen[-15:] == [3] * 15


def test_guarded_keeps_drafting_a_gamma_that_pays_little() -> None:
    """Fixed γ = 2 with half of the first drafts accepted: 1.5 tokens a round for a verify
    10% dearer than a plain step pays, so the guard does not step in."""
    schedule = GuardedGamma(target_cost(0.05), max_gamma=2)
    chosen = drive(schedule, lambda i, k: min(k, i % 2), 60)
    assert chosen == [2] * 60


# --- the decode loop with schedules ------------------------------------------------------


class ScriptDrafter(NoMemory):
    """Proposes the target's own greedy continuation, looked up: an all-accepting drafter
    that costs next to nothing (unlike the target drafting for itself, which costs a
    target forward per draft, so that speculation cannot pay and the adaptive schedule
    rightly falls back to plain decoding)."""

    name = "script"
    needs_target_hidden = False

    def __init__(self, text: list[int]) -> None:
        self.text = text

    def reset(self) -> None:
        pass

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        n = context.shape[1]
        return Proposal(torch.tensor([self.text[n : n + k]], dtype=torch.long), None)

    def observe(self, outcome: Outcome) -> None:
        pass


@pytest.fixture(scope="module")
def target() -> PreTrainedModel:
    return tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def reference(target: PreTrainedModel) -> list[int]:
    return hf_greedy(target, PROMPT, NEW_TOKENS)


def make_drafter(kind: str, target: PreTrainedModel) -> Drafter:
    model = {
        "self": lambda: target,
        "unrelated": lambda: tiny_model("llama", seed=99),
        "perturbed": lambda: perturbed_copy(target, scale=0.1, seed=1),
    }[kind]()
    return DraftModelDrafter(model, vocab_size=TINY_VOCAB)


def make_decoder(target: PreTrainedModel, drafter: Drafter, **kwargs: object) -> SpecDecoder:
    return SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256, **kwargs)


@pytest.mark.parametrize("kind", ["self", "unrelated", "perturbed"])
@pytest.mark.parametrize("schedule", ["fixed", "heuristic", "adaptive", "guarded"])
def test_every_schedule_is_lossless_under_greedy(
    target: PreTrainedModel, reference: list[int], kind: str, schedule: str
) -> None:
    decoder = make_decoder(target, make_drafter(kind, target))
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=4, schedule=schedule)
    result = decoder.generate(PROMPT, config)
    assert result.tokens == reference
    assert sum(result.stats.requested_gammas.values()) == result.stats.rounds


def test_adaptive_measures_a_cost_model_on_first_use(
    target: PreTrainedModel, reference: list[int], measurements: list[int]
) -> None:
    decoder = make_decoder(target, make_drafter("perturbed", target))
    for schedule in ("fixed", "heuristic"):
        decoder.generate(PROMPT, GenerationConfig(max_new_tokens=8, schedule=schedule))
    assert measurements == []  # only the adaptive and guarded schedules need costs
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=4, schedule="adaptive")
    assert decoder.generate(PROMPT, config).tokens == reference
    assert decoder.generate(PROMPT, config).tokens == reference
    assert measurements == [5]  # once, for T(1)..T(γ + 1), then kept
    cost = decoder.schedules.cost_model(PROMPT, 4)
    assert len(cost.verify_s) == 5 and all(t > 0 for t in cost.verify_s)
    assert (cost.draft_fixed_s, cost.draft_per_token_s) == (0.0, 0.0)  # learned while decoding
    assert decoder.schedules.cost_model(PROMPT, 4) is cost
    # A larger γ needs T(n) further out: measured again.
    assert len(decoder.schedules.cost_model(PROMPT, 6).verify_s) == 7
    assert measurements == [5, 7]


def test_guarded_measures_its_cost_model_too(
    target: PreTrainedModel, reference: list[int], measurements: list[int]
) -> None:
    decoder = make_decoder(target, make_drafter("perturbed", target))
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3, schedule="guarded")
    assert decoder.generate(PROMPT, config).tokens == reference
    assert measurements == [4]  # T(1)..T(γ + 1)


def test_adaptive_uses_a_given_cost_model_when_it_covers_gamma(
    target: PreTrainedModel, measurements: list[int]
) -> None:
    """Greedy: T(n) is measured in this process (once), the given draft costs are kept.
    Sampling: the given model as it is, so a seed gives the same output in every process."""
    given = CostModel((1e-3,) * 5, draft_per_token_s=1e-4)
    decoder = make_decoder(target, make_drafter("perturbed", target), cost_model=given)
    sampled = GenerationConfig(
        max_new_tokens=8, gamma=4, schedule="adaptive", sampling=SamplingConfig(temperature=0.8)
    )
    decoder.generate(PROMPT, sampled)
    assert decoder.schedules.cost_model(PROMPT, 4, fresh=False) is given
    assert measurements == []
    decoder.generate(PROMPT, GenerationConfig(max_new_tokens=8, gamma=4, schedule="adaptive"))
    assert measurements == [5]
    cost = decoder.schedules.cost_model(PROMPT, 4)
    assert cost.verify_s != given.verify_s and len(cost.verify_s) == 5
    assert (cost.draft_fixed_s, cost.draft_per_token_s) == (0.0, 1e-4)
    decoder.generate(PROMPT, GenerationConfig(max_new_tokens=8, gamma=6, schedule="adaptive"))
    assert measurements == [5, 7]  # too short for γ = 6


# --- seeded sampling ---------------------------------------------------------------------


class FakeTime:
    """Stands in for the `time` module inside specmtp.decode: the clock moves only when a
    forward or a draft says so, so every run sees the same timings."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slowdown = 1.0  # every forward and draft takes this many times as long

    def perf_counter(self) -> float:
        return self.now


class ClockedDrafter(DraftModelDrafter):
    """A draft model whose drafts take `per_token` seconds each on the fake clock, and each
    token it must catch up on before drafting `per_read` seconds."""

    def __init__(
        self, model: PreTrainedModel, clock: FakeTime, per_token: float, per_read: float = 0.0
    ) -> None:
        super().__init__(model, vocab_size=TINY_VOCAB)
        self.clock = clock
        self.per_token = per_token
        self.per_read = per_read

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        read = self.catch_up(context)
        self.clock.now += (self.per_token * k + self.per_read * read) * self.clock.slowdown
        return super().propose(context, k, sampling, generator)


VERIFY_S = 1e-3  # fake seconds per target forward, whatever its size
DRAFT_S = 3e-4  # fake seconds per draft token: dear enough that γ varies


def decode_on_fake_clock(
    monkeypatch: pytest.MonkeyPatch, target: PreTrainedModel, drafter: Drafter, clock: FakeTime
) -> SpecDecoder:
    """A decoder whose target forwards each take VERIFY_S on `clock`, whatever their size,
    also when the decoder measures T(n) (greedy runs measure it in process): real timings
    of the tiny model, on a busy machine, once kept an always-right drafter at γ <= 2."""
    monkeypatch.setattr(decode, "time", clock)
    monkeypatch.setattr(decode_schedules, "time", clock)
    monkeypatch.setattr(costmodel, "time", clock)
    decoder = make_decoder(target, drafter, cost_model=CostModel((VERIFY_S,) * 5))
    forward = decoder.target.forward

    def timed_forward(tokens: torch.Tensor, **kwargs: object) -> torch.Tensor:
        clock.now += VERIFY_S * clock.slowdown
        return forward(tokens, **kwargs)

    monkeypatch.setattr(decoder.target, "forward", timed_forward)
    return decoder


def sample_on_fake_clock(
    monkeypatch: pytest.MonkeyPatch,
    target: PreTrainedModel,
    *,
    seed: int,
    draft_per_token_s: float,
) -> tuple[list[int], dict[int, int]]:
    clock = FakeTime()
    drafter = ClockedDrafter(perturbed_copy(target, scale=0.1, seed=1), clock, draft_per_token_s)
    decoder = decode_on_fake_clock(monkeypatch, target, drafter, clock)
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS,
        gamma=4,
        schedule="adaptive",
        sampling=SamplingConfig(temperature=0.8),
        seed=seed,
    )
    result = decoder.generate(PROMPT, config)
    return result.tokens, result.stats.requested_gammas


def test_adaptive_choices_follow_the_drafter(
    monkeypatch: pytest.MonkeyPatch, target: PreTrainedModel, reference: list[int]
) -> None:
    """On a fake clock (a target forward costs VERIFY_S, a draft token DRAFT_S) the choices
    depend on the acceptances only, not on how busy the machine running the tests is."""
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=4, schedule="adaptive")
    clock = FakeTime()
    unrelated = ClockedDrafter(tiny_model("llama", seed=99), clock, DRAFT_S)
    useless = decode_on_fake_clock(monkeypatch, target, unrelated, clock).generate(PROMPT, config)
    assert useless.tokens == reference
    gammas = useless.stats.requested_gammas
    assert gammas.get(0, 0) > useless.stats.rounds / 2  # mostly plain decoding
    # A free, always-right drafter: long drafts nearly every round (the first round's
    # choice rests on the prior only, and the last rounds may be cut by max_new_tokens).
    # Not the target drafting for itself: see ScriptDrafter.
    clock = FakeTime()
    oracle = decode_on_fake_clock(monkeypatch, target, ScriptDrafter(PROMPT + reference), clock)
    result = oracle.generate(PROMPT, config)
    assert result.tokens == reference
    gammas = result.stats.requested_gammas
    assert sum(n for k, n in gammas.items() if k >= 3) >= result.stats.rounds - 3
    assert result.stats.mean_accepted_tokens > 3


def test_a_drafter_too_dear_to_pay_is_not_retried_on_the_next_sequence(
    monkeypatch: pytest.MonkeyPatch, target: PreTrainedModel, reference: list[int]
) -> None:
    """The target drafting for itself at a target step per draft: always accepted, never
    faster. The first sequence learns that (its first round reads the prompt and is not
    timed, so it takes two drafting rounds); the next starts from it and never drafts."""
    clock = FakeTime()
    dear = ClockedDrafter(target, clock, VERIFY_S)
    decoder = decode_on_fake_clock(monkeypatch, target, dear, clock)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3, schedule="guarded")
    first = decoder.generate(PROMPT, config)
    assert first.tokens == reference
    assert first.stats.requested_gammas.get(3) == 2
    assert list(decoder.schedules.learned_draft_s.values()) == [pytest.approx(VERIFY_S)]
    second = decoder.generate(PROMPT, config)
    assert second.tokens == reference and set(second.stats.requested_gammas) == {0}
    # Sampling starts from no learned timing: a seed must fix the output in any process.
    sampled = replace(config, sampling=SamplingConfig(temperature=0.8))
    schedule = decoder.schedules.for_arm(sampled, "", CostModel((VERIFY_S,) * 4))
    assert schedule.current_cost().draft_s(1) == 0


@pytest.mark.parametrize("per_read", [0.0, 0.5 * VERIFY_S])
def test_a_prompt_read_that_drafting_cannot_repay_is_not_made(
    monkeypatch: pytest.MonkeyPatch, target: PreTrainedModel, reference: list[int], per_read: float
) -> None:
    """The target drafting for itself at 0.9 of a target step per draft, every draft
    accepted: at γ 3 over a flat T(n), 8% faster than plain decoding once it has read the
    prompt. At half a step per token, reading the prompt costs more than 40 tokens of
    drafting save. The first sequence learns the draft cost, and at its first probe (after
    plain rounds: its acceptance estimates start at 0.5) the catch-up; the next start from
    both and draft nothing, not even probes. With a free catch-up every sequence drafts."""
    clock = FakeTime()
    self_draft = ClockedDrafter(target, clock, 0.9 * VERIFY_S, per_read)
    decoder = decode_on_fake_clock(monkeypatch, target, self_draft, clock)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3, schedule="guarded")
    for sequence in range(3):
        result = decoder.generate(PROMPT, config)
        assert result.tokens == reference
        drafting = result.stats.requested_gammas.get(3, 0)
        assert drafting > 0 if per_read == 0 or sequence == 0 else drafting == 0
    seconds, read = decoder.schedules.learned_catch_up[""]
    assert seconds / read == pytest.approx(per_read)


def test_the_machine_speed_carries_to_the_next_sequence(
    monkeypatch: pytest.MonkeyPatch, target: PreTrainedModel, reference: list[int]
) -> None:
    """The target drafting for itself, then every forward and draft 2x slower than when T(n)
    was timed (another process on the machine). A sequence started from the timed speed
    stores its first plain rounds' T(1) against a speed factor still near 1, and a draft
    step looks half a target step: it drafts (9 rounds here; so did every sequence, each
    starting from speed 1). The next starts from the speed the one before left: at most two
    drafting rounds while the speed factor settles (its drafts all accepted, the estimate
    leaves the neutral guess quickly), and none after."""
    clock = FakeTime()
    dear = ClockedDrafter(target, clock, VERIFY_S)
    decoder = decode_on_fake_clock(monkeypatch, target, dear, clock)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3, schedule="guarded")
    assert decoder.generate(PROMPT, config).tokens == reference  # learns the draft cost
    clock.slowdown = 2.0
    slowed = decoder.generate(PROMPT, config)
    assert slowed.tokens == reference and slowed.stats.requested_gammas.get(3, 0) > 0
    assert decoder.schedules.machine_speed > 1.5  # the speed factor on its way to 2
    after = decoder.generate(PROMPT, config)
    assert after.tokens == reference and after.stats.requested_gammas.get(3, 0) <= 2
    settled = decoder.generate(PROMPT, config)
    assert settled.tokens == reference and set(settled.stats.requested_gammas) == {0}
    assert list(decoder.schedules.learned_draft_s.values()) == [pytest.approx(VERIFY_S)]


def test_guarded_choices_follow_the_drafter(
    monkeypatch: pytest.MonkeyPatch, target: PreTrainedModel, reference: list[int]
) -> None:
    """On the fake clock: an unrelated drafter is mostly switched off, with probes at γ;
    an always-right one drafts γ in every round that has room for it."""
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3, schedule="guarded")
    clock = FakeTime()
    unrelated = ClockedDrafter(tiny_model("llama", seed=99), clock, DRAFT_S)
    useless = decode_on_fake_clock(monkeypatch, target, unrelated, clock).generate(PROMPT, config)
    assert useless.tokens == reference
    gammas = useless.stats.requested_gammas
    assert set(gammas) <= {0, 3} and gammas.get(0, 0) > useless.stats.rounds / 2
    clock = FakeTime()
    oracle = decode_on_fake_clock(monkeypatch, target, ScriptDrafter(PROMPT + reference), clock)
    result = oracle.generate(PROMPT, config)
    assert result.tokens == reference
    assert result.stats.requested_gammas.get(3, 0) >= result.stats.rounds - 1
    assert result.stats.mean_accepted_tokens > 3


def test_adaptive_sampling_is_reproducible_for_a_seed_when_timings_repeat(
    monkeypatch: pytest.MonkeyPatch, target: PreTrainedModel
) -> None:
    """The adaptive schedule's choices depend on the acceptances and the timings only, so
    with timings that repeat exactly (a fake clock), a seed fixes the output."""
    tokens, gammas = sample_on_fake_clock(monkeypatch, target, seed=3, draft_per_token_s=DRAFT_S)
    assert 0 not in gammas or len(gammas) > 1  # it drafted
    assert sample_on_fake_clock(monkeypatch, target, seed=3, draft_per_token_s=DRAFT_S) == (
        tokens,
        gammas,
    )
    other, _ = sample_on_fake_clock(monkeypatch, target, seed=4, draft_per_token_s=DRAFT_S)
    assert other != tokens


def test_adaptive_sampling_output_does_not_depend_on_machine_speed(
    monkeypatch: pytest.MonkeyPatch, target: PreTrainedModel
) -> None:
    """Under sampling the schedule ignores timings (given a cost model), so a 30x slower
    drafter leaves the seeded output unchanged."""
    fast, _ = sample_on_fake_clock(monkeypatch, target, seed=3, draft_per_token_s=DRAFT_S)
    slow, _ = sample_on_fake_clock(monkeypatch, target, seed=3, draft_per_token_s=3e-3)
    assert slow == fast


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sampled_rounds_tell_the_schedule_their_acceptance_probabilities(
    monkeypatch: pytest.MonkeyPatch, target: PreTrainedModel, temperature: float
) -> None:
    """In the decode loop, a sampled drafting round tells the schedule the acceptance
    probability of every draft position it reached (its accepted drafts and the first
    rejected one); a greedy round tells none (its outcomes are exact)."""
    records: list[RoundRecord] = []
    update = AdaptiveGamma.update

    def spy(self: AdaptiveGamma, record: RoundRecord) -> None:
        records.append(record)
        update(self, record)

    monkeypatch.setattr(AdaptiveGamma, "update", spy)
    decoder = make_decoder(target, make_drafter("perturbed", target))
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS, gamma=3, schedule="adaptive", seed=1,
        sampling=SamplingConfig(temperature=temperature),
    )  # fmt: skip
    decoder.generate(PROMPT, config)
    drafting = [r for r in records if r.requested]
    assert drafting and any(r.accepted for r in drafting)
    for r in drafting:
        if temperature == 0:
            assert r.accept_probs == ()
        else:
            assert len(r.accept_probs) == min(r.accepted + 1, r.drafted)
            assert all(0 <= p <= 1 + 1e-6 for p in r.accept_probs)
    assert all(r.accept_probs == () for r in records if not r.requested)


def test_adaptive_schedule_near_the_end_of_the_context() -> None:
    """T(n) is measured after the prompt; near the end of the context there is no room for
    γ + 1 more positions after all of it (GPT-2's learned positions would index past
    their table), so the measurement must use less of the prompt."""
    target = tiny_model("gpt2", seed=0, context=16)
    drafter = DraftModelDrafter(perturbed_copy(target, scale=0.1, seed=1), vocab_size=TINY_VOCAB)
    decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=16)
    prompt = list(range(3, 15))  # 12 of 16 positions
    config = GenerationConfig(max_new_tokens=3, gamma=6, schedule="adaptive")
    assert decoder.generate(prompt, config).tokens == hf_greedy(target, prompt, 3)
    assert len(decoder.schedules.cost_model(prompt, 6).verify_s) == 7


# --- the memory budget -------------------------------------------------------------------


def weights_and_kv_per_token(decoder: SpecDecoder, drafter: DraftModelDrafter) -> tuple[int, int]:
    weights = tensor_bytes(module_tensors(decoder.target.model) + drafter.weight_tensors())
    return weights, kv_bytes_per_token(decoder.target.model) + drafter.kv_bytes_per_token()


@pytest.fixture
def forward_calls(target: PreTrainedModel) -> Iterator[list[str]]:
    calls: list[str] = []
    handle = target.register_forward_pre_hook(lambda module, args: calls.append("target"))
    yield calls
    handle.remove()


@pytest.mark.parametrize("schedule", ["fixed", "adaptive"])
def test_a_budget_too_small_fails_before_any_forward(
    target: PreTrainedModel, forward_calls: list[str], schedule: str
) -> None:
    drafter = make_drafter("perturbed", target)
    assert isinstance(drafter, DraftModelDrafter)
    draft_calls: list[str] = []
    drafter.runner.model.register_forward_pre_hook(lambda module, args: draft_calls.append("d"))
    decoder = make_decoder(target, drafter)
    weights, per_token = weights_and_kv_per_token(decoder, drafter)
    fits = 9  # new tokens the budget has room for
    budget = weights + per_token * (len(PROMPT) + fits) - 1  # the cache needs P + new - 1
    config = GenerationConfig(max_new_tokens=fits + 1, schedule=schedule, max_memory_bytes=budget)
    with pytest.raises(SpecMTPError, match=f"at most {fits} new tokens fit"):
        decoder.generate(PROMPT, config)
    assert forward_calls == [] and draft_calls == []
    assert decoder.target.length == 0 and drafter.runner.length == 0
    # What the message says fits does fit.
    config = GenerationConfig(max_new_tokens=fits, schedule=schedule, max_memory_bytes=budget)
    assert len(decoder.generate(PROMPT, config).tokens) == fits


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_bytes_per_token_matches_the_cache(arch: str, dtype: torch.dtype) -> None:
    model = tiny_model(arch, seed=0).to(dtype)
    runner = CachedModel(model, vocab_size=TINY_VOCAB)
    runner.forward(torch.tensor([PROMPT]))
    runner.forward(torch.tensor([[7, 8, 9]]))
    assert runner.kv_bytes() == kv_bytes_per_token(model) * runner.length
    assert runner.length == len(PROMPT) + 3


def test_a_budget_that_just_fits_plain_decoding(
    target: PreTrainedModel, reference: list[int]
) -> None:
    """Room for the whole request and not one position more: speculation still runs, and
    never holds more cache than plain decoding of the request would. Drafts are never
    proposed past max_new_tokens, so the cache never holds more than prompt +
    max_new_tokens - 1 positions (the last token is never fed back): the budget does not
    even have to shorten γ, and a generous budget does not change it either."""

    def run(budget: int | None) -> tuple[list[int], dict[int, int], int]:
        drafter = make_drafter("perturbed", target)
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=4, max_memory_bytes=budget)
        result = make_decoder(target, drafter).generate(PROMPT, config)
        return result.tokens, result.stats.requested_gammas, result.stats.peak_kv_bytes

    drafter = make_drafter("perturbed", target)
    assert isinstance(drafter, DraftModelDrafter)
    weights, per_token = weights_and_kv_per_token(make_decoder(target, drafter), drafter)
    tight = weights + per_token * (len(PROMPT) + NEW_TOKENS)
    tokens, gammas, peak = run(tight)
    assert tokens == reference
    assert peak <= tight - weights
    assert peak >= kv_bytes_per_token(target) * (len(PROMPT) + NEW_TOKENS - 1)
    unbounded_tokens, unbounded_gammas, _ = run(None)
    assert unbounded_tokens == reference
    assert gammas == unbounded_gammas == run(tight * 4)[1]
    assert gammas[4] > 1


def test_adaptive_expects_cheaper_verifies_from_a_drafter_that_proposes_less() -> None:
    """n-gram lookup often proposes nothing: the round then verifies 1 token, not k + 1."""
    cost = CostModel(tuple(1.0 + 0.5 * (n - 1) for n in range(1, 9)))
    always, often_none = AdaptiveGamma(cost, max_gamma=4), AdaptiveGamma(cost, max_gamma=4)
    for i in range(40):
        always.update(RoundRecord(4, 4, 0, 5, 0.0, cost.target_s(5)))
        drafted = 4 if i % 4 == 0 else 0
        often_none.update(RoundRecord(4, drafted, 0, drafted + 1, 0.0, cost.target_s(drafted + 1)))
    for schedule in (always, often_none):
        lengths = schedule.proposal_lengths(4)
        assert len(lengths) == 5 and sum(lengths) == pytest.approx(1.0)
    assert always.proposal_lengths(4)[4] > 0.95
    assert often_none.proposal_lengths(4)[0] == pytest.approx(0.75, abs=0.1)
    # The same E(k) (nothing accepted either way), but the verify it expects is cheaper.
    assert often_none.alphas[0] == pytest.approx(always.alphas[0])
    assert often_none.predicted_speedup(4) > always.predicted_speedup(4) * 1.5


def test_adaptive_learns_verify_times_per_size() -> None:
    """At a long context T(n) grows faster with n than the cost model measured on a short
    prompt: the schedule follows the times it sees for each size and drafts less."""
    cost = target_cost(0.0)  # T(n) = 1 + 0.05 (n - 1): drafting looks nearly free
    short, long = AdaptiveGamma(cost, max_gamma=6), AdaptiveGamma(cost, max_gamma=6)
    drive(short, first_three, 30)
    for _ in range(30):  # the same acceptance, but every extra verified token costs 1.5 T(1)
        k = long.next_gamma(8)
        long.update(RoundRecord(k, k, min(k, 3), k + 1, 0.0, 1.0 + 1.5 * k))
    assert long.current_cost().target_s(4) > 2 * short.current_cost().target_s(4)
    assert long.next_gamma(8) < short.next_gamma(8)
