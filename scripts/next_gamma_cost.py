"""Microseconds one `AdaptiveGamma.next_gamma` call takes: 8 choices, after 30 rounds whose
drafts all missed (the guard falls back to plain decoding), at the default model's bfloat16
T(n). Median of 5 x 2000 calls.

Run: python scripts/next_gamma_cost.py
"""

from __future__ import annotations

import statistics
import time

from specmtp.adaptive_schedule import AdaptiveGamma
from specmtp.costmodel import CostModel
from specmtp.schedule import RoundRecord

VERIFY_S = (0.0445, 0.0489, 0.0486, 0.046, 0.049, 0.052, 0.0515, 0.053, 0.050)


def main() -> None:
    schedule = AdaptiveGamma(CostModel(VERIFY_S), max_gamma=8)
    for _ in range(30):
        k = schedule.next_gamma(50)
        verify_s = VERIFY_S[0] + 0.004 * (k > 0)
        record = RoundRecord(k, k, 0, k + 1, 0.003 * (k > 0), verify_s, checking=schedule.checking)
        schedule.update(record)
    per_call = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(2000):
            schedule.next_gamma(50)
        per_call.append((time.perf_counter() - start) / 2000 * 1e6)
    print(f"next_gamma: {statistics.median(per_call):.1f} us a call (median of 5 x 2000)")


if __name__ == "__main__":
    main()
