"""Benchmark: plain decoding (`ar`) against speculative methods, in one process.

Every number comes from one run: the `ar` baseline and each method decode the same prompts
with the same settings on one loaded target. Methods are interleaved per prompt (prompt 1:
ar, m1, m2; prompt 2: ...) so machine noise hits all of them alike. Definitions of every
reported figure are in bench_results.

A method is named by a spec:
- `DRAFT[@GAMMA]`: our decoder with a draft (see api.build_drafter); GAMMA is N, `auto`
  (adaptive schedule, from the pair's tuning profile if any), `best` (the profile's fastest
  fixed γ), `hf` (Hugging Face's +2/-1 schedule run by our engine) or `guard:N` (N behind
  the never-slower guard: plain rounds while N is predicted not to pay); default: --gamma.
- `hf-assisted:MODEL[@N]`: transformers' own assisted generation with MODEL as assistant,
  N drafts per round; `@default` runs HF's own defaults instead (draft length, schedule and
  the confidence threshold that stops drafting early), as a user who sets nothing gets.
- `hf-prompt-lookup[:N][@N]`: transformers' prompt lookup (longest n-gram N).
Hugging Face's methods run with stock kernels (F.linear), as its users run them; ours use
the measured kernel plan unless --plain-kernels.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from specmtp.api import SpecGenerator, eos_token_ids, gamma_settings
from specmtp.bench_results import BASELINE, MethodResult, PromptRun, step_in_runs, table
from specmtp.config import GenerationConfig
from specmtp.costmodel import CostModel, measure_verify_costs
from specmtp.drafters import drafter_tree, has_arms
from specmtp.errors import SpecMTPError
from specmtp.hf_baselines import HFGenerator, HFRun, HFSettings, hf_default_assisted
from specmtp.kernels import (
    MAX_ROWS,
    KernelPlan,
    measure_kernel_plan,
    stock_kernels,
    tuned_linear_enabled,
)
from specmtp.models import DTYPES, LoadedModel, dtype_name, load_model
from specmtp.profile import Profile, find_profile
from specmtp.prompts import BenchPrompt, context_text, load_prompt_spec
from specmtp.stats import GenerationStats, resident_bytes
from specmtp.timings import use_stored_kernel_plan

WARMUP_TOKENS = 8  # a warm-up only needs to touch every code path once
PLAIN_STEP_TOLERANCE = 0.1  # warn when T(1) and ar's own steps differ by more than this
HF_PREFIX = "hf-"
HF_DEFAULTS = "default"  # hf-assisted:MODEL@default: transformers' own assisted settings

Log = Callable[[str], None]


def log_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class BenchConfig:
    prompts: tuple[str, ...]  # prompt files or random:COUNTxLENGTH specs
    target: str = "default"
    dtype: str = "float32"  # a models.DTYPES name, for target and drafts alike
    drafts: tuple[str, ...] = ()  # method specs, see the module docstring
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    default_gamma: str | None = None  # for drafts without @GAMMA: N, auto, best, hf or guard:N
    temperatures: tuple[float, ...] = ()  # more passes at these temperatures
    limit: int | None = None  # first N prompts of each file; None: all
    per_category: int | None = None  # first N prompts of each category
    warmup: int = 1  # unmeasured short generations per method before the measured ones
    repeats: int = 1
    contexts: tuple[int, ...] = ()  # context-length sweep: prompt lengths in tokens
    context_prompts: int = 2  # prompts per context length
    # The kernel plan: measured in this run (each process picks the fastest at the time,
    # and may pick other kernels than the last), or the one stored for this machine
    # (timings.use_stored_kernel_plan: the same in every run, as `generate` runs it).
    stored_kernels: bool = False

    def __post_init__(self) -> None:
        if not self.prompts:
            raise SpecMTPError("the bench needs --prompts")
        if self.dtype not in DTYPES:
            raise SpecMTPError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.warmup < 0 or self.repeats < 1 or self.context_prompts < 1:
            raise SpecMTPError("warmup must be >= 0, repeats and context-prompts >= 1")
        if any(n < 8 for n in self.contexts):
            raise SpecMTPError(f"context lengths must be >= 8 tokens, got {list(self.contexts)}")
        if self.default_gamma not in (None, "auto", "best", "hf"):
            replace(self.generation, **gamma_settings(self.default_gamma))  # validates
        for t in self.temperatures:
            replace(self.generation.sampling, temperature=t)  # validates
        names = [BASELINE, *self.drafts]
        if len(set(names)) != len(names):
            raise SpecMTPError(f"each method must be named once and not {BASELINE!r}: {names}")

    @property
    def method_names(self) -> list[str]:
        return [BASELINE, *self.drafts]


class Runner(Protocol):
    schedule: str  # how γ is chosen, for the report
    has_rounds: bool  # per-round statistics (τ, acceptance) exist
    profile: Profile | None  # the tuning profile it started from

    def run(self, ids: list[int], config: GenerationConfig) -> tuple[list[int], GenerationStats]:
        """Generate; the stats' total_s is the latency."""


