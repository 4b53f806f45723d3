"""Hugging Face's own generate(), plain, assisted and prompt lookup, as a baseline: same
tokens as our decoder under greedy decoding, honest timings, seeded sampling, and settings
that really reach HF (the assistant's draft length, no early stop of drafting)."""

from __future__ import annotations

import logging
import warnings
from functools import cache
from typing import Any

import pytest
import torch
from conftest import TINY_VOCAB, hf_greedy, perturbed_copy, tiny_model
from transformers import PreTrainedModel
from transformers.generation.candidate_generator import AssistedCandidateGenerator

from specmtp.config import GenerationConfig
from specmtp.decode import SpecDecoder
from specmtp.errors import SpecMTPError
from specmtp.hf_baselines import HFGenerator, HFRun, HFSettings, cut_at_stops

NEW_TOKENS = 32
ARCHS = ["llama", "qwen2"]
# Each case: an HF method and the assistant it gets ("self": an identical copy).
CASES = {
    "plain": ("plain", None),
    "assisted-self": ("assisted", "self"),
    "assisted-perturbed": ("assisted", "perturbed"),
    "assisted-unrelated": ("assisted", "unrelated"),
    "prompt-lookup": ("prompt-lookup", None),
}


@cache
def target(arch: str) -> PreTrainedModel:
    return tiny_model(arch, seed=0)


@cache
def assistant(arch: str, kind: str) -> PreTrainedModel:
    if kind == "self":
        return perturbed_copy(target(arch), scale=0.0, seed=0)
    if kind == "perturbed":
        return perturbed_copy(target(arch), scale=0.5, seed=3)
    return tiny_model(arch, seed=99)


def prompt() -> list[int]:
    return torch.randint(0, TINY_VOCAB, (12,), generator=torch.Generator().manual_seed(5)).tolist()


def generator(arch: str, case: str, eos: list[int] | None = None, **settings: Any) -> HFGenerator:
    method, kind = CASES[case]
    return HFGenerator(
        target(arch),
        settings=HFSettings(method, **settings),
        assistant=None if kind is None else assistant(arch, kind),
        eos_token_ids=eos or (),
    )


def ours(model: PreTrainedModel, prompt_ids: list[int], eos: list[int] | None) -> list[int]:
    """Our decoder's plain greedy decoding."""
    decoder = SpecDecoder(model, vocab_size=TINY_VOCAB, context_length=256, eos_token_ids=eos or ())
    return decoder.generate(prompt_ids, GenerationConfig(max_new_tokens=NEW_TOKENS)).tokens


def early_eos(tokens: list[int]) -> int:
    """A token whose first occurrence is a few tokens in, so an EOS stop cuts the output."""
    return next(t for i, t in enumerate(tokens) if i >= 3 and t not in tokens[:i])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("with_eos", [False, True])
def test_greedy_equals_hf_greedy_and_our_decoder(arch: str, case: str, with_eos: bool) -> None:
    full = hf_greedy(target(arch), prompt(), NEW_TOKENS)
    eos = [early_eos(full)] if with_eos else None
    expected = hf_greedy(target(arch), prompt(), NEW_TOKENS, eos=eos)
    assert expected == ours(target(arch), prompt(), eos)
    if with_eos:
        assert len(expected) < NEW_TOKENS and expected[-1] == eos[0]
    run = generator(arch, case, eos).generate(prompt(), max_new_tokens=NEW_TOKENS)
    assert run.tokens == expected


@pytest.mark.parametrize("case", list(CASES))
def test_timings(case: str) -> None:
    run = generator("llama", case).generate(prompt(), max_new_tokens=NEW_TOKENS)
    assert len(run.tokens) == NEW_TOKENS
    assert run.latency_s >= run.ttft_s > 0
    assert run.tpot_s == pytest.approx((run.latency_s - run.ttft_s) / (NEW_TOKENS - 1))
    one = generator("llama", case).generate(prompt(), max_new_tokens=1)
    assert len(one.tokens) == 1 and one.latency_s >= one.ttft_s > 0 and one.tpot_s == 0


