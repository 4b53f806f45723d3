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

from collections.abc import Sequence
from dataclasses import replace

from specmtp.api import SpecGenerator, weights_fingerprints
from specmtp.costmodel import CostModel, expected_tokens, fit_draft_cost
from specmtp.drafter_specs import build_drafter
from specmtp.drafters import has_arms
from specmtp.errors import SpecMTPError
from specmtp.kernels import MAX_ROWS, measure_kernel_plan
from specmtp.models import DTYPES, load_model
from specmtp.mtp_drafter import drafter_tree, dynamic_tree_drafter
from specmtp.profile import Profile
from specmtp.stats import GenerationStats
from specmtp.train_prompts import load_train_prompts
from specmtp.tree import TokenTree
from specmtp.tune_nodes import node_counts, tune_node_counts
from specmtp.tune_pairs import build_pair_profile, sweep_pair_runs
from specmtp.tune_runs import (
    Log,
    TuneConfig,
    generation,
    pooled_alphas,
    predicted_speedup,
    run_once,
    sweep_row,
    tokens_per_s,
    tune_meta,
    verify_costs,
)
from specmtp.tune_tree import budget_trees, expected_tree_tokens, rank_probabilities, sweep_budgets

__all__ = ["TuneConfig", "run_tune"]


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
            runs[gamma].append(run_once(gen, ids, generation(config, max(gamma, 1))))
        line = " ".join(f"{g}:{r[-1].tokens_per_s:.1f}" for g, r in runs.items())
        log(f"[{i}/{len(prompt_ids)}] tokens/s by γ {line}")
    return runs


def build_profile(
    config: TuneConfig, runs: dict[int, list[GenerationStats]], verify_s: tuple[float, ...]
) -> Profile:
    """The cost model, α and the per-γ table from the sweep and the measured T(n)."""
    samples = [(g, s.draft_s / s.rounds) for g, rs in runs.items() if g > 0 for s in rs if s.rounds]
    fixed, per_token = fit_draft_cost(samples)
    cost = CostModel(verify_s, fixed, per_token)
    alphas = pooled_alphas([s for g, rs in runs.items() if g > 0 for s in rs], config.max_gamma)
    plain = tokens_per_s(runs[0])
    sweep = [sweep_row(runs[0], plain, 1.0, gamma=0)]
    for gamma in range(1, config.max_gamma + 1):
        rs = runs[gamma]
        predicted = predicted_speedup(cost, expected_tokens(alphas, gamma), rs)
        sweep.append(sweep_row(rs, plain, predicted, gamma=gamma))
    best = max(sweep[1:], key=lambda row: row["measured_speedup"])["gamma"]
    meta = tune_meta(config, len(runs[0]))
    return Profile(config.target, config.draft, cost, alphas, best, tuple(sweep), meta)


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
    plain = tokens_per_s(runs[0])
    sweep = [sweep_row(runs[0], plain, 1.0, gamma=0, budget=0)]
    for budget, tree in trees.items():
        rs, expected = runs[budget], expected_tree_tokens(tree, rank_probs)
        row = sweep_row(rs, plain, predicted_speedup(cost, expected, rs),
                         gamma=tree.max_depth, budget=budget)  # fmt: skip
        row["expected_tokens"] = round(expected, 4)
        row["tree"] = [list(p) for p in tree.paths]
        sweep.append(row)
    best = max(sweep[1:], key=lambda row: row["measured_speedup"])
    alphas = tuple(row[0] if row else 0.0 for row in rank_probs)
    meta = tune_meta(config, len(runs[0]))
    meta["rank_probabilities"] = [[round(p, 4) for p in row] for row in rank_probs]
    return Profile(
        config.target, config.draft, cost, alphas, int(best["gamma"]), tuple(sweep), meta,
        tree=trees[int(best["budget"])].paths,
    )  # fmt: skip


def run_tune(config: TuneConfig, *, log: Log) -> Profile:
    texts = load_train_prompts(config.prompts, seed=config.seed)[: config.limit]
    log(f"loading target {config.target} and draft {config.draft}")
    target = load_model(config.target, dtype=DTYPES[config.dtype])
    drafter, _ = build_drafter(config.draft, target, dtype=target.model.dtype)
    heads = dynamic_tree_drafter(drafter)
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
    warmup = replace(generation(config, config.max_gamma), max_new_tokens=8)
    for gen in (plain, spec):
        gen.decoder.generate(prompt_ids[0], warmup)
    if heads is not None and counts:
        profile = tune_node_counts(config, plain, spec, prompt_ids, heads, counts, log)
    elif has_arms(spec.decoder.drafter):
        pairs = sweep_pair_runs(plain, spec, prompt_ids, config, log)
        verify_s = verify_costs(spec, prompt_ids, pairs, config, log)
        profile = build_pair_profile(config, pairs, verify_s)
    elif tree is None:
        runs = sweep_runs(plain, spec, prompt_ids, config, log)
        profile = build_profile(config, runs, verify_costs(spec, prompt_ids, runs, config, log))
    else:
        profile = _tune_tree_budgets(config, plain, spec, prompt_ids, tree, log)
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


def _tune_tree_budgets(
    config: TuneConfig,
    plain: SpecGenerator,
    spec: SpecGenerator,
    prompt_ids: Sequence[list[int]],
    tree: TokenTree,
    log: Log,
) -> Profile:
    """A static tree's budgets: rank probabilities from the drafter's own tree, the best
    tree per budget, each measured against plain decoding (tune_tree.py)."""
    log(f"measuring rank probabilities with the drafter's {tree.num_nodes}-node tree")
    first = [run_once(spec, ids, generation(config, tree.max_depth)) for ids in prompt_ids]
    rank_probs = rank_probabilities(first)
    if not rank_probs:
        raise SpecMTPError(
            "no tree round ran: every answer ended at once; give more or longer prompts"
        )
    trees = budget_trees(rank_probs, config.budgets)

    def run(gen: SpecGenerator, ids: list[int], gamma: int) -> GenerationStats:
        return run_once(gen, ids, generation(config, gamma))

    runs = sweep_budgets(plain, spec, prompt_ids, trees, run, log)
    verify_s = verify_costs(spec, prompt_ids, runs, config, log)
    return build_tree_profile(config, runs, trees, rank_probs, verify_s)
