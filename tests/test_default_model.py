"""Greedy exactness on the real default model (SmolLM2-135M-Instruct) for three drafters."""

from __future__ import annotations

import pytest
from conftest import hf_greedy, tiny_model

from specmtp.api import SpecGenerator, eos_token_ids
from specmtp.config import GenerationConfig
from specmtp.draft_model_drafter import DraftModelDrafter
from specmtp.drafters import Drafter, NgramDrafter
from specmtp.models import LoadedModel, load_model

PROMPTS = [
    "List the first five prime numbers and explain why 1 is not prime.",
    "Write a Python function that reverses a string.",
]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def default() -> LoadedModel:
    return load_model("default")


def make_drafter(kind: str, target: LoadedModel) -> Drafter:
    vocab = target.model.config.vocab_size
    if kind == "self":  # every draft is the target's own argmax: all accepted
        return DraftModelDrafter(target.model, vocab_size=vocab)
    if kind == "unrelated":  # a random model on the same vocabulary: almost none accepted
        return DraftModelDrafter(tiny_model("llama", seed=7, vocab_size=vocab), vocab_size=vocab)
    return NgramDrafter()  # prompt lookup: partly accepted


@pytest.mark.parametrize("kind", ["self", "unrelated", "ngram"])
def test_default_model_greedy_equals_hf_generate(default: LoadedModel, kind: str) -> None:
    generator = SpecGenerator(default, draft=make_drafter(kind, default))
    for prompt in PROMPTS:
        ids = generator.encode(prompt, chat=True)
        expected = hf_greedy(default.model, ids, NEW_TOKENS, eos=eos_token_ids(default))
        result = generator.decoder.generate(
            ids, GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=4)
        )
        assert result.tokens == expected
        if kind == "self":
            assert result.stats.accepted_tokens == result.stats.drafted_tokens > 0
        if kind == "unrelated":
            assert result.stats.accepted_tokens < result.stats.drafted_tokens / 4
