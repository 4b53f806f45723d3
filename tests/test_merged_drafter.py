"""A lookup's copy and MTP heads' drafts verified as one tree (`ngram|SPEC`, `store|SPEC`):
what the tree holds, that output stays the target's own, and the specs."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, tiny_model
from test_decode_tree import TREE
from test_mtp_drafter import PROMPT, trained_heads

from specmtp.api import build_drafter
from specmtp.config import GenerationConfig, SamplingConfig
from specmtp.decode import SpecDecoder
from specmtp.drafters import LOOKUP_ARM, MODEL_ARM, NgramDrafter, NoMemory, Outcome, Proposal
from specmtp.errors import SpecMTPError
from specmtp.merged_drafter import MergedDrafter
from specmtp.models import LoadedModel
from specmtp.mtp_drafter import MTPDrafter, drafter_tree, single_path

GREEDY = SamplingConfig()


class FixedHeads(NoMemory):
    """Stands in for MTP heads: drafts fixed token paths with fixed log-probabilities."""

    name = "fixed"
    needs_target_hidden = False
    max_depth = 3
    tree = None

    def __init__(self, paths: dict[tuple[int, ...], float], nodes: int | None = None) -> None:
        self.paths = paths
        self.nodes = nodes
        self.asked: list[int] = []  # the depth each drafted_paths call asked for

    def reset(self) -> None:
        pass

    def observe(self, outcome: Outcome) -> None:
        pass

    def drafted_paths(self, context: torch.Tensor, k: int) -> dict[tuple[int, ...], float]:
        self.asked.append(k)  # MTPDrafter.drafted_paths: paths no deeper than k or the heads
        return {p: lp for p, lp in self.paths.items() if len(p) <= min(k, self.max_depth)}

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        chain = max((p for p in self.paths if len(p) <= k), key=len, default=())
        return Proposal(torch.tensor([chain], dtype=torch.long).reshape(1, -1), None)


def merged(paths: dict[tuple[int, ...], float], nodes: int | None = None) -> MergedDrafter:
    return MergedDrafter(FixedHeads(paths, nodes), lookup=NgramDrafter(max_ngram=3, min_ngram=2))  # type: ignore[arg-type]


def node_paths(proposal: Proposal) -> set[tuple[int, ...]]:
    """The proposal's nodes as token paths from the root."""
    assert proposal.tree is not None
    tokens = proposal.tokens[0].tolist()
    by_rank: dict[tuple[int, ...], tuple[int, ...]] = {(): ()}
    for path, token in zip(proposal.tree.paths, tokens, strict=True):
        by_rank[path] = (*by_rank[path[:-1]], token)
    return {by_rank[p] for p in proposal.tree.paths}


# "2 3" occurred before, followed by 7 8 9: the copy; the heads draft 7 5 / 7 6 and 4.
COPYING = torch.tensor([[1, 2, 3, 7, 8, 9, 2, 3]])
HEADS = {(7,): -0.1, (7, 5): -0.5, (7, 6): -2.0, (4,): -1.0, (4, 1): -3.0}


def test_the_tree_holds_the_copy_then_the_heads_likeliest_nodes() -> None:
    drafter = merged(HEADS)
    assert drafter.name == "ngram|fixed"
    proposal = drafter.propose(COPYING, 3, GREEDY, None)
    assert node_paths(proposal) == {(7,), (7, 8), (7, 8, 9), *HEADS}  # (7,) once: shared
    assert proposal.tree is not None
    assert proposal.tree.num_nodes == 7 and proposal.depth == 3
    # Siblings by priority: the copy's 7 before 4, under 7 the copy's 8 before 5 before 6.
    first = {
        path: token
        for path, token in zip(proposal.tree.paths, proposal.tokens[0].tolist(), strict=True)
    }
    assert [first[(0,)], first[(1,)]] == [7, 4]
    assert [first[(0, 0)], first[(0, 1)], first[(0, 2)]] == [8, 5, 6]
    assert drafter.heads.asked == [3]  # the heads draft their whole depth beside any copy
    assert (drafter.lookup_rounds, drafter.fallback_rounds) == (1, 0)
    # γ bounds the tree's depth: one copied token, the heads' first tokens beside it.
    assert node_paths(drafter.propose(COPYING, 1, GREEDY, None)) == {(7,), (4,)}
    assert drafter.heads.asked == [3, 1]


