"""Prompt lookup first, a model drafter otherwise (`ngram+SPEC`): which drafter drafts each
round, that the fallback keeps in step, and that output stays the target's own."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, hf_greedy, perturbed_copy, tiny_model
from test_decode_tree import TREE
from test_mtp_drafter import PROMPT, trained_heads

from specmtp.api import build_drafter
from specmtp.config import GenerationConfig, SamplingConfig
from specmtp.decode import SpecDecoder
from specmtp.drafters import (
    DraftModelDrafter,
    LookupFirstDrafter,
    MTPDrafter,
    NgramDrafter,
    Outcome,
    Proposal,
)
from specmtp.errors import SpecMTPError
from specmtp.models import LoadedModel

GREEDY = SamplingConfig()


class SpyDrafter(NgramDrafter):
    """Proposes a fixed token; records what it was asked and told."""

    def __init__(self) -> None:
        super().__init__()
        self.name = "spy"
        self.proposed: list[int] = []  # context lengths it drafted for
        self.observed: list[int] = []  # context lengths it was told about
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        self.proposed.append(context.shape[1])
        return Proposal(torch.full((1, k), 42), None)

    def observe(self, outcome: Outcome) -> None:
        self.observed.append(outcome.context.shape[1])


def test_lookup_drafts_on_a_two_token_match_and_the_fallback_otherwise() -> None:
    spy = SpyDrafter()
    drafter = LookupFirstDrafter(spy)
    assert drafter.name == "ngram+spy"
    # "2 3" occurred before, followed by 7 8: lookup drafts, the fallback is not asked.
    found = drafter.propose(torch.tensor([[1, 2, 3, 7, 8, 2, 3]]), 2, GREEDY, None)
    assert found.tokens.tolist() == [[7, 8]]
    assert spy.proposed == []
    # Only the last token ("3") occurred before: a one-token match is not enough.
    missed = drafter.propose(torch.tensor([[1, 3, 5, 9, 3]]), 2, GREEDY, None)
    assert missed.tokens.tolist() == [[42, 42]]
    assert spy.proposed == [5]
    assert (drafter.lookup_rounds, drafter.fallback_rounds) == (1, 1)
    # The fallback hears every outcome, whoever drafted, and every reset.
    drafter.observe(Outcome(torch.tensor([[1, 2, 3]]), 1, None))
    drafter.reset()
    assert spy.observed == [3] and spy.resets == 1


def test_longer_lookup_windows_are_tried_first() -> None:
    drafter = LookupFirstDrafter(SpyDrafter(), max_ngram=3)
    # "2 3" last occurred at index 5 (then 9), "1 2 3" at index 0 (then 4): the longer wins.
    context = torch.tensor([[1, 2, 3, 4, 0, 2, 3, 9, 1, 2, 3]])
    assert drafter.propose(context, 1, GREEDY, None).tokens.tolist() == [[4]]


@pytest.mark.parametrize("fallback", ["perturbed", "mtp-chain", "mtp-tree"])
def test_greedy_output_is_the_targets_own(fallback: str) -> None:
    target = tiny_model("llama", seed=0)
    if fallback == "perturbed":
        inner = DraftModelDrafter(perturbed_copy(target, scale=0.5, seed=3), vocab_size=TINY_VOCAB)
    else:
        heads = trained_heads(target, "sequential", steps=30)
        inner = MTPDrafter(heads, tree=TREE if fallback == "mtp-tree" else None)
    drafter = LookupFirstDrafter(inner)
    decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
    # A prompt that repeats itself, so that lookup finds matches in some rounds.
    prompt = PROMPT * 3
    result = decoder.generate(prompt, GenerationConfig(max_new_tokens=48, gamma=3))
    assert result.tokens == hf_greedy(target, prompt, 48)
    assert drafter.lookup_rounds > 0 and drafter.fallback_rounds > 0
    assert result.stats.accepted_tokens > 0


def test_specs(default_model: LoadedModel) -> None:
    drafter, vocab = build_drafter("ngram:4+mtp", default_model)
    assert isinstance(drafter, LookupFirstDrafter)
    assert isinstance(drafter.fallback, MTPDrafter)
    assert drafter.lookup.max_ngram == 4 and drafter.lookup.min_ngram == 2
    assert drafter.name == "ngram+mtp" and drafter.needs_target_hidden
    assert vocab == build_drafter("mtp", default_model)[1]
    for bad in ("ngram+", "ngram:1+mtp", "ngram:x+mtp", "ngram+ngram", "ngramz+mtp"):
        with pytest.raises(SpecMTPError, match="bad draft spec"):
            build_drafter(bad, default_model)
