"""Draft-length schedules: how many tokens to draft in each round.

A schedule is asked for each round's γ and told what the round did (`Schedule`). Here:
- fixed: the same γ every round.
- heuristic: Hugging Face's assisted-generation schedule: +2 after a round that accepted
  every draft, -1 (not below 1) otherwise.
The adaptive schedule, which chooses γ from a measured cost model and has a never-slower
guard, and a fixed γ behind that guard are in `specmtp.adaptive_schedule`. Fixed γ alone
has no floor: a drafter that misses makes every round cost a verify pass (and the drafts)
for one token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class RoundRecord:
    """What one round did, as the schedule sees it."""

    requested: int  # γ asked of the drafter
    drafted: int  # draft positions it proposed (a tree's depth); may be < requested
    accepted: int
    verified: int  # tokens in the verify forward (k + 1, or a tree's nodes + 1)
    draft_s: float
    verify_s: float
    caught_up: int = 0  # tokens the drafter read before drafting (drafters.drafter_catch_up)
    checking: bool = False  # a round that only checked whether drafting pays (Schedule.checking)
    # Sampling: for each draft position the round reached (the accepted ones and the first
    # rejected), the probability that it was accepted (Verdict.accept_probs): the
    # outcome's expected value, without the coin's noise. Empty: the outcomes are all known.
    accept_probs: tuple[float, ...] = ()


class Schedule(Protocol):
    # Whether the round next_gamma chose only checks whether drafting pays (a probe after
    # plain rounds): it should be the cheapest of its depth (a tree drafter's top path).
    checking: bool

    def next_gamma(self, limit: int, catch_up: int = 0) -> int:
        """γ for the coming round, at most `limit` (the tokens or memory left); drafting
        first makes the drafter read `catch_up` tokens it has not seen."""

    def update(self, record: RoundRecord) -> None: ...


class FixedGamma:
    checking = False

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma

    def next_gamma(self, limit: int, catch_up: int = 0) -> int:
        return min(self.gamma, limit)

    def update(self, record: RoundRecord) -> None:
        pass


class HeuristicGamma:
    """Hugging Face's `num_assistant_tokens_schedule="heuristic"`, run by our engine."""

    checking = False

    def __init__(self, start: int) -> None:
        self.gamma = start

    def next_gamma(self, limit: int, catch_up: int = 0) -> int:
        return min(self.gamma, limit)

    def update(self, record: RoundRecord) -> None:
        if record.requested == 0:
            return
        all_accepted = record.accepted == record.requested
        self.gamma = self.gamma + 2 if all_accepted else max(1, self.gamma - 1)
