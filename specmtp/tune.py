"""`specmtp tune`: measure a target/drafter pair on this machine and choose the draft length.

It measures the target's verify cost T(n), the drafter's cost per round D(k) and the
conditional acceptance α_i per draft position, on training prompts (never the evaluation
sets: a γ tuned on them would flatter the benchmark), then sweeps γ with plain decoding
interleaved per prompt, prints predicted and measured speedup per γ, and writes a profile
that `--gamma auto` (the adaptive schedule) and `SPEC@best` in the bench start from.
A tree drafter (`mtp-tree`) sweeps tree budgets instead (nodes per tree, `tune_tree.py`),
and its profile carries the fastest tree. A drafter with arms (`ngram+SPEC`: prompt lookup
first, the model otherwise) sweeps γ pairs N/M (N for the lookup rounds, M for the model's)
by coordinate search, and its profile carries the fastest pair and α per arm. A dynamic
tree whose node count is left to tuning (`mtp-tree#nodes=auto`, alone, after `ngram+` or
merged after `ngram|`) sweeps that count (`--budgets`) at the default γ (a lookup arm's) and
the tree's full depth, and its profile carries the fastest count; a dynamic tree with a
fixed count `#nodes=N` alone is measured at N (an `ngram+` / `ngram|` one sweeps γ pairs).
One dimension per drafter: the others stay at their defaults.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from specmtp.api import SpecGenerator, make_config, weights_fingerprints
from specmtp.config import GenerationConfig
from specmtp.costmodel import (
    CostModel,
    conditional_acceptance,
    expected_tokens,
    fit_draft_cost,
    measure_verify_costs,
)
from specmtp.drafter_specs import build_drafter
from specmtp.drafters import LOOKUP_ARM, MODEL_ARM, Drafter, has_arms
from specmtp.errors import SpecMTPError
from specmtp.kernels import MAX_ROWS, measure_kernel_plan
from specmtp.merged_drafter import MergedDrafter
from specmtp.models import DTYPES, load_model
from specmtp.mtp_drafter import MTPDrafter, drafter_tree, dynamic_tree_heads
from specmtp.profile import Profile, default_profile_path
from specmtp.stats import GenerationStats
from specmtp.train_prompts import load_train_prompts, refuse_evaluation_sets
from specmtp.tree import TokenTree
from specmtp.tune_tree import (
    budget_trees,
    expected_tree_tokens,
    rank_probabilities,
    sweep_budgets,
    sweep_node_counts,
)

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
        if not self.budgets or not all(1 <= b <= 64 for b in self.budgets):
            raise SpecMTPError(f"tree budgets must be in 1..64 nodes, got {list(self.budgets)}")
        if self.limit < 1:
            raise SpecMTPError(f"limit must be >= 1, got {self.limit}")
        GenerationConfig(self.max_new_tokens)  # validates max_new_tokens

    @property
    def profile_path(self) -> Path:
        return self.out or default_profile_path(self.target, self.draft, self.dtype)


def _generation(config: TuneConfig, gamma: int) -> GenerationConfig:
    return make_config(
        max_new_tokens=config.max_new_tokens,
        gamma=gamma,
        temperature=config.temperature,
        seed=config.seed,
    )


def _pair_generation(config: TuneConfig, pair: tuple[int, int]) -> GenerationConfig:
    lookup, model = pair
    return replace(_generation(config, max(lookup, 1)), model_gamma=max(model, 1))


def _run(gen: SpecGenerator, ids: list[int], config: GenerationConfig) -> GenerationStats:
    return gen.decoder.generate(ids, config).stats  # stats.total_s: the generation's wall time


def sweep_runs(
    plain: SpecGenerator,
    spec: SpecGenerator,
    prompt_ids: Sequence[list[int]],
    config: TuneConfig,
    log: Log,
) -> dict[int, list[GenerationStats]]:
    """Every γ in 0..max_gamma (0: plain decoding) on every prompt, interleaved per prompt."""
    runs: dict[int, list[GenerationStats]] = {g: [] for g in range(config.max_gamma + 1)}
    for i, ids in enumerate(prompt_ids, 1):
        for gamma in runs:
            gen = plain if gamma == 0 else spec
            runs[gamma].append(_run(gen, ids, _generation(config, max(gamma, 1))))
        line = " ".join(f"{g}:{r[-1].tokens_per_s:.1f}" for g, r in runs.items())
        log(f"[{i}/{len(prompt_ids)}] tokens/s by γ {line}")
    return runs


Pair = tuple[int, int]  # (lookup γ, model γ); (0, 0) is plain decoding
PLAIN: Pair = (0, 0)


def sweep_pair_runs(
    plain: SpecGenerator,
    spec: SpecGenerator,
    prompt_ids: Sequence[list[int]],
    config: TuneConfig,
    log: Log,
) -> dict[Pair, list[GenerationStats]]:
    """γ pairs for a drafter with arms, by coordinate search: first the model rounds' γ
    M = 1..max_gamma (MTP heads: up to their depth) with the lookup rounds at the default γ,
    then the lookup rounds' γ N = 1..max_gamma with M at the fastest of the first pass.
    Plain decoding runs with every prompt of both passes, interleaved, so load changes hit
    every point alike."""
    runs: dict[Pair, list[GenerationStats]] = {PLAIN: []}
    lookup = min(GenerationConfig().gamma, config.max_gamma)
    top = range(1, config.max_gamma + 1)
    # MTP heads draft at most one token per depth: a longer model γ would repeat the deepest.
    depth = getattr(spec.decoder.drafter.fallback, "max_depth", config.max_gamma)
    first = [(lookup, m) for m in top if m <= depth]
    _pair_pass(plain, spec, prompt_ids, config, first, runs, log, "model γ")
    model = max(first, key=lambda pair: _tokens_per_s(runs[pair]))[1]
    second = [(n, model) for n in top if (n, model) not in runs]
    _pair_pass(plain, spec, prompt_ids, config, second, runs, log, f"lookup γ (model γ {model})")
    return runs


def _pair_pass(
    plain: SpecGenerator,
    spec: SpecGenerator,
    prompt_ids: Sequence[list[int]],
    config: TuneConfig,
    pairs: Sequence[Pair],
    runs: dict[Pair, list[GenerationStats]],
    log: Log,
    varied: str,
) -> None:
    for i, ids in enumerate(prompt_ids, 1):
        for pair in (PLAIN, *pairs):
            gen = plain if pair == PLAIN else spec
            config_i = _generation(config, 1) if pair == PLAIN else _pair_generation(config, pair)
            runs.setdefault(pair, []).append(_run(gen, ids, config_i))
        line = " ".join(f"{n}/{m}:{runs[(n, m)][-1].tokens_per_s:.1f}" for n, m in (PLAIN, *pairs))
        log(f"[{i}/{len(prompt_ids)}] {varied}: tokens/s by N/M {line}")


def arm_alphas(runs: Sequence[GenerationStats], max_gamma: int) -> dict[str, tuple[float, ...]]:
    """α_i per drafter arm over every run, counts summed before dividing; positions never
    reached get 0."""
    alphas: dict[str, tuple[float, ...]] = {}
    for arm in sorted({arm for s in runs for arm in s.arm_reached}):
        reached, accepted = [0] * max_gamma, [0] * max_gamma
        for s in runs:
            for i, (r, a) in enumerate(zip(s.arm_reached.get(arm, []), s.arm_accepted.get(arm, []),
                                           strict=True)):  # fmt: skip
                if i < max_gamma:
                    reached[i] += r
                    accepted[i] += a
        alphas[arm] = tuple(a or 0.0 for a in conditional_acceptance(reached, accepted))
    return alphas


def build_pair_profile(
    config: TuneConfig, runs: dict[Pair, list[GenerationStats]], verify_s: tuple[float, ...]
) -> Profile:
    """The profile of a γ pair sweep. The draft cost model is the model arm's alone (the
    lookup arm's drafts cost next to nothing, and the adaptive schedule learns them); the
    prediction for a pair weighs each arm's E(γ) by its share of the rounds."""
    drafting = {pair: rs for pair, rs in runs.items() if pair != PLAIN}
    samples = [(m, s.arm_draft_s[MODEL_ARM] / s.arm_counts[MODEL_ARM][0])
               for (_, m), rs in drafting.items() for s in rs
               if s.arm_counts.get(MODEL_ARM, [0])[0]]  # fmt: skip
    cost = CostModel(verify_s, *fit_draft_cost(samples))
    every = [s for rs in drafting.values() for s in rs]
    alphas, per_arm = pooled_alphas(every, config.max_gamma), arm_alphas(every, config.max_gamma)
    plain = _tokens_per_s(runs[PLAIN])
    sweep = [_sweep_row(runs[PLAIN], plain, 1.0, gamma=0, model_gamma=0)]
    for (n, m), rs in drafting.items():
        rounds = {arm: sum(s.arm_counts.get(arm, [0])[0] for s in rs) for arm in per_arm}
        total = sum(rounds.values()) or 1
        expected = sum(rounds[arm] / total * expected_tokens(per_arm[arm], n if arm == LOOKUP_ARM
                       else m) for arm in per_arm)  # fmt: skip
        row = _sweep_row(rs, plain, predicted_speedup(cost, expected, rs), gamma=n, model_gamma=m)
        row["arm_rounds"] = rounds
        sweep.append(row)
    best = max(sweep[1:], key=lambda row: row["measured_speedup"])
    meta = _meta(config, len(runs[PLAIN]) // 2)  # plain runs once per prompt and pass
    first = [row for row in sweep[1:] if row["gamma"] == sweep[1]["gamma"]]
    meta["pair_search"] = {
        "lookup_gamma_while_model_varies": sweep[1]["gamma"],
        "model_gamma_while_lookup_varies": max(first, key=lambda r: r["measured_speedup"])[
            "model_gamma"
        ],
    }
    return Profile(
        config.target, config.draft, cost, alphas, int(best["gamma"]), tuple(sweep), meta,
        model_gamma=int(best["model_gamma"]), arm_alphas=per_arm,
    )  # fmt: skip


def _tokens_per_s(runs: Sequence[GenerationStats]) -> float:
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


def build_profile(
    config: TuneConfig, runs: dict[int, list[GenerationStats]], verify_s: tuple[float, ...]
) -> Profile:
    """The cost model, α and the per-γ table from the sweep and the measured T(n)."""
    samples = [(g, s.draft_s / s.rounds) for g, rs in runs.items() if g > 0 for s in rs if s.rounds]
    fixed, per_token = fit_draft_cost(samples)
    cost = CostModel(verify_s, fixed, per_token)
    alphas = pooled_alphas([s for g, rs in runs.items() if g > 0 for s in rs], config.max_gamma)
    plain = _tokens_per_s(runs[0])
    sweep = [_sweep_row(runs[0], plain, 1.0, gamma=0)]
    for gamma in range(1, config.max_gamma + 1):
        rs = runs[gamma]
        predicted = predicted_speedup(cost, expected_tokens(alphas, gamma), rs)
        sweep.append(_sweep_row(rs, plain, predicted, gamma=gamma))
    best = max(sweep[1:], key=lambda row: row["measured_speedup"])["gamma"]
    return Profile(
        config.target, config.draft, cost, alphas, best, tuple(sweep), _meta(config, len(runs[0]))
    )


def build_tree_profile(
    config: TuneConfig,
    runs: dict[int, list[GenerationStats]],
    trees: dict[int, TokenTree],
    rank_probs: list[list[float]],
    verify_s: tuple[float, ...],
) -> Profile:
    """The profile of a tree budget sweep: per budget, the tree, E, predicted and measured
    speedup and τ; the fastest measured tree becomes the profile's tree. α per depth is the
    top-ranked child's acceptance, for the adaptive schedule's depth choice."""
    samples = [(tree.max_depth, s.draft_s / s.rounds) for b, tree in trees.items()
               for s in runs[b] if s.rounds]  # fmt: skip
    cost = CostModel(verify_s, *fit_draft_cost(samples))
    plain = _tokens_per_s(runs[0])
    sweep = [_sweep_row(runs[0], plain, 1.0, gamma=0, budget=0)]
    for budget, tree in trees.items():
        rs, expected = runs[budget], expected_tree_tokens(tree, rank_probs)
        row = _sweep_row(rs, plain, predicted_speedup(cost, expected, rs),
                         gamma=tree.max_depth, budget=budget)  # fmt: skip
        row["expected_tokens"] = round(expected, 4)
        row["tree"] = [list(p) for p in tree.paths]
        sweep.append(row)
    best = max(sweep[1:], key=lambda row: row["measured_speedup"])
    alphas = tuple(row[0] if row else 0.0 for row in rank_probs)
    meta = _meta(config, len(runs[0]))
    meta["rank_probabilities"] = [[round(p, 4) for p in row] for row in rank_probs]
    return Profile(
        config.target, config.draft, cost, alphas, int(best["gamma"]), tuple(sweep), meta,
        tree=trees[int(best["budget"])].paths,
    )  # fmt: skip


def build_nodes_profile(
    config: TuneConfig,
    runs: dict[int, list[GenerationStats]],
    verify_s: tuple[float, ...],
    *,
    depth: int,
    lookup_gamma: int | None,
) -> Profile:
    """The profile of a dynamic tree's node sweep: per node count, predicted and measured
    speedup and τ; the fastest measured count becomes the profile's `nodes`. The prediction
    takes each count's measured τ (a dynamic tree has no fixed shape to expect from) over
    the round time the cost model gives. With a lookup arm (`lookup_gamma`), the draft cost
    model is the model arm's, as in a γ pair profile, and α per arm is pooled over every
    count; α per depth is the top-ranked child's acceptance at the fastest count (alone) or
    pooled over its rounds."""
    drafting = {n: rs for n, rs in runs.items() if n > 0}
    if lookup_gamma is None:
        samples = [(depth, s.draft_s / s.rounds) for rs in drafting.values() for s in rs
                   if s.rounds]  # fmt: skip
    else:
        samples = [(depth, s.arm_draft_s[MODEL_ARM] / s.arm_counts[MODEL_ARM][0])
                   for rs in drafting.values() for s in rs
                   if s.arm_counts.get(MODEL_ARM, [0])[0]]  # fmt: skip
    cost = CostModel(verify_s, *fit_draft_cost(samples))
    plain = _tokens_per_s(runs[0])
    sweep = [_sweep_row(runs[0], plain, 1.0, gamma=0, budget=0)]
    for count, rs in drafting.items():
        rounds = sum(s.rounds for s in rs)
        tau = sum(s.accepted_tokens + s.rounds for s in rs) / rounds if rounds else 1.0
        row = _sweep_row(rs, plain, predicted_speedup(cost, tau, rs) if rounds else 0.0,
                         gamma=lookup_gamma or depth, budget=count)  # fmt: skip
        if lookup_gamma is not None:
            row["model_gamma"] = depth
        sweep.append(row)
    best = max(sweep[1:], key=lambda row: row["measured_speedup"])
    fastest = runs[int(best["budget"])]
    every = [s for rs in drafting.values() for s in rs]  # α per arm: the arms' own rounds
    width = max(depth, lookup_gamma or 0, config.max_gamma if lookup_gamma else 0)
    if lookup_gamma is None:
        tops = [row[0] if row else 0.0 for row in rank_probabilities(fastest)]
        alphas = tuple(tops[:width]) + (0.0,) * max(0, width - len(tops))
    else:
        alphas = pooled_alphas(fastest, width)
    meta = _meta(config, len(runs[0]))
    meta["node_sweep"] = {"depth": depth, "lookup_gamma": lookup_gamma}
    return Profile(
        config.target, config.draft, cost, alphas, lookup_gamma or depth, tuple(sweep), meta,
        model_gamma=None if lookup_gamma is None else depth,
        arm_alphas={} if lookup_gamma is None else arm_alphas(every, width),
        nodes=int(best["budget"]),
    )  # fmt: skip


def _sweep_row(
    runs: Sequence[GenerationStats], plain: float, predicted: float, **point: int
) -> dict[str, Any]:
    """One sweep point (γ, or a tree budget and its depth): speedups against plain decoding's
    tokens/s, and τ for a drafting point."""
    row: dict[str, Any] = {**point, "predicted_speedup": round(predicted, 4)}
    row["measured_speedup"] = round(_tokens_per_s(runs) / plain, 4)
    row["tokens_per_s"] = round(_tokens_per_s(runs), 3)
    if point.get("gamma"):
        committed = sum(s.accepted_tokens + s.rounds for s in runs)
        row["mean_accepted_tokens"] = round(committed / sum(s.rounds for s in runs), 4)
    return row


def _meta(config: TuneConfig, num_prompts: int) -> dict[str, Any]:
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


def run_tune(config: TuneConfig, *, log: Log) -> Profile:
    texts = load_train_prompts(config.prompts, seed=config.seed)[: config.limit]
    log(f"loading target {config.target} and draft {config.draft}")
    target = load_model(config.target, dtype=DTYPES[config.dtype])
    drafter, _ = build_drafter(config.draft, target, dtype=target.model.dtype)
    heads = dynamic_tree_heads(drafter)
    counts = node_counts(heads, drafter, config, log)
    if heads is not None and counts:
        heads.nodes = max(counts)  # the warm-up and kernel plan below, then the sweep's own
    plain, spec = SpecGenerator(target), SpecGenerator(target, draft=drafter)
    prompt_ids = [plain.encode(text, chat=True) for text in texts]
    tree = getattr(spec.decoder.drafter, "tree", None)  # a tree drafter: budgets to sweep
    # The verify passes to come, as decode_schedules.verify_rows counts them: any tree (a
    # lookup-first or merged drafter's too) may verify up to MAX_ROWS rows.
    rows = MAX_ROWS if drafter_tree(spec.decoder.drafter) is not None else config.max_gamma + 1
    plan = measure_kernel_plan(spec.decoder.target, prompt_ids[0], max_rows=rows)
    if plan is not None:
        log(f"kernel plan (transposed product by rows): {plan.by_rows}; weights {plan.layout}")
    warmup = replace(_generation(config, config.max_gamma), max_new_tokens=8)
    for gen in (plain, spec):
        gen.decoder.generate(prompt_ids[0], warmup)
    if heads is not None and counts:
        assert heads.tree is not None  # a dynamic tree drafts from one
        depth = heads.tree.max_depth
        lookup = min(GenerationConfig().gamma, config.max_gamma) if has_arms(drafter) else None
        settings = (
            _generation(config, depth)
            if lookup is None
            else _pair_generation(config, (lookup, depth))
        )

        def run_count(gen: SpecGenerator, ids: list[int]) -> GenerationStats:
            return _run(gen, ids, _generation(config, 1) if gen is plain else settings)

        runs = sweep_node_counts(plain, spec, prompt_ids, heads, counts, run_count, log)
        verify_s = _verify_costs(spec, prompt_ids, runs, config, log)
        profile = build_nodes_profile(config, runs, verify_s, depth=depth, lookup_gamma=lookup)
        heads.nodes = profile.nodes
    elif has_arms(spec.decoder.drafter):
        pairs = sweep_pair_runs(plain, spec, prompt_ids, config, log)
        verify_s = _verify_costs(spec, prompt_ids, pairs, config, log)
        profile = build_pair_profile(config, pairs, verify_s)
    elif tree is None:
        runs = sweep_runs(plain, spec, prompt_ids, config, log)
        profile = build_profile(config, runs, _verify_costs(spec, prompt_ids, runs, config, log))
    else:
        log(f"measuring rank probabilities with the drafter's {tree.num_nodes}-node tree")
        first = [_run(spec, ids, _generation(config, tree.max_depth)) for ids in prompt_ids]
        rank_probs = rank_probabilities(first)
        if not rank_probs:
            raise SpecMTPError(
                "no tree round ran: every answer ended at once; give more or longer prompts"
            )
        trees = budget_trees(rank_probs, config.budgets)

        def run(gen: SpecGenerator, ids: list[int], gamma: int) -> GenerationStats:
            return _run(gen, ids, _generation(config, gamma))

        runs = sweep_budgets(plain, spec, prompt_ids, trees, run, log)
        verify_s = _verify_costs(spec, prompt_ids, runs, config, log)
        profile = build_tree_profile(config, runs, trees, rank_probs, verify_s)
    # What a draft model's catch-up costs per token read (its prompt, the tokens of plain
    # rounds): the sweep's fixed γ never catches up past the prompt, which D(k) averages in.
    read_s = spec.decoder.schedules.measure_draft_cost(prompt_ids[0])[2]
    profile = replace(profile, cost_model=replace(profile.cost_model, catch_up_per_token_s=read_s))
    log(f"catch-up: {read_s * 1e3:.3f} ms per token the drafter reads before drafting")
    profile.meta["kernel_plan"] = None if plan is None else plan.by_rows
    profile.meta["kernel_layout"] = None if plan is None else plan.layout
    profile.meta["weights"] = weights_fingerprints(target, spec.decoder.drafter)
    profile.save(config.profile_path)
    return profile


def node_counts(
    heads: MTPDrafter | None, drafter: Drafter | None, config: TuneConfig, log: Log
) -> tuple[int, ...]:
    """The node counts a dynamic tree's sweep runs: `--budgets` for `#nodes=auto` (none
    beyond the heads' tree alone, which could verify no more; a merged drafter's copied
    nodes come on top of it), the fixed count for `mtp-tree#nodes=N` alone; () when the
    drafter is swept otherwise (no dynamic tree, or a fixed count with a lookup arm)."""
    if heads is None or (not heads.tuned_nodes and has_arms(drafter)):
        return ()
    if not heads.tuned_nodes:
        assert heads.nodes is not None
        log(f"{config.draft} verifies {heads.nodes} nodes a round: measuring that count "
            f"(#nodes=auto sweeps --budgets)")  # fmt: skip
        return (heads.nodes,)
    assert heads.tree is not None
    most = 64 if isinstance(drafter, MergedDrafter) else heads.tree.num_nodes
    counts = tuple(sorted({b for b in config.budgets if b <= most})) or (most,)
    if dropped := sorted(b for b in config.budgets if b > most):
        log(f"node counts {dropped} dropped: the heads' tree has {most} nodes")
    return counts


def _verify_costs(
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