def test_a_check_proposes_the_copy_alone() -> None:
    """Under `single_path` (a round that only checks whether drafting pays) a merged
    drafter proposes what its lookup-first parent would: the copy, a chain; after it, the
    tree again."""
    drafter = merged(HEADS)
    with single_path(drafter):
        proposal = drafter.propose(COPYING, 3, GREEDY, None)
    assert proposal.tree is None and proposal.tokens.tolist() == [[7, 8, 9]]
    assert drafter.heads.asked == [] and not drafter.single_path
    assert drafter.propose(COPYING, 3, GREEDY, None).tree is not None


def test_a_node_budget_keeps_the_copy_and_drops_the_least_likely_drafts() -> None:
    proposal = merged(HEADS, nodes=5).propose(COPYING, 3, GREEDY, None)
    assert node_paths(proposal) == {(7,), (7, 8), (7, 8, 9), (7, 5), (4,)}
    # A budget below the copy's length: the copy's first tokens, a chain.
    chain = merged(HEADS, nodes=2).propose(COPYING, 3, GREEDY, None)
    assert chain.tree is None and chain.tokens.tolist() == [[7, 8]]


def test_heads_that_agree_with_the_copy_give_a_chain_and_no_copy_gives_theirs() -> None:
    agreeing = merged({(7,): -0.1, (7, 8): -0.2})
    proposal = agreeing.propose(COPYING, 3, GREEDY, None)
    assert proposal.tree is None and proposal.tokens.tolist() == [[7, 8, 9]]
    # Nothing to copy ("3" alone occurred before): the heads' own proposal, the model arm.
    alone = merged(HEADS)
    context = torch.tensor([[1, 3, 5, 9, 3]])
    assert alone.next_arm(context) == MODEL_ARM and alone.next_arm(COPYING) == LOOKUP_ARM
    assert alone.propose(context, 2, GREEDY, None).tokens.tolist() == [[7, 5]]
    assert alone.heads.asked == [] and alone.fallback_rounds == 1


class RoundSpy(MergedDrafter):
    """Counts merged rounds that were trees."""

    trees = 0

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        proposal = super().propose(context, k, sampling, generator)
        self.trees += proposal.tree is not None and self.next_arm(context) == LOOKUP_ARM
        return proposal


@pytest.mark.parametrize("shape", ["tree", "dynamic-tree", "chain"])
def test_greedy_output_is_the_targets_own(shape: str) -> None:
    target = tiny_model("llama", seed=0)
    heads = trained_heads(target, "sequential", steps=30)
    tree, nodes = {"tree": (TREE, None), "dynamic-tree": (TREE, 5), "chain": (None, None)}[shape]
    drafter = RoundSpy(
        MTPDrafter(heads, tree=tree, nodes=nodes), lookup=NgramDrafter(max_ngram=3, min_ngram=2)
    )
    decoder = SpecDecoder(target, drafter=drafter, vocab_size=heads.config.vocab_size,
                          context_length=256)  # fmt: skip
    prompt = PROMPT * 3  # repeats itself: lookup finds matches in some rounds
    result = decoder.generate(prompt, GenerationConfig(max_new_tokens=48, gamma=4))
    assert result.tokens == hf_greedy(target, prompt, 48)
    assert drafter.trees > 0 and drafter.fallback_rounds > 0, vars(drafter)
    assert result.stats.accepted_tokens > 0


def test_specs(default_model: LoadedModel) -> None:
    drafter, vocab = build_drafter("ngram|mtp-tree#nodes=15", default_model)
    assert isinstance(drafter, MergedDrafter) and isinstance(drafter.heads, MTPDrafter)
    assert drafter.name == "ngram|mtp-tree#nodes=15" and drafter.nodes == 15
    assert drafter.needs_target_hidden and vocab == build_drafter("mtp", default_model)[1]
    assert drafter_tree(drafter) is drafter.heads.tree  # T(n) is timed with the heads' tree
    chain, _ = build_drafter("ngram:4|mtp", default_model)
    assert isinstance(chain, MergedDrafter) and chain.lookup.max_ngram == 4  # type: ignore[attr-defined]
    assert chain.nodes is None and chain.timing_tree.num_nodes > chain.heads.max_depth
    store, _ = build_drafter("store#min-p=0.5|mtp-tree", default_model)
    assert isinstance(store, MergedDrafter) and store.name == "store#min-p=0.5|mtp-tree"
    assert store.lookup.min_probability == 0.5  # type: ignore[attr-defined]
    for bad in ("ngram|", "ngram|distilled", "ngram|ngram", "ngram:1|mtp", "ngrams|mtp",
                "store:|mtp", "mtp|mtp-tree"):  # fmt: skip
        with pytest.raises(SpecMTPError, match="bad draft spec"):
            build_drafter(bad, default_model)
    with pytest.raises(SpecMTPError, match="bench --draft"):
        build_drafter("ngram|mtp@3", default_model)
