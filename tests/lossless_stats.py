"""The statistic behind the losslessness tests, and the Markov chains they sample from.

Shared by test_lossless.py (chains) and test_tree.py (trees).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import chisquare

from specmtp.config import SamplingConfig
from specmtp.sampling import logits_to_probs

# A distribution passes when no sample falls in a cell of probability 0, the chi-square
# p-value is above P_PASS, and the total variation distance stays under a bound that N exact
# samples exceed with probability below P_PASS. Seeds are fixed, so a pass never flakes; the
# lossy rules below land far under P_FAIL.
P_PASS = 1e-4
P_FAIL = 1e-6
MIN_EXPECTED = 5.0  # chi-square cells expecting fewer samples are pooled
NULL_DRAWS = 200  # draws of N exact samples that estimate the mean TV under the null


@dataclass(frozen=True)
class Fit:
    """How far counts of N samples lie from an exact distribution over the same cells."""

    samples: int
    p_value: float  # chi-square goodness of fit, rare cells pooled
    tv: float  # total variation distance of the empirical distribution
    tv_bound: float  # exceeded by the tv of N exact samples with probability < P_PASS
    impossible: int  # samples in cells of probability 0

    @property
    def passes(self) -> bool:
        return self.impossible == 0 and self.p_value > P_PASS and self.tv < self.tv_bound

    def __str__(self) -> str:
        return (
            f"N={self.samples} p={self.p_value:.3g} tv={self.tv:.4f} "
            f"(bound {self.tv_bound:.4f}) impossible={self.impossible}"
        )


def fit(counts: torch.Tensor, probs: torch.Tensor) -> Fit:
    """Compare counts with probs (same shape, any number of cells; probs sum to 1)."""
    observed = counts.flatten().double().numpy()
    exact = probs.flatten().double().numpy()
    exact = exact / exact.sum()
    n = int(observed.sum())
    impossible = int(observed[exact == 0].sum())
    tv = 0.5 * np.abs(observed / n - exact).sum()
    # One sample moves the tv by at most 1/N, so by McDiarmid's inequality N exact samples
    # exceed their mean tv by t with probability at most exp(-2 N t^2). The mean is estimated
    # by drawing; its error is far below the margin t.
    null = np.random.default_rng(0).multinomial(n, exact, size=NULL_DRAWS) / n  # [draws, cells]
    tv_bound = 0.5 * np.abs(null - exact).sum(1).mean() + math.sqrt(math.log(1 / P_PASS) / (2 * n))
    # Pool the rarest cells (ascending) until the pool and every cell left expect enough.
    support = exact > 0
    order = np.argsort(exact[support])
    expected, seen = exact[support][order] * n, observed[support][order]
    pooled = 0
    while pooled < len(expected) and (
        expected[pooled] < MIN_EXPECTED or 0 < expected[:pooled].sum() < MIN_EXPECTED
    ):
        pooled += 1
    if pooled:
        expected = np.append(expected[pooled:], expected[:pooled].sum())
        seen = np.append(seen[pooled:], seen[:pooled].sum())
    p_value = 0.0 if impossible else float(chisquare(seen, expected).pvalue)
    return Fit(n, p_value, float(tv), float(tv_bound), impossible)


V = 6
START = 0  # the last context token before generation


def markov_chains(sampling: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Target p and draft q: rows [V, V] of next-token distributions given the last token.

    The draft's logits are the target's plus noise, as a small draft model's would be:
    close enough that whole drafts pass, far enough that many are rejected. Both go through
    the same logits processing, as in the decode loop.
    """
    generator = torch.Generator().manual_seed(1234)
    target_logits = 1.5 * torch.randn(V, V, generator=generator)
    draft_logits = target_logits + 1.5 * torch.randn(V, V, generator=generator)
    return logits_to_probs(target_logits, sampling), logits_to_probs(draft_logits, sampling)


def markov_joint(p: torch.Tensor, length: int) -> torch.Tensor:
    """Exact joint of the next `length` tokens after START: [V] * length, float64."""
    p = p.double()
    joint = p[START]
    for _ in range(length - 1):
        joint = joint[..., None] * p  # (..., a, b) = joint(..., a) * p(b | a)
    return joint
