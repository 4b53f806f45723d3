"""--dtype: speculative decoding is lossless to the model in the dtype it runs in, and costs
measured in one dtype are kept apart from another's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, hf_greedy, perturbed_copy, run_cli, tiny_model

from specmtp.bench import BenchConfig
from specmtp.config import GenerationConfig
from specmtp.decode import SpecDecoder
from specmtp.drafters import DraftModelDrafter
from specmtp.errors import SpecMTPError
from specmtp.profile import default_profile_path
from specmtp.tune import TuneConfig


@pytest.mark.parametrize("gamma", [1, 3])
def test_bfloat16_greedy_matches_the_bfloat16_model(gamma: int) -> None:
    target = tiny_model("llama", seed=0)
    draft = perturbed_copy(target, scale=0.5, seed=3).to(torch.bfloat16)
    target = target.to(torch.bfloat16)
    prompt = list(range(3, 15))
    expected = hf_greedy(target, prompt, 40)
    decoder = SpecDecoder(
        target, drafter=DraftModelDrafter(draft, vocab_size=TINY_VOCAB), vocab_size=TINY_VOCAB,
        context_length=256,
    )  # fmt: skip
    result = decoder.generate(prompt, GenerationConfig(max_new_tokens=40, gamma=gamma))
    assert result.tokens == expected
    assert 0 < result.stats.accepted_tokens < result.stats.drafted_tokens


def test_profiles_are_kept_per_dtype(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECMTP_CACHE", str(tmp_path))
    plain = default_profile_path("default", "ngram")
    assert plain == default_profile_path("default", "ngram", "float32")
    assert plain.name == "default__ngram.json"  # profiles tuned before --dtype still found
    assert default_profile_path("default", "ngram", "bfloat16") != plain


def test_unknown_dtypes_are_refused(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SpecMTPError, match="dtype"):
        BenchConfig(prompts=("random:1x8",), dtype="float8")
    with pytest.raises(SpecMTPError, match="dtype"):
        TuneConfig(prompts=(Path(__file__),), dtype="int8")
    with pytest.raises(SystemExit) as exit_info:
        run_cli(capfd, "generate", "--dtype", "int8", "hello")
    assert exit_info.value.code == 2
    assert "argument --dtype: invalid choice: 'int8'" in capfd.readouterr().err


def test_cli_generate_in_bfloat16_is_lossless(capfd: pytest.CaptureFixture[str]) -> None:
    args = ["generate", "--dtype", "bfloat16", "--max-new-tokens", "24", "--threads", "1"]
    code, plain, _ = run_cli(capfd, *args, "--chat", "List three colours.")
    assert code == 0
    code, spec, _ = run_cli(capfd, *args, "--draft", "ngram", "--chat", "List three colours.")
    assert code == 0
    assert spec.split("\n\n")[0] == plain.split("\n\n")[0]  # the text, before the stats
