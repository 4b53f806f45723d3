"""`specmtp export-draft`: a draft becomes a plain HF Llama that both engines can draft with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_captured, run_cli
from transformers import LlamaConfig, LlamaForCausalLM

from specmtp.draft_export import export_hf_draft, to_hf_llama
from specmtp.draft_model import DraftLM, draft_config_for, init_from_target, save_draft
from specmtp.models import LoadedModel, load_model

# Ids spread over the default tokenizer's vocabulary, deliberately unsorted.
DRAFT_VOCAB = tuple(range(49_000, 0, -97))


@pytest.fixture(scope="module")
def loaded(tiny_target: Path) -> LoadedModel:
    return load_model(str(tiny_target))


def make_draft(target: LoadedModel, vocab: tuple[int, ...] | None, *, seed: int = 3) -> DraftLM:
    """Two layers from the target, then moved off it so that the draft is its own model."""
    torch.manual_seed(seed)
    config = draft_config_for(target.model, num_layers=2, draft_vocab=vocab)
    draft = DraftLM(config, target=target.model)
    init_from_target(draft, target.model, [1, 0])
    with torch.no_grad():
        for param in draft.body.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return draft.eval()


def ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 49_152, (2, 12), generator=torch.Generator().manual_seed(seed))


def tied_target(loaded: LoadedModel) -> LoadedModel:
    config = LlamaConfig(**{**loaded.model.config.to_dict(), "tie_word_embeddings": True})
    torch.manual_seed(5)
    model = LlamaForCausalLM(config).eval()
    return LoadedModel(model=model, tokenizer=loaded.tokenizer, spec="tied", context_length=512)


@pytest.mark.parametrize("tied", [False, True])
def test_a_full_vocabulary_draft_exports_as_the_same_model(loaded: LoadedModel, tied: bool) -> None:
    target = tied_target(loaded) if tied else loaded
    draft = make_draft(target, None)
    exported = to_hf_llama(draft, target)
    assert exported.config.tie_word_embeddings is tied
    assert exported.config.num_hidden_layers == 2
    x = ids(0)
    with torch.no_grad():
        torch.testing.assert_close(exported(x).logits, draft(x).logits, rtol=1e-5, atol=1e-5)


def test_a_draft_vocabulary_keeps_its_logits_and_zeroes_the_rest(loaded: LoadedModel) -> None:
    draft = make_draft(loaded, DRAFT_VOCAB)
    exported = to_hf_llama(draft, loaded)
    assert not exported.config.tie_word_embeddings  # zeroed rows: no longer the embedding
    x = ids(1)
    with torch.no_grad():
        ours, theirs = draft(x).logits, exported(x).logits  # [2, 12, V]
    vocab = torch.tensor(DRAFT_VOCAB)
    torch.testing.assert_close(theirs[..., vocab], ours[..., vocab], rtol=1e-5, atol=1e-5)
    outside = torch.ones(theirs.shape[-1], dtype=torch.bool)
    outside[vocab] = False
    assert torch.equal(theirs[..., outside], torch.zeros_like(theirs[..., outside]))
    # Where the draft's best logit is positive, both pick the same greedy draft.
    positive = ours.max(-1).values > 0
    assert positive.any()
    assert torch.equal(theirs.argmax(-1)[positive], ours.argmax(-1)[positive])


def test_export_writes_a_loadable_model_dir_and_refuses_a_non_empty_one(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    draft = make_draft(loaded, DRAFT_VOCAB)
    out = export_hf_draft(draft, loaded, tmp_path / "hf", dtype=torch.bfloat16)
    back = load_model(str(out))  # its tokenizer is the target's: the load check passes
    assert back.tokenizer.get_vocab() == loaded.tokenizer.get_vocab()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    x = ids(2)
    with torch.no_grad():
        expected = to_hf_llama(draft, loaded).to(torch.bfloat16)(x).logits
        torch.testing.assert_close(back.model.to(torch.bfloat16)(x).logits, expected)
    with pytest.raises(Exception, match="not empty"):
        export_hf_draft(draft, loaded, out)


@pytest.fixture(scope="module")
def exported_cli(
    loaded: LoadedModel, tiny_target: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A draft saved by save_draft, exported by the CLI command."""
    folder = tmp_path_factory.mktemp("export")
    save_draft(make_draft(loaded, DRAFT_VOCAB), folder / "draft")
    out = folder / "hf"
    code, stdout, err = run_captured(
        "export-draft", "--target", str(tiny_target), "--draft", f"draft:{folder / 'draft'}",
        "--out", str(out), "--threads", "1",
    )  # fmt: skip
    assert code == 0, err
    assert f"hf-assisted:{out}" in stdout
    return out


def test_both_engines_draft_with_the_export_and_keep_greedy_outputs(
    exported_cli: Path, tiny_target: Path
) -> None:
    drafts = [f"{exported_cli}@3", f"hf-assisted:{exported_cli}@3",
              f"hf-assisted:{exported_cli}@default"]  # fmt: skip
    code, out, err = run_captured(
        "bench", "--target", str(tiny_target), "--prompts", "random:2x10",
        *[flag for spec in drafts for flag in ("--draft", spec)],
        "--max-new-tokens", "12", "--warmup", "0", "--threads", "1",
    )  # fmt: skip
    assert code == 0, err
    methods = json.loads(out.strip().splitlines()[-1])["methods"]
    assert set(methods) == {"ar", *drafts}
    assert all(m["greedy_mismatches"] == 0 for m in methods.values())
    assert methods[drafts[2]]["schedule"] == "hf-default:20,0.4"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--draft", "distilled-xl"], "bad draft spec"),
        (["--draft", "draft:/no/such/dir"], "no draft in /no/such/dir"),
    ],
)
def test_bad_export_input_is_a_one_line_error(
    capfd: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], message: str
) -> None:
    code, out, err = run_cli(capfd, "export-draft", "--out", str(tmp_path / "x"), *flags)
    assert code == 2
    assert out == ""
    assert err.strip().splitlines() == [err.strip()]
    assert message in err


def test_a_draft_for_another_target_is_refused(
    capfd: pytest.CaptureFixture[str], exported_cli: Path, tmp_path: Path
) -> None:
    draft_dir = exported_cli.parent / "draft"  # made for the tiny target, not the default
    code, _, err = run_cli(
        capfd, "export-draft", "--draft", f"draft:{draft_dir}", "--out", str(tmp_path / "x")
    )
    assert code == 2
    assert "was made for" in err
