"""`MODEL#min-p=P`: a draft model stops drafting in a round once its path's own probability
falls below P, as a chain (draft_model_drafter.py) and as a tree (draft_tree_drafter.py).
Checked against slow references of fresh forwards, against Hugging Face's greedy output, for
the target's joint distribution at temperature 1, and through the specs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import test_draft_tree
import torch
from conftest import TINY_VOCAB, hf_greedy
from lossless_models import TINY_V, decoder_counts, peaked_target_and_draft, target_joint
from lossless_stats import fit
from test_draft_tree import PROMPT, make_draft, proposed_paths, reference_scores
from test_lossless import LOOP_SAMPLES, SAMPLINGS
from transformers import PreTrainedModel

from specmtp import decode
from specmtp.api import SpecGenerator, build_drafter, eos_token_ids
from specmtp.config import GenerationConfig, SamplingConfig
from specmtp.draft_model import DraftLM
from specmtp.draft_model_drafter import DraftModelDrafter
from specmtp.draft_tree_drafter import DraftTreeDrafter
from specmtp.drafters import LookupFirstDrafter
from specmtp.errors import SpecMTPError
from specmtp.models import LoadedModel

# test_draft_tree's fixtures: its peaked tiny Llama (a random draft of it is sure of some
# tokens and unsure of others, so path probabilities spread over (0, 1)), the tiny saved
# target, and drafts of it saved as `same` (its layers) and `mtp` (with two MTP heads).
target = test_draft_tree.target
loaded_target = test_draft_tree.loaded_target
saved_drafts = test_draft_tree.saved_drafts

GREEDY = SamplingConfig()
NEW_TOKENS = 40
LEVELS = (0.0, 0.3, 0.6, 0.9)  # min-p values; 0 drafts all k


def reference_chain(
    draft: DraftLM, context: list[int], k: int, min_probability: float
) -> list[int]:
    """The slow reference chain: the draft's greedy tokens from fresh forwards, drafting the
    next only while the product of the drafted tokens' probabilities is >= min_probability."""
    tokens: list[int] = []
    path = 1.0
    while len(tokens) < k and path >= min_probability:
        with torch.no_grad():
            logits = draft(torch.tensor([context + tokens])).logits[0, -1]  # [V]
        probs = torch.softmax(logits.float(), -1)
        tokens.append(int(probs.argmax()))
        path *= float(probs.max())
    return tokens


def test_a_chain_stops_where_its_paths_probability_falls_below_min_p(
    target: PreTrainedModel,
) -> None:
    draft = make_draft(target, copy=False)
    lengths = set()
    for level in LEVELS:
        drafter = DraftModelDrafter(draft, vocab_size=TINY_VOCAB, min_probability=level)
        context = PROMPT
        for _ in range(4):  # later rounds read from the cache the rounds before left
            expected = reference_chain(draft, context, 6, level)
            proposal = drafter.propose(torch.tensor([context]), 6, GREEDY, None)
            assert proposal.tokens[0].tolist() == expected, level
            lengths.add(len(expected))
            context = [*context, *expected[:2], 7]  # two accepted, then the target drew 7
    assert len(lengths) >= 3, lengths  # the levels cut the chains at different depths


@pytest.mark.parametrize("level", LEVELS[1:])
def test_a_tree_with_min_p_is_the_slow_references_grown_while_the_draft_is_sure(
    target: PreTrainedModel, level: float
) -> None:
    draft = make_draft(target, copy=False)
    drafter = DraftTreeDrafter(draft, vocab_size=TINY_VOCAB, nodes=12, min_probability=level)
    context = PROMPT
    for _ in range(3):
        expected = reference_scores(draft, context, 5, 12, drafter.beam, min_probability=level)
        proposed = proposed_paths(drafter, context, 5)
        assert proposed.keys() == expected.keys()
        for path, score in proposed.items():
            assert score == pytest.approx(expected[path], abs=1e-4), path
        assert drafter.runner.length == len(context) + len(drafter.tree_fed)
        deepest = max(expected, key=lambda p: (len(p), expected[p]))
        context = [*context, *deepest, 7]