class SpecRunner:
    """Our decoder, with the method's draft-length settings applied to every request."""

    has_rounds = True

    def __init__(self, gen: SpecGenerator, settings: dict[str, Any]) -> None:
        self.gen, self.settings = gen, settings
        self.schedule = _schedule_name(settings)
        self.profile = gen.profile

    def run(self, ids: list[int], config: GenerationConfig) -> tuple[list[int], GenerationStats]:
        result = self.gen.decoder.generate(ids, replace(config, **self.settings))
        return result.tokens, result.stats

    def prepare(self, ids: list[int], config: GenerationConfig) -> None:
        """Times what the schedule's cost model needs (T(n)) now, not inside a timed run."""
        self.gen.decoder.schedule_costs(ids, replace(config, **self.settings))


class HFRunner:
    """transformers' generate(): no per-round statistics, only tokens and timings."""

    has_rounds = False
    profile = None

    def __init__(self, gen: HFGenerator, schedule: str) -> None:
        self.gen, self.schedule = gen, schedule

    def run(self, ids: list[int], config: GenerationConfig) -> tuple[list[int], GenerationStats]:
        # As a Hugging Face user runs it: stock kernels, not our measured kernel plan.
        with stock_kernels(self.gen.target, self.gen.assistant):
            out = self._generate(ids, config)
        stats = GenerationStats(gamma=0, prompt_tokens=len(ids), new_tokens=len(out.tokens))
        stats.total_s, stats.first_token_s = out.latency_s, out.ttft_s
        stats.peak_rss_bytes = resident_bytes()
        return out.tokens, stats

    def _generate(self, ids: list[int], config: GenerationConfig) -> HFRun:
        s = config.sampling
        return self.gen.generate(
            ids,
            max_new_tokens=config.max_new_tokens,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            seed=config.seed,
        )


def _schedule_name(settings: dict[str, Any]) -> str:
    schedule = settings.get("schedule", "fixed")
    if schedule not in ("fixed", "guarded") or "gamma" not in settings:
        return schedule
    model = settings.get("model_gamma")
    return f"{schedule}:{settings['gamma']}" + ("" if model is None else f"/{model}")


def build_runner(
    spec: str, target: LoadedModel, base: GenerationConfig, default_gamma: str | None = None
) -> Runner:
    """The one place a method spec becomes a runner."""
    name, _, gamma = spec.partition("@")
    gamma = gamma or default_gamma or str(base.gamma)
    if spec == BASELINE:
        runner = SpecRunner(SpecGenerator(target), {})
        runner.schedule = "plain"
        return runner
    if name.startswith(HF_PREFIX):
        return _hf_runner(name, gamma, target)
    dtype = dtype_name(target.model.dtype)
    profile = find_profile(target.spec, name, dtype=dtype) if gamma in ("auto", "best") else None
    settings = gamma_settings(gamma, profile)
    replace(base, **settings)  # a bad γ fails now, not after the baseline has run
    generator = SpecGenerator(target, draft=name, profile=profile)
    if "model_gamma" in settings and not has_arms(generator.decoder.drafter):
        raise SpecMTPError(f"{spec}: a γ pair N/M needs an ngram+SPEC drafter")
    return SpecRunner(generator, settings)


