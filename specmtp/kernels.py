"""Kernel choice for the few-row matrix products of decoding and verification on CPU.

A verify pass multiplies every weight matrix by a handful of rows (γ + 1 tokens). On CPU,
`F.linear` (x @ W^T) handles 2-8 rows badly: for SmolLM2's 49152 x 576 LM head, 2 rows cost
twice one row (15 ms against 7), although both read the same 113 MB of weights. The
transposed product (W @ x^T)^T runs 2-8 rows at close to the one-row cost (5-10 ms). For the
small per-layer matrices it depends: inside the model (weights streamed from memory) it
helps at 2-3 rows and hurts from 4.

So a KernelPlan says, per row count, which modules use the transposed product: none
(`plain`, the default for one row), the LM head only (`head`, the default for 2-8 rows),
every linear layer (`all`), or every layer with an odd row count padded by a copy of the
last row (`even`). The last is for one row above all: on some of these CPUs the one-column
product takes a slow matrix-vector path, and two rows cost less than one (T(1) of the
default model 73.5 ms plain, 45.2 ms even; float32, 1 thread, scripts/one_row_kernels.py).
`measure_kernel_plan` picks per row count, one row included (plain decoding's step), by
timing whole target forwards, the quantity that matters. Both kernels compute the same
product; only the order of float additions differs, as it already does between row counts.
Modules are swapped in place (their class, not their parameters), so plain and speculative
decoding of one model use the same kernels and the bench stays fair. Training keeps
F.linear.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specmtp.cache import CachedModel
from specmtp.costmodel import measure_verify_costs

MAX_ROWS = 8  # more rows than this: F.linear everywhere
STRATEGIES = ("plain", "head", "all", "even")

# Process-wide, like torch.set_num_threads: whether load_model swaps in TunedLinear.
_ENABLED = True


def set_tuned_linear(enabled: bool) -> None:
    global _ENABLED
    _ENABLED = enabled


def tuned_linear_enabled() -> bool:
    return _ENABLED


@dataclass
class KernelPlan:
    """Per row count, which linear layers use the transposed product."""

    by_rows: dict[int, str] = field(default_factory=dict)  # rows -> one of STRATEGIES
    disabled: bool = False  # F.linear everywhere for now (see stock_kernels)

    def strategy(self, rows: int) -> str:
        if self.disabled or not 1 <= rows <= MAX_ROWS:
            return "plain"
        return self.by_rows.get(rows, "plain" if rows == 1 else "head")


def transposed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, even: bool = False
) -> torch.Tensor:
    """x @ W^T + b as (W @ x^T)^T; with `even`, an odd row count is padded with a copy of
    the last row, whose product is dropped."""
    rows = x.reshape(-1, x.shape[-1])  # [M, in]
    m = rows.shape[0]
    if even and m % 2:
        rows = torch.cat([rows, rows[-1:]])  # [M+1, in]
    out = (weight @ rows.T).T[:m]  # [out, in] @ [in, M] -> [M, out]
    out = out.contiguous() if bias is None else out + bias  # callers may .view() it
    return out.reshape(*x.shape[:-1], weight.shape[0])


class TunedLinear(nn.Linear):
    """nn.Linear that follows its model's KernelPlan for inference on a few rows."""

    kernel_plan: KernelPlan
    is_head: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        training = torch.is_grad_enabled() and self.weight.requires_grad
        if not training and x.device.type == "cpu":
            strategy = self.kernel_plan.strategy(rows)
            if strategy in ("all", "even") or (strategy == "head" and self.is_head):
                return transposed_linear(x, self.weight, self.bias, even=strategy == "even")
        return F.linear(x, self.weight, self.bias)


def use_tuned_linear(model: nn.Module) -> KernelPlan:
    """Swap every plain nn.Linear of `model` for TunedLinear sharing one (default) plan."""
    plan = kernel_plan(model) or KernelPlan()  # a second call keeps the plan in use
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for module in model.modules():
        if type(module) in (nn.Linear, TunedLinear):
            module.__class__ = TunedLinear
            module.kernel_plan = plan
            module.is_head = module is head
    return plan


def apply_kernel_plan(model: nn.Module, by_rows: dict[Any, str] | None) -> None:
    """Use a plan measured earlier (a tuning profile's); keys may be JSON strings."""
    plan = kernel_plan(model)
    if plan is not None and by_rows:
        plan.by_rows = {int(rows): strategy for rows, strategy in by_rows.items()}


def kernel_plan(model: nn.Module) -> KernelPlan | None:
    """The plan `model`'s linear layers follow, if they were swapped."""
    for module in model.modules():
        if isinstance(module, TunedLinear):
            return module.kernel_plan
    return None


def measure_kernel_plan(
    runner: CachedModel, prompt_ids: Sequence[int], *, max_rows: int = MAX_ROWS, repeats: int = 3
) -> KernelPlan | None:
    """Time T(n) of the whole model under each strategy and keep the fastest per n.

    Strategies take turns sweep by sweep, so load changes hit them alike. Updates and
    returns the model's plan (None when its layers were not swapped).
    """
    plan = kernel_plan(runner.model)
    if plan is None:
        return None
    rows = min(max_rows, MAX_ROWS)
    sweeps: dict[str, list[tuple[float, ...]]] = {s: [] for s in STRATEGIES}
    saved = plan.by_rows
    try:
        for _ in range(repeats):
            for strategy in STRATEGIES:
                plan.by_rows = dict.fromkeys(range(1, rows + 1), strategy)
                sweeps[strategy].append(
                    measure_verify_costs(runner, prompt_ids, max_tokens=rows, repeats=1)
                )
    except BaseException:
        plan.by_rows = saved  # an interrupted measurement leaves the plan as it was
        raise
    medians = {s: [statistics.median(t) for t in zip(*v, strict=True)] for s, v in sweeps.items()}
    plan.by_rows = {n: min(STRATEGIES, key=lambda s: medians[s][n - 1]) for n in range(1, rows + 1)}
    return plan


@contextmanager
def stock_kernels(*models: nn.Module | None) -> Iterator[None]:
    """Run `models` with F.linear everywhere for a while: how other engines (Hugging Face's
    generate) run them."""
    plans = [plan for plan in map(kernel_plan, filter(None, models)) if plan is not None]
    saved = [plan.disabled for plan in plans]
    for plan in plans:
        plan.disabled = True
    try:
        yield
    finally:
        for plan, was in zip(plans, saved, strict=True):
            plan.disabled = was