def test_min_p_cuts_the_trees_draft_forwards(target: PreTrainedModel) -> None:
    """Over the same rounds, a higher min-p spends fewer draft forwards, and the depths it
    gives up are those whose likeliest node the draft doubts."""
    draft = make_draft(target, copy=False)
    forwards = {}
    for level in (0.0, 0.6):
        drafter = DraftTreeDrafter(draft, vocab_size=TINY_VOCAB, nodes=12, min_probability=level)
        calls = 0
        step = drafter._tree_step

        def counting(*args: object, _step=step) -> torch.Tensor:  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            return _step(*args)  # type: ignore[arg-type]

        drafter._tree_step = counting  # type: ignore[method-assign]
        context = PROMPT
        for _ in range(4):
            paths = proposed_paths(drafter, context, 5)
            context = [*context, *max(paths, key=len), 7]
        forwards[level] = calls
    assert forwards[0.6] < forwards[0.0], forwards


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("level", [0.3, 0.9])
def test_greedy_decoding_with_min_p_matches_hf(
    target: PreTrainedModel, tree: bool, level: float
) -> None:
    draft = make_draft(target, copy=False)
    drafter = (
        DraftTreeDrafter(draft, vocab_size=TINY_VOCAB, nodes=6, min_probability=level)
        if tree
        else DraftModelDrafter(draft, vocab_size=TINY_VOCAB, min_probability=level)
    )
    decoder = decode.SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
    result = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=4))
    assert result.tokens == hf_greedy(target, PROMPT, NEW_TOKENS)
    assert result.stats.drafted_tokens > 0


@pytest.mark.parametrize("tree", [False, True])
def test_sampled_decoding_with_min_p_emits_the_target_joint(tree: bool) -> None:
    """At temperature 1 the rounds stop at lengths that depend on the drawn tokens; the
    output is still the target's exact joint distribution."""
    target, draft = peaked_target_and_draft()
    drafter = (
        DraftTreeDrafter(draft, vocab_size=TINY_V, nodes=4, min_probability=0.5)
        if tree
        else DraftModelDrafter(draft, vocab_size=TINY_V, min_probability=0.5)
    )
    counts = decoder_counts(target, drafter, SAMPLINGS["t1.0"], LOOP_SAMPLES)
    result = fit(counts, target_joint(target, SAMPLINGS["t1.0"]))
    assert result.passes, result


# --- specs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "tree", "name"),
    [
        ("draft:{root}/same#min-p=0.4", False, "draft:{root}/same#min-p=0.4"),
        ("draft:{root}/same#min-p=0.4#nodes=4", True, "draft:{root}/same#min-p=0.4#nodes=4"),
        ("draft:{root}/same#nodes=4#min-p=0.4", True, "draft:{root}/same#min-p=0.4#nodes=4"),
        ("draft-ar:{root}/mtp#min-p=0.2", False, "draft-ar:{root}/mtp#min-p=0.2"),
        ("ngram+{target}#min-p=0.5#nodes=3", True, "{target}#min-p=0.5#nodes=3"),
        ("{target}#min-p=0.5#int8", False, "{target}#min-p=0.5#int8"),
    ],
)
def test_min_p_specs_generate_what_hf_does(
    loaded_target: LoadedModel,
    saved_drafts: Path,
    tiny_target: Path,
    spec: str,
    tree: bool,
    name: str,
) -> None:
    spec = spec.format(root=saved_drafts, target=tiny_target)
    generator = SpecGenerator(loaded_target, draft=spec)
    drafter = generator.decoder.drafter
    if isinstance(drafter, LookupFirstDrafter):
        drafter = drafter.fallback
    assert isinstance(drafter, DraftModelDrafter)
    assert isinstance(drafter, DraftTreeDrafter) == tree
    assert drafter.name == name.format(root=saved_drafts, target=tiny_target)
    assert math.isclose(drafter.min_probability, float(spec.split("#min-p=")[1][:3]))
    prompt = loaded_target.tokenizer("The colours of the rainbow are").input_ids
    completion = generator.generate(prompt, max_new_tokens=24, gamma=3)
    expected = hf_greedy(loaded_target.model, prompt, 24, eos=eos_token_ids(loaded_target))
    assert completion.tokens == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("draft:{root}/mtp#min-p=0.3", "LM head alone"),
        ("mtp#min-p=0.3", "applies to draft models"),
        ("mtp-tree#min-p=0.3", "applies to draft models"),
        ("ngram#min-p=0.3", "applies to draft models"),
        ("{target}#min-p=0.3#heads={root}/h", "applies to draft models"),
        ("draft:{root}/same#min-p=1.5", "0 <= P < 1"),
        ("draft:{root}/same#min-p=x#nodes=3", "0 <= P < 1"),
    ],
)
def test_bad_min_p_specs_are_refused(
    loaded_target: LoadedModel, saved_drafts: Path, tiny_target: Path, spec: str, message: str
) -> None:
    with pytest.raises(SpecMTPError, match=message):
        build_drafter(spec.format(root=saved_drafts, target=tiny_target), loaded_target)


def test_min_p_outside_zero_to_one_is_refused_by_the_drafter(target: PreTrainedModel) -> None:
    with pytest.raises(SpecMTPError, match="min-p"):
        DraftModelDrafter(make_draft(target, copy=True), vocab_size=TINY_VOCAB, min_probability=1.0)
