"""T(n) and draft costs timed once per machine for sampled runs: a seed fixes the output.

At temperature > 0 the adaptive and guarded schedules steer by acceptances and the cost
model alone, never by the rounds' wall-clock times: γ decides how the generator's numbers
are used, so a γ that followed the clock would make the sampled text follow it too. But
without a tuning profile the cost model's T(n) is itself timed when first needed, and two
processes time it differently: near a tie between two γ, the choice, and the text, went
with the clock (the same seed, two measured T(n), two texts: tests/test_timings.py).

So sampled runs without a profile read T(n) from a file kept per target weights, dtype,
thread count and torch version, and the drafter's D(k) from one per drafter too: without
timing feedback nothing else tells them what a draft costs, and drafts taken as free made
the target drafting for itself draft 8 tokens every round, at 0.71x of plain decoding. The
first run times and stores it; every later run on the machine reads the same numbers, and a
run that needs larger sizes appends them, keeping the stored ones. Greedy runs still time
T(n) in their own process: their output does not depend on it, their speed does. The key
leaves out the kernel plan (kernels.py): a bench measures one per process, and here the
numbers must repeat, not follow the kernels.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specmtp.drafters import Drafter
from specmtp.profile import cache_root, weights_fingerprint

TIMINGS_VERSION = 1


@dataclass(frozen=True)
class TimingStore:
    """One file of seconds for the machine described by `key`: T(n) for n = 1, 2, ...,
    or a drafter's D(k) = a + b·k as (a, b)."""

    path: Path
    key: dict[str, Any]

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, *, drafter: Drafter | None = None, root: Path | None = None
    ) -> TimingStore:
        """The store for `model` as this process runs it: its weights, dtype, device, the
        threads torch uses and torch's version all change what a forward costs. With a
        drafter, the store of that drafter's costs next to this target."""
        key: dict[str, Any] = {
            "version": TIMINGS_VERSION,
            "weights": weights_fingerprint(model.parameters()),
            "dtype": str(next(model.parameters()).dtype),
            "device": str(next(model.parameters()).device),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        }
        if drafter is not None:
            key["drafter"] = getattr(drafter, "name", type(drafter).__name__)
            key["drafter_weights"] = weights_fingerprint(drafter.weight_tensors())
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        return cls((root or cache_root()) / "timings" / f"{digest}.json", key)

    def load(self) -> tuple[float, ...]:
        """The stored T(n), () when there is none. A file that cannot be read, or was
        written for another machine, is reported on stderr and read as none: it is a
        cache, and the next store replaces it."""
        try:
            found = json.loads(self.path.read_text())
            if found["key"] != self.key:
                raise ValueError("it was written for another model or machine")
            seconds = tuple(float(s) for s in found["seconds"])
            if not seconds or min(seconds) < 0:
                raise ValueError("its times are negative or missing")
            return seconds
        except FileNotFoundError:
            return ()
        except (OSError, ValueError, KeyError, TypeError) as error:
            print(f"specmtp: ignoring stored timings {self.path}: {error}", file=sys.stderr)
            return ()

    def keep(self, measured: Sequence[float]) -> tuple[float, ...]:
        """Store `measured` where it reaches past what is stored, keeping the stored sizes
        (a run that read them must read them again), and return what is stored now.
        A first file is created only if none exists (two processes timing at once both
        go on with the first one written)."""
        stored = self.load()
        if len(stored) >= len(measured):
            return stored
        seconds = (*stored, *measured[len(stored) :])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"key": self.key, "seconds": seconds}, indent=1)
        handle, name = tempfile.mkstemp(dir=self.path.parent, prefix=".timings-")
        try:
            with os.fdopen(handle, "w") as file:
                file.write(text)
            if stored or self.path.exists():  # extended, or unreadable: replaced
                os.replace(name, self.path)
            else:
                try:
                    os.link(name, self.path)  # fails if another process stored first
                except FileExistsError:
                    return self.load() or seconds
        finally:
            if os.path.exists(name):
                os.unlink(name)
        return seconds
