"""MTP heads as a drafter: greedy-exact in chain and tree form, and useful once trained."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, hf_greedy, tiny_model
from test_decode_tree import TREE
from transformers import PreTrainedModel

from specmtp.config import GenerationConfig, SamplingConfig
from specmtp.decode import SpecDecoder
from specmtp.drafters import LookupFirstDrafter, Outcome, Proposal
from specmtp.errors import SpecMTPError
from specmtp.heads import Heads, build_heads, describe_target
from specmtp.heads_config import HeadsConfig
from specmtp.mtp_drafter import MTPDrafter, single_path
from specmtp.mtp_loss import decaying_weights, mtp_losses
from specmtp.tree import TokenTree

PROMPT = [5, 17, 3, 88, 41, 5, 17, 3, 60, 2]


def trained_heads(target: PreTrainedModel, kind: str, *, steps: int) -> Heads:
    """Heads fitted for a few steps to the target's own greedy continuations."""
    config = HeadsConfig(
        kind=kind,
        num_heads=3,
        hidden_size=target.config.hidden_size,
        vocab_size=TINY_VOCAB,
        base_model=describe_target(target),
    )
    torch.manual_seed(0)
    heads = build_heads(config, target)
    prompts = torch.randint(1, TINY_VOCAB, (16, 10), generator=torch.Generator().manual_seed(1))
    prompts[0] = torch.tensor(PROMPT)  # the heads see the test prompt's continuation
    with torch.no_grad():
        ids = target.generate(prompts, max_new_tokens=40, min_new_tokens=40, do_sample=False)
        hidden = target(ids, output_hidden_states=True).hidden_states[-1]
    optimizer = torch.optim.Adam([p for p in heads.parameters() if p.requires_grad], lr=1e-2)
    mask = torch.ones_like(ids, dtype=torch.bool)
    for _ in range(steps):
        optimizer.zero_grad()
        mtp_losses(heads, ids, hidden, mask, decaying_weights(3)).loss.backward()
        optimizer.step()
    return heads


@pytest.fixture(scope="module")
def target() -> PreTrainedModel:
    return tiny_model("llama", seed=0)


@pytest.mark.parametrize("kind", ["parallel", "sequential"])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("steps", [0, 60])
def test_mtp_drafting_is_greedy_exact(
    target: PreTrainedModel, kind: str, tree: bool, steps: int
) -> None:
    heads = trained_heads(target, kind, steps=steps)
    drafter = MTPDrafter(heads, tree=TREE if tree else None)
    decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
    result = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=40, gamma=3))
    assert result.tokens == hf_greedy(target, PROMPT, 40)
    assert result.stats.drafted_tokens > 0


@pytest.mark.parametrize("kind", ["parallel", "sequential"])
def test_trained_heads_are_accepted_more_than_fresh_ones(
    target: PreTrainedModel, kind: str
) -> None:
    def tau(steps: int) -> float:
        drafter = MTPDrafter(trained_heads(target, kind, steps=steps))
        decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
        return decoder.generate(
            PROMPT, GenerationConfig(max_new_tokens=40, gamma=3)
        ).stats.mean_accepted_tokens

    assert tau(300) > tau(0) + 0.25


class TreeRecorder(MTPDrafter):
    """Records the tree each round verifies."""

    def __init__(self, heads: Heads, **kwargs: object) -> None:
        super().__init__(heads, **kwargs)  # type: ignore[arg-type]
        self.trees: list[TokenTree] = []

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        proposal = super().propose(context, k, sampling, generator)
        if proposal.tree is not None:
            self.trees.append(proposal.tree)
        return proposal


