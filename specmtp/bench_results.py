"""What the benchmark measured, summarised per method, per group of prompts, per setting.

Definitions (per method, over all prompts):
- latency: wall-clock seconds of one generation (prefill included); with repeats > 1,
  the median of the repeats of that prompt.
- tokens_per_s: total new tokens / total latency.
- speedup: tokens_per_s / tokens_per_s of `ar`. Under greedy decoding both emit the same
  tokens, so this equals the ratio of summed latencies.
- mean_accepted_tokens (τ): committed tokens / target verify rounds, summed over prompts
  (so it is weighted by rounds), as in Spec-Bench; `ar` has τ = 1.
- acceptance_per_position: rounds accepting draft position i / rounds drafting it.
- predicted_speedup: the cost model's prediction for the rounds as they happened: target
  forwards at T(n) measured in the same run, the drafter's measured time, the prefill, against
  plain decoding's T(1) per token. For a fixed γ this is Leviathan et al.'s formula with the
  per-position α measured in the run. efficiency = speedup / predicted_speedup: 1.0 means the
  loop adds nothing beyond the model forwards and the drafter.
- plain_step: T(1) as timed for the cost model against `ar`'s mean forward time per step in
  its timed runs; a ratio far from 1 (machine load changed, or the typical context's step
  is not the runs' average) moves every efficiency by about as much.
- target_pace: the method's target forwards in its timed runs against the same forwards at
  T(n) as timed after the runs (1.0: the machine ran as fast during its runs as then). Every
  method's forwards are bound by the same memory, so their paces should agree. A method
  whose pace differs from `ar`'s mostly ran under other load from other processes than the
  baseline did, and then its speedup is off by about the ratio of the two; otherwise its
  forwards cost more in its loop than when timed.
- ttft_s / tpot_s: mean time to the first new token, and per new token after it.
- peak_rss_bytes: the process's resident memory, highest sample while the method ran (one
  process holds every method's models, so compare differences, not totals).
- kv_cache_bytes: the largest KV cache (target and drafter) of any round, before rollback.
- greedy_mismatches: prompts whose tokens differ from `ar`'s (None unless temperature 0).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specmtp.costmodel import CostModel
from specmtp.stats import GenerationStats

BASELINE = "ar"


@dataclass
class PromptRun:
    """One method on one prompt: the output and stats of the first repeat, every latency."""

    question_id: Any
    group: str
    tokens: list[int]
    stats: GenerationStats
    latencies: list[float] = field(default_factory=list)
    has_rounds: bool = True  # False for Hugging Face's methods: no per-round statistics

    @property
    def latency_s(self) -> float:
        return statistics.median(self.latencies)

    def to_dict(self) -> dict[str, Any]:
        n = self.stats.new_tokens
        return {
            "question_id": self.question_id,
            "group": self.group,
            "latency_s": round(self.latency_s, 4),
            "new_tokens": n,
            "mean_accepted_tokens": (
                round(self.stats.mean_accepted_tokens, 4) if self.has_rounds else None
            ),
            "tokens_per_s": round(n / self.latency_s, 3),
        }


def tokens_per_s(runs: Sequence[PromptRun]) -> float:
    return sum(r.stats.new_tokens for r in runs) / sum(r.latency_s for r in runs)


def mean_accepted(runs: Sequence[PromptRun]) -> float | None:
    if not all(r.has_rounds for r in runs):
        return None
    rounds = sum(r.stats.rounds for r in runs)
    committed = sum(r.stats.accepted_tokens + r.stats.rounds for r in runs)
    return committed / rounds if rounds else None


def acceptance_per_position(runs: Sequence[PromptRun]) -> list[float | None]:
    depth = max((r.stats.gamma for r in runs if r.has_rounds), default=0)
    rates: list[float | None] = []
    for i in range(depth):
        proposed = sum(r.stats.position_proposed[i] for r in runs if i < r.stats.gamma)
        accepted = sum(r.stats.position_accepted[i] for r in runs if i < r.stats.gamma)
        rates.append(accepted / proposed if proposed else None)
    return rates


def step_in_runs(runs: Sequence[PromptRun]) -> float | None:
    """Mean target forward time per round in timed runs: for `ar` (one-token rounds) what
    T(1), timed apart after the runs at one typical context, should come close to."""
    rounds = sum(r.stats.rounds for r in runs if r.has_rounds)
    return sum(r.stats.verify_s for r in runs if r.has_rounds) / rounds if rounds else None


def timed_verify_s(stats: GenerationStats, cost: CostModel) -> float:
    """What these rounds' target forwards take at the timed T(n)."""
    return sum(count * cost.target_s(n) for n, count in stats.verify_sizes.items())


def predicted_speedup(runs: Sequence[PromptRun], cost: CostModel, plain_step_s: float) -> float:
    """The cost model's speedup for these runs' rounds; `plain_step_s` is T(1) of `ar`."""
    spec_s = plain_s = 0.0
    for run in runs:
        s = run.stats
        spec_s += s.prefill_s + s.draft_s + timed_verify_s(s, cost)
        plain_s += s.prefill_s + s.new_tokens * plain_step_s
    return plain_s / spec_s


def target_pace(runs: Sequence[PromptRun], cost: CostModel) -> float | None:
    """Seconds of target forwards in these runs / the same forwards at the timed T(n)."""
    if not all(r.has_rounds for r in runs):
        return None
    timed = sum(timed_verify_s(r.stats, cost) for r in runs)
    return sum(r.stats.verify_s for r in runs) / timed if timed else None


