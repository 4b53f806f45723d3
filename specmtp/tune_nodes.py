"""Node counts for a dynamic tree (`specmtp tune --draft '...mtp-tree#nodes=auto'`, or a
draft model's tree `MODEL#nodes=auto`).

A dynamic tree (`mtp-tree#nodes=auto`, alone, after `ngram+` or merged after `ngram|`; a
draft model's tree, alone or after `ngram+`) has no fixed shape to choose: each round
verifies the N likeliest of the nodes drafted. Its budget is N itself, and
`sweep_node_counts` runs the drafter at each N, with plain decoding interleaved per
prompt; the profile keeps the fastest measured N (`Profile.nodes`).
Since the tree changes every round there is no E(tree) to predict from: the prediction for
an N takes that N's measured tokens per round and checks the cost side (T(n) at the verify
sizes the rounds used, and the draft time), as the bench's efficiency does. A draft
model's tree is as deep as γ, so each N runs with the adaptive schedule, as `@auto` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from specmtp.api import SpecGenerator
from specmtp.config import GenerationConfig
from specmtp.costmodel import CostModel, fit_draft_cost
from specmtp.draft_tree_drafter import DraftTreeDrafter
from specmtp.drafters import Drafter, has_arms
from specmtp.merged_drafter import MergedDrafter
from specmtp.mtp_drafter import MTPDrafter
from specmtp.profile import Profile
from specmtp.stats import GenerationStats
from specmtp.tune_pairs import arm_alphas
from specmtp.tune_runs import (
    Log,
    TuneConfig,
    generation,
    model_round_draft_s,
    pair_generation,
    pooled_alphas,
    predicted_speedup,
    run_once,
    sweep_row,
    tokens_per_s,
    tune_meta,
    verify_costs,
)
from specmtp.tune_tree import rank_probabilities


def node_counts(
    heads: MTPDrafter | DraftTreeDrafter | None,
    drafter: Drafter | None,
    config: TuneConfig,
    log: Log,
) -> tuple[int, ...]:
    """The node counts a dynamic tree's sweep runs: `--budgets` for `#nodes=auto` (for MTP
    heads none beyond the heads' tree alone, which could verify no more; a merged drafter's
    copied nodes come on top of it), the fixed count for `mtp-tree#nodes=N` alone; () when
    the drafter is swept otherwise (no dynamic tree, a fixed count with a lookup arm, or a
    draft model's tree of a fixed count, whose γ is swept)."""
    if heads is None or (not heads.tuned_nodes and has_arms(drafter)):
        return ()
    if isinstance(heads, DraftTreeDrafter):  # no tree bounds its count; a fixed one sweeps γ
        return tuple(sorted(set(config.budgets))) if heads.tuned_nodes else ()
    if not heads.tuned_nodes:
        assert heads.nodes is not None
        log(f"{config.draft} verifies {heads.nodes} nodes a round: measuring that count "
            f"(#nodes=auto sweeps --budgets)")  # fmt: skip
        return (heads.nodes,)
    assert heads.tree is not None
    most = Profile.MAX_NODES if isinstance(drafter, MergedDrafter) else heads.tree.num_nodes
    counts = tuple(sorted({b for b in config.budgets if b <= most})) or (most,)
    if dropped := sorted(b for b in config.budgets if b > most):
        log(f"node counts {dropped} dropped: the heads' tree has {most} nodes")
    return counts


def tune_node_counts(
    config: TuneConfig,
    plain: SpecGenerator,
    spec: SpecGenerator,
    prompt_ids: Sequence[list[int]],
    heads: MTPDrafter | DraftTreeDrafter,
    counts: Sequence[int],
    log: Log,
) -> Profile:
    """A dynamic tree's node counts, each at the tree's full depth (and, with a lookup
    arm, the default lookup γ), against plain decoding; the drafter keeps the fastest. A
    draft model's tree has no depth of its own: each count runs as it is meant to, with
    the adaptive schedule, up to --max-gamma deep."""
    adaptive = isinstance(heads, DraftTreeDrafter)
    if adaptive:
        depth = config.max_gamma
    else:
        assert heads.tree is not None  # a dynamic tree of heads drafts from one
        depth = heads.tree.max_depth
    arms = has_arms(spec.decoder.drafter)
    lookup = min(GenerationConfig().gamma, config.max_gamma) if arms else None
    drafting = (
        generation(config, depth) if lookup is None else pair_generation(config, (lookup, depth))
    )
    if adaptive:
        drafting = replace(drafting, schedule="adaptive")

    def run(gen: SpecGenerator, ids: list[int]) -> GenerationStats:
        return run_once(gen, ids, generation(config, 1) if gen is plain else drafting)

    runs = sweep_node_counts(plain, spec, prompt_ids, heads, counts, run, log)
    verify_s = verify_costs(spec, prompt_ids, runs, config, log)
    profile = build_nodes_profile(
        config, runs, verify_s, depth=depth, lookup_gamma=lookup, schedule=drafting.schedule
    )
    heads.nodes = profile.nodes
    return profile


def sweep_node_counts(
    plain: SpecGenerator,
    spec: SpecGenerator,
    prompt_ids: Sequence[list[int]],
    heads: MTPDrafter | DraftTreeDrafter,
    counts: Sequence[int],
    run: Callable[[SpecGenerator, list[int]], GenerationStats],
    log: Log,
) -> dict[int, list[GenerationStats]]:
    """Plain decoding (0 nodes) and the dynamic tree at every node count on every prompt,
    interleaved; `heads` is the MTP drafter inside `spec`'s drafter whose count is set."""
    runs: dict[int, list[GenerationStats]] = {0: [], **{n: [] for n in counts}}
    for i, ids in enumerate(prompt_ids, 1):
        runs[0].append(run(plain, ids))
        for count in counts:
            heads.nodes = count
            runs[count].append(run(spec, ids))
        line = " ".join(f"{n}:{r[-1].tokens_per_s:.1f}" for n, r in runs.items())
        log(f"[{i}/{len(prompt_ids)}] tokens/s by nodes verified a round {line}")
    return runs


def build_nodes_profile(
    config: TuneConfig,
    runs: dict[int, list[GenerationStats]],
    verify_s: tuple[float, ...],
    *,
    depth: int,
    lookup_gamma: int | None,
    schedule: str = "fixed",
) -> Profile:
    """The profile of a dynamic tree's node sweep: per node count, predicted and measured
    speedup and τ; the fastest measured count becomes the profile's `nodes`. The prediction
    takes each count's measured τ (a dynamic tree has no fixed shape to expect from) over
    the round time the cost model gives. With a lookup arm (`lookup_gamma`), the draft cost
    model is the model arm's, as in a γ pair profile, and α per arm is pooled over every
    count; α per depth is the top-ranked child's acceptance at the fastest count (alone) or
    pooled over its rounds. `schedule`: how each count chose γ (fixed at `depth`, or
    adaptive up to it: a draft model's tree)."""
    drafting = {n: rs for n, rs in runs.items() if n > 0}
    if lookup_gamma is None and schedule == "adaptive":  # rounds of many depths, some none
        samples = [sample for rs in drafting.values() for s in rs
                   if (sample := _mean_round(s)) is not None]  # fmt: skip
    elif lookup_gamma is None:
        samples = [(depth, s.draft_s / s.rounds) for rs in drafting.values() for s in rs
                   if s.rounds]  # fmt: skip
    else:
        samples = [(depth, d) for rs in drafting.values() for s in rs
                   if (d := model_round_draft_s(s)) is not None]  # fmt: skip
    cost = CostModel(verify_s, *fit_draft_cost(samples))
    plain = tokens_per_s(runs[0])
    sweep = [sweep_row(runs[0], plain, 1.0, gamma=0, budget=0)]
    for count, rs in drafting.items():
        rounds = sum(s.rounds for s in rs)
        tau = sum(s.accepted_tokens + s.rounds for s in rs) / rounds if rounds else 1.0
        row = sweep_row(rs, plain, predicted_speedup(cost, tau, rs) if rounds else 0.0,
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
    meta = tune_meta(config, len(runs[0]))
    meta["node_sweep"] = {"depth": depth, "lookup_gamma": lookup_gamma, "schedule": schedule}
    return Profile(
        config.target, config.draft, cost, alphas, lookup_gamma or depth, tuple(sweep), meta,
        model_gamma=None if lookup_gamma is None else depth,
        arm_alphas={} if lookup_gamma is None else arm_alphas(every, width),
        nodes=int(best["budget"]),
    )  # fmt: skip


def _mean_round(stats: GenerationStats) -> tuple[int, float] | None:
    """An adaptive run's drafting rounds as one cost sample: (their mean γ, rounded, and
    the drafting seconds per such round); None when no round drafted."""
    drafting = {g: n for g, n in stats.requested_gammas.items() if g > 0}
    rounds = sum(drafting.values())
    if not rounds:
        return None
    mean_gamma = sum(g * n for g, n in drafting.items()) / rounds
    return max(1, round(mean_gamma)), stats.draft_s / rounds
