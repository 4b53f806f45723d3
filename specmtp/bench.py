"""Benchmark: plain decoding (`ar`) against speculative methods on Spec-Bench prompts.

Every number comes from one run: the `ar` baseline and each draft method decode the same
prompts with the same settings in the same process, on one loaded target. Methods are
interleaved per prompt (prompt 1: ar, m1, m2; prompt 2: ...) so machine noise hits all
of them alike.

Definitions (per method, over all prompts):
- latency: wall-clock seconds of one generation (prefill included); with repeats > 1,
  the median of the repeats of that prompt.
- tokens_per_s: total new tokens / total latency.
- speedup: tokens_per_s / tokens_per_s of `ar`. Under greedy decoding both emit the same
  tokens, so this equals the ratio of summed latencies.
- mean_accepted_tokens (τ): committed tokens / target verify rounds, summed over prompts
  (so it is weighted by rounds), as in Spec-Bench; `ar` has τ = 1.
- acceptance_per_position: rounds accepting draft position i / rounds drafting it.
- greedy_mismatches: prompts whose tokens differ from `ar`'s (None unless temperature 0).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from specmtp.api import SpecGenerator
from specmtp.config import GenerationConfig
from specmtp.errors import SpecMTPError
from specmtp.models import load_model
from specmtp.stats import GenerationStats

BASELINE = "ar"
WARMUP_TOKENS = 8  # a warm-up only needs to touch every code path once

Log = Callable[[str], None]


def log_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class BenchConfig:
    prompts: Path
    target: str = "default"
    drafts: tuple[str, ...] = ()
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    limit: int | None = None  # first N prompts; None: all
    warmup: int = 1  # unmeasured short generations per method before the measured ones
    repeats: int = 1

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise SpecMTPError(f"limit must be >= 1, got {self.limit}")
        if self.warmup < 0:
            raise SpecMTPError(f"warmup must be >= 0, got {self.warmup}")
        if self.repeats < 1:
            raise SpecMTPError(f"repeats must be >= 1, got {self.repeats}")
        names = [BASELINE, *self.drafts]
        if len(set(names)) != len(names):
            raise SpecMTPError(f"each draft must be named once and not {BASELINE!r}: {names}")

    @property
    def method_names(self) -> list[str]:
        return [BASELINE, *self.drafts]


@dataclass(frozen=True)
class BenchPrompt:
    question_id: Any
    category: str
    text: str  # the first turn


def _parse_prompt_line(line: str, where: str) -> BenchPrompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise SpecMTPError(f"{where}: bad JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise SpecMTPError(f"{where}: expected a JSON object with 'turns'")
    turns = record.get("turns")
    if not isinstance(turns, list) or not turns:
        raise SpecMTPError(f"{where}: missing 'turns' (a non-empty list of strings)")
    if not isinstance(turns[0], str) or not turns[0].strip():
        raise SpecMTPError(f"{where}: the first turn must be a non-empty string")
    return BenchPrompt(record.get("question_id"), str(record.get("category", "")), turns[0])


def load_prompts(path: Path, limit: int | None = None) -> list[BenchPrompt]:
    """Spec-Bench prompts: one JSON object per line, {question_id, category, turns}."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise SpecMTPError(f"cannot read prompts file {path}: {reason}") from None
    prompts = [
        _parse_prompt_line(line, f"{path} line {n}")
        for n, line in enumerate(lines, 1)
        if line.strip()
    ]
    if not prompts:
        raise SpecMTPError(f"prompts file {path} holds no prompts")
    return prompts[:limit]


@dataclass
class PromptRun:
    """One method on one prompt: the output and stats of the first repeat, every latency."""

    question_id: Any
    tokens: list[int]
    stats: GenerationStats
    latencies: list[float] = field(default_factory=list)

    @property
    def latency_s(self) -> float:
        return statistics.median(self.latencies)

    def to_dict(self) -> dict[str, Any]:
        n = self.stats.new_tokens
        return {
            "question_id": self.question_id,
            "latency_s": round(self.latency_s, 4),
            "new_tokens": n,
            "mean_accepted_tokens": round(self.stats.mean_accepted_tokens, 4),
            "tokens_per_s": round(n / self.latency_s, 3),
        }


@dataclass(frozen=True)
class MethodResult:
    name: str
    runs: list[PromptRun]
    tokens_per_s: float
    speedup: float
    greedy_mismatches: int | None

    @property
    def new_tokens(self) -> int:
        return sum(r.stats.new_tokens for r in self.runs)

    @property
    def latency_s(self) -> float:
        """Mean latency per prompt."""
        return statistics.fmean(r.latency_s for r in self.runs)

    @property
    def mean_accepted_tokens(self) -> float:
        rounds = sum(r.stats.rounds for r in self.runs)
        committed = sum(r.stats.accepted_tokens + r.stats.rounds for r in self.runs)
        return committed / rounds if rounds else 0.0

    @property
    def acceptance_per_position(self) -> list[float | None]:
        proposed = [
            sum(p) for p in zip(*(r.stats.position_proposed for r in self.runs), strict=True)
        ]
        accepted = [
            sum(a) for a in zip(*(r.stats.position_accepted for r in self.runs), strict=True)
        ]
        return [a / p if p else None for a, p in zip(accepted, proposed, strict=True)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens_per_s": round(self.tokens_per_s, 3),
            "speedup": round(self.speedup, 3),
            "mean_accepted_tokens": round(self.mean_accepted_tokens, 4),
            "greedy_mismatches": self.greedy_mismatches,
            "latency_s": round(self.latency_s, 4),
            "new_tokens": self.new_tokens,
            "acceptance_per_position": [
                None if a is None else round(a, 4) for a in self.acceptance_per_position
            ],
            "per_prompt": [r.to_dict() for r in self.runs],
        }