@dataclass(frozen=True)
class MethodResult:
    name: str
    schedule: str
    runs: list[PromptRun]
    baseline: list[PromptRun]
    greedy: bool
    cost: CostModel | None = None  # T(n) measured for this method's target in the run
    plain_step_s: float | None = None  # T(1) of `ar`

    @property
    def tokens_per_s(self) -> float:
        return tokens_per_s(self.runs)

    @property
    def speedup(self) -> float:
        return self.tokens_per_s / tokens_per_s(self.baseline)

    @property
    def greedy_mismatches(self) -> int | None:
        if not self.greedy:
            return None
        return sum(r.tokens != b.tokens for r, b in zip(self.runs, self.baseline, strict=True))

    @property
    def predicted_speedup(self) -> float | None:
        if self.cost is None or self.plain_step_s is None:
            return None
        if not all(r.has_rounds for r in self.runs):
            return None
        return predicted_speedup(self.runs, self.cost, self.plain_step_s)

    @property
    def target_pace(self) -> float | None:
        return None if self.cost is None else target_pace(self.runs, self.cost)

    @property
    def efficiency(self) -> float | None:
        predicted = self.predicted_speedup
        return None if predicted is None else self.speedup / predicted

    def per_group(self) -> dict[str, dict[str, Any]]:
        groups: dict[str, list[int]] = {}
        for i, run in enumerate(self.runs):
            groups.setdefault(run.group, []).append(i)
        table = {}
        for group, rows in groups.items():
            runs = [self.runs[i] for i in rows]
            base = [self.baseline[i] for i in rows]
            tau = mean_accepted(runs)
            table[group] = {
                "num_prompts": len(rows),
                "tokens_per_s": round(tokens_per_s(runs), 3),
                "speedup": round(tokens_per_s(runs) / tokens_per_s(base), 4),
                "mean_accepted_tokens": None if tau is None else round(tau, 4),
            }
        return table

    def to_dict(self, *, per_prompt: bool = True) -> dict[str, Any]:
        stats = [r.stats for r in self.runs]
        tau = mean_accepted(self.runs)

        def rounded(value: float | None, digits: int = 4) -> float | None:
            return None if value is None else round(value, digits)

        data = {
            "tokens_per_s": round(self.tokens_per_s, 3),
            "speedup": round(self.speedup, 4),
            "mean_accepted_tokens": rounded(tau),
            "greedy_mismatches": self.greedy_mismatches,
            "latency_s": round(statistics.fmean(r.latency_s for r in self.runs), 4),
            "new_tokens": sum(s.new_tokens for s in stats),
            "acceptance_per_position": [rounded(a) for a in acceptance_per_position(self.runs)],
            "predicted_speedup": rounded(self.predicted_speedup),
            "efficiency": rounded(self.efficiency),
            "target_pace": rounded(self.target_pace),
            "ttft_s": round(statistics.fmean(s.first_token_s for s in stats), 4),
            "tpot_s": round(statistics.fmean(s.tpot_s for s in stats), 5),
            "peak_rss_bytes": max(s.peak_rss_bytes for s in stats) or None,
            "kv_cache_bytes": max(s.peak_kv_bytes for s in stats) or None,
            "draft_s": round(sum(s.draft_s for s in stats), 4),
            "verify_s": round(sum(s.verify_s for s in stats), 4),
            "other_s": round(sum(s.other_s for s in stats), 4),
            "schedule": self.schedule,
            "requested_gammas": _merged(s.requested_gammas for s in stats),
            "arms": arm_summary(stats),
            "per_group": self.per_group(),
        }
        if per_prompt:
            data["per_prompt"] = [r.to_dict() for r in self.runs]
        return data


def arm_summary(stats: Sequence[GenerationStats]) -> dict[str, dict[str, Any]]:
    """Per drafter arm (lookup-first drafters): rounds, drafted and accepted tokens, and τ
    over that arm's rounds (a round that drafted nothing commits 1 token)."""
    totals: dict[str, list[int]] = {}
    for s in stats:
        for arm, counts in s.arm_counts.items():
            totals[arm] = [a + b for a, b in zip(totals.get(arm, [0, 0, 0]), counts, strict=True)]
    return {
        arm: {
            "rounds": rounds,
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "mean_accepted_tokens": round((accepted + rounds) / rounds, 4),
        }
        for arm, (rounds, drafted, accepted) in sorted(totals.items())
    }


def _merged(counts: Any) -> dict[str, int]:
    total: dict[int, int] = {}
    for count in counts:
        for key, value in count.items():
            total[key] = total.get(key, 0) + value
    return {str(k): v for k, v in sorted(total.items())}


def table(methods: dict[str, MethodResult]) -> str:
    """The human summary: one row per method."""
    width = max(len("method"), *(len(name) for name in methods))
    header = (
        f"{'method':<{width}}  latency s  tokens/s  speedup     τ  mismatches  efficiency"
        "  TTFT ms  KV MiB"
    )
    rows = [header, "-" * len(header)]
    for name, m in methods.items():
        mismatches = "-" if m.greedy_mismatches is None else str(m.greedy_mismatches)
        tau = mean_accepted(m.runs)
        eff = m.efficiency
        stats = [r.stats for r in m.runs]
        kv = max(s.peak_kv_bytes for s in stats) / 2**20
        ttft = statistics.fmean(s.first_token_s for s in stats) * 1000
        rows.append(
            f"{name:<{width}}  {statistics.fmean(r.latency_s for r in m.runs):9.3f}  "
            f"{m.tokens_per_s:8.1f}  {m.speedup:6.2f}x  "
            f"{'-' if tau is None else f'{tau:4.2f}':>4}  {mismatches:>10}  "
            f"{'-' if eff is None else f'{eff:10.2f}':>10}  {ttft:7.0f}  "
            f"{'-' if not kv else f'{kv:6.1f}':>6}"
        )
    return "\n".join(rows)
