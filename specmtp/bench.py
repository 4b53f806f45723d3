"""Benchmark: plain decoding (`ar`) against speculative methods, in one process.

Every number comes from one run: the `ar` baseline and each method decode the same prompts
with the same settings on one loaded target. Methods are interleaved per prompt (prompt 1:
ar, m1, m2; prompt 2: ...) so machine noise hits all of them alike. Definitions of every
reported figure are in bench_results.

Methods are named by specs (`DRAFT[@GAMMA]`, `hf-assisted:MODEL[@N]`,
`hf-prompt-lookup[:N][@N]`), which bench_runners turns into runners and describes.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from specmtp.api import SpecGenerator, gamma_settings
from specmtp.bench_results import BASELINE, MethodResult, PromptRun, step_in_runs, table
from specmtp.bench_runners import Runner, SpecRunner, build_runner, verify_rows
from specmtp.config import GenerationConfig
from specmtp.costmodel import CostModel, measure_verify_costs
from specmtp.drafter_specs import sharing_draft_models
from specmtp.errors import SpecMTPError
from specmtp.kernels import KernelPlan, measure_kernel_plan, tuned_linear_enabled
from specmtp.models import DTYPES, LoadedModel, load_model
from specmtp.mtp_drafter import drafter_tree
from specmtp.prompts import BenchPrompt, context_text, load_prompt_spec
from specmtp.timings import use_stored_kernel_plan

WARMUP_TOKENS = 8  # a warm-up only needs to touch every code path once
PLAIN_STEP_TOLERANCE = 0.1  # warn when T(1) and ar's own steps differ by more than this
# warn when a method's target forwards ran this much faster or slower than ar's (see
# bench_results: target_pace)
PACE_TOLERANCE = 0.15

Log = Callable[[str], None]


def log_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class BenchConfig:
    prompts: tuple[str, ...]  # prompt files or random:COUNTxLENGTH specs
    target: str = "default"
    dtype: str = "float32"  # a models.DTYPES name, for target and drafts alike
    drafts: tuple[str, ...] = ()  # method specs, see bench_runners
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


def uneven_pace(methods: dict[str, MethodResult]) -> list[str]:
    """One warning per method whose target forwards ran at another pace than `ar`'s: mostly
    the machine's speed moving between them (other processes), which moves that speedup by
    about as much; or that method's forwards costing more in its loop than when timed."""
    plain = methods.get(BASELINE)
    base = None if plain is None else plain.target_pace
    if not base:
        return []
    warnings = []
    for name, m in methods.items():
        pace = m.target_pace
        if pace is not None and abs(pace / base - 1) > PACE_TOLERANCE:
            warnings.append(
                f"warning: {name}'s target forwards ran at {pace:.2f}x their timed T(n), ar's "
                f"at {base:.2f}x: if the machine's load changed between them, its speedup is "
                f"off by about {abs(base / pace - 1):.0%}; a rerun tells that from forwards "
                "that cost more in its loop than timed"
            )
    return warnings


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
            # the products of row-invariant half-precision forwards: "packed", "flat", "padded"
            # (blocks of 8 rows), "padded16" (past 8 rows, of 16),
            # or per weight shape ("packed, padded for 1536x8960")
            "row_invariant": None if self.kernel_plan is None else self.kernel_plan.row_invariant,
            # what computes their attention: "native (attention.c)" or "torch, row by row"
            "row_invariant_attention": None
            if self.kernel_plan is None
            else self.kernel_plan.row_invariant_attention,
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
    for warning in uneven_pace(methods):
        log(warning)
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
    with sharing_draft_models():  # methods drafting with one model share its weights
        for spec in config.method_names:
            log(f"preparing {spec}")
            runners[spec] = build_runner(spec, target, config.generation, config.default_gamma)
    plain = runners[BASELINE]
    assert isinstance(plain, SpecRunner)
    ids = [_encode(plain.gen, p) for p in prompts]
    warmup = replace(
        config.generation, max_new_tokens=min(WARMUP_TOKENS, config.generation.max_new_tokens)
    )
    rows = verify_rows(runners, config.generation)
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
