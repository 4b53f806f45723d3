"""Tree budgets for `specmtp tune --draft mtp-tree`: how many nodes a token tree should have.

A wider tree accepts more per round, but every node is one more token in the verify forward,
and on a CPU T(n) grows with n. So, for a tree drafter, tune:

1. drafts with the drafter's own tree on every prompt and counts, per (depth, child rank),
   the rounds that reached a node (its parent was accepted) and that accepted it: the rank
   probabilities p[d][r];
2. builds, for each budget B, the B-node tree with the largest expected accepted length
   under p (`tree.best_tree`), E = 1 + Σ_nodes Π_{nodes on its path} p;
3. sweeps the budgets with plain decoding interleaved per prompt; `tune.build_tree_profile`
   predicts each budget's speedup from E, its measured draft time and T(n), and keeps the
   fastest measured tree in the profile, which `mtp-tree@best` and `mtp-tree@auto` then
   draft with.

Rank probabilities are measured in step 1 on the same prompts as the sweep (training
prompts): the prediction is checked against measurement, not against the evaluation sets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specmtp.api import SpecGenerator
from specmtp.stats import GenerationStats
from specmtp.tree import TokenTree, best_tree

Log = Callable[[str], None]
Run = Callable[[SpecGenerator, list[int], int], GenerationStats]  # generator, prompt, γ


def rank_probabilities(runs: Sequence[GenerationStats]) -> list[list[float]]:
    """p[d-1][r]: P(the rank-r child at depth d is accepted | its parent was), pooled over
    runs; ranks never reached at a depth get 0."""
    reached: dict[tuple[int, int], int] = {}
    accepted: dict[tuple[int, int], int] = {}
    for stats in runs:
        for key, count in stats.tree_reached.items():
            reached[key] = reached.get(key, 0) + count
            accepted[key] = accepted.get(key, 0) + stats.tree_accepted.get(key, 0)
    if not reached:
        return []
    depth = max(d for d, _ in reached)
    width = max(r for _, r in reached) + 1
    return [
        [_ratio(accepted.get((d, r), 0), reached.get((d, r), 0)) for r in range(width)]
        for d in range(1, depth + 1)
    ]


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def expected_tree_tokens(tree: TokenTree, rank_probs: Sequence[Sequence[float]]) -> float:
    """Tokens a round commits: 1 (the recovered or bonus token) plus, for every node, the
    chance that its whole path is accepted."""
    return 1.0 + sum(_chance(path, rank_probs) for path in tree.paths)


def budget_trees(
    rank_probs: Sequence[Sequence[float]], budgets: Sequence[int]
) -> dict[int, TokenTree]:
    """The best tree for each budget, keyed by its node count. Nodes that were never accepted
    are left out (they only cost verify time), so a budget beyond the nodes with a chance
    gets the largest tree that has one, once."""
    trees: dict[int, TokenTree] = {}
    for budget in sorted(set(budgets)):
        full = best_tree(rank_probs, budget)
        paths = tuple(p for p in full.paths if _chance(p, rank_probs) > 0) or full.paths[:1]
        trees.setdefault(len(paths), TokenTree(paths))
    return trees


def _chance(path: Sequence[int], rank_probs: Sequence[Sequence[float]]) -> float:
    """P(every node on the path accepted), depths taken as independent."""
    chance = 1.0
    for depth, rank in enumerate(path):
        row = rank_probs[depth] if depth < len(rank_probs) else ()
        chance *= row[rank] if rank < len(row) else 0.0
    return chance


def sweep_budgets(
    plain: SpecGenerator,
    spec: SpecGenerator,
    prompt_ids: Sequence[list[int]],
    trees: dict[int, TokenTree],
    run: Run,
    log: Log,
) -> dict[int, list[GenerationStats]]:
    """Plain decoding (budget 0) and every budget's tree on every prompt, interleaved."""
    drafter = spec.decoder.drafter
    runs: dict[int, list[GenerationStats]] = {0: [], **{b: [] for b in trees}}
    for i, ids in enumerate(prompt_ids, 1):
        runs[0].append(run(plain, ids, 1))
        for budget, tree in trees.items():
            drafter.tree = tree
            runs[budget].append(run(spec, ids, tree.max_depth))
        line = " ".join(f"{b}:{r[-1].tokens_per_s:.1f}" for b, r in runs.items())
        log(f"[{i}/{len(prompt_ids)}] tokens/s by tree nodes {line}")
    return runs
