"""Atomic writes: a file is either its old content or its new one, never half written."""

from __future__ import annotations

from pathlib import Path

import pytest

from specmtp.errors import SpecMTPError
from specmtp.files import first_line, write_atomically


def test_a_write_lands_whole_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    final = tmp_path / "heads.json"
    write_atomically(final, lambda path: path.write_text("new"))
    assert final.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["heads.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    final = tmp_path / "heads.json"
    final.write_text("old")

    def half_then_fail(path: Path) -> None:
        path.write_text("ha")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        write_atomically(final, half_then_fail)
    assert final.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["heads.json"]


def test_an_unwritable_place_is_a_one_line_error(tmp_path: Path) -> None:
    final = tmp_path / "missing" / "heads.json"
    with pytest.raises(SpecMTPError, match=r"cannot write .*heads\.json") as error:
        write_atomically(final, lambda path: path.write_text("new"))
    assert "\n" not in str(error.value)

    def fails(path: Path) -> None:
        raise OSError("No space left on device\nmore detail")

    with pytest.raises(SpecMTPError, match=r"No space left on device$"):
        write_atomically(tmp_path / "heads.json", fails)
    assert list(tmp_path.iterdir()) == []


def test_first_line_of_an_error() -> None:
    assert first_line(ValueError("one\ntwo")) == "one"
    assert first_line(ValueError("")) == "ValueError"
