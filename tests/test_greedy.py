"""Greedy speculative decoding must be token-identical to the target's own greedy decoding."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, hf_greedy, perturbed_copy, tiny_model
from transformers import PreTrainedModel

from specmtp.config import GenerationConfig
from specmtp.decode import SpecDecoder
from specmtp.draft_model_drafter import DraftModelDrafter
from specmtp.drafters import Drafter, NgramDrafter

ARCHS = ["llama", "qwen2", "gpt2"]
NEW_TOKENS = 48


def make_drafter(kind: str, target: PreTrainedModel, arch: str) -> Drafter:
    if kind == "self":
        return DraftModelDrafter(target, vocab_size=TINY_VOCAB)
    if kind == "unrelated":
        return DraftModelDrafter(tiny_model(arch, seed=99), vocab_size=TINY_VOCAB)
    if kind == "perturbed":
        return DraftModelDrafter(perturbed_copy(target, scale=0.5, seed=3), vocab_size=TINY_VOCAB)
    return NgramDrafter()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["self", "unrelated", "perturbed", "ngram"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_matches_hf_generate(arch: str, kind: str, gamma: int) -> None:
    target = tiny_model(arch, seed=0)
    prompt = torch.randint(
        0, TINY_VOCAB, (12,), generator=torch.Generator().manual_seed(5)
    ).tolist()
    expected = hf_greedy(target, prompt, NEW_TOKENS)
    decoder = SpecDecoder(
        target, drafter=make_drafter(kind, target, arch), vocab_size=TINY_VOCAB, context_length=256
    )
    result = decoder.generate(prompt, GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=gamma))
    assert result.tokens == expected
    stats = result.stats
    assert stats.new_tokens == NEW_TOKENS
    if kind == "self":  # the target drafting for itself is always right
        assert stats.accepted_tokens == stats.drafted_tokens
        assert stats.mean_accepted_tokens > gamma  # every round: all drafts plus the bonus
    if kind == "unrelated":
        assert stats.accepted_tokens < stats.drafted_tokens


def test_partly_accepting_drafter_accepts_some_not_all() -> None:
    """The perturbed copy exercises both rejection and acceptance in one run."""
    target = tiny_model("llama", seed=0)
    decoder = SpecDecoder(
        target,
        drafter=make_drafter("perturbed", target, "llama"),
        vocab_size=TINY_VOCAB,
        context_length=256,
    )
    prompt = list(range(10))
    stats = decoder.generate(prompt, GenerationConfig(max_new_tokens=64, gamma=4)).stats
    assert 0 < stats.accepted_tokens < stats.drafted_tokens
    assert sum(stats.accept_histogram) == stats.rounds
