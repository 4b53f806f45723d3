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
holds the kernel plan the target runs (kernels.py: the product per row count, the weight
layout): `generate` runs the plan stored per machine, so its T(n) repeat; a bench that
measures a plan of its own times T(n) again under it unless one was stored for that plan.
Left out of the key, T(n) stored under one plan steered runs of another: with T(2) stored
2% above T(1) under packed products and 17% above under the plan a bench measured, a
draft chain at temperature 1.0 kept drafting with 0.2 of its drafts accepted, at 0.91x
(docs/tuning-and-measurement.md section 35).

The kernel plan itself (kernels.py: which product each row count uses) is measured once
per machine for `generate` too, and kept here beside the timings (KernelPlanStore): a
tuning profile carries one, but `generate` without a profile, fixed γ and plain decoding
included, ran the loaded defaults: on this project's CPU (default model, float32, one
thread, 128 tokens) 58.8 ms per token against 49.3 ms for plain decoding, and 39.6 against
33.4 ms with the MTP heads at γ 4 (docs/tuning-and-measurement.md section 24).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specmtp.cache import CachedModel
from specmtp.drafters import Drafter
from specmtp.files import write_atomically
from specmtp.kernels import (
    LAYOUTS,
    MAX_ROWS,
    STRATEGIES,
    KernelPlan,
    apply_kernel_plan,
    kernel_plan,
    measure_kernel_plan,
)
from specmtp.profile import cache_root, weights_fingerprint

# 2: oneDNN's packed products joined the kernel plans (kernels.py) and made verify passes
# of 4-8 rows up to a third cheaper: T(n) and plans stored before are timed again, once.
TIMINGS_VERSION = 2
KERNELS_VERSION = 2


