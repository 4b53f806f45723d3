"""Small helpers for the files specmtp writes (heads, drafts, data caches, kernel plans)
and the JSON Lines files it reads (prompts, metrics)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specmtp.errors import SpecMTPError


def write_atomically(final: Path, write: Callable[[Path], Any]) -> None:
    """`write(path)` to a temporary file beside `final`, then rename it into place, so a
    killed process never leaves a half-written file under the final name."""
    try:
        fd, name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")
    except OSError as exc:
        raise SpecMTPError(f"cannot write {final}: {first_line(exc)}") from exc
    os.close(fd)
    try:
        write(Path(name))
        os.replace(name, final)
    except OSError as exc:
        raise SpecMTPError(f"cannot write {final}: {first_line(exc)}") from exc
    finally:
        Path(name).unlink(missing_ok=True)


def jsonl_lines(text: str) -> list[tuple[int, str]]:
    """The non-blank lines of JSON Lines text with their 1-based numbers.

    Split on newlines only: `str.splitlines` also splits on U+2028, U+2029 and other
    separators that JSON strings may hold unescaped (awesome-chatgpt-prompts has U+2028).
    """
    lines = (line.rstrip("\r") for line in text.split("\n"))
    return [(n, line) for n, line in enumerate(lines, 1) if line.strip()]


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line, for one-line errors."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
