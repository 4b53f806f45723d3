"""--dtype: the target and every drafter run in the dtype asked for, and costs measured in
one dtype are kept apart from another's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from specmtp import native
from specmtp.api import SpecGenerator
from specmtp.bench import BenchConfig
from specmtp.errors import SpecMTPError
from specmtp.profile import default_profile_path
from specmtp.tune import TuneConfig


def test_a_draft_model_follows_the_target_dtype(tiny_target: Path) -> None:
    generator = SpecGenerator(str(tiny_target), draft=str(tiny_target), dtype=torch.bfloat16)
    assert generator.target.model.dtype == torch.bfloat16
    assert generator.decoder.drafter.runner.model.dtype == torch.bfloat16
    done = generator.generate([5, 6, 7, 8], max_new_tokens=8, gamma=3)
    assert len(done.tokens) == 8


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


def test_a_bfloat16_bench_is_row_invariant_and_lossless(capfd: pytest.CaptureFixture[str]) -> None:
    """The default model in bfloat16: every speculative method, a tree among them, gives
    plain bfloat16 decoding's tokens, and the config says how the forwards were made exact."""
    code, out, err = run_cli(
        capfd, "bench", "--dtype", "bfloat16", "--prompts", "random:2x24",
        "--draft", "mtp@3", "--draft", "mtp-tree", "--draft", "ngram+mtp@4/1",
        "--max-new-tokens", "40", "--warmup", "0", "--threads", "1",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["config"]["dtype"] == "bfloat16"
    # "amx", "packed", "flat", "padded", "padded16", or per shape ("flat, padded for 576x1536")
    assert report["config"]["row_invariant"].split(",")[0] in (
        "amx",
        "packed",
        "flat",
        "padded",
        "padded16",
    )
    # the default model's 64-wide heads take the C kernel wherever it could be built
    assert report["config"]["row_invariant_attention"] == native.kernel_name()
    for name, method in report["methods"].items():
        assert method["greedy_mismatches"] == 0, name
    assert report["methods"]["mtp@3"]["mean_accepted_tokens"] > 1.0