def test_tpot_and_cut_rules() -> None:
    assert HFRun([1, 2, 3], latency_s=1.0, ttft_s=0.4).tpot_s == pytest.approx(0.3)
    assert HFRun([1], latency_s=1.0, ttft_s=1.0).tpot_s == 0
    assert cut_at_stops([5, 7, 9, 7], [7, 9], max_new_tokens=10) == [5, 7]
    assert cut_at_stops([5, 6, 7], [7], max_new_tokens=2) == [5, 6]
    assert cut_at_stops([5, 6, 7], [], max_new_tokens=10) == [5, 6, 7]


@pytest.mark.parametrize("case", ["plain", "assisted-perturbed", "prompt-lookup"])
@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 20}])
def test_sampling_is_seeded(case: str, sampling: dict[str, float]) -> None:
    gen, budget = generator("qwen2", case), NEW_TOKENS
    runs = [gen.generate(prompt(), max_new_tokens=budget, seed=s, **sampling) for s in (1, 1, 2)]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].tokens != runs[2].tokens
    assert runs[0].tokens != hf_greedy(target("qwen2"), prompt(), NEW_TOKENS)


@pytest.mark.parametrize("case", ["plain", "assisted-perturbed", "prompt-lookup"])
def test_sampling_settings_reach_hf(case: str) -> None:
    """Top-k 1 leaves one token to sample, so a lossless sampler reproduces greedy."""
    run = generator("llama", case).generate(
        prompt(), max_new_tokens=NEW_TOKENS, temperature=1.5, top_k=1, top_p=0.9, seed=4
    )
    assert run.tokens == hf_greedy(target("llama"), prompt(), NEW_TOKENS)


def test_sampling_stops_at_eos() -> None:
    sampled = generator("llama", "assisted-perturbed").generate(
        prompt(), max_new_tokens=NEW_TOKENS, temperature=1.0, seed=3
    )
    eos = early_eos(sampled.tokens)
    run = generator("llama", "assisted-perturbed", [eos]).generate(
        prompt(), max_new_tokens=NEW_TOKENS, temperature=1.0, seed=3
    )
    assert run.tokens[-1] == eos and eos not in run.tokens[:-1]


