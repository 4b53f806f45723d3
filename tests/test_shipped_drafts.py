"""The draft models shipped for the default model: they load offline, draft, stay exact,
and the distilled ones agree with the target more than the general one."""

from __future__ import annotations

import pytest
import torch
from conftest import SHIPPED_NEW_TOKENS, SHIPPED_PROMPT, tiny_model
from safetensors.torch import load_file

from specmtp.api import SpecGenerator
from specmtp.config import GenerationConfig
from specmtp.decode import GenerationResult
from specmtp.draft_model import DRAFT_CONFIG, SHIPPED_DRAFTS, load_draft, shipped_drafts_dir
from specmtp.errors import SpecMTPError
from specmtp.models import LoadedModel, load_model
from specmtp.trunk import TRUNK_FILE, check_trunk


@pytest.fixture(scope="module")
def runs(default_model: LoadedModel) -> dict[str, GenerationResult]:
    """Each shipped draft's greedy run on SHIPPED_PROMPT at γ = 3."""
    found = {}
    for spec in SHIPPED_DRAFTS:
        generator = SpecGenerator(default_model, draft=spec)
        ids = generator.encode(SHIPPED_PROMPT, chat=True)
        config = GenerationConfig(max_new_tokens=SHIPPED_NEW_TOKENS, gamma=3)
        found[spec] = generator.decoder.generate(ids, config)
    return found


def test_shipped_drafts_record_their_target(default_model: LoadedModel) -> None:
    """Each shipped draft records the default model's weights, so another checkpoint of the
    architecture is refused (trunk.check_trunk, tested on tiny models)."""
    folders = {p.parent for p in shipped_drafts_dir().glob(f"*/{DRAFT_CONFIG}")}
    assert folders and all((folder / TRUNK_FILE).exists() for folder in folders)
    for folder in folders:
        check_trunk(folder, default_model.model, what="draft")


@pytest.mark.parametrize("spec", list(SHIPPED_DRAFTS))
def test_shipped_drafts_stay_greedy_exact(
    runs: dict[str, GenerationResult], shipped_greedy: list[int], spec: str
) -> None:
    assert runs[spec].tokens == shipped_greedy
    assert runs[spec].stats.accepted_tokens > 0


def test_distillation_beats_plain_text_training(runs: dict[str, GenerationResult]) -> None:
    """The distilled draft learned the target's behaviour; the general one only English."""
    general = runs["general"].stats.mean_accepted_tokens
    assert runs["distilled"].stats.mean_accepted_tokens > general


def test_the_mtp_draft_proposes_several_tokens_per_forward(
    default_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    draft = load_draft(shipped_drafts_dir() / "distilled-mtp", target=default_model.model)
    assert draft.heads is not None and draft.draft_config.mtp_heads == 3
    calls = []
    generator = SpecGenerator(default_model, draft="distilled-mtp")
    model = generator.decoder.drafter.runner.model
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    ids = generator.encode(SHIPPED_PROMPT, chat=True)
    result = generator.decoder.generate(ids, GenerationConfig(max_new_tokens=24, gamma=4))
    rounds = result.stats.rounds  # verify passes
    assert 0 < len(calls) <= rounds  # at most one draft forward per round (γ = 1 + 3 heads)
    assert result.stats.drafted_tokens > 2 * len(calls)


def test_shipped_drafts_refuse_another_target() -> None:
    tokenizer = load_model("default").tokenizer
    tiny = tiny_model("llama", seed=0, vocab_size=len(tokenizer))
    target = LoadedModel(model=tiny, tokenizer=tokenizer, spec="tiny", context_length=256)
    with pytest.raises(SpecMTPError, match="was made for"):
        SpecGenerator(target, draft="distilled")


def test_shipped_files_hold_only_the_draft_layers() -> None:
    for name in set(SHIPPED_DRAFTS.values()):
        folder = shipped_drafts_dir() / name
        size = (folder / "draft.safetensors").stat().st_size
        assert size < 20 * 2**20, f"{name}: {size} bytes"
        assert "step_cost_ratio" in (folder / "report.json").read_text()
        tensors = load_file(folder / "draft.safetensors")
        assert {t.dtype for t in tensors.values()} == {torch.float16}
        assert not any("embed" in key for key in tensors)  # the target's, not shipped