def _verify_rows(runners: dict[str, Runner]) -> int:
    """The most rows our methods' verify passes can hold (kernels.MAX_ROWS at most): γ + 1
    for a fixed γ (the larger of a pair) or the adaptive schedule's largest γ, MAX_ROWS for
    trees and the heuristic (no bound). The kernel plan is measured, and its weight layout
    chosen, for 1..this many rows."""
    rows = 1
    for runner in runners.values():
        if not isinstance(runner, SpecRunner) or runner.gen.decoder.drafter is None:
            continue  # plain decoding verifies 1 row; Hugging Face's methods: stock kernels
        settings = runner.settings
        if "gamma" not in settings or getattr(runner.gen.decoder.drafter, "tree", None):
            return MAX_ROWS
        rows = max(rows, settings["gamma"] + 1, settings.get("model_gamma", 0) + 1)
    return min(rows, MAX_ROWS)


def _hf_runner(name: str, gamma: str, target: LoadedModel) -> HFRunner:
    method, _, argument = name.partition(":")
    eos = eos_token_ids(target)
    if method == "hf-assisted" and gamma == HF_DEFAULTS:
        settings = hf_default_assisted()
        schedule = f"hf-default:{settings.num_tokens},{settings.confidence_threshold}"
    elif gamma.isdigit() and int(gamma) >= 1:
        settings = HFSettings("assisted", num_tokens=int(gamma))  # no early stop of drafting
        schedule = f"fixed:{gamma}"
    else:
        raise SpecMTPError(
            f"{name}: Hugging Face's methods take a fixed γ >= 1 (hf-assisted also "
            f"@{HF_DEFAULTS}: HF's own settings), got {gamma!r}"
        )
    if method == "hf-assisted":
        if not argument:
            raise SpecMTPError("hf-assisted needs its assistant: hf-assisted:MODEL")
        assistant = load_model(argument, dtype=target.model.dtype).model
        return HFRunner(HFGenerator(target.model, settings=settings, assistant=assistant,
                                    eos_token_ids=eos), schedule)  # fmt: skip
    if method == "hf-prompt-lookup":
        if argument and not argument.isdigit():
            raise SpecMTPError(f"bad {name!r}: use hf-prompt-lookup or hf-prompt-lookup:N")
        settings = HFSettings(
            "prompt-lookup",
            num_tokens=int(gamma),
            max_matching_ngram_size=int(argument) if argument else None,
        )
        return HFRunner(HFGenerator(target.model, settings=settings, eos_token_ids=eos),
                        f"fixed:{gamma}")  # fmt: skip
    raise SpecMTPError(
        f"unknown Hugging Face method {name!r}: hf-assisted:MODEL or hf-prompt-lookup"
    )


def measure(
    runners: dict[str, Runner],
    prompts: Sequence[BenchPrompt],
    prompt_ids: Sequence[list[int]],
    config: GenerationConfig,
    repeats: int,
    log: Log,
) -> dict[str, list[PromptRun]]:
    """Every method on every prompt, interleaved per prompt; latencies repeated."""
    runs: dict[str, list[PromptRun]] = {name: [] for name in runners}
    for i, (prompt, ids) in enumerate(zip(prompts, prompt_ids, strict=True), 1):
        for repeat in range(repeats):
            for name, runner in runners.items():
                start = time.perf_counter()
                tokens, stats = runner.run(ids, config)
                latency = time.perf_counter() - start
                if repeat == 0:
                    runs[name].append(
                        PromptRun(
                            prompt.question_id, prompt.group, tokens, stats, [], runner.has_rounds
                        )
                    )
                runs[name][-1].latencies.append(latency)
                log(
                    f"[{i}/{len(prompts)}] {prompt.group} {prompt.question_id} {name}: "
                    f"{stats.new_tokens} tokens in {latency:.2f} s "
                    f"({stats.new_tokens / latency:.1f} tok/s)"
                )
    return runs


