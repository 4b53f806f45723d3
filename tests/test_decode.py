"""The decode loop's bookkeeping: cache rollback, stops inside a block, seeds, drafters."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, perturbed_copy, tiny_model
from transformers import DynamicCache

from specmtp.cache import CachedModel
from specmtp.config import GenerationConfig, SamplingConfig
from specmtp.decode import SpecDecoder
from specmtp.draft_model_drafter import DraftModelDrafter
from specmtp.drafters import NgramDrafter
from specmtp.errors import SpecMTPError

PROMPT = [5, 17, 3, 88, 41, 5, 17, 3, 60, 2]


def fresh_kv(model: torch.nn.Module, ids: list[int]) -> list[torch.Tensor]:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    return [layer.keys for layer in cache.layers] + [layer.values for layer in cache.layers]


def cached_kv(runner: CachedModel) -> list[torch.Tensor]:
    layers = runner.cache.layers
    return [layer.keys for layer in layers] + [layer.values for layer in layers]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_equal_a_fresh_forward_after_rejections(temperature: float) -> None:
    """After rounds with rejections, both caches hold exactly the committed tokens' K/V."""
    target = tiny_model("llama", seed=0)
    draft = perturbed_copy(target, scale=0.6, seed=1)
    drafter = DraftModelDrafter(draft, vocab_size=TINY_VOCAB)
    decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
    config = GenerationConfig(
        max_new_tokens=40, gamma=4, sampling=SamplingConfig(temperature=temperature)
    )
    result = decoder.generate(PROMPT, config)
    assert 0 < result.stats.accepted_tokens < result.stats.drafted_tokens  # rejections happened
    committed = PROMPT + result.tokens
    # The target holds everything but the pending last token; the draft what it was fed.
    assert decoder.target.length == len(committed) - 1
    for got, want in zip(cached_kv(decoder.target), fresh_kv(target, committed[:-1]), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    fed = drafter.fed[0].tolist()
    assert fed == committed[: len(fed)]
    for got, want in zip(cached_kv(drafter.runner), fresh_kv(draft, fed), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_crop_refuses_growing() -> None:
    runner = CachedModel(tiny_model("llama", seed=0), vocab_size=TINY_VOCAB)
    runner.forward(torch.tensor([PROMPT]))
    with pytest.raises(ValueError):
        runner.crop(len(PROMPT) + 1)
    runner.crop(3)
    assert runner.length == 3 and runner.cache.get_seq_length() == 3


def self_drafting_decoder(**kwargs: object) -> SpecDecoder:
    """All drafts accepted, so every round commits gamma + 1 tokens."""
    target = tiny_model("qwen2", seed=0)
    return SpecDecoder(
        target,
        drafter=DraftModelDrafter(target, vocab_size=TINY_VOCAB),
        vocab_size=TINY_VOCAB,
        context_length=256,
        **kwargs,
    )


def reference(new_tokens: int = 40) -> list[int]:
    decoder = SpecDecoder(tiny_model("qwen2", seed=0), vocab_size=TINY_VOCAB, context_length=256)
    return decoder.generate(PROMPT, GenerationConfig(max_new_tokens=new_tokens)).tokens


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 13])
def test_max_new_tokens_inside_a_block(max_new_tokens: int) -> None:
    result = self_drafting_decoder().generate(
        PROMPT, GenerationConfig(max_new_tokens=max_new_tokens, gamma=4)
    )
    assert result.tokens == reference()[:max_new_tokens]
    assert result.stats.finish_reason == "length"


def test_eos_inside_a_block() -> None:
    ref = reference()
    eos = next(t for i, t in enumerate(ref) if i % 5 not in (0, 4) and t not in ref[:i])
    stop_at = ref.index(eos)
    result = self_drafting_decoder(eos_token_ids=[eos]).generate(
        PROMPT, GenerationConfig(max_new_tokens=40, gamma=4)
    )
    assert result.tokens == ref[: stop_at + 1]
    assert result.stats.finish_reason == "eos"
    # Without stopping on EOS the same run goes on to the budget.
    unstopped = self_drafting_decoder(eos_token_ids=[eos]).generate(
        PROMPT, GenerationConfig(max_new_tokens=40, gamma=4, stop_on_eos=False)
    )
    assert unstopped.tokens == ref


def letters(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_string_inside_a_block() -> None:
    ref = reference()
    stop = letters(ref[6:8])
    end = next(i for i in range(len(ref)) if stop in letters(ref[: i + 1]))
    result = self_drafting_decoder(detokenize=letters).generate(
        PROMPT, GenerationConfig(max_new_tokens=40, gamma=4, stop_strings=(stop,))
    )
    assert result.tokens == ref[: end + 1]
    assert result.stats.finish_reason == "stop_string"


def test_context_limit_stops_generation() -> None:
    target = tiny_model("llama", seed=0, context=16)
    decoder = SpecDecoder(target, drafter=NgramDrafter(), vocab_size=TINY_VOCAB, context_length=16)
    result = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=40, gamma=4))
    assert result.stats.finish_reason == "context"
    assert len(PROMPT) + len(result.tokens) == 17  # the last token comes from position 15


def test_bad_prompts_are_refused() -> None:
    decoder = SpecDecoder(tiny_model("llama", seed=0), vocab_size=TINY_VOCAB, context_length=8)
    with pytest.raises(SpecMTPError, match="empty"):
        decoder.generate([], GenerationConfig())
    with pytest.raises(SpecMTPError, match="context"):
        decoder.generate(PROMPT, GenerationConfig())


@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_sampling_is_deterministic_for_a_seed(kind: str) -> None:
    target = tiny_model("llama", seed=0)

    def run(seed: int) -> list[int]:
        drafter = (
            DraftModelDrafter(perturbed_copy(target, scale=0.5, seed=1), vocab_size=TINY_VOCAB)
            if kind == "draft"
            else NgramDrafter()
        )
        decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
        sampling = SamplingConfig(temperature=1.0, top_k=20, top_p=0.9)
        config = GenerationConfig(max_new_tokens=30, gamma=3, sampling=sampling, seed=seed)
        return decoder.generate(PROMPT, config).tokens

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    drafter = NgramDrafter(max_ngram=2)
    greedy = SamplingConfig()
    context = torch.tensor([[1, 2, 3, 4, 9, 2, 3, 7, 8, 2, 3]])
    # "2 3" last occurred at index 5, followed by 7 8 2.
    assert drafter.propose(context, 3, greedy, None).tokens.tolist() == [[7, 8, 2]]
    # Proposals stop where the context ends.
    assert drafter.propose(torch.tensor([[4, 5, 4]]), 3, greedy, None).tokens.tolist() == [[5, 4]]
    assert drafter.propose(torch.tensor([[1, 2, 3]]), 3, greedy, None).depth == 0


def test_sampling_config_validation() -> None:
    for bad in ({"temperature": -0.1}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(SpecMTPError):
            SamplingConfig(**bad)
    with pytest.raises(SpecMTPError):
        GenerationConfig(gamma=0)
    with pytest.raises(SpecMTPError):
        GenerationConfig(max_new_tokens=0)
