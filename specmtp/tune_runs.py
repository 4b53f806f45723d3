"""What every `specmtp tune` sweep shares: its config, one timed generation, speedups
against plain decoding, the cost model's prediction for a sweep point, and the rows and
metadata a profile records (tune.py runs the sweeps; tune_pairs.py, tune_tree.py and
tune_nodes.py hold the γ pair, tree budget and node count sweeps)."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from specmtp.api import SpecGenerator, make_config
from specmtp.config import GenerationConfig
from specmtp.costmodel import CostModel, conditional_acceptance, measure_verify_costs
from specmtp.drafters import MODEL_ARM
from specmtp.errors import SpecMTPError
from specmtp.models import DTYPES
from specmtp.profile import Profile, default_profile_path
from specmtp.stats import GenerationStats
from specmtp.train_prompts import refuse_evaluation_sets

Log = Callable[[str], None]


@dataclass(frozen=True)
class TuneConfig:
    prompts: tuple[Path, ...]
    target: str = "default"
    dtype: str = "float32"  # a models.DTYPES name
    draft: str = "ngram"
    max_gamma: int = 8
    budgets: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16)  # tree nodes, for a tree drafter
    limit: int = 8  # prompts used, after a seeded shuffle of the sources
    max_new_tokens: int = 96
    temperature: float = 0.0
    seed: int = 0
    out: Path | None = None  # None: default_profile_path
    plot: Path | None = None  # None: the profile path with .png

    def __post_init__(self) -> None:
        if not self.prompts:
            raise SpecMTPError("tune needs --prompts (training prompts)")
        if self.dtype not in DTYPES:
            raise SpecMTPError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        refuse_evaluation_sets(self.prompts, "tune")
        if not 1 <= self.max_gamma <= 32:
            raise SpecMTPError(f"max-gamma must be in 1..32, got {self.max_gamma}")
        if not self.budgets or not all(1 <= b <= Profile.MAX_NODES for b in self.budgets):
            raise SpecMTPError(
                f"tree budgets must be in 1..{Profile.MAX_NODES} nodes, got {list(self.budgets)}"
            )
        if self.limit < 1:
            raise SpecMTPError(f"limit must be >= 1, got {self.limit}")
        GenerationConfig(self.max_new_tokens)  # validates max_new_tokens

    @property
    def profile_path(self) -> Path:
        return self.out or default_profile_path(self.target, self.draft, self.dtype)


def generation(config: TuneConfig, gamma: int) -> GenerationConfig:
    return make_config(
        max_new_tokens=config.max_new_tokens,
        gamma=gamma,
        temperature=config.temperature,
        seed=config.seed,
    )


def pair_generation(config: TuneConfig, pair: tuple[int, int]) -> GenerationConfig:
    lookup, model = pair
    return replace(generation(config, max(lookup, 1)), model_gamma=max(model, 1))


def run_once(gen: SpecGenerator, ids: list[int], config: GenerationConfig) -> GenerationStats:
    return gen.decoder.generate(ids, config).stats  # stats.total_s: the generation's wall time


def tokens_per_s(runs: Sequence[GenerationStats]) -> float:
    return sum(s.new_tokens for s in runs) / sum(s.total_s for s in runs)


def pooled_alphas(runs: Sequence[GenerationStats], max_gamma: int) -> tuple[float, ...]:
    """α_i over every run: counts summed before dividing. Positions never reached get 0."""
    reached = [sum(s.position_reached[i] for s in runs if i < s.gamma) for i in range(max_gamma)]
    accepted = [sum(s.position_accepted[i] for s in runs if i < s.gamma) for i in range(max_gamma)]
    return tuple(a or 0.0 for a in conditional_acceptance(reached, accepted))


def predicted_speedup(cost: CostModel, expected: float, runs: Sequence[GenerationStats]) -> float:
    """`expected` tokens per round (E(γ) from α, or a tree's), over the expected round time:
    the measured draft time per round, and T(n) weighted by how often each verify size n
    occurred (a drafter that finds nothing, like n-gram lookup, verifies fewer than γ + 1
    tokens; a tree verifies its nodes + 1)."""
    rounds = sum(s.rounds for s in runs)
    draft = sum(s.draft_s for s in runs) / rounds
    verify = sum(c * cost.target_s(n) for s in runs for n, c in s.verify_sizes.items()) / rounds
    return expected * cost.target_s(1) / (draft + verify)


def sweep_row(
    runs: Sequence[GenerationStats], plain: float, predicted: float, **point: int
) -> dict[str, Any]:
    """One sweep point (γ, or a tree budget and its depth): speedups against plain decoding's
    tokens/s, and τ for a drafting point."""
    row: dict[str, Any] = {**point, "predicted_speedup": round(predicted, 4)}
    row["measured_speedup"] = round(tokens_per_s(runs) / plain, 4)
    row["tokens_per_s"] = round(tokens_per_s(runs), 3)
    if point.get("gamma"):
        committed = sum(s.accepted_tokens + s.rounds for s in runs)
        row["mean_accepted_tokens"] = round(committed / sum(s.rounds for s in runs), 4)
    return row


def tune_meta(config: TuneConfig, num_prompts: int) -> dict[str, Any]:
    return {
        "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "prompts": [str(p) for p in config.prompts],
        "num_prompts": num_prompts,
        "max_new_tokens": config.max_new_tokens,
        "temperature": config.temperature,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def verify_costs(
    spec: SpecGenerator,
    prompt_ids: Sequence[list[int]],
    runs: dict[Any, list[GenerationStats]],
    config: TuneConfig,
    log: Log,
) -> tuple[float, ...]:
    largest = max(n for rs in runs.values() for s in rs for n in s.verify_sizes)
    log(f"measuring T(n) for n = 1..{largest}")
    return measure_verify_costs(
        spec.decoder.target, prompt_ids[0], max_tokens=max(largest, config.max_gamma + 1)
    )


def model_round_draft_s(stats: GenerationStats) -> float | None:
    """Seconds per round the model arm of a drafter with arms spent drafting (the lookup
    arm's drafts cost next to nothing); None when it drafted no round."""
    rounds = stats.arm_counts.get(MODEL_ARM, [0])[0]
    return stats.arm_draft_s[MODEL_ARM] / rounds if rounds else None
