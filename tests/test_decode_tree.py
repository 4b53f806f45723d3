"""Tree rounds and target hidden states through the one decode loop."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, hf_greedy, perturbed_copy, tiny_model
from lossless_models import decoder_counts, peaked_target_and_draft, target_joint
from lossless_stats import fit
from transformers import PreTrainedModel

from specmtp.cache import CachedModel
from specmtp.config import GenerationConfig, SamplingConfig
from specmtp.decode import SpecDecoder
from specmtp.draft_model_drafter import DraftModelDrafter
from specmtp.drafters import NoMemory, Outcome, Proposal, empty_proposal
from specmtp.tree import TokenTree, build_tree_tokens

TREE = TokenTree(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)))
PROMPT = [5, 17, 3, 88, 41, 5, 17, 3, 60, 2]


class TopKTreeDrafter(NoMemory):
    """Medusa-shaped candidates from a draft model: along the draft's greedy chain, the
    top-K tokens at each depth. Enough to exercise tree rounds with partial acceptance."""

    def __init__(self, draft: PreTrainedModel, tree: TokenTree) -> None:
        self.model, self.tree = draft, tree
        self.name, self.needs_target_hidden = "topk-tree", False

    def reset(self) -> None:
        pass

    @torch.no_grad()
    def propose(
        self, context: torch.Tensor, k: int, sampling: SamplingConfig, generator: object
    ) -> Proposal:
        tree = self.tree.pruned(k)
        if not tree.paths:
            return empty_proposal(context.shape[0], context.device)
        ids, candidates = context, []
        for _ in range(tree.max_depth):
            logits = self.model(ids).logits[:, -1]  # [B, V]
            candidates.append(logits.topk(3, dim=-1).indices)  # [B, 3]
            ids = torch.cat([ids, candidates[-1][:, :1]], 1)
        return Proposal(build_tree_tokens(tree, candidates), None, tree=tree)

    def observe(self, outcome: Outcome) -> None:
        pass


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("gamma", [2, 4])
def test_tree_rounds_are_greedy_exact(arch: str, gamma: int) -> None:
    target = tiny_model(arch, seed=0)
    drafter = TopKTreeDrafter(perturbed_copy(target, scale=0.4, seed=2), TREE)
    decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
    result = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=45, gamma=gamma))
    assert result.tokens == hf_greedy(target, PROMPT, 45)
    stats = result.stats
    assert 0 < stats.accepted_tokens < stats.drafted_tokens  # partly accepted
    assert stats.verified_tokens > stats.rounds + stats.drafted_tokens  # trees are wider


def test_tree_rounds_sample_deterministically_per_seed() -> None:
    target = tiny_model("llama", seed=0)

    def run(seed: int) -> list[int]:
        drafter = TopKTreeDrafter(perturbed_copy(target, scale=0.4, seed=2), TREE)
        decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
        sampling = SamplingConfig(temperature=0.8)
        return decoder.generate(PROMPT, GenerationConfig(30, 4, sampling, seed=seed)).tokens

    assert run(3) == run(3) != run(4)


class HiddenSpy(NoMemory):
    """Records what the loop hands a drafter that asks for the target's hidden states."""

    def __init__(self, inner: TopKTreeDrafter | None = None) -> None:
        self.inner, self.name, self.needs_target_hidden = inner, "spy", True
        self.outcomes: list[Outcome] = []

    def reset(self) -> None:
        self.outcomes.clear()

    def propose(self, context, k, sampling, generator) -> Proposal:
        if self.inner is None:
            return Proposal(context[:, -k:].flip(1), None)  # a chain that is mostly wrong
        return self.inner.propose(context, k, sampling, generator)

    def observe(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)


@pytest.mark.parametrize("tree", [False, True])
def test_drafters_get_the_target_hidden_states_of_kept_positions(tree: bool) -> None:
    target = tiny_model("qwen2", seed=0)
    draft = perturbed_copy(target, scale=0.3, seed=2)
    inner = (
        TopKTreeDrafter(draft, TREE) if tree else DraftModelDrafter(draft, vocab_size=TINY_VOCAB)
    )
    spy = HiddenSpy(inner)
    decoder = SpecDecoder(target, drafter=spy, vocab_size=TINY_VOCAB, context_length=256)
    result = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=30, gamma=3))
    committed = torch.tensor([PROMPT + result.tokens])
    with torch.no_grad():
        reference = target(committed, output_hidden_states=True).hidden_states[-1]  # [1, n, H]
    prefill, *rounds = spy.outcomes  # the prefill verifies every prompt token but the last
    assert prefill.num_accepted == 0 and prefill.verified == len(PROMPT) - 1
    torch.testing.assert_close(prefill.target_hidden, reference[:, : len(PROMPT) - 1])
    position = len(PROMPT) - 1  # the first round verifies from the last prompt token
    for outcome in rounds:
        kept = outcome.num_accepted + 1
        assert outcome.target_hidden.shape[1] == kept
        want = reference[:, position : position + kept]
        torch.testing.assert_close(outcome.target_hidden, want, atol=1e-4, rtol=1e-4)
        position += kept
    assert any(o.num_accepted > 0 for o in spy.outcomes)


def test_cached_model_keeps_hidden_only_when_asked() -> None:
    model = tiny_model("llama", seed=0)
    plain = CachedModel(model, vocab_size=TINY_VOCAB)
    plain.forward(torch.tensor([PROMPT]))
    assert plain.last_hidden is None
    keeping = CachedModel(model, vocab_size=TINY_VOCAB, keep_hidden=True)
    keeping.forward(torch.tensor([PROMPT]))
    assert keeping.last_hidden.shape == (1, len(PROMPT), model.config.hidden_size)


def test_tree_rounds_emit_the_target_joint_at_temperature() -> None:
    """Loop-level losslessness of tree rounds: the first three tokens of 3000 sampled
    generations against the target's exact joint (the verification-level tree tests in
    test_tree.py show that wrong rules fail the same statistic)."""
    target, draft = peaked_target_and_draft()
    tree = TokenTree(((0,), (1,), (0, 0), (0, 1), (1, 0)))
    sampling = SamplingConfig(temperature=1.0)
    counts = decoder_counts(target, TopKTreeDrafter(draft, tree), sampling, 3000)
    result = fit(counts, target_joint(target, sampling))
    assert result.passes, result
