"""Progress of the long jobs (the target's answers, rescoring, training steps): a tqdm bar
on a terminal, and plain lines in a log.

tqdm draws nothing when stderr is not a terminal (`disable=None`), so a data build run
under nohup or in CI said nothing for half an hour. There each job instead writes a line
now and then, and one when it ends:

    target answers: 48/280 prompts, 5.1 min, about 24.7 min left
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from tqdm.auto import tqdm

LINE_INTERVAL_S = 60.0  # at most one line a minute in a log, and one at the end


class LineProgress:
    """tqdm's update / set_postfix / close, as lines on a stream that is not a terminal."""

    def __init__(self, *, total: int, desc: str, unit: str, initial: int, stream: TextIO) -> None:
        self.total, self.desc, self.unit, self.stream = total, desc, unit, stream
        self.n = self.initial = initial
        self.postfix = ""
        self.start = self.last = time.monotonic()
        self.closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self.last >= LINE_INTERVAL_S:
            self._write()

    def set_postfix(self, values: Mapping[str, Any]) -> None:
        self.postfix = ", ".join(f"{key}={value}" for key, value in values.items())

    def close(self) -> None:
        if not self.closed and self.n > self.initial:
            self._write()
        self.closed = True

    def _write(self) -> None:
        self.last = time.monotonic()
        elapsed = self.last - self.start
        parts = [f"{self.desc}: {self.n}/{self.total} {self.unit}s", f"{elapsed / 60:.1f} min"]
        done = self.n - self.initial
        if done > 0 and self.n < self.total:
            left = elapsed / done * (self.total - self.n)
            parts.append(f"about {left / 60:.1f} min left")
        if self.postfix:
            parts.append(self.postfix)
        print(", ".join(parts), file=self.stream, flush=True)


def progress(
    *, total: int, desc: str, unit: str = "step", initial: int = 0, quiet: bool = False
) -> tqdm | LineProgress:
    """A tqdm bar when stderr is a terminal, else LineProgress on stderr; nothing if quiet
    (another process of a data-parallel run shows it)."""
    if quiet:
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=True)
    if sys.stderr.isatty():
        return tqdm(total=total, initial=initial, desc=desc, unit=unit)
    return LineProgress(total=total, desc=desc, unit=unit, initial=initial, stream=sys.stderr)