def typical_context(ids: Sequence[list[int]], plain: Sequence[PromptRun]) -> list[int]:
    """What T(n) is timed after: the prompt of median length and the first half of plain
    decoding's answer to it, the context of a verify pass midway through a typical answer
    (the per-row attention of bfloat16 runs costs more over longer contexts)."""
    median = sorted(range(len(ids)), key=lambda i: len(ids[i]))[len(ids) // 2]
    answer = plain[median].tokens
    return [*ids[median], *answer[: len(answer) // 2]]


def measure_costs(
    runners: dict[str, Runner],
    runs: dict[str, list[PromptRun]],
    ids: list[int],
    log: Log,
    repeats: int = 5,
) -> dict[str, CostModel]:
    """T(n) of each of our methods' target (as it runs there: MTP keeps hidden states, a
    tree drafter's passes are tree forwards), up to the largest verify pass that method
    made. Methods take turns, sweep by sweep, so a change in machine load moves every
    method's costs alike; medians over `repeats`."""
    sizes = {
        name: max(n for r in runs[name] for n in r.stats.verify_sizes)
        for name, runner in runners.items()
        if isinstance(runner, SpecRunner)
    }
    log(f"measuring T(n) of each method's target after {len(ids)} tokens: {sizes}")
    sweeps: dict[str, list[tuple[float, ...]]] = {name: [] for name in sizes}
    for _ in range(repeats):
        for name, largest in sizes.items():
            decoder = runners[name].gen.decoder
            context = ids[: max(2, decoder.context_length - largest)]
            tree = drafter_tree(decoder.drafter)
            costs = measure_verify_costs(
                decoder.target, context, max_tokens=largest, repeats=1, tree=tree
            )
            sweeps[name].append(costs)
    return {
        name: CostModel(tuple(statistics.median(t) for t in zip(*rows, strict=True)))
        for name, rows in sweeps.items()
    }


def plain_step_check(methods: dict[str, MethodResult]) -> dict[str, float | None]:
    """T(1) as timed for the cost model against `ar`'s own steps in its timed runs."""
    plain = methods.get(BASELINE)
    timed = None if plain is None else plain.plain_step_s
    in_runs = None if plain is None else step_in_runs(plain.runs)
    ratio = None if timed is None or not in_runs else round(timed / in_runs, 4)
    return {"timed_t1_s": timed, "ar_step_s": in_runs, "ratio": ratio}


def summarize(
    runners: dict[str, Runner],
    runs: dict[str, list[PromptRun]],
    costs: dict[str, CostModel],
    greedy: bool,
) -> dict[str, MethodResult]:
    plain_step = costs[BASELINE].target_s(1) if BASELINE in costs else None
    return {
        name: MethodResult(
            name, runners[name].schedule, r, runs[BASELINE], greedy, costs.get(name), plain_step
        )
        for name, r in runs.items()
    }


@dataclass
class BenchResult:
    config: BenchConfig
    num_prompts: int
    methods: dict[str, MethodResult]
    by_temperature: dict[str, dict[str, MethodResult]] = field(default_factory=dict)
    context_sweep: list[dict[str, Any]] = field(default_factory=list)
    gamma_sweep: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    kernel_plan: KernelPlan | None = None

    def config_dict(self) -> dict[str, Any]:
        gen = self.config.generation
        return {
            "target": self.config.target,
            "dtype": self.config.dtype,
            "drafts": list(self.config.drafts),
            "prompts": list(self.config.prompts),
            "num_prompts": self.num_prompts,
            "limit": self.config.limit,
            "per_category": self.config.per_category,
            "max_new_tokens": gen.max_new_tokens,
            "gamma": gen.gamma,
            "temperature": gen.sampling.temperature,
            "temperatures": [gen.sampling.temperature, *self.config.temperatures],
            "top_k": gen.sampling.top_k,
            "top_p": gen.sampling.top_p,
            "seed": gen.seed,
            "chat_template": True,
            "warmup": self.config.warmup,
            "repeats": self.config.repeats,
            "speedup": f"tokens_per_s / {BASELINE} tokens_per_s",
            "efficiency": "speedup / predicted_speedup; the prediction uses T(n) measured in "
            "this run for every verify pass, the drafter's measured time and the prefill",
            "torch_threads": torch.get_num_threads(),
            "kernels": "tuned" if tuned_linear_enabled() else "plain",
            "kernel_plan_from": "stored" if self.config.stored_kernels else "measured",
            "kernel_plan": None if self.kernel_plan is None else self.kernel_plan.by_rows,
            "kernel_layout": None if self.kernel_plan is None else self.kernel_plan.layout,
            # "flat" or "padded" products when half-precision forwards are row-invariant
            "row_invariant": None if self.kernel_plan is None else self.kernel_plan.row_invariant,
        }

    def to_dict(self) -> dict[str, Any]:
        main_cost = next((m.cost for m in reversed(self.methods.values()) if m.cost), None)
        return {
            "plain_step": plain_step_check(self.methods),
            "methods": {name: m.to_dict() for name, m in self.methods.items()},
            "by_temperature": {
                t: {name: m.to_dict(per_prompt=False) for name, m in methods.items()}
                for t, methods in self.by_temperature.items()
            },
            "context_sweep": self.context_sweep,
            "gamma_sweep": self.gamma_sweep,
            "cost_model": None if main_cost is None else main_cost.to_dict(),
            "config": self.config_dict(),
        }

    def table(self) -> str:
        lines = [table(self.methods)]
        for t, methods in self.by_temperature.items():
            if methods is not self.methods:
                lines += ["", f"temperature {t}:", table(methods)]
        for point in self.context_sweep:
            lines.append(
                f"context {point['context_tokens']} tokens: "
                + ", ".join(f"{n} {m['speedup']:.2f}x" for n, m in point["methods"].items())
            )
        return "\n".join(lines)


def _load_prompts(config: BenchConfig, target: LoadedModel) -> list[BenchPrompt]:
    tokenizer = target.tokenizer
    prompts = []
    for spec in config.prompts:
        prompts += load_prompt_spec(
            spec,
            limit=config.limit,
            per_category=config.per_category,
            vocab_size=len(tokenizer),
            exclude=tokenizer.all_special_ids,
        )
    return prompts


def _encode(gen: SpecGenerator, prompt: BenchPrompt) -> list[int]:
    return list(prompt.ids) if prompt.ids is not None else gen.encode(prompt.text, chat=True)


def _pass(
    runners: dict[str, Runner],
    prompts: Sequence[BenchPrompt],
    ids: Sequence[list[int]],
    generation: GenerationConfig,
    config: BenchConfig,
    log: Log,
) -> dict[str, MethodResult]:
    runs = measure(runners, prompts, ids, generation, config.repeats, log)
    costs = measure_costs(runners, runs, typical_context(ids, runs[BASELINE]), log)
    methods = summarize(runners, runs, costs, generation.sampling.greedy)
    check = plain_step_check(methods)
    if check["ratio"] is not None and abs(check["ratio"] - 1) > PLAIN_STEP_TOLERANCE:
        log(
            f"warning: T(1) timed {1e3 * check['timed_t1_s']:.1f} ms, but ar's steps took "
            f"{1e3 * check['ar_step_s']:.1f} ms in its runs: every efficiency is off by "
            f"about {abs(check['ratio'] - 1):.0%}"
        )
    return methods


def context_sweep(
    runners: dict[str, Runner],
    prompts: Sequence[BenchPrompt],
    target: LoadedModel,
    config: BenchConfig,
    log: Log,
) -> list[dict[str, Any]]:
    """Speedup and memory as the prompt grows: long-context versions of the first prompts."""
    plain = runners[BASELINE]
    assert isinstance(plain, SpecRunner)

    def count(text: str) -> int:
        return len(target.tokenizer(text).input_ids)

    textual = [p for p in prompts if p.text]
    points = []
    for length in config.contexts:
        if length + config.generation.max_new_tokens >= target.context_length:
            log(f"context {length}: skipped, the model's context is {target.context_length}")
            continue
        chosen = textual[: config.context_prompts]
        texts = [context_text(p, textual, tokens=length, count_tokens=count) for p in chosen]
        ids = [plain.gen.encode(text, chat=True) for text in texts]
        methods = _pass(runners, chosen, ids, config.generation, config, log)
        points.append(
            {
                "context_tokens": length,
                "prompt_tokens": round(sum(map(len, ids)) / len(ids)),
                "methods": {n: m.to_dict(per_prompt=False) for n, m in methods.items()},
            }
        )
    return points


def run_bench(config: BenchConfig, *, log: Log = log_to_stderr) -> BenchResult:
    """Load the target once, warm every method up, then measure them interleaved."""
    log(f"loading target {config.target}")
    target = load_model(config.target, dtype=DTYPES[config.dtype])
    prompts = _load_prompts(config, target)
    if config.contexts and sum(p.text is not None for p in prompts) < 2:
        raise SpecMTPError("a context sweep needs at least 2 text prompts to build documents from")
    runners: dict[str, Runner] = {}
    for spec in config.method_names:
        log(f"preparing {spec}")
        runners[spec] = build_runner(spec, target, config.generation, config.default_gamma)
    plain = runners[BASELINE]
    assert isinstance(plain, SpecRunner)
    ids = [_encode(plain.gen, p) for p in prompts]
    warmup = replace(
        config.generation, max_new_tokens=min(WARMUP_TOKENS, config.generation.max_new_tokens)
    )
    rows = _verify_rows(runners)
    if config.stored_kernels:
        context = target.context_length
        plan = use_stored_kernel_plan(target.model, rows=rows, context_length=context, log=log)
    else:
        plan = measure_kernel_plan(plain.gen.decoder.target, ids[0], max_rows=rows)
    if plan is not None:
        log(f"kernel plan (transposed product by rows): {plan.by_rows}; weights {plan.layout}")
    passes = [config.generation] + [
        replace(config.generation, sampling=replace(config.generation.sampling, temperature=t))
        for t in config.temperatures
    ]
    for runner in runners.values():
        if isinstance(runner, SpecRunner):
            for generation in passes:  # sampled passes read stored costs (timings.py)
                runner.prepare(ids[0], generation)
    for name, runner in runners.items():
        log(f"warming up {name} ({config.warmup}x)")
        for _ in range(config.warmup):
            runner.run(ids[0], warmup)
    methods = _pass(runners, prompts, ids, config.generation, config, log)
    result = BenchResult(config, len(prompts), methods, kernel_plan=plan)
    result.by_temperature[str(config.generation.sampling.temperature)] = methods
    for generation in passes[1:]:
        t = generation.sampling.temperature
        result.by_temperature[str(t)] = _pass(runners, prompts, ids, generation, config, log)
    result.context_sweep = context_sweep(runners, prompts, target, config, log)
    result.gamma_sweep = _profile_sweeps(runners)
    return result


def _profile_sweeps(runners: dict[str, Runner]) -> dict[str, list[dict[str, Any]]]:
    """The γ sweeps of the tuning profiles that methods started from."""
    return {
        name: list(runner.profile.sweep)
        for name, runner in runners.items()
        if runner.profile is not None and runner.profile.sweep
    }
