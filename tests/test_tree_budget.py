"""A dynamic tree's node count chosen each round (`mtp-tree#nodes=conf`, tree_budget.py): the
choice against a brute-force reference, the calibration, the spec, and the decode loop
(greedy-exact; the count follows the cost model it is given)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import TINY_VOCAB, hf_greedy
from test_decode_tree import TREE
from test_mtp_drafter import PROMPT, TreeRecorder, target, trained_heads  # noqa: F401
from transformers import PreTrainedModel

from specmtp.config import GenerationConfig, SamplingConfig
from specmtp.costmodel import CostModel
from specmtp.decode import SpecDecoder
from specmtp.drafter_specs import build_drafter
from specmtp.drafters import LookupFirstDrafter
from specmtp.errors import SpecMTPError
from specmtp.models import LoadedModel
from specmtp.mtp_drafter import MTPDrafter, confident_tree_heads
from specmtp.specs import split_confident_nodes
from specmtp.tree_budget import NodeCalibration, paying_node_count


def reference_count(chances: list[float], round_s: list[float], rate: float) -> int:
    """The definition, evaluated for every n: the smallest n with the largest gain."""

    def gain(n: int) -> float:
        return 1 + sum(chances[:n]) - rate * round_s[n - 1]

    return max(range(1, len(chances) + 1), key=lambda n: (gain(n), -n))


def test_paying_node_count_matches_its_definition() -> None:
    rng = random.Random(0)
    for _ in range(300):
        size = rng.randint(1, 16)
        chances = sorted((rng.random() ** 2 for _ in range(size)), reverse=True)
        base, step = rng.uniform(0.02, 0.1), rng.uniform(0.0, 0.02)
        round_s = [base + step * n * rng.uniform(0.5, 1.5) for n in range(1, size + 1)]
        round_s = [max(round_s[: n + 1]) for n in range(size)]  # never cheaper for more
        rate = rng.uniform(5.0, 60.0)  # tokens per second
        got = paying_node_count(chances, lambda n, r=round_s: r[n - 1], rate)
        assert got == reference_count(chances, round_s, rate)


def test_free_nodes_are_all_verified_and_dear_ones_are_not() -> None:
    chances = [0.9, 0.5, 0.3, 0.1, 0.01]
    assert paying_node_count(chances, lambda n: 1.0, 2.0) == 5
    assert paying_node_count(chances, lambda n: 1.0 + n, 1.0) == 1
    # At 2 tokens a second a node adding 0.05 s must be right more than 10% of the time:
    # the 0.3 node pays, the 0.1 node only breaks even.
    assert paying_node_count(chances, lambda n: 1.0 + 0.05 * n, 2.0) == 3
    with pytest.raises(ValueError):
        paying_node_count([], lambda n: 1.0, 1.0)


def test_the_sequence_rate_starts_at_plain_decodings() -> None:
    calibration = NodeCalibration()
    assert calibration.rate(20.0) == 20.0
    for _ in range(100):
        calibration.record_round(3, 0.1)  # 30 tokens a second
    assert 29.0 < calibration.rate(20.0) < 30.0


def test_calibration_follows_what_was_accepted_at_each_depth() -> None:
    calibration = NodeCalibration()
    assert calibration.scale(1) == calibration.scale(3) == 1.0  # the heads at their word
    for _ in range(20):
        calibration.record([0.5, 0.5], 1)  # the first draft always right, the second never
    assert calibration.scale(1) > 1.5 and calibration.scale(2) < 0.2
    assert calibration.scale(3) == 1.0  # no evidence that deep
    for _ in range(60):  # older evidence fades (decay 0.95 a round)
        calibration.record([0.5, 0.5], 2)
    assert calibration.scale(2) > 1.5
    # Scaled chances stay at most 1 and at most the parent's.
    paths = [(0,), (0, 0), (1,), (0, 0, 0)]
    assert calibration.calibrated(paths, [0.9, 0.8, 0.1, 0.7]) == pytest.approx(
        [1.0, 1.0, min(1.0, 0.1 * calibration.scale(1)), 0.7]
    )


def test_the_spec() -> None:
    assert split_confident_nodes("mtp-tree#nodes=conf") == ("mtp-tree", True)
    assert split_confident_nodes("mtp-tree:DIR#nodes=conf") == ("mtp-tree:DIR", True)
    assert split_confident_nodes("mtp-tree#nodes=4") == ("mtp-tree#nodes=4", False)
    assert split_confident_nodes("#nodes=conf") == ("#nodes=conf", False)


def test_built_from_its_spec(default_model: LoadedModel) -> None:
    drafter, _ = build_drafter("ngram+mtp-tree#nodes=conf", default_model)
    heads = confident_tree_heads(drafter)
    assert heads is not None and heads.name == "mtp-tree#nodes=conf"
    assert heads.nodes is None and not heads.tuned_nodes
    for spec, message in (
        ("mtp#nodes=conf", "applies to mtp-tree"),
        ("ngram|mtp-tree#nodes=conf", "merged trees take"),
        ("mtp-tree#nodes=confx", "bad draft spec"),
    ):
        with pytest.raises(SpecMTPError, match=message):
            build_drafter(spec, default_model)


def test_one_source_of_the_count(target: PreTrainedModel) -> None:  # noqa: F811
    heads = trained_heads(target, "sequential", steps=0)
    with pytest.raises(SpecMTPError, match="dynamic tree"):
        MTPDrafter(heads, confident_nodes=True)  # no tree to choose from
    with pytest.raises(SpecMTPError, match="one place"):
        MTPDrafter(heads, tree=TREE, nodes=4, confident_nodes=True)


@pytest.mark.parametrize("kind", ["parallel", "sequential"])
@pytest.mark.parametrize("lookup_first", [False, True])
def test_greedy_output_is_plain_decoding(
    target: PreTrainedModel,  # noqa: F811
    kind: str,
    lookup_first: bool,
) -> None:
    heads = TreeRecorder(trained_heads(target, kind, steps=60), tree=TREE, confident_nodes=True)
    drafter = LookupFirstDrafter(heads) if lookup_first else heads
    decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
    for schedule in ("fixed", "adaptive"):
        heads.trees.clear()
        config = GenerationConfig(max_new_tokens=40, gamma=3, schedule=schedule)
        result = decoder.generate(PROMPT, config)
        assert result.tokens == hf_greedy(target, PROMPT, 40)
        assert heads.trees and all(set(t.paths) <= set(TREE.paths) for t in heads.trees)


def sampled_tree_sizes(target: PreTrainedModel, verify_s: tuple[float, ...]) -> set[int]:  # noqa: F811
    """The node counts verified under a given cost model (sampling: costs as given)."""
    heads = TreeRecorder(
        trained_heads(target, "sequential", steps=60), tree=TREE, confident_nodes=True
    )
    decoder = SpecDecoder(
        target, drafter=heads, vocab_size=TINY_VOCAB, context_length=256,
        cost_model=CostModel(verify_s),
    )  # fmt: skip
    sampling = SamplingConfig(temperature=1.0)
    config = GenerationConfig(max_new_tokens=30, gamma=3, sampling=sampling, seed=3)
    decoder.generate(PROMPT, config)
    return {t.num_nodes for t in heads.trees}


def test_the_count_follows_the_cost_model(target: PreTrainedModel) -> None:  # noqa: F811
    """Free verification: the whole drafted tree (as deep as the heads draft) in some round;
    verification a hundred plain steps dearer per extra token: one node a round."""
    pruned = TREE.pruned(3).num_nodes
    assert max(sampled_tree_sizes(target, tuple([0.05] * 12))) == pruned
    assert sampled_tree_sizes(target, (0.05, *(5.0 * n for n in range(2, 13)))) == {1}


def test_a_round_without_costs_is_an_error(target: PreTrainedModel) -> None:  # noqa: F811
    heads = MTPDrafter(trained_heads(target, "parallel", steps=0), tree=TREE, confident_nodes=True)
    heads.hidden = torch.zeros(1, 1, target.config.hidden_size)
    with pytest.raises(SpecMTPError, match="cost model"):
        heads.propose(torch.tensor([PROMPT]), 3, SamplingConfig(), None)
