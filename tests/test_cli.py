"""The `specmtp generate` command: output format, streaming, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli, tiny_model
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from specmtp import cli
from specmtp.cli import main
from specmtp.models import load_model

REPO = Path(__file__).resolve().parents[1]
PROMPT = "List the days of the week, then list them again."
# One thread: on a shared 2-core machine two threads contend and run several times slower.
FAST = ["--max-new-tokens", "12", "--threads", "1"]


def assert_one_line_error(code: int, err: str, *, contains: str = "") -> None:
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("specmtp: error: ")
    assert contains.lower() in lines[0].lower()


def tiny_llama(vocab_size: int, *, context: int, eos: int) -> PreTrainedModel:
    model = tiny_model("llama", seed=0, vocab_size=vocab_size, context=context)
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    return model


@pytest.fixture(scope="session")
def short_context_target(tmp_path_factory: pytest.TempPathFactory, specmtp_cache: Path) -> Path:
    """A tiny random model with the default tokenizer and only 32 positions."""
    tokenizer = load_model("default").tokenizer
    path = tmp_path_factory.mktemp("short-context")
    tiny_llama(len(tokenizer), context=32, eos=tokenizer.eos_token_id).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def other_vocab_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model whose word-level tokenizer shares no ids with the default's."""
    vocab = {
        "<unk>": 0,
        "</s>": 1,
        **{w: i + 2 for i, w in enumerate(["the", "a", "cat", "sat", "on", "mat"])},
    }
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="</s>"
    )
    path = tmp_path_factory.mktemp("other-vocab")
    tiny_llama(len(vocab), context=64, eos=1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_generate_ngram_json(capfd: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        capfd, "generate", PROMPT, "--draft", "ngram", "--chat", "--json", *FAST
    )
    assert code == 0, err
    assert err == ""  # no warnings, progress bars or logs
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["text"].strip()
    assert stats["mean_accepted_tokens"] >= 1
    assert stats["tokens_per_s"] > 0
    assert 1 <= stats["new_tokens"] <= 12
    assert out.startswith(stats["text"])
    assert "mean accepted tokens" in out  # the human summary precedes the JSON line


@pytest.mark.parametrize(
    ("flags", "gamma"),
    [
        ([], "4"),  # greedy: the config's fixed γ
        (["--temperature", "0.7"], "auto"),  # sampled: adaptive unless told
        (["--temperature", "0.7", "--gamma", "2"], "2"),
    ],
)
def test_generate_drafts_auto_when_sampling_unless_told(
    capfd: pytest.CaptureFixture[str], flags: list[str], gamma: str
) -> None:
    code, out, err = run_cli(
        capfd, "generate", PROMPT, "--draft", "ngram", "--chat", "--json", *flags, *FAST
    )
    assert code == 0, err
    assert err == ""  # no notice about a missing profile: auto was not asked for
    assert json.loads(out.strip().splitlines()[-1])["gamma"] == gamma


@pytest.mark.parametrize(
    ("flags", "rows"),
    [
        ([], 1),  # plain decoding
        (["--draft", "mtp", "--gamma", "2"], 3),
        (["--draft", "mtp", "--temperature", "0.7"], 4),  # auto allows γ 8; three heads draft 3
        (["--draft", "ngram", "--temperature", "0.7"], 8),  # γ 8 + 1, capped at MAX_ROWS
    ],
)
def test_generate_times_kernels_for_the_verify_passes_it_can_make(
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    rows: int,
) -> None:
    asked: list[int] = []
    monkeypatch.setattr(
        cli, "use_stored_kernel_plan", lambda model, *, rows, **_: asked.append(rows)
    )
    code, _, err = run_cli(capfd, "generate", PROMPT, "--chat", "--json", *flags, *FAST)
    assert code == 0, err
    assert asked == [rows]


def test_stream_prints_the_same_text(capfd: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", PROMPT, "--draft", "ngram", "--chat", "--json", "--gamma", "3", *FAST]
    code, plain_out, _ = run_cli(capfd, *argv)
    assert code == 0
    code, stream_out, _ = run_cli(capfd, *argv, "--stream")
    assert code == 0
    plain, streamed = (json.loads(o.strip().splitlines()[-1]) for o in (plain_out, stream_out))
    assert streamed["text"] == plain["text"]
    assert stream_out.startswith(plain["text"] + "\n")


def test_plain_decoding_has_tau_one(capfd: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capfd, "generate", "Hello", "--json", *FAST)
    assert code == 0
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["mean_accepted_tokens"] == 1.0
    assert stats["draft"] is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gamma", "0"], "gamma"),
        (["--temperature", "-0.5"], "temperature"),
        (["--top-p", "0"], "top-p"),
        (["--top-p", "1.5"], "top-p"),
        (["--top-k", "-1"], "top-k"),
        (["--max-new-tokens", "0"], "max-new-tokens"),
        (["--stop", ""], "stop"),
        (["--threads", "0"], "threads"),
        (["--target", "/no/such/model"], "not found"),
        (["--target", "no/such/model.gguf"], "not found"),
    ],
)
def test_bad_settings_fail_in_one_line(
    capfd: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    code, _, err = run_cli(capfd, "generate", PROMPT, *flags)
    assert_one_line_error(code, err, contains=message)


@pytest.mark.parametrize("draft", ["ngram:x", "ngram:0", "./no/such/draft"])
def test_unknown_draft_spec(capfd: pytest.CaptureFixture[str], draft: str) -> None:
    code, _, err = run_cli(capfd, "generate", PROMPT, "--draft", draft)
    assert_one_line_error(code, err)


@pytest.mark.parametrize("command", ["train-mtp", "distill"])
def test_an_output_folder_that_cannot_be_made_fails_in_one_line(
    capfd: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker / "out"
    code, _, err = run_cli(capfd, command, "--data", str(tmp_path), "--out", str(out))
    assert_one_line_error(code, err, contains=str(out))


def test_the_hub_clients_failed_requests_stay_off_the_terminal() -> None:
    """Loading a name that is not on disk asks the Hub, whose client logs every failed
    request (and each retry) before the one-line error; the CLI keeps those logs off the
    terminal. In a fresh process: the client's log handler holds the stderr of its time."""
    script = (
        "from huggingface_hub.utils import logging\n"
        "from specmtp.cli import main\n"
        "code = main(['generate', 'hi', '--max-new-tokens', '0'])\n"  # any run quiets them
        "logging.get_logger('huggingface_hub.utils._http').warning('HEAD failed, retrying')\n"
        "raise SystemExit(code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert_one_line_error(done.returncode, done.stderr, contains="max-new-tokens")


@pytest.mark.parametrize("prompt", ["", "   \n"])
def test_empty_prompt(capfd: pytest.CaptureFixture[str], prompt: str) -> None:
    code, _, err = run_cli(capfd, "generate", prompt)
    assert_one_line_error(code, err, contains="empty")


def test_corrupt_gguf(capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    code, _, err = run_cli(capfd, "generate", PROMPT, "--target", str(bad))
    assert_one_line_error(code, err, contains="broken.gguf")


def test_not_a_model_file(capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"\0" * 64)
    code, _, err = run_cli(capfd, "generate", PROMPT, "--target", str(bad))
    assert_one_line_error(code, err, contains="not a model")


def test_unsupported_model_directory(capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "bert", "architectures": ["BertForSequenceClassification"]})
    )
    code, _, err = run_cli(capfd, "generate", PROMPT, "--target", str(tmp_path))
    assert_one_line_error(code, err, contains="not a causal language model")


def test_vocabulary_mismatch(capfd: pytest.CaptureFixture[str], other_vocab_draft: Path) -> None:
    code, _, err = run_cli(capfd, "generate", PROMPT, "--draft", str(other_vocab_draft))
    assert_one_line_error(code, err, contains="vocabulary mismatch")


def test_prompt_longer_than_context(
    capfd: pytest.CaptureFixture[str], short_context_target: Path
) -> None:
    code, _, err = run_cli(
        capfd, "generate", "many words " * 40, "--target", str(short_context_target)
    )
    assert_one_line_error(code, err, contains="context")


def test_short_context_still_generates(
    capfd: pytest.CaptureFixture[str], short_context_target: Path
) -> None:
    """A prompt that fits generates until the context is full, then stops cleanly."""
    argv = ["generate", "one two three", "--target", str(short_context_target), "--json"]
    code, out, err = run_cli(capfd, *argv, "--draft", "ngram", "--max-new-tokens", "100")
    assert code == 0, err
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["finish_reason"] in {"context", "eos"}
    assert stats["prompt_tokens"] + stats["new_tokens"] <= 33


def test_argparse_errors_exit_2(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", PROMPT, "--gamma", "many"])
    assert exit_info.value.code == 2
    assert "Traceback" not in capfd.readouterr().err


def test_module_entry_point_reports_errors_in_one_line(other_vocab_draft: Path) -> None:
    """The real process: no tracebacks, warnings or progress bars reach the terminal."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    argv = ["generate", PROMPT, "--draft", str(other_vocab_draft)]
    done = subprocess.run(
        [sys.executable, "-m", "specmtp", *argv], capture_output=True, text=True, env=env
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("specmtp: error: vocabulary mismatch")
