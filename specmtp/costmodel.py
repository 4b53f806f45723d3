"""The cost model of speculative decoding: what a round costs and what it commits.

Leviathan et al. (2023) predict the tokens a round commits from one acceptance rate α and a
draft/target cost ratio c. We generalise both: a conditional acceptance α_i per draft
position, and a measured target cost T(n) for one forward over n tokens (on a CPU it is far
from linear, and not even monotone: the LM head's small matrix products are slow).

A round that drafts k tokens (k = 0 is plain decoding):

    E(k)    = 1 + Σ_{j=1..k} Π_{i=1..j} α_i      committed: accepted drafts + the next token
    time(k) = D(k) + T(k + 1)                    draft k, then one verify over [last, *drafts]

Plain decoding commits one token per T(1), so the predicted speedup of k is
E(k) · T(1) / time(k). α_i is conditional: P(draft i accepted | drafts 1..i-1 accepted).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from specmtp.cache import CachedModel
from specmtp.errors import SpecMTPError

if TYPE_CHECKING:
    from specmtp.tree import TokenTree


def expected_tokens(alphas: Sequence[float], k: int) -> float:
    """E(k): tokens one round commits when it drafts k, with conditional acceptances α_i."""
    total, reach = 1.0, 1.0
    for i in range(k):
        reach *= alphas[i] if i < len(alphas) else 0.0
        total += reach
    return total


@dataclass(frozen=True)
class CostModel:
    """Measured costs on one machine: T(n) for n = 1..len(verify_s), and D(k) = a + b·k."""

    verify_s: tuple[float, ...]  # [N] seconds of one target forward over n = 1..N tokens
    draft_fixed_s: float = 0.0  # a: per drafting round (k >= 1)
    draft_per_token_s: float = 0.0  # b: per drafted token
    # Per token a drafter with a cache of its own reads before drafting: a draft model's
    # prompt, and the tokens of plain rounds (drafters.drafter_catch_up); 0: not known.
    catch_up_per_token_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.verify_s or any(not t > 0 for t in self.verify_s):
            raise SpecMTPError("a cost model needs positive target costs T(1), T(2), ...")
        if min(self.draft_fixed_s, self.draft_per_token_s, self.catch_up_per_token_s) < 0:
            raise SpecMTPError("draft costs must be >= 0")

    def target_s(self, n: int) -> float:
        """T(n); beyond the measured range, extended along the last measured slope (>= 0)."""
        if n < 1:
            raise ValueError(f"a forward needs n >= 1 tokens, got {n}")
        measured = self.verify_s
        if n <= len(measured):
            return measured[n - 1]
        slope = max(0.0, measured[-1] - measured[-2]) if len(measured) > 1 else 0.0
        return measured[-1] + slope * (n - len(measured))

    def draft_s(self, k: int) -> float:
        return 0.0 if k == 0 else self.draft_fixed_s + self.draft_per_token_s * k

    def round_s(self, k: int, verified: int | None = None) -> float:
        """One round drafting k tokens and verifying `verified` (k + 1 for a chain)."""
        return self.draft_s(k) + self.target_s(k + 1 if verified is None else verified)

    def speedup(self, alphas: Sequence[float], k: int, verified: int | None = None) -> float:
        """Predicted tokens/s of drafting k per round, over plain decoding's."""
        return expected_tokens(alphas, k) * self.target_s(1) / self.round_s(k, verified)

    def best_gamma(self, alphas: Sequence[float], max_gamma: int) -> int:
        """The k in 0..max_gamma with the highest predicted speedup (0: do not speculate)."""
        return max(range(max_gamma + 1), key=lambda k: (self.speedup(alphas, k), -k))

    def scaled(self, *, target: float = 1.0, draft: float = 1.0) -> CostModel:
        """The same shape on a machine `target` / `draft` times slower (a busy machine)."""
        return CostModel(
            tuple(t * target for t in self.verify_s),
            self.draft_fixed_s * draft,
            self.draft_per_token_s * draft,
            self.catch_up_per_token_s * draft,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "verify_s": {str(n): round(t, 6) for n, t in enumerate(self.verify_s, 1)},
            "draft_fixed_s": round(self.draft_fixed_s, 6),
            "draft_per_token_s": round(self.draft_per_token_s, 6),
            "catch_up_per_token_s": round(self.catch_up_per_token_s, 6),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        try:
            costs = {int(n): float(t) for n, t in data["verify_s"].items()}
            if sorted(costs) != list(range(1, len(costs) + 1)):
                raise ValueError("verify_s must cover n = 1..N")
            return cls(
                tuple(costs[n] for n in range(1, len(costs) + 1)),
                float(data.get("draft_fixed_s", 0.0)),
                float(data.get("draft_per_token_s", 0.0)),
                float(data.get("catch_up_per_token_s", 0.0)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise SpecMTPError(f"bad cost model: {e}") from None


def conditional_acceptance(reached: Sequence[int], accepted: Sequence[int]) -> list[float | None]:
    """α_i = rounds accepting draft i / rounds that drafted i with drafts 1..i-1 accepted."""
    return [a / r if r else None for a, r in zip(accepted, reached, strict=True)]


def fit_draft_cost(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares D(k) = a + b·k from (k, seconds per round) samples, both kept >= 0."""
    points = [(k, s) for k, s in samples if k > 0]
    if not points:
        return 0.0, 0.0
    ks = [k for k, _ in points]
    if len(set(ks)) == 1:
        return 0.0, statistics.fmean(s for _, s in points) / ks[0]
    slope, intercept = statistics.linear_regression(ks, [s for _, s in points])
    if slope < 0:  # cheaper per round when drafting more is noise: a flat cost
        return statistics.fmean(s for _, s in points), 0.0
    if intercept < 0:  # a negative fixed cost is noise: refit through the origin
        return 0.0, sum(k * s for k, s in points) / sum(k * k for k in ks)
    return intercept, max(0.0, slope)


@torch.inference_mode()
def measure_verify_costs(
    runner: CachedModel,
    prompt_ids: Sequence[int],
    *,
    max_tokens: int,
    repeats: int = 5,
    tree: TokenTree | None = None,
) -> tuple[float, ...]:
    """T(n) for n = 1..max_tokens after a prefill of `prompt_ids`: the median of `repeats`
    timed forwards, each rolled back. Sizes are interleaved so machine noise hits all alike.

    With a tree, a forward of n tokens is the root and the tree's first n - 1 nodes with
    their tree mask, as a tree drafter's verify pass is (past the tree's size, a chain):
    with row-invariant attention a tree row costs more than a chain row.
    """
    from specmtp.tree import TokenTree, tree_forward  # tree.py imports kernels, which imports us

    if max_tokens < 1 or repeats < 1 or len(prompt_ids) < 2:
        raise SpecMTPError("measuring T(n) needs max_tokens >= 1, repeats >= 1, a 2-token prompt")
    ids = torch.tensor([list(prompt_ids)], device=runner.device)  # [1, P]
    runner.reset()
    runner.forward(ids[:, :-1], last_only=True)
    past = runner.length
    tokens = ids[:, -1:].repeat(1, max_tokens)  # [1, max_tokens]: content does not change cost
    shapes = {
        n: TokenTree(tree.paths[: n - 1])
        for n in range(2, max_tokens + 1)
        if tree is not None and n - 1 <= tree.num_nodes
    }
    times: dict[int, list[float]] = {n: [] for n in range(1, max_tokens + 1)}
    for _ in range(repeats + 1):  # the first sweep warms every shape up and is dropped
        for n in times:
            start = time.perf_counter()
            if n in shapes:
                tree_forward(runner, shapes[n], tokens[:, :1], tokens[:, 1:n])
            else:
                runner.forward(tokens[:, :n])
            times[n].append(time.perf_counter() - start)
            runner.crop(past)
    runner.reset()
    return tuple(statistics.median(t[1:]) for t in times.values())
