"""Replay the adaptive schedule on scripted rounds: a drafter accepted with fixed
per-position probabilities, the verify and draft costs of a float32 run of the default
model (T(n) = 1 + 0.11 (n - 1) steps, a draft token 0.075 of a step) and a tuning profile's
prior from easier text (0.56, 0.7, 0.7). Prints the mean speed against plain decoding over
seeded 60-round sequences, for the current rules, for the rules before commit 2e93f79 (the
fallback on the recent ~20 rounds alone, the profile's later priors as they are) and for a
fixed γ = 1.

    python scripts/schedule_replay.py
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from specmtp.adaptive_schedule import AdaptiveGamma, AdaptiveSettings
from specmtp.costmodel import CostModel
from specmtp.schedule import FixedGamma, RoundRecord

COST = CostModel(tuple(1.0 + 0.11 * (n - 1) for n in range(1, 9)), draft_per_token_s=0.075)
PRIOR = (0.56, 0.7, 0.7)


class BeforeRules(AdaptiveGamma):
    """The profile's prior for later positions unscaled (the fallback's old reading is the
    settings below: the recent record, no standard error)."""

    @property
    def alphas(self) -> list[float]:
        s, estimates = self.settings.prior_strength, []
        for i, (a, r) in enumerate(zip(self.accepted, self.reached, strict=True)):
            p = self.prior[i] if i < len(self.prior) else estimates[-1] if estimates else 0.5
            estimates.append((a + s * p) / (r + s))
        return estimates


def speed(schedule: AdaptiveGamma | FixedGamma, alphas: Sequence[float], seed: int) -> float:
    """Tokens per plain step over 60 rounds."""
    chance = torch.Generator().manual_seed(seed)
    tokens, seconds = 0, 0.0
    for _ in range(60):
        k = schedule.next_gamma(8)
        accepted = 0
        while accepted < k and float(torch.rand((), generator=chance)) < alphas[accepted]:
            accepted += 1
        draft_s, verify_s = COST.draft_s(k) if k else 0.0, COST.target_s(k + 1)
        schedule.update(RoundRecord(k, k, accepted, k + 1, draft_s, verify_s))
        tokens, seconds = tokens + accepted + 1, seconds + draft_s + verify_s
    return tokens / seconds


def main() -> None:
    before = AdaptiveSettings(long_decay=AdaptiveSettings.decay, confidence=0.0)
    print("acceptance by position   now   before  fixed γ=1")
    for alphas in [(0.0, 0.0, 0.0), (0.1, 0.2, 0.2), (0.2, 0.3, 0.3), (0.3, 0.3, 0.5),
                   (0.4, 0.5, 0.5), (0.5, 0.7, 0.7)]:  # fmt: skip
        runs = {
            "now": [
                speed(AdaptiveGamma(COST, max_gamma=3, prior=PRIOR), alphas, s) for s in range(30)
            ],
            "before": [
                speed(BeforeRules(COST, max_gamma=3, prior=PRIOR, settings=before), alphas, s)
                for s in range(30)
            ],
            "fixed": [speed(FixedGamma(1), alphas, s) for s in range(30)],
        }
        means = "  ".join(f"{statistics.fmean(v):.3f}" for v in runs.values())
        print(f"{alphas!s:24s} {means}")


if __name__ == "__main__":
    main()
