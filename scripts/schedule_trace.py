"""`specmtp bench` (any arguments) with every drafting round of an adaptive or guarded
schedule printed to stderr: γ asked, drafts accepted, draft and verify seconds, plain rounds
before it, and the costs the schedule steered by (learned draft cost, T(1), T(3), predicted
speedup with every draft accepted). Used in docs/tuning-and-measurement.md, section 17, to
find why the target drafting for itself still drafted behind the guard.

    python scripts/schedule_trace.py bench --threads 1 --prompts random:8x64 \\
        --max-new-tokens 64 --draft default@2 --draft default@guard:2 --draft default@auto
"""

from __future__ import annotations

import sys

from specmtp import cli
from specmtp.adaptive_schedule import AdaptiveGamma
from specmtp.schedule import RoundRecord

update = AdaptiveGamma.update


def traced_update(self: AdaptiveGamma, record: RoundRecord) -> None:
    if record.requested:
        cost = self.current_cost()
        all_accepted = [
            round(self.predicted_speedup(k, [1.0] * k), 3) for k in self.choices(self.max_gamma)
        ]
        print(
            f"DRAFT {type(self).__name__} k={record.requested} accepted={record.accepted} "
            f"draft_s={record.draft_s:.3f} verify_s={record.verify_s:.3f} "
            f"plain_before={self.plain_rounds} caught_up={record.caught_up} "
            f"catch_up_ms_per_token={1e3 * self.catch_up_s(1):.2f} "
            f"draft_ms={1e3 * cost.draft_per_token_s:.1f} T1_ms={1e3 * cost.target_s(1):.1f} "
            f"T3_ms={1e3 * cost.target_s(3):.1f} all_accepted={all_accepted}",
            file=sys.stderr,
            flush=True,
        )
    update(self, record)


AdaptiveGamma.update = traced_update  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