def machine_key(model: torch.nn.Module) -> dict[str, Any]:
    """What a forward of `model` costs depends on, as this process runs it: its weights,
    dtype and device, the threads torch uses, torch's version, and for row-invariant
    forwards what computes their attention (the C kernel's T(n) is not the torch loop's)."""
    key = {
        "weights": weights_fingerprint(model.parameters()),
        "dtype": str(next(model.parameters()).dtype),
        "device": str(next(model.parameters()).device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    plan = kernel_plan(model)
    if plan is not None and plan.row_invariant_attention is not None:
        key["attention"] = plan.row_invariant_attention
    return key


@dataclass(frozen=True)
class TimingStore:
    """One file of seconds for the machine described by `machine`, under the kernel plan
    `kernels_of` runs when the file is read or written: T(n) for n = 1, 2, ..., or a
    drafter's D(k) = a + b·k as (a, b)."""

    directory: Path
    machine: dict[str, Any]
    kernels_of: torch.nn.Module | None = field(default=None, compare=False, repr=False)

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, *, drafter: Drafter | None = None, root: Path | None = None
    ) -> TimingStore:
        """The store for `model` as this process runs it: its weights, dtype, device, the
        threads torch uses and torch's version all change what a forward costs. With a
        drafter, the store of that drafter's costs next to this target."""
        key: dict[str, Any] = {"version": TIMINGS_VERSION, **machine_key(model)}
        if drafter is not None:
            key["drafter"] = getattr(drafter, "name", type(drafter).__name__)
            key["drafter_weights"] = weights_fingerprint(drafter.weight_tensors())
        return cls((root or cache_root()) / "timings", key, model)

    @property
    def key(self) -> dict[str, Any]:
        """`machine`, and the kernel per row count and the weight layout the model runs now
        (read when used: a bench measures its plan after building its generators)."""
        plan = None if self.kernels_of is None else kernel_plan(self.kernels_of)
        if plan is None or plan.row_invariant is not None:
            return self.machine  # no plan, or a row-invariant one (fixed kernels, machine_key)
        kernels = [plan.strategy(rows) for rows in range(1, MAX_ROWS + 1)]
        return {**self.machine, "kernels": kernels, "layout": plan.layout}

    @property
    def path(self) -> Path:
        return self._file(self.key)

    def _file(self, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        return self.directory / f"{digest}.json"

    def load(self) -> tuple[float, ...]:
        """The stored T(n), () when there is none. A file that cannot be read, or was
        written for another machine, is reported on stderr and read as none: it is a
        cache, and the next store replaces it."""
        key = self.key
        path = self._file(key)
        try:
            found = json.loads(path.read_text())
            if found["key"] != key:
                raise ValueError("it was written for another model or machine")
            seconds = tuple(float(s) for s in found["seconds"])
            if not seconds or min(seconds) < 0:
                raise ValueError("its times are negative or missing")
            return seconds
        except FileNotFoundError:
            return ()
        except (OSError, ValueError, KeyError, TypeError) as error:
            print(f"specmtp: ignoring stored timings {path}: {error}", file=sys.stderr)
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
        key = self.key
        path = self._file(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"key": key, "seconds": seconds}, indent=1)
        handle, name = tempfile.mkstemp(dir=path.parent, prefix=".timings-")
        try:
            with os.fdopen(handle, "w") as file:
                file.write(text)
            if stored or path.exists():  # extended, or unreadable: replaced
                os.replace(name, path)
            else:
                try:
                    os.link(name, path)  # fails if another process stored first
                except FileExistsError:
                    return self.load() or seconds
        finally:
            if os.path.exists(name):
                os.unlink(name)
        return seconds


@dataclass(frozen=True)
class KernelPlanStore:
    """One file holding the kernel plan measured for `model` on this machine: the
    strategy per row count and the weight layout (kernels.KernelPlan)."""

    path: Path
    key: dict[str, Any]

    @classmethod
    def for_model(cls, model: torch.nn.Module, *, root: Path | None = None) -> KernelPlanStore:
        """Keyed like the timings, and by the CPU: a cache shared by machines (a home
        directory on a cluster) must not hand one CPU's kernels to another."""
        key = {"version": KERNELS_VERSION, **machine_key(model), "cpu": _cpu_name()}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        return cls((root or cache_root()) / "kernels" / f"{digest}.json", key)

    def load(self) -> tuple[dict[int, str], str] | None:
        """(strategy per row count, layout), or None when nothing usable is stored; an
        unreadable file is reported on stderr and read as none (the next store replaces it)."""
        try:
            found = json.loads(self.path.read_text())
            if found["key"] != self.key:
                raise ValueError("it was written for another model or machine")
            by_rows = {int(rows): str(s) for rows, s in dict(found["by_rows"]).items()}
            layout = str(found["layout"])
            if not by_rows or set(by_rows.values()) - set(STRATEGIES) or layout not in LAYOUTS:
                raise ValueError("its strategies or layout are not known ones")
            return by_rows, layout
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            print(f"specmtp: ignoring stored kernel plan {self.path}: {error}", file=sys.stderr)
            return None

    def keep(self, plan: KernelPlan) -> None:
        """Store `plan` (written whole, then renamed into place)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"key": self.key, "by_rows": plan.by_rows, "layout": plan.layout}
        write_atomically(self.path, lambda path: path.write_text(json.dumps(data, indent=1)))


def use_stored_kernel_plan(
    model: torch.nn.Module,
    *,
    rows: int,
    context_length: int,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> KernelPlan | None:
    """Run `model` with the kernel plan stored for it on this machine, measured first for
    row counts 1..`rows` where the store has fewer (kernels.measure_kernel_plan after a
    64-token context, twice per strategy, with the weights as loaded: the other layout
    paid only for verify passes of 6 rows or more, on a Xeon with AMX, and timing it too
    took the default model about 27 s for 5 rows, against 7 s; once). A plan is extended,
    never changed: rows already stored keep their kernels, so `model`'s output on this
    machine does not move with later measurements (the kernels' float addition orders
    differ). Nothing to do for a model whose layers were not swapped (`--plain-kernels`)
    or whose kernels were fixed for row-invariant numerics. Returns the plan in use."""
    plan = kernel_plan(model)
    if plan is None or plan.disabled or plan.row_invariant is not None:
        return plan
    rows = max(1, min(rows, MAX_ROWS))
    store = KernelPlanStore.for_model(model)
    stored = store.load()
    if stored is not None and max(stored[0]) >= rows:
        apply_kernel_plan(model, *stored)
        return plan
    log(f"specmtp: timing this machine's kernels for 1-{rows} rows, once: {store.path}")
    vocab = model.get_output_embeddings().weight.shape[0]
    context = max(2, min(64, context_length - rows - 1))
    runner = CachedModel(model, vocab_size=vocab)
    layouts = ("out-major",) if stored is None else (stored[1],)
    ids = [i % vocab for i in range(1, context + 1)]
    measured = measure_kernel_plan(runner, ids, max_rows=rows, repeats=2, layouts=layouts)
    assert measured is not None  # swapped layers: measured
    if stored is not None:
        measured.by_rows = {**measured.by_rows, **stored[0]}
    store.keep(measured)
    return measured


def _cpu_name() -> str:
    """The CPU's model name (Linux), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
