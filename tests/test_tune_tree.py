"""Tree budgets in `specmtp tune`: rank counts, the expected tree length, the budget trees,
and a tuned tree reaching `--gamma best` (tune_tree.py, tune.build_tree_profile).

One tune run on the default model with the shipped MTP tree (budgets 1 and 3, 2 short
prompts) is shared by the end-to-end tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import run_captured, run_cli
from test_tune import GENERATE, assert_one_line_error, last_json, write_train_prompts

from specmtp.api import SpecGenerator
from specmtp.cli import main
from specmtp.costmodel import expected_tokens
from specmtp.errors import SpecMTPError
from specmtp.profile import Profile
from specmtp.stats import GenerationStats
from specmtp.tree import TokenTree, best_tree
from specmtp.tune_tree import budget_trees, expected_tree_tokens, rank_probabilities

TREE = TokenTree(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
NEW_TOKENS = 12


def tree_stats(rounds: list[list[int]]) -> GenerationStats:
    stats = GenerationStats(gamma=3)
    for path in rounds:
        stats.record_tree(TREE.paths, path)
    return stats


def test_record_tree_counts_reached_and_accepted_nodes() -> None:
    # Node indices: 0 (0,), 1 (1,), 2 (0,0), 3 (0,1), 4 (1,0), 5 (0,0,0).
    stats = tree_stats([[0, 2], [1], []])
    # Depth 1 is reached every round; (0,) accepted once, (1,) once.
    assert stats.tree_reached[(1, 0)] == 3 and stats.tree_accepted[(1, 0)] == 1
    assert stats.tree_reached[(1, 1)] == 3 and stats.tree_accepted[(1, 1)] == 1
    # Depth 2 rank 0: under (0,) in round 1, under (1,) in round 2.
    assert stats.tree_reached[(2, 0)] == 2 and stats.tree_accepted[(2, 0)] == 1
    # Depth 2 rank 1 exists only under (0,): reached in round 1 only, not accepted.
    assert stats.tree_reached[(2, 1)] == 1 and stats.tree_accepted[(2, 1)] == 0
    # Depth 3 under (0, 0): reached in round 1.
    assert stats.tree_reached[(3, 0)] == 1 and stats.tree_accepted[(3, 0)] == 0


def test_rank_probabilities_pool_runs() -> None:
    probs = rank_probabilities([tree_stats([[0, 2], [1]]), tree_stats([[], [0, 2, 5]])])
    assert probs == [
        [2 / 4, 1 / 4],  # (1, 0): accepted in 2 of 4 rounds; (1, 1) in 1 of 4
        # (2, 0): reached under (0,) twice and accepted both times, and under (1,) once
        # (rejected); (2, 1) reached in the two rounds that accepted (0,)
        [2 / 3, 0 / 2],
        [1 / 2, 0.0],  # (3, 0) reached in the two rounds that accepted (0, 0)
    ]
    assert rank_probabilities([GenerationStats(gamma=2)]) == []


def test_expected_tree_tokens_of_a_chain_is_leviathans_expectation() -> None:
    alphas = [0.7, 0.5, 0.4]
    chain = TokenTree(((0,), (0, 0), (0, 0, 0)))
    probs = [[a, 0.2] for a in alphas]
    assert expected_tree_tokens(chain, probs) == pytest.approx(expected_tokens(alphas, 3))
    # A second candidate at depth 1 adds its own chance; deeper ranks not measured add 0.
    wider = TokenTree(((0,), (1,), (0, 0), (0, 0, 0), (0, 0, 0, 0)))
    assert expected_tree_tokens(wider, probs) == pytest.approx(expected_tokens(alphas, 3) + 0.2)


def test_budget_trees_are_best_trees_without_hopeless_nodes() -> None:
    probs = [[0.6, 0.2, 0.0], [0.5, 0.1], [0.4]]
    trees = budget_trees(probs, [1, 2, 3, 5, 40, 60])
    # Nodes with a chance: depth 1 ranks 0-1 (2), depth 2: 2 parents x 2 ranks (4),
    # depth 3: 4 parents (4): 10 in all; 40 and 60 both give that tree, once.
    assert list(trees) == [1, 2, 3, 5, 10]
    for budget, tree in trees.items():
        assert tree.num_nodes == budget
        if budget <= 5:
            assert tree == best_tree(probs, budget)
        assert all(expected_tree_tokens(TokenTree((p,)), probs) > 1 for p in tree.paths[:1])
    assert (2,) not in trees[10].paths  # rank 2 at depth 1 was never accepted
    # Each tree is the best one of its size: larger budgets expect more tokens.
    expected = [expected_tree_tokens(t, probs) for t in trees.values()]
    assert expected == sorted(expected) and len(set(expected)) == len(expected)


# --- end to end: tune --draft mtp-tree -------------------------------------------------


@pytest.fixture(scope="module")
def tuned_tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, Path]:
    root = tmp_path_factory.mktemp("tune-tree")
    train = write_train_prompts(root / "train")
    profile = root / "out" / "tree.json"
    code, out, err = run_captured(
        "tune", "--prompts", str(train), "--draft", "mtp-tree", "--budgets", "1,3",
        "--limit", "2", "--max-new-tokens", str(NEW_TOKENS), "--out", str(profile),
        "--threads", "1",
    )  # fmt: skip
    assert code == 0, err
    return out, err, profile


@pytest.fixture
def tree_profile(tuned_tree: tuple[str, str, Path]) -> Profile:
    return Profile.load(tuned_tree[2])


def test_tune_sweeps_tree_budgets(tuned_tree: tuple[str, str, Path], tree_profile: Profile) -> None:
    out, err, path = tuned_tree
    lines = out.strip().splitlines()
    assert lines[0].split() == ["nodes", "depth", "predicted", "measured", "tokens/s", "τ"]
    assert "measuring rank probabilities with the drafter's 16-node tree" in err
    sweep = tree_profile.sweep
    assert [row["budget"] for row in sweep] == [0, 1, 3]
    probs = tree_profile.meta["rank_probabilities"]
    assert len(probs) == 3 and all(0 <= p <= 1 for row in probs for p in row)
    for row in sweep[1:]:
        tree = TokenTree(tuple(tuple(p) for p in row["tree"]))
        assert tree.num_nodes == row["budget"] and tree.max_depth == row["gamma"]
        assert tree == budget_trees(probs, [row["budget"]])[row["budget"]]
        assert row["expected_tokens"] == pytest.approx(expected_tree_tokens(tree, probs), abs=1e-3)
        assert row["predicted_speedup"] > 0 and row["mean_accepted_tokens"] >= 1.0
    fastest = max(sweep[1:], key=lambda row: row["measured_speedup"])
    assert [list(p) for p in tree_profile.tree] == fastest["tree"]
    assert tree_profile.best_gamma == fastest["gamma"]
    assert tree_profile.alphas == tuple(row[0] for row in probs)
    assert last_json(out) == json.loads(path.read_text())


def test_best_drafts_with_the_tuned_tree(
    capfd: pytest.CaptureFixture[str], tuned_tree: tuple[str, str, Path], tree_profile: Profile
) -> None:
    argv = [*GENERATE, "--draft", "mtp-tree", "--gamma", "best", "--profile", str(tuned_tree[2])]
    code, out, err = run_cli(capfd, *argv, "--max-new-tokens", str(NEW_TOKENS))
    assert code == 0, err
    stats = last_json(out)
    tree = tree_profile.token_tree()
    assert tree is not None
    # every verify pass holds the tuned tree (+ the root), pruned in depth near the token limit
    sizes = {tree.pruned(d).num_nodes + 1 for d in range(1, tree.max_depth + 1)}
    assert set(map(int, stats["verify_sizes"])) <= sizes
    assert int(max(stats["verify_sizes"], key=int)) == tree.num_nodes + 1
    code, plain_out, err = run_cli(capfd, *GENERATE, "--max-new-tokens", str(NEW_TOKENS))
    assert code == 0, err
    assert out.splitlines()[0] == plain_out.splitlines()[0]  # greedy text unchanged


def test_a_tree_profile_for_a_chain_drafter_is_refused(tree_profile: Profile) -> None:
    chain = Profile(
        "default", "mtp", tree_profile.cost_model, tree_profile.alphas,
        tree_profile.best_gamma, tree_profile.sweep, {}, tree=tree_profile.tree,
    )  # fmt: skip
    with pytest.raises(SpecMTPError, match="holds a token tree, but this draft drafts chains"):
        SpecGenerator("default", draft="mtp", profile=chain)


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ([[0, 0]], "has no parent"),
        ([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], "deeper than its acceptance rates"),
    ],
)
def test_bad_profile_trees_are_refused(tree_profile: Profile, tree: Any, message: str) -> None:
    data = tree_profile.to_dict()
    data["tree"] = tree
    with pytest.raises(SpecMTPError, match=message):
        Profile.from_dict(data)


def test_bad_budgets(capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    train = write_train_prompts(tmp_path / "train")
    tune = ["tune", "--prompts", str(train), "--draft", "mtp-tree", "--budgets"]
    code, out, err = run_cli(capfd, *tune, "0,4")
    assert_one_line_error(code, out, err, "tree budgets must be in 1..64")
    with pytest.raises(SystemExit) as exit_info:  # argparse: a usage line and the error
        main([*tune, "a,b"])
    assert exit_info.value.code == 2
    assert "expected numbers like 2,4,8; got 'a,b'" in capfd.readouterr().err