def draft_lengths(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Record (context length, drafts proposed) for every assisted round from now on."""
    rounds: list[tuple[int, int]] = []
    original = AssistedCandidateGenerator.get_candidates

    def spy(
        self: AssistedCandidateGenerator, input_ids: torch.Tensor, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        candidates, logits = original(self, input_ids, **kwargs)
        rounds.append((input_ids.shape[1], candidates.shape[1] - input_ids.shape[1]))
        return candidates, logits

    monkeypatch.setattr(AssistedCandidateGenerator, "get_candidates", spy)
    return rounds


def test_assistant_settings_reach_hf(monkeypatch: pytest.MonkeyPatch) -> None:
    """num_tokens sets the draft length; with no threshold, drafting never stops early,
    though the assistant's own config asks for other values and tiny random models are
    never confident (HF's default threshold, 0.4, would cut every draft to one token)."""
    helper = perturbed_copy(target("llama"), scale=0.5, seed=3)
    helper.generation_config.num_assistant_tokens = 1
    helper.generation_config.assistant_confidence_threshold = 0.4
    rounds = draft_lengths(monkeypatch)
    settings = HFSettings("assisted", num_tokens=3)
    HFGenerator(target("llama"), settings=settings, assistant=helper).generate(
        prompt(), max_new_tokens=NEW_TOKENS
    )
    # HF drafts at most end - n - 1 tokens at context length n.
    end = len(prompt()) + NEW_TOKENS
    assert rounds and all(k == min(3, end - n - 1) for n, k in rounds)
    rounds.clear()
    sure = HFSettings("assisted", num_tokens=3, confidence_threshold=0.99)
    HFGenerator(target("llama"), settings=sure, assistant=helper).generate(
        prompt(), max_new_tokens=NEW_TOKENS
    )
    assert rounds and all(k == min(1, end - n - 1) for n, k in rounds)


def test_heuristic_schedule_starts_afresh_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    helper = assistant("llama", "self")
    own = helper.generation_config
    rounds = draft_lengths(monkeypatch)
    settings = HFSettings("assisted", num_tokens=2, schedule="heuristic")
    gen = HFGenerator(target("llama"), settings=settings, assistant=helper)
    gen.generate(prompt(), max_new_tokens=NEW_TOKENS)
    first = list(rounds)
    rounds.clear()
    gen.generate(prompt(), max_new_tokens=NEW_TOKENS)
    assert rounds == first
    assert first[1][1] == 4  # an all-accepting assistant grows the draft by 2 per round
    assert helper.generation_config is own


def test_model_generation_config_does_not_leak() -> None:
    """A model's own defaults (sampling, penalties, suppressed tokens, max length) are kept
    out of the call, and the model gets its config back untouched."""
    model = tiny_model("llama", seed=0)
    expected = ours(model, prompt(), None)
    own = model.generation_config
    own.do_sample, own.temperature, own.top_k, own.repetition_penalty = True, 5.0, 3, 3.0
    own.suppress_tokens, own.max_length = [expected[0]], 5
    before = own.to_dict()
    for method in ("plain", "prompt-lookup"):
        run = HFGenerator(model, settings=HFSettings(method)).generate(
            prompt(), max_new_tokens=NEW_TOKENS
        )
        assert run.tokens == expected
    assert model.generation_config is own and own.to_dict() == before


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_no_warnings() -> None:
    # transformers' loggers do not propagate, so listen on its root logger itself; and it
    # warns once per process, so forget what was already shown.
    logging.Logger.warning_once.cache_clear()
    records = Records()
    logging.getLogger("transformers").addHandler(records)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for case in CASES:
                gen = generator("qwen2", case, eos=[3])
                gen.generate(prompt(), max_new_tokens=8)
                gen.generate(prompt(), max_new_tokens=8, temperature=0.7, top_k=5, top_p=0.9)
    finally:
        logging.getLogger("transformers").removeHandler(records)
    assert records.messages == []


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"method": "beam"}, "unknown HF method"),
        ({"method": "assisted", "num_tokens": 0}, "num_tokens must be >= 1"),
        ({"method": "assisted", "schedule": "fast"}, "unknown schedule"),
        ({"method": "assisted", "confidence_threshold": 1.5}, "confidence_threshold"),
        ({"method": "prompt-lookup", "max_matching_ngram_size": 0}, "max_matching_ngram_size"),
        ({"method": "plain", "confidence_threshold": 0.5}, "for assisted generation"),
        ({"method": "prompt-lookup", "schedule": "heuristic"}, "for assisted generation"),
        ({"method": "assisted", "max_matching_ngram_size": 3}, "prompt lookup only"),
    ],
)
def test_bad_settings(settings: dict[str, object], message: str) -> None:
    with pytest.raises(SpecMTPError, match=message):
        HFSettings(**settings)


def test_bad_generator_arguments() -> None:
    model = target("llama")
    with pytest.raises(SpecMTPError, match="needs an assistant"):
        HFGenerator(model, settings=HFSettings("assisted"))
    for method in ("prompt-lookup", "plain"):
        with pytest.raises(SpecMTPError, match="takes no assistant"):
            HFGenerator(model, settings=HFSettings(method), assistant=assistant("llama", "self"))
    other_vocab = tiny_model("llama", seed=1, vocab_size=TINY_VOCAB + 8)
    with pytest.raises(SpecMTPError, match="vocabulary"):
        HFGenerator(model, settings=HFSettings("assisted"), assistant=other_vocab)
    gen = HFGenerator(model, settings=HFSettings("plain"))
    with pytest.raises(SpecMTPError, match="empty"):
        gen.generate([], max_new_tokens=4)
    with pytest.raises(SpecMTPError, match="max-new-tokens"):
        gen.generate(prompt(), max_new_tokens=0)
    with pytest.raises(SpecMTPError, match="temperature"):
        gen.generate(prompt(), max_new_tokens=4, temperature=-1.0)
