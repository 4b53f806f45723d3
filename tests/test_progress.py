"""Long jobs report progress in a log too: plain lines where tqdm would draw nothing."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from specmtp import progress as progress_module
from specmtp.answers import generate_answers
from specmtp.models import load_model
from specmtp.progress import LineProgress, progress


def test_lines_count_the_work_and_estimate_whats_left(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress_module, "LINE_INTERVAL_S", 0.0)  # a line every update
    stream = io.StringIO()
    bar = LineProgress(total=4, desc="train", unit="step", initial=1, stream=stream)
    bar.update(1)
    bar.set_postfix({"loss": 2.5, "top1": [0.4, 0.2]})
    bar.update(2)
    bar.close()
    bar.close()  # once only
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("train: 2/4 steps, ") and "min left" in lines[0]
    assert lines[1].startswith("train: 4/4 steps, ") and "left" not in lines[1]
    assert lines[1].endswith("loss=2.5, top1=[0.4, 0.2]")
    assert lines[2].startswith("train: 4/4 steps, ")


def test_lines_wait_for_the_interval_and_close_says_where_it_ended() -> None:
    stream = io.StringIO()
    bar = LineProgress(total=10, desc="rescoring", unit="shard", initial=0, stream=stream)
    for _ in range(10):
        bar.update(1)
    assert stream.getvalue() == ""  # within the first minute
    bar.close()
    assert stream.getvalue().startswith("rescoring: 10/10 shards, 0.0 min")
    idle = io.StringIO()
    LineProgress(total=3, desc="x", unit="step", initial=3, stream=idle).close()
    assert idle.getvalue() == ""  # resumed at the end: nothing done, nothing said


def test_a_log_gets_lines_and_a_quiet_process_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert isinstance(progress(total=2, desc="x"), LineProgress)  # pytest's stderr: no terminal
    quiet = progress(total=2, desc="x", quiet=True)
    quiet.update(2)
    quiet.close()
    assert capsys.readouterr().err == ""


def test_the_targets_answers_report_their_progress(
    tiny_target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = load_model(str(tiny_target))
    answers = generate_answers(model, ["a b c", "d e"], max_new_tokens=3, batch_size=1)
    assert len(answers) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("target answers: 2/2 prompts, ")
