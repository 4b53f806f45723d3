"""Statistics of one generation: what was drafted, accepted, and where the time went."""

from __future__ import annotations

import os
import resource
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """The process's resident memory now (Linux /proc), else its peak so far (getrusage)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


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
    # [gamma] rounds that asked for pos i with every earlier draft accepted: α_i's denominator
    position_reached: list[int] = field(default_factory=list)
    requested_gammas: dict[int, int] = field(default_factory=dict)  # γ asked -> rounds
    verify_sizes: dict[int, int] = field(default_factory=dict)  # tokens verified -> rounds
    # Token trees, per (depth, child rank): rounds whose accepted path reached the node's
    # parent, and rounds that accepted the node. tune estimates rank probabilities from them.
    tree_reached: dict[tuple[int, int], int] = field(default_factory=dict)
    tree_accepted: dict[tuple[int, int], int] = field(default_factory=dict)
    # Drafters with arms (lookup first, a model otherwise): arm -> [rounds, drafted, accepted]
    arm_counts: dict[str, list[int]] = field(default_factory=dict)
    # ... and per arm, position_reached and position_accepted over that arm's rounds
    arm_reached: dict[str, list[int]] = field(default_factory=dict)
    arm_accepted: dict[str, list[int]] = field(default_factory=dict)
    arm_draft_s: dict[str, float] = field(default_factory=dict)
    peak_kv_bytes: int = 0  # target and drafter caches together, sampled after each verify
    peak_rss_bytes: int = 0  # the process's resident memory, sampled after each verify
    first_token_s: float = 0.0  # time to the first committed new token (TTFT)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = ""

    def __post_init__(self) -> None:
        self.accept_histogram = [0] * (self.gamma + 1)
        self.position_proposed = [0] * self.gamma
        self.position_accepted = [0] * self.gamma
        self.position_reached = [0] * self.gamma

    def record_round(self, drafted: int, accepted: int, verified: int, requested: int) -> None:
        """One verify pass over `verified` tokens that checked `drafted` draft positions (a
        tree's depth) of the `requested` γ and kept `accepted` of them."""
        if drafted > self.gamma:  # a tree deeper than gamma
            grow = drafted - self.gamma
            self.gamma = drafted
            self.accept_histogram += [0] * grow
            self.position_proposed += [0] * grow
            self.position_accepted += [0] * grow
            self.position_reached += [0] * grow
        self.requested_gammas[requested] = self.requested_gammas.get(requested, 0) + 1
        self.verify_sizes[verified] = self.verify_sizes.get(verified, 0) + 1
        self.rounds += 1
        self.drafted_tokens += drafted
        self.verified_tokens += verified
        self.accepted_tokens += accepted
        self.accept_histogram[accepted] += 1
        for i in range(drafted):
            self.position_proposed[i] += 1
            self.position_accepted[i] += i < accepted
            self.position_reached[i] += i <= accepted
        if accepted == drafted < min(requested, self.gamma):
            # The drafter stopped short (n-gram lookup found nothing more): for the cost
            # model, a position asked for and not drafted is a position rejected.
            self.position_reached[drafted] += 1

    def record_arm(
        self, arm: str, drafted: int, accepted: int, requested: int, draft_s: float = 0.0
    ) -> None:
        """A round of the drafter arm `arm` (rounds that drafted nothing count too), counted
        per position as record_round does: a position asked for and not drafted, rejected."""
        self.arm_draft_s[arm] = self.arm_draft_s.get(arm, 0.0) + draft_s
        counts = self.arm_counts.setdefault(arm, [0, 0, 0])
        counts[0] += 1
        counts[1] += drafted
        counts[2] += accepted
        tried = drafted + (accepted == drafted < requested)
        reached = self.arm_reached.setdefault(arm, [])
        hits = self.arm_accepted.setdefault(arm, [])
        for counts_i in (reached, hits):
            counts_i += [0] * (tried - len(counts_i))
        for i in range(min(tried, accepted + 1)):
            reached[i] += 1
            hits[i] += i < accepted

    def record_tree(self, paths: Sequence[tuple[int, ...]], accepted: Sequence[int]) -> None:
        """One tree round: `paths` are the tree's nodes as child-rank paths, `accepted` the
        node indices of the accepted path. A node is reached when its parent is the root or
        on the accepted path."""
        kept = {()} | {paths[i] for i in accepted}
        for path in paths:
            if path[:-1] in kept:
                key = (len(path), path[-1])
                self.tree_reached[key] = self.tree_reached.get(key, 0) + 1
                self.tree_accepted[key] = self.tree_accepted.get(key, 0) + (path in kept)

    def record_memory(self, kv_bytes: int) -> None:
        self.peak_kv_bytes = max(self.peak_kv_bytes, kv_bytes)
        self.peak_rss_bytes = max(self.peak_rss_bytes, resident_bytes())

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
    def conditional_acceptance(self) -> list[float | None]:
        """α_i: P(draft i accepted | drafts before it accepted), None where never reached."""
        return [
            a / r if r else None
            for a, r in zip(self.position_accepted, self.position_reached, strict=True)
        ]

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first."""
        if self.new_tokens < 2:
            return 0.0
        return (self.total_s - self.first_token_s) / (self.new_tokens - 1)

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
            "conditional_acceptance": [
                None if a is None else round(a, 4) for a in self.conditional_acceptance
            ],
            "requested_gammas": dict(sorted(self.requested_gammas.items())),
            "verify_sizes": dict(sorted(self.verify_sizes.items())),
            "peak_kv_bytes": self.peak_kv_bytes,
            "peak_rss_bytes": self.peak_rss_bytes,
            "ttft_s": round(self.first_token_s, 4),
            "tpot_s": round(self.tpot_s, 5),
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
                f"time to first token {self.first_token_s * 1000:.0f} ms, then "
                f"{self.tpot_s * 1000:.1f} ms per token; peak KV cache "
                f"{self.peak_kv_bytes / 2**20:.1f} MiB",
                f"time: prefill {self.prefill_s:.2f} s, draft {self.draft_s:.2f} s, "
                f"verify {self.verify_s:.2f} s, other {self.other_s:.2f} s",
            ]
        )