@pytest.mark.parametrize("kind", ["parallel", "sequential"])
def test_a_dynamic_tree_verifies_its_likeliest_nodes_and_stays_greedy_exact(
    target: PreTrainedModel, kind: str
) -> None:
    drafter = TreeRecorder(trained_heads(target, kind, steps=60), tree=TREE, nodes=4)
    decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
    result = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=40, gamma=3))
    assert result.tokens == hf_greedy(target, PROMPT, 40)
    assert result.stats.accepted_tokens > 0
    assert all(set(t.paths) <= set(TREE.paths) for t in drafter.trees)
    full = [t for t in drafter.trees if t.num_nodes == 4]  # rounds near the end draft less
    assert len(full) >= len(drafter.trees) - 2
    assert len({t.paths for t in full}) > 1  # the shape follows the drafts


@pytest.mark.parametrize("kind", ["parallel", "sequential"])
@pytest.mark.parametrize("nodes", [None, 4])
def test_a_check_drafts_the_heads_chain(
    target: PreTrainedModel, kind: str, nodes: int | None
) -> None:
    """Under `single_path` (a round that only checks whether drafting pays) MTP heads that
    draft a tree, fixed or dynamic, propose the chain the same heads draft without one."""
    heads = trained_heads(target, kind, steps=60)
    tree, chain = MTPDrafter(heads, tree=TREE, nodes=nodes), MTPDrafter(heads)
    context = torch.tensor([PROMPT])
    with torch.no_grad():
        hidden = target(context[:, :-1], output_hidden_states=True).hidden_states[-1]
    for drafter in (tree, chain):  # the prompt's hidden states, as the decoder's prefill
        drafter.observe(Outcome(context, 0, hidden, verified=hidden.shape[1]))
    expected = chain.propose(context, 3, SamplingConfig(), None)
    assert expected.tokens.shape == (1, 3)
    with single_path(tree):
        proposal = tree.propose(context, 3, SamplingConfig(), None)
    assert proposal.tree is None and torch.equal(proposal.tokens, expected.tokens)
    assert tree.propose(context, 3, SamplingConfig(), None).tree is not None


def test_a_dynamic_tree_needs_a_tree_and_nodes(target: PreTrainedModel) -> None:
    heads = trained_heads(target, "sequential", steps=0)
    for kwargs in ({"nodes": 4}, {"tree": TREE, "nodes": 0}, {"tuned_nodes": True}):
        with pytest.raises(SpecMTPError, match="dynamic tree"):
            MTPDrafter(heads, **kwargs)  # type: ignore[arg-type]


def test_sampled_mtp_chain_is_seeded(target: PreTrainedModel) -> None:
    drafter = MTPDrafter(trained_heads(target, "parallel", steps=30))
    decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)

    def run(seed: int) -> list[int]:
        sampling = SamplingConfig(temperature=0.9, top_p=0.95)
        return decoder.generate(PROMPT, GenerationConfig(30, 3, sampling, seed=seed)).tokens

    assert run(1) == run(1) != run(2)


@pytest.mark.parametrize(
    ("drafting", "timed", "asked"),
    [("chain", [4], {0, 1, 2, 3}), ("tree", [9], None), ("lookup first", [9], None)],
)
def test_auto_times_and_asks_no_more_drafts_than_the_heads_propose(
    target: PreTrainedModel,
    measurements: list[int],
    drafting: str,
    timed: list[int],
    asked: set[int] | None,
) -> None:
    """`--gamma auto` allows γ up to 8: three heads drafting a chain propose 3, so T(n) is
    timed for n <= 4 and the schedule chooses among 0..3. A tree's verify pass and a lookup
    arm are not bounded by the heads: timed up to γ + 1 as before."""
    heads = trained_heads(target, "parallel", steps=60)
    drafter = MTPDrafter(heads, tree=TREE if drafting == "tree" else None)
    if drafting == "lookup first":
        drafter = LookupFirstDrafter(drafter)
    decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
    config = GenerationConfig(max_new_tokens=40, gamma=8, schedule="adaptive")
    result = decoder.generate(PROMPT, config)
    assert result.tokens == hf_greedy(target, PROMPT, 40)
    assert measurements == timed
    if asked is not None:
        assert set(result.stats.requested_gammas) <= asked
        assert result.stats.drafted_tokens > 0
