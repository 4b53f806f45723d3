"""Statistics of one generation: what was drafted, accepted, and where the time went."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerationStats:
    """Counters filled in by the decode loop.

    τ (mean_accepted_tokens) follows Spec-Bench: tokens committed per target verify pass,
    counting the recovered or bonus token, so plain decoding has τ = 1.0. The prefill
    pass over the prompt is counted apart, in prefill_s.
    """

    gamma: int
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0  # target verify passes
    drafted_tokens: int = 0
    verified_tokens: int = 0  # tokens fed to the target in verify passes (tree nodes included)
    accepted_tokens: int = 0
    accept_histogram: list[int] = field(default_factory=list)  # [gamma+1] rounds by accepted
    position_proposed: list[int] = field(default_factory=list)  # [gamma] rounds drafting pos i
    position_accepted: list[int] = field(default_factory=list)  # [gamma] rounds accepting pos i
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = ""

    def __post_init__(self) -> None:
        self.accept_histogram = [0] * (self.gamma + 1)
        self.position_proposed = [0] * self.gamma
        self.position_accepted = [0] * self.gamma

    def record_round(self, drafted: int, accepted: int, verified: int) -> None:
        """One verify pass over `verified` tokens that checked `drafted` draft positions (a
        tree's depth) and kept `accepted` of them."""
        if drafted > self.gamma:  # a tree deeper than gamma
            grow = drafted - self.gamma
            self.gamma = drafted
            self.accept_histogram += [0] * grow
            self.position_proposed += [0] * grow
            self.position_accepted += [0] * grow
        self.rounds += 1
        self.drafted_tokens += drafted
        self.verified_tokens += verified
        self.accepted_tokens += accepted
        self.accept_histogram[accepted] += 1
        for i in range(drafted):
            self.position_proposed[i] += 1
            self.position_accepted[i] += i < accepted

    @property
    def mean_accepted_tokens(self) -> float:
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_per_position(self) -> list[float | None]:
        """P(draft i accepted) over the rounds that drafted position i (None: never drafted)."""
        return [
            a / p if p else None
            for a, p in zip(self.position_accepted, self.position_proposed, strict=True)
        ]

    @property
    def other_s(self) -> float:
        return max(0.0, self.total_s - self.prefill_s - self.draft_s - self.verify_s)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "target_forwards": self.rounds + 1,  # verify passes plus the prefill
            "verify_rounds": self.rounds,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "verified_tokens": self.verified_tokens,
            "mean_accepted_tokens": round(self.mean_accepted_tokens, 4),
            "accept_histogram": self.accept_histogram,
            "acceptance_per_position": [
                None if a is None else round(a, 4) for a in self.acceptance_per_position
            ],
            "prefill_s": round(self.prefill_s, 4),
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "other_s": round(self.other_s, 4),
            "total_s": round(self.total_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "finish_reason": self.finish_reason,
        }

    def summary(self) -> str:
        """A few human lines for the CLI."""
        rates = " ".join("-" if a is None else f"{a:.2f}" for a in self.acceptance_per_position)
        return "\n".join(
            [
                f"new tokens {self.new_tokens} in {self.total_s:.2f} s "
                f"({self.tokens_per_s:.1f} tok/s), finish: {self.finish_reason}",
                f"target forwards {self.rounds + 1} (1 prefill + {self.rounds} verify), "
                f"mean accepted tokens τ {self.mean_accepted_tokens:.2f}",
                f"accepted drafts per round (0..{self.gamma}): {self.accept_histogram}",
                f"acceptance by draft position: {rates}",
                f"time: prefill {self.prefill_s:.2f} s, draft {self.draft_s:.2f} s, "
                f"verify {self.verify_s:.2f} s, other {self.other_s:.2f} s",
            ]
        )