@dataclass(frozen=True)
class BenchResult:
    config: BenchConfig
    num_prompts: int
    methods: dict[str, MethodResult]

    def config_dict(self) -> dict[str, Any]:
        gen = self.config.generation
        return {
            "target": self.config.target,
            "drafts": list(self.config.drafts),
            "prompts": str(self.config.prompts),
            "num_prompts": self.num_prompts,
            "max_new_tokens": gen.max_new_tokens,
            "gamma": gen.gamma,
            "temperature": gen.sampling.temperature,
            "top_k": gen.sampling.top_k,
            "top_p": gen.sampling.top_p,
            "seed": gen.seed,
            "chat_template": True,
            "warmup": self.config.warmup,
            "repeats": self.config.repeats,
            "speedup": f"tokens_per_s / {BASELINE} tokens_per_s",
            "torch_threads": torch.get_num_threads(),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "methods": {name: m.to_dict() for name, m in self.methods.items()},
            "config": self.config_dict(),
        }

    def table(self) -> str:
        """The human summary: one row per method."""
        width = max(len("method"), *(len(name) for name in self.methods))
        header = f"{'method':<{width}}  latency s  tokens/s  speedup     τ  mismatches"
        rows = [header, "-" * len(header)]
        for name, m in self.methods.items():
            mismatches = "-" if m.greedy_mismatches is None else str(m.greedy_mismatches)
            rows.append(
                f"{name:<{width}}  {m.latency_s:9.3f}  {m.tokens_per_s:8.1f}  "
                f"{m.speedup:6.2f}x  {m.mean_accepted_tokens:4.2f}  {mismatches:>10}"
            )
        return "\n".join(rows)


def _tokens_per_s(runs: list[PromptRun]) -> float:
    return sum(r.stats.new_tokens for r in runs) / sum(r.latency_s for r in runs)


def summarize_method(
    name: str, runs: list[PromptRun], baseline: list[PromptRun], greedy: bool
) -> MethodResult:
    """Aggregate one method's runs; `baseline` holds the `ar` runs of the same prompts."""
    tokens_per_s = _tokens_per_s(runs)
    speedup = tokens_per_s / _tokens_per_s(baseline)
    mismatches = (
        sum(r.tokens != b.tokens for r, b in zip(runs, baseline, strict=True)) if greedy else None
    )
    return MethodResult(name, runs, tokens_per_s, speedup, mismatches)


def _timed(
    gen: SpecGenerator, ids: list[int], config: GenerationConfig
) -> tuple[list[int], GenerationStats, float]:
    # The decoder itself, not gen.generate: the bench times token generation, not the
    # incremental detokenization that streaming text needs.
    start = time.perf_counter()
    result = gen.decoder.generate(ids, config)
    return result.tokens, result.stats, time.perf_counter() - start


def _measure(
    generators: dict[str, SpecGenerator],
    prompts: Sequence[BenchPrompt],
    prompt_ids: Sequence[list[int]],
    config: BenchConfig,
    log: Log,
) -> dict[str, list[PromptRun]]:
    runs: dict[str, list[PromptRun]] = {name: [] for name in generators}
    for i, (prompt, ids) in enumerate(zip(prompts, prompt_ids, strict=True), 1):
        for repeat in range(config.repeats):
            for name, gen in generators.items():
                tokens, stats, latency = _timed(gen, ids, config.generation)
                if repeat == 0:
                    runs[name].append(PromptRun(prompt.question_id, tokens, stats))
                runs[name][-1].latencies.append(latency)
                log(
                    f"[{i}/{len(prompts)}] question {prompt.question_id} {name}: "
                    f"{stats.new_tokens} tokens in {latency:.2f} s "
                    f"({stats.new_tokens / latency:.1f} tok/s, τ {stats.mean_accepted_tokens:.2f})"
                )
    return runs


def run_bench(config: BenchConfig, *, log: Log = log_to_stderr) -> BenchResult:
    """Load the target once, warm every method up, then measure them interleaved."""
    prompts = load_prompts(config.prompts, config.limit)
    log(f"loading target {config.target}")
    target = load_model(config.target)
    generators = {BASELINE: SpecGenerator(target)}
    for spec in config.drafts:
        log(f"loading draft {spec}")
        generators[spec] = SpecGenerator(target, draft=spec)
    prompt_ids = [generators[BASELINE].encode(p.text, chat=True) for p in prompts]
    warmup = replace(
        config.generation, max_new_tokens=min(WARMUP_TOKENS, config.generation.max_new_tokens)
    )
    for name, gen in generators.items():
        log(f"warming up {name} ({config.warmup}x)")
        for _ in range(config.warmup):
            gen.decoder.generate(prompt_ids[0], warmup)
    runs = _measure(generators, prompts, prompt_ids, config, log)
    greedy = config.generation.sampling.greedy
    methods = {name: summarize_method(name, r, runs[BASELINE], greedy) for name, r in runs.items()}
    return BenchResult(config, len(prompts), methods)
