"""A draft model with a reduced output vocabulary (`MODEL#vocab=N`): it proposes only the
kept ids, and what is accepted does not change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specmtp.api import SpecGenerator, build_drafter
from specmtp.config import SamplingConfig
from specmtp.draft_model_drafter import DraftModelDrafter
from specmtp.errors import SpecMTPError
from specmtp.models import load_model
from specmtp.specs import OUTPUT_VOCAB, split_count, split_heads

KEPT = 3000  # of the default tokenizer's 49,152 ids


def _prompt(seed: int, length: int = 16) -> list[int]:
    return torch.randint(
        100, 5000, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def test_greedy_output_is_plain_decodings_and_drafts_come_from_the_kept_ids(
    tiny_target: Path,
) -> None:
    plain = SpecGenerator(str(tiny_target))
    full = SpecGenerator(str(tiny_target), draft=str(tiny_target))  # the target drafts itself
    cut = SpecGenerator(str(tiny_target), draft=f"{tiny_target}#vocab={KEPT}")
    drafter = cut.decoder.drafter
    assert isinstance(drafter, DraftModelDrafter) and drafter.output_ids is not None
    kept = set(drafter.output_ids.tolist())
    assert set(range(KEPT)) <= kept and cut.target.tokenizer.eos_token_id in kept
    assert len(kept) < KEPT + 100
    for seed in range(3):
        prompt = _prompt(seed)
        expected = plain.generate(prompt, max_new_tokens=40).tokens
        whole = full.generate(prompt, max_new_tokens=40, gamma=4)
        done = cut.generate(prompt, max_new_tokens=40, gamma=4)
        assert whole.tokens == expected and done.tokens == expected
        # The self-draft is always right; cut to 3,000 ids it misses every other token.
        assert whole.stats.accepted_tokens == whole.stats.drafted_tokens
        assert done.stats.accepted_tokens < done.stats.drafted_tokens
    context = torch.tensor([_prompt(5)])
    for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0)):
        drafter.reset()
        proposal = drafter.propose(context, 6, sampling, torch.Generator().manual_seed(0))
        assert set(proposal.tokens[0].tolist()) <= kept
        if proposal.probs is not None:  # q: a distribution over the full vocabulary, 0 off them
            off = torch.ones(proposal.probs.shape[-1], dtype=torch.bool)
            off[drafter.output_ids] = False
            assert torch.all(proposal.probs[..., off] == 0)
            torch.testing.assert_close(proposal.probs.sum(-1), torch.ones(1, 6))


def test_the_cut_head_scores_the_kept_ids_as_the_full_head_does(tiny_target: Path) -> None:
    target = load_model(str(tiny_target))
    full = load_model(str(tiny_target)).model
    drafter, _ = build_drafter(f"{tiny_target}#vocab=500", target)
    assert isinstance(drafter, DraftModelDrafter) and drafter.output_ids is not None
    ids = torch.tensor([_prompt(7)])
    with torch.inference_mode():
        expected = full(input_ids=ids).logits[0, :, drafter.output_ids]
        got = drafter.runner.model(input_ids=ids).logits[0]
        embedded = drafter.runner.model.get_input_embeddings().weight.shape[0]
    assert got.shape == expected.shape == (16, len(drafter.output_ids))
    torch.testing.assert_close(got, expected)
    assert embedded == full.get_input_embeddings().weight.shape[0]  # every token still read


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("{t}#vocab=0", "N >= 1"),
        ("{t}#vocab=lots", "N >= 1"),
        ("{t}#vocab=49152", "not smaller than the draft's vocabulary"),
        ("mtp#vocab=100", "applies to a draft model given by name or path"),
        ("distilled#vocab=100", "applies to a draft model given by name or path"),
    ],
)
def test_bad_output_vocab_specs_are_refused(tiny_target: Path, spec: str, message: str) -> None:
    target = load_model(str(tiny_target))
    with pytest.raises(SpecMTPError, match=message):
        build_drafter(spec.format(t=tiny_target), target)


def test_the_options_split_off_the_model_spec() -> None:
    usage = "MODEL#vocab=N"
    assert split_count("some/model.gguf#vocab=32768", OUTPUT_VOCAB, usage) == (
        "some/model.gguf", 32768,
    )  # fmt: skip
    assert split_count("default", OUTPUT_VOCAB, usage) == ("default", None)
    with pytest.raises(SpecMTPError, match="use MODEL#vocab=N with N >= 1"):
        split_count("m#vocab=", OUTPUT_VOCAB, usage)
    spec = "some/model.gguf#vocab=100#heads=runs/a#b"  # the heads' path runs to the end
    assert split_heads(spec) == ("some/model.gguf#vocab=100", "runs/a#b")
    assert split_heads("default") == ("default", None)
