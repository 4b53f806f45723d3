"""The MTP heads shipped for the default model: they load offline, draft, and stay exact."""

from __future__ import annotations

import pytest
from conftest import hf_greedy, tiny_model

from specmtp.api import SpecGenerator, eos_token_ids
from specmtp.config import GenerationConfig
from specmtp.errors import SpecMTPError
from specmtp.models import LoadedModel, load_model

PROMPT = "Write a Python function that returns the sum of the squares of a list of numbers."
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def default() -> LoadedModel:
    return load_model("default")


@pytest.fixture(scope="module")
def expected(default: LoadedModel) -> list[int]:
    ids = SpecGenerator(default).encode(PROMPT, chat=True)
    return hf_greedy(default.model, ids, NEW_TOKENS, eos=eos_token_ids(default))


@pytest.mark.parametrize("spec", ["mtp", "mtp-tree"])
def test_shipped_heads_draft_and_stay_greedy_exact(
    default: LoadedModel, expected: list[int], spec: str
) -> None:
    generator = SpecGenerator(default, draft=spec)
    ids = generator.encode(PROMPT, chat=True)
    result = generator.decoder.generate(ids, GenerationConfig(max_new_tokens=NEW_TOKENS))
    assert result.tokens == expected
    # Trained heads get drafts accepted; fresh (identity) heads would almost never.
    assert result.stats.accepted_tokens > 0.1 * len(expected)


def test_mtp_heads_refuse_another_target() -> None:
    tokenizer = load_model("default").tokenizer
    tiny = tiny_model("llama", seed=0, vocab_size=len(tokenizer))
    target = LoadedModel(model=tiny, tokenizer=tokenizer, spec="tiny", context_length=256)
    with pytest.raises(SpecMTPError):
        SpecGenerator(target, draft="mtp")
