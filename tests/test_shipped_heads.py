"""The MTP heads shipped for the default model: they load offline, draft, and stay exact."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import SHIPPED_NEW_TOKENS, SHIPPED_PROMPT, tiny_model

from specmtp.api import SpecGenerator, build_drafter
from specmtp.config import GenerationConfig
from specmtp.errors import SpecMTPError
from specmtp.heads_io import load_heads, shipped_heads_dir
from specmtp.models import LoadedModel, load_model
from specmtp.mtp_drafter import MTPDrafter
from specmtp.trunk import TRUNK_FILE


@pytest.mark.parametrize("spec", ["mtp", "mtp-tree", "mtp-tree#nodes=4"])
def test_shipped_heads_draft_and_stay_greedy_exact(
    default_model: LoadedModel, shipped_greedy: list[int], spec: str
) -> None:
    generator = SpecGenerator(default_model, draft=spec)
    ids = generator.encode(SHIPPED_PROMPT, chat=True)
    result = generator.decoder.generate(ids, GenerationConfig(max_new_tokens=SHIPPED_NEW_TOKENS))
    assert result.tokens == shipped_greedy
    # Trained heads get drafts accepted; fresh (identity) heads would almost never.
    assert result.stats.accepted_tokens > 0.1 * len(shipped_greedy)


def test_dynamic_tree_specs(default_model: LoadedModel) -> None:
    drafter, _ = build_drafter("mtp-tree#nodes=5", default_model)
    assert isinstance(drafter, MTPDrafter) and drafter.nodes == 5
    assert drafter.name == "mtp-tree#nodes=5" and drafter.tree is not None
    for bad, message in [
        ("mtp#nodes=5", "applies to mtp-tree and draft models"),
        ("ngram#nodes=5", "applies to mtp-tree and draft models"),
        ("mtp-tree#nodes=0", "N >= 1"),
        ("mtp-tree#nodes=many", "N >= 1"),
        ("mtp@2", "bench --draft` syntax; here give --draft mtp --gamma 2"),
        ("ngram+mtp@auto", "give --draft ngram\\+mtp --gamma auto"),
    ]:
        with pytest.raises(SpecMTPError, match=message):
            build_drafter(bad, default_model)


def test_mtp_heads_refuse_another_target() -> None:
    tokenizer = load_model("default").tokenizer
    tiny = tiny_model("llama", seed=0, vocab_size=len(tokenizer))
    target = LoadedModel(model=tiny, tokenizer=tokenizer, spec="tiny", context_length=256)
    with pytest.raises(SpecMTPError):
        SpecGenerator(target, draft="mtp")


def test_shipped_heads_know_their_checkpoint(default_model: LoadedModel) -> None:
    """The shipped heads record the default model's weights: another checkpoint of the same
    architecture (here one layer changed by 1%) is refused, not drafted for badly."""
    assert (shipped_heads_dir() / TRUNK_FILE).exists()
    load_heads(shipped_heads_dir(), target_model=default_model.model)
    other = copy.deepcopy(default_model.model)
    with torch.no_grad():
        weight = other.model.layers[-1].mlp.down_proj.weight
        weight.mul_(1 + 0.01 * torch.randn_like(weight))
    with pytest.raises(SpecMTPError, match="trained on other weights"):
        load_heads(shipped_heads_dir(), target_model=other)
