"""The adaptive draft-length schedule, and a fixed γ behind its never-slower guard.

- adaptive: per sequence, acceptance estimates α_i updated as tokens are accepted, and the γ
  that maximises expected tokens per second under a measured cost model (costmodel.py).
  Under sampling it ignores wall-clock timings (a seed must fix the output, and γ decides
  how the generator's numbers are used): only acceptances and the given costs steer it,
  costs that are the same in every process (a profile's, or T(n) stored: timings.py).
  It includes a never-slower guard: when no γ >= 1 is predicted to beat plain decoding,
  not even with the first position's acceptance at the top of what the sequence's longer
  record allows, it drafts nothing, and probes with γ = 1 now and then in case the text
  has become predictable again (a tree drafter's top path alone: a check, not a bet; see
  `checking`); the interval doubles after each probe that leaves
  drafting predicted not to pay, accepted drafts or not, and there are no probes when not
  even drafts that are all accepted would pay. A draft model that sat out rounds (or has
  not read the prompt) reads them before it drafts: it starts drafting only when the
  tokens left could repay that.
- guarded: a fixed γ behind the adaptive schedule's guard: γ every round while γ is
  predicted to pay, else plain decoding with probes at γ.

Both follow `specmtp.schedule.Schedule`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import accumulate

from specmtp.costmodel import CostModel, expected_tokens
from specmtp.schedule import RoundRecord

NEUTRAL = 0.5  # the first position's α before any evidence, without a measured prior


@dataclass(frozen=True)
class AdaptiveSettings:
    prior_strength: float = 2.0  # pseudo-rounds behind the prior α at each position
    # Pseudo-rounds behind the first position's neutral 0.5 when no prior was measured (no
    # profile, or one tuned at another temperature): a guess weighs less than a measure.
    # At 2, MTP heads on random tokens at temperature 1.0 drafted 5-row trees for about 7
    # rounds a sequence, and checked for about 12 more, before the guess wore off (0.94x).
    guess_strength: float = 1.0
    decay: float = 0.95  # per round: older evidence fades, so estimates follow the text
    cost_decay: float = 0.9  # per round: how fast the machine's speed factor is re-estimated
    margin: float = 1.02  # speculate only when predicted to be this much faster
    # The fallback reads the first position's acceptance over a longer record (decay per
    # round), raised by `confidence` standard errors: near break-even, the ~20 rounds that
    # `decay` keeps dip below it by chance, and plain rounds gather no evidence to undo it.
    long_decay: float = 0.99
    confidence: float = 1.0
    first_probe: int = 4  # plain rounds before the first probe; doubles after a failed one
    last_probe: int = 64


class AdaptiveGamma:
    """Chooses each round's γ from per-position acceptance estimates and a cost model.

    Estimates: α_i = (accepted_i + s·prior_i) / (reached_i + s), where reached_i counts the
    rounds that drafted position i with every earlier draft accepted, and both counts decay
    by `decay` per update. Under sampling accepted_i adds up the probabilities that the
    reached drafts were accepted (RoundRecord.accept_probs), not the coin's outcomes: the
    same expected value without its noise. At temperature 1.0 on random tokens, where a
    draft is accepted one time in 25, each chance acceptance had lifted the estimate over
    what the guard rules out, and the sequence checked again for several rounds. A drafter
    that proposes fewer tokens than asked (n-gram lookup finding no match) counts as
    rejected at the first missing position, and the length it proposes is tracked apart,
    since a shorter proposal is a cheaper verify. Costs: the cost model's T(n) and D(k),
    times speed factors re-estimated from the rounds' own timings, so a busier machine moves
    target and draft costs alike.
    """

    def __init__(
        self,
        cost: CostModel,
        *,
        max_gamma: int,
        prior: Sequence[float] = (),
        settings: AdaptiveSettings = AdaptiveSettings(),
        timing_feedback: bool = True,
    ) -> None:
        self.cost = cost
        self.max_gamma = max_gamma
        self.settings = settings
        self.prior = list(prior[:max_gamma])
        self.timing_feedback = timing_feedback
        self.reached = [0.0] * max_gamma
        self.accepted = [0.0] * max_gamma
        # Proposal lengths: asked for position i with i - 1 proposed, and i proposed.
        self.offered = [0.0] * max_gamma
        self.proposed = [0.0] * max_gamma
        # Measured / modelled seconds: the machine's speed now, against the speed at which
        # the cost model was timed (another process on the machine moves it).
        self.target_speed = 1.0
        self.draft_speed = 1.0
        # Without measured draft costs (no profile), learn seconds per drafted token here.
        # (At the cost model's speed: seconds per token when target_speed is 1.)
        self.learn_draft = cost.draft_s(1) == 0
        self.draft_per_token_s = 0.0
        # A draft model's catch-up: decayed sums of the seconds its catch-up rounds took
        # beyond their drafts (at the cost model's speed) and of the tokens they read. A
        # cost model's price per token read starts it, as if from one token.
        read_s = cost.catch_up_per_token_s
        self.catch_up_record = (read_s, 1.0) if read_s else (0.0, 0.0)
        self.unpriced_catch_up: tuple[RoundRecord, float] | None = None  # before a draft's cost
        self.verified: dict[int, int] = {}  # depth drafted -> tokens verified (trees: more)
        # Verify seconds seen per size n: T(n)'s shape changes with the context length
        # (attention over a long prompt), which one speed factor cannot follow. With the
        # target_speed each was last timed at: a size not timed lately follows the machine.
        self.seen_verify_s: dict[int, float] = {}
        self.seen_at: dict[int, float] = {}
        self.plain_rounds = 0
        self.timed_drafts = 0  # drafting rounds seen by _update_speeds
        self.probe_every = settings.first_probe
        # First position (long_decay): accepted, reached, and the accepted outcomes' squares
        # (the same as accepted for 0/1 outcomes; less for probabilities, whose spread
        # is smaller than a coin's).
        self.long_record = [0.0, 0.0, 0.0]
        # Whether the round chosen last only checks that drafting pays: a probe, or a round
        # the record cannot rule out but does not predict to pay. Such a round's drafter
        # proposes its cheapest shape of that depth (a tree drafter its top path alone):
        # on text where drafts miss, a tree's probe verified 5 rows to learn what 2 tell,
        # and cost about a plain step more each (random tokens at temperature 1.0).
        self.checking = False

    @property
    def alphas(self) -> list[float]:
        """Estimates per position. The profile's prior for a later position is scaled by
        how this text's first position compares with the profile's (the one position with
        evidence every round: text harder than the tuning prompts there is harder further
        on too). Past the profile's prior, a position's prior is the estimate of the one
        before it, so a drafter that is always right is not held back at a short γ by
        positions it has not tried yet. Without a prior, the first position starts from
        NEUTRAL with `guess_strength`."""
        estimates: list[float] = []
        for i, (a, r) in enumerate(zip(self.accepted, self.reached, strict=True)):
            s = self.settings.prior_strength
            if i == 0 and not self.prior:
                p, s = NEUTRAL, self.settings.guess_strength
            elif i >= len(self.prior):
                p = estimates[-1]
            elif i > 0 and self.prior[0] > 0:
                p = min(1.0, self.prior[i] * estimates[0] / self.prior[0])
            else:
                p = self.prior[i]
            estimates.append((a + s * p) / (r + s))
        return estimates

    def optimistic_alphas(self) -> list[float]:
        """The estimates with the first one taken over the longer record (`long_decay`) and
        raised by `confidence` standard errors (of the record's own spread): what the
        evidence cannot yet rule out."""
        alphas = self.alphas
        s = self.settings.prior_strength if self.prior else self.settings.guess_strength
        prior = self.prior[0] if self.prior else NEUTRAL
        accepted, reached, squares = self.long_record
        rounds = reached + s
        first = (accepted + s * prior) / rounds
        # The record's spread, the prior's pseudo-rounds counted as 0/1 outcomes (x² = x):
        # first · (1 - first) when every outcome is 0 or 1.
        spread = max(0.0, (squares + s * prior) / rounds - first * first)
        first += self.settings.confidence * (spread / rounds) ** 0.5
        return [min(1.0, first), *alphas[1:]]

    def current_cost(self) -> CostModel:
        """The cost model at this machine's current speed, and at this sequence's context:
        T(n) as seen in this sequence where it was seen, else modelled times the speed, never
        lower for more tokens."""
        speed = self.target_speed
        cost = self.cost.scaled(target=speed, draft=self.draft_speed)
        top = max(len(cost.verify_s), *self.seen_verify_s, 0)
        times = [self.seen_s(n) or cost.target_s(n) for n in range(1, top + 1)]
        # Verifying more tokens never costs less than fewer. Where T(n) is flat (bfloat16),
        # noise can time T(2) below T(1) (or a seen T(2) below a modelled T(1)), and a
        # one-token draft would look free forever to a drafter that never hits.
        cost = replace(cost, verify_s=tuple(accumulate(times, max)))
        if self.learn_draft:
            cost = replace(cost, draft_per_token_s=speed * self.unit_draft_s())
        return cost

    def seen_s(self, n: int) -> float | None:
        """T(n) as this sequence timed it, moved by the machine's speed since then: a size
        timed while another process was running must not stay that dear (or cheap) after
        it stops. Left stale, plain rounds timed on a busy machine made T(1) dearer than the
        drafts timed later on a quiet one, and a drafter as dear as a target step (the
        target drafting for itself) was predicted to pay."""
        if n not in self.seen_verify_s:
            return None
        return self.seen_verify_s[n] * self.target_speed / self.seen_at[n]

    def catch_up_s(self, tokens: int) -> float:
        """Predicted seconds for the drafter to read `tokens` before drafting, at the
        machine's current speed: seconds per token over the catch-ups seen (0 before any)."""
        seconds, read = self.catch_up_record
        return tokens * seconds / read * self.target_speed if read else 0.0

    def repays(self, speedup: float, catch_up: int, left: int) -> bool:
        """Whether drafting at `speedup` over the `left` tokens still to generate saves
        more than the drafter's catch-up on `catch_up` tokens costs. A draft model reads a
        whole prompt before its first draft, and the skipped tokens after plain rounds:
        for the target drafting for itself at best 2-3% faster, that is four to six target
        steps, more than 64 tokens of drafting can win back."""
        if not catch_up:
            return True
        saving = left * self.current_cost().target_s(1) * (1 - 1 / speedup)
        return saving >= self.catch_up_s(catch_up)

    def unit_draft_s(self) -> float:
        """The learned seconds per drafted token at the cost model's speed: what the next
        sequence's schedule starts from."""
        return self.draft_per_token_s

    def proposal_lengths(self, k: int) -> list[float]:
        """P(the drafter proposes exactly l tokens when asked for k), l = 0..k. A model
        drafter always proposes k; n-gram lookup often fewer, and then verifies fewer."""
        s = self.settings.prior_strength
        at_least = [1.0]
        for i in range(k):
            rate = (self.proposed[i] + s) / (self.offered[i] + s)  # prior: it proposes all
            at_least.append(at_least[-1] * rate)
        at_least.append(0.0)
        return [at_least[length] - at_least[length + 1] for length in range(k + 1)]

    def predicted_speedup(
        self, k: int, alphas: Sequence[float] | None = None, cost: CostModel | None = None
    ) -> float:
        """E(k) · T(1) / (D(k) + E[T(verified)]), the verify size following the proposal
        length (a missing draft already counts as rejected in E(k)); E(k) under the
        current estimates unless `alphas` are given, at current_cost() unless `cost` is
        (a round's choice prices every k at one cost: building it once per k made choosing
        among 8 take 181 µs a round, 52 µs since; scripts/next_gamma_cost.py)."""
        cost = self.current_cost() if cost is None else cost
        lengths = self.proposal_lengths(k)
        verify = sum(
            p * cost.target_s(self.verified.get(length, length + 1))
            for length, p in enumerate(lengths)
        )
        round_s = (cost.draft_s(k) if k else 0.0) + verify
        alphas = self.alphas if alphas is None else alphas
        return expected_tokens(alphas, k) * cost.target_s(1) / round_s

    def choices(self, top: int) -> range:
        """The draft lengths it may choose (besides none) when at most `top` fit, cheapest
        first: the fallback's checks and probes use the cheapest."""
        return range(1, top + 1)

    def next_gamma(self, limit: int, catch_up: int = 0) -> int:
        self.checking = False
        choices = self.choices(max(0, min(self.max_gamma, limit)))
        if not choices:
            return 0
        k, self.checking = self.paying_choice(choices)
        if k:
            if not catch_up:  # drafting every round: nothing to repay, nothing to predict again
                return k
            speedup = max(
                self.predicted_speedup(k), self.predicted_speedup(k, self.optimistic_alphas())
            )
            return k if self.repays(speedup, catch_up, limit) else 0
        if self.plain_rounds >= self.probe_every and self.could_pay(choices, catch_up, limit):
            self.checking = True
            return choices[0]  # a probe: is the text predictable again?
        return 0

    def could_pay(self, choices: range, catch_up: int = 0, left: int = 0) -> bool:
        """Whether a probe (the cheapest choice) is worth taking: some choice would beat
        plain decoding if every draft were accepted, and the probe itself, every draft
        accepted, would over the `left` tokens repay the drafter's catch-up on `catch_up`
        tokens. If no choice would beat plain decoding (a drafter that costs about a target
        step per draft), no text makes drafting pay, and a probe only costs: the drafter
        catches up on the plain rounds' tokens and drafts for nothing. The catch-up is the
        probe's to repay: one accepted probe does not take the estimates to a longer γ, and
        a longer γ that could repay it had the target drafting for itself probe three
        times a sequence, with drafts of 1 that could not (0.92x at temperature 0.7)."""
        margin, cost = self.settings.margin, self.current_cost()
        if all(self.predicted_speedup(k, [1.0] * k, cost) < margin for k in choices):
            return False
        probe = choices[0]
        return self.repays(self.predicted_speedup(probe, [1.0] * probe, cost), catch_up, left)

    def paying_gamma(self, choices: range) -> int:
        """The choice predicted to draft fastest, if it beats plain decoding by the margin;
        else the cheapest, if the sequence's record cannot yet rule out that it does; else
        0 (fall back to plain decoding)."""
        return self.paying_choice(choices)[0]

    def paying_choice(self, choices: range) -> tuple[int, bool]:
        """paying_gamma's choice, and whether it only checks (not ruled out, not predicted)."""
        margin, cost, alphas = self.settings.margin, self.current_cost(), self.alphas
        speedups = {k: self.predicted_speedup(k, alphas, cost) for k in choices}
        best = max(choices, key=lambda k: (speedups[k], -k))
        if speedups[best] >= margin:
            return best, False
        if self.predicted_speedup(choices[0], self.optimistic_alphas(), cost) >= margin:
            return choices[0], True
        return 0, False

    def update(self, record: RoundRecord) -> None:
        if self.timing_feedback:
            self._update_speeds(record)
        if not record.checking:  # a check's top path is not the size of the rounds it checks for
            self.verified[record.drafted] = record.verified
        if record.requested == 0:
            self.plain_rounds += 1
            return
        probe = self.plain_rounds > 0
        self.plain_rounds = 0
        self._update_acceptance(record)
        if probe:  # back off further unless drafting pays again
            # A probe whose drafts were accepted can still fail: a drafter that is always
            # right but costs a target step per draft never pays, and probing it every few
            # rounds would cost more than the guard saves.
            pays = self.paying_gamma(self.choices(self.max_gamma)) > 0
            self.probe_every = (
                self.settings.first_probe
                if pays
                else min(2 * self.probe_every, self.settings.last_probe)
            )

    def _update_acceptance(self, record: RoundRecord) -> None:
        decay = self.settings.decay
        for counts in (self.reached, self.accepted, self.offered, self.proposed):
            counts[:] = [c * decay for c in counts]
        for i in range(min(record.requested, record.drafted + 1, self.max_gamma)):
            self.offered[i] += 1
            self.proposed[i] += i < record.drafted
        # Positions tried: every drafted one reached, plus the first missing one.
        tried = min(record.requested, record.drafted + 1, self.max_gamma)
        for i in range(min(tried, record.accepted + 1)):
            self.reached[i] += 1
            self.accepted[i] += _accepted_at(record, i)
        if tried:
            keep, first = self.settings.long_decay, _accepted_at(record, 0)
            accepted, reached, squares = self.long_record
            self.long_record = [
                keep * accepted + first,
                keep * reached + 1,
                keep * squares + first * first,
            ]

    def _update_speeds(self, record: RoundRecord) -> None:
        keep = self.settings.cost_decay
        n = record.verified
        # The old value at the machine's speed before this round: the round's own timing
        # already carries any change since, so it is moved by the earlier changes only.
        seen = self.seen_s(n)
        round_speed = record.verify_s / self.cost.target_s(n)
        self.target_speed = keep * self.target_speed + (1 - keep) * round_speed
        seen = seen or record.verify_s  # the first timing of a size sets it
        self.seen_verify_s[n] = keep * seen + (1 - keep) * record.verify_s
        self.seen_at[n] = self.target_speed
        if not record.drafted:
            return
        # A draft model's first round of a sequence reads the prompt, and its first after
        # plain rounds catches up on their tokens: neither times what a draft costs while
        # drafting, and either could price drafting out (then nothing would be probed).
        catching_up = record.caught_up > 0 or self.plain_rounds > 0 or not self.timed_drafts
        self.timed_drafts += 1
        if record.caught_up:
            self._learn_catch_up(record, round_speed)
        if catching_up:
            return
        if self.learn_draft:
            # Taken to the cost model's speed by this round's own verify pass: the speed
            # factor lags a change in the machine's load by about ten rounds, and a draft
            # timed inside that lag was stored too cheap (or too dear) for good, since
            # the next sequence starts from it.
            per_token = record.draft_s / record.drafted / round_speed
            unit = self.draft_per_token_s or per_token  # the first timing sets it
            self.draft_per_token_s = keep * unit + (1 - keep) * per_token
            if self.unpriced_catch_up is not None:
                self._learn_catch_up(*self.unpriced_catch_up)
                self.unpriced_catch_up = None
        else:
            ratio = record.draft_s / self.cost.draft_s(record.drafted)
            self.draft_speed = keep * self.draft_speed + (1 - keep) * ratio

    def _learn_catch_up(self, record: RoundRecord, round_speed: float) -> None:
        """The seconds a catch-up round took beyond its drafts, per token read. Weighted by
        the tokens: a prompt read times it better than the noise of a few skipped tokens.
        A catch-up before a draft's own cost is known (the first round's prompt read) is
        priced once it is."""
        if self.learn_draft:
            drafts_s = self.draft_per_token_s * record.drafted * round_speed
            if not drafts_s:
                self.unpriced_catch_up = (record, round_speed)
                return
        else:
            drafts_s = self.cost.draft_s(record.drafted) * self.draft_speed
        extra_s = max(0.0, record.draft_s - drafts_s) / round_speed
        keep, (seconds, read) = self.settings.cost_decay, self.catch_up_record
        self.catch_up_record = (keep * seconds + extra_s, keep * read + record.caught_up)


def _accepted_at(record: RoundRecord, i: int) -> float:
    """Reached draft position i's acceptance: its probability under sampling, where known,
    else the outcome (a position the drafter left empty counts as rejected)."""
    if i < len(record.accept_probs):
        return record.accept_probs[i]
    return float(i < record.accepted)


class GuardedGamma(AdaptiveGamma):
    """A fixed γ (`max_gamma`, or the limit when less fits) with AdaptiveGamma's estimates,
    fallback and probes: it drafts γ tokens whenever γ is predicted to beat plain decoding
    (or the record cannot yet rule that out), and no other length."""

    def choices(self, top: int) -> range:
        return range(top, top + 1) if top >= 1 else range(0)
