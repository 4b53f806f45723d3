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

Or every layer takes oneDNN's product on a copy of its weights packed once for it
(`packed`, where torch has oneDNN). F.linear's BLAS seems to rearrange the weights it reads
on every call with a few rows; a packed copy is read as it is, and 8 rows cost about what
2 do. On an Intel Xeon with AMX (float32, 1 thread, every product of the default model's 30
layers and its LM head for 1-8 rows, ms; scripts/packed_products.py): F.linear 45 46 52
76 77 84 99 100, packed 47 52 55 58 59 62 61 66. The copy costs memory (the model's linear
weights once more, `packed_bytes`), so it is kept only while the plan uses it for some
row count.
`measure_kernel_plan` picks per row count, one row included (plain decoding's step), by
timing whole target forwards, the quantity that matters. Both kernels compute the same
product; only the order of float additions differs, as it already does between row counts.
Modules are swapped in place (their class, not their parameters), so plain and speculative
decoding of one model use the same kernels and the bench stays fair. Training keeps
F.linear.

A plan also says how the weights of every linear layer but the LM head (often the
embedding matrix too) are stored: `out-major` as loaded ([out, in], one output's weights
contiguous), or `in-major` (the same values stored [in, out], `weight` being its transposed
view), so F.linear's product reads them without a transpose. Which is faster depends on the
CPU and its BLAS: on an Intel Xeon with AMX (float32, 1 thread, default model, whole-model
T(n) in ms for n = 1 2 3 4 6 8; scripts/kernel_layouts.py at commit 8e503d9) out-major gave
63.6 73.4 75.6 109.6 126.9 147.7 and in-major 64.1 88.1 91.8 106.9 110.5 124.0.
`measure_kernel_plan` times both and keeps the layout with the smaller
geometric mean over row counts of the fastest strategy's T(n).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specmtp.amx import amx_linear, amx_pack
from specmtp.cache import CachedModel
from specmtp.costmodel import measure_verify_costs
from specmtp.errors import SpecMTPError

MAX_ROWS = 8  # more rows than this: F.linear everywhere


def packing_available() -> bool:
    """Whether this torch has oneDNN's packed linear product (the `packed` strategy)."""
    try:
        return torch.backends.mkldnn.is_available() and bool(
            torch.ops.mkldnn._linear_pointwise and torch.ops.mkldnn._reorder_linear_weight
        )
    except (AttributeError, RuntimeError):
        return False


PACKING_AVAILABLE = packing_available()
PACKED = "packed"
STRATEGIES = ("plain", "head", "all", "even", *((PACKED,) if PACKING_AVAILABLE else ()))
PACKED_ROWS = 8  # the row count oneDNN packs the weights for: verify passes of 1-MAX_ROWS
# The row-invariant product on AMX tiles (amx.py), where this machine runs it: its own copy
# of the weights, as PACKED. Only a row-invariant plan uses it, for bfloat16 weights.
AMX = "amx"
PACKED_PRODUCTS = (PACKED, AMX)  # the products that read a packed copy of the weights
LAYOUTS = ("out-major", "in-major")  # how the non-head weights are stored (set_weight_layout)

# Process-wide, like torch.set_num_threads: whether load_model swaps in TunedLinear.
_ENABLED = True


def set_tuned_linear(enabled: bool) -> None:
    global _ENABLED
    _ENABLED = enabled


def tuned_linear_enabled() -> bool:
    return _ENABLED


# Process-wide too: whether weights may be packed (`--no-packed-weights` says no: the
# copies cost memory). Plans then neither time nor run `packed` (a plan from a profile or
# another machine takes the default kernels for its packed rows), and models loaded
# meanwhile take other row-invariant products.
_PACKING = True


def set_packing(enabled: bool) -> None:
    global _PACKING
    _PACKING = enabled


def packing_allowed() -> bool:
    """Whether packing is both wanted (set_packing) and possible (this torch has oneDNN)."""
    return _PACKING and PACKING_AVAILABLE


@contextmanager
def without_packing() -> Iterator[None]:
    """No packing for a while: a drafter whose products all become int8 would pack its
    weights at load only to drop them."""
    before = _PACKING
    set_packing(False)
    try:
        yield
    finally:
        set_packing(before)


@dataclass
class KernelPlan:
    """Per row count, which linear layers use the transposed product."""

    by_rows: dict[int, str] = field(default_factory=dict)  # rows -> one of STRATEGIES
    disabled: bool = False  # F.linear everywhere for now (see stock_kernels)
    layout: str = "out-major"  # one of LAYOUTS; change it with set_weight_layout
    # Set by invariant.use_row_invariant: what its products are ("flat", "padded", or per
    # weight shape, e.g. "flat, padded for 576x1536"), each layer's own for every row
    # count, which measurements and profiles leave alone; and the attention the model had
    # before (restored by stock_kernels); and what computes the row-invariant attention
    # (invariant.attention_path).
    row_invariant: str | None = None
    stock_attention: str | None = None
    row_invariant_attention: str | None = None

    def strategy(self, rows: int) -> str:
        if self.disabled:
            return "plain"
        if self.row_invariant is not None:
            return INVARIANT
        if not 1 <= rows <= MAX_ROWS:
            return "plain"
        strategy = self.by_rows.get(rows, "plain" if rows == 1 else "head")
        if strategy == PACKED and not packing_allowed():  # a stored plan's: the default
            return "plain" if rows == 1 else "head"
        return strategy


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


# The block height of padded products: one block serves a plain step and a verify pass of
# up to 8 rows (16 cost a plain step 4% more on an AMD EPYC; docs/exact-bfloat16.md).
PAD_ROWS = 8
# Past PAD_ROWS rows, blocks of 16 ("padded16"), where a row gets the same bits in a block
# of 8 and of 16 (its probe): a verify pass of 9-16 rows (a 15-node tree) then reads the
# weights once, not twice, and a plain step still pays for a block of 8. The Qwen2.5-Coder
# 1.5B target's 8960 -> 1536 down projection on an Intel Xeon with AMX: T(9..16) 243-280 ms
# against T(1..8) 200-215 in blocks of 8, 216-250 in blocks of 16 (verify_costs.txt in
# docs/bench-int4-2026-12-07/); blocks of 16 for every row count cost T(1) about 5% more.
WIDE_PAD_ROWS = 16
WIDE = "padded16"


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + b by oneDNN, on W packed by `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A copy of `weight` [out, in] (either layout) in oneDNN's layout for PACKED_ROWS rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_ROWS)


def pack_for(product: str, weight: torch.Tensor) -> torch.Tensor | None:
    """The copy of `weight` that `product` reads: amx.c's layout for "amx", oneDNN's for
    "packed"; None for the products that read the weights as they are."""
    if product == AMX:
        return amx_pack(weight)
    return pack_weight(weight) if product == PACKED else None


def padded_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, block: int = PAD_ROWS
) -> torch.Tensor:
    """x @ W^T + b on blocks of exactly `block` rows (the last zero-padded): a BLAS that
    picks its algorithm by row count then gives a row the same bits at every row count."""
    rows = x.reshape(-1, x.shape[-1])  # [M, in]
    m = rows.shape[0]
    if m % block:
        rows = torch.cat([rows, rows.new_zeros(block - m % block, rows.shape[1])])
    out = torch.cat([F.linear(part, weight, bias) for part in rows.split(block)])[:m]
    return out.reshape(*x.shape[:-1], weight.shape[0])


INVARIANT = "invariant"  # the strategy of every row count under a row-invariant plan


class TunedLinear(nn.Linear):
    """nn.Linear that follows its model's KernelPlan for inference on a few rows."""

    kernel_plan: KernelPlan
    is_head: bool
    # Set by invariant.use_row_invariant: this weight's row-invariant product, "packed",
    # "flat", "padded" or "padded16", probed for its shape (invariant_linear).
    invariant_product: str = "flat"

    # The weights packed for the `packed` strategy, and the (address, version) of the
    # weights they were packed from: a weight moved or changed in place is packed again.
    packed: torch.Tensor | None = None
    packed_from: tuple[int, int, bool] | None = None  # and whether amx.c's layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        training = torch.is_grad_enabled() and self.weight.requires_grad
        if not training and x.device.type == "cpu":
            strategy = self.kernel_plan.strategy(rows)
            if strategy == INVARIANT:
                packed = self.invariant_product in PACKED_PRODUCTS and not torch.is_grad_enabled()
                return invariant_linear(
                    x, self.weight, self.bias, self.invariant_product,
                    packed=self.packed_weight() if packed else None,
                )  # fmt: skip
            if strategy in ("all", "even") or (strategy == "head" and self.is_head):
                return transposed_linear(x, self.weight, self.bias, even=strategy == "even")
            if strategy == PACKED and not torch.is_grad_enabled():  # an inference-only kernel
                return packed_linear(x, self.packed_weight(), self.bias)
        return F.linear(x, self.weight, self.bias)

    def packed_weight(self) -> torch.Tensor:
        """The weights packed for their product (oneDNN's, or amx.c's for a row-invariant
        `amx` product), packed now if they never were or have changed."""
        amx = self.kernel_plan.row_invariant is not None and self.invariant_product == AMX
        source = (self.weight.data_ptr(), self.weight._version, amx)
        if self.packed is None or self.packed_from != source:
            self.packed = None  # the old copy goes before the new one is made
            self.packed = pack_for(AMX if amx else PACKED, self.weight)
            self.packed_from = source
        return self.packed

    def release_packed(self) -> None:
        self.packed, self.packed_from = None, None


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    product: str,
    *,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ W^T + b by one of the row-invariant products (TunedLinear.invariant_product):
    amx.c's on bfloat16 weights in its tiles' layout ("amx", given as `packed`), oneDNN's
    product on the weights packed once ("packed", given as `packed`; without either,
    as when gradients are wanted, F.linear as "flat"), F.linear on 2-D rows ("flat";
    some BLAS builds take another kernel for a 3-D input of one row than of several) or
    padded blocks of PAD_ROWS rows ("padded"; "padded16": past PAD_ROWS rows, blocks of
    WIDE_PAD_ROWS)."""
    if product == AMX:
        if packed is None:  # gradients wanted: F.linear, as for "packed"
            return F.linear(x, weight, bias)
        return amx_linear(x, packed, weight.shape[0], bias)
    if product == "padded":
        return padded_linear(x, weight, bias)
    if product == WIDE:
        wide = x.numel() // x.shape[-1] > PAD_ROWS
        return padded_linear(x, weight, bias, block=WIDE_PAD_ROWS if wide else PAD_ROWS)
    rows = x.reshape(-1, x.shape[-1])
    out = F.linear(rows, weight, bias) if packed is None else packed_linear(rows, packed, bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


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


def apply_kernel_plan(
    model: nn.Module, by_rows: dict[Any, str] | None, layout: str | None = None
) -> None:
    """Use a plan measured earlier (a tuning profile's); keys may be JSON strings. A
    row-invariant plan stays as it is: the numerics, not speed, chose its kernels."""
    plan = kernel_plan(model)
    if plan is not None and plan.row_invariant is not None:
        return
    if plan is not None and by_rows:
        plan.by_rows = {int(rows): strategy for rows, strategy in by_rows.items()}
    if plan is not None and layout is not None:
        set_weight_layout(model, layout)
    if plan is not None:
        settle_packed(model)


def set_weight_layout(model: nn.Module, layout: str) -> None:
    """Store the weights of `model`'s swapped linear layers, the LM head aside, out-major
    (contiguous [out, in], as loaded) or in-major (contiguous [in, out], `weight` its
    transposed view). Values, shapes and parameters stay the same; only the storage moves."""
    if layout not in LAYOUTS:
        raise SpecMTPError(f"kernel layout must be one of {LAYOUTS}, got {layout!r}")
    plan = kernel_plan(model)
    if plan is None:
        raise ValueError("set_weight_layout needs a model whose linear layers were swapped")
    for module in model.modules():
        if isinstance(module, TunedLinear) and not module.is_head:
            weight = module.weight.data
            stored_in_major = weight.dim() == 2 and weight.stride() == (1, weight.shape[0])
            if layout == "in-major" and not stored_in_major:
                module.weight.data = weight.t().contiguous().t()
            elif layout == "out-major" and not weight.is_contiguous():
                module.weight.data = weight.contiguous()
    plan.layout = layout


def uses_packed(plan: KernelPlan, module: TunedLinear | None = None) -> bool:
    """Whether `plan` runs the packed product for some row count (of `module`, for a
    row-invariant plan: each weight shape has its product)."""
    if plan.row_invariant is not None:
        return module is not None and module.invariant_product in PACKED_PRODUCTS
    return not plan.disabled and packing_allowed() and PACKED in plan.by_rows.values()


def pack_weights(model: nn.Module) -> None:
    """Pack every swapped layer's weights for the `packed` strategy (if not already)."""
    for module in model.modules():
        if isinstance(module, TunedLinear):
            module.packed_weight()


def release_packed(model: nn.Module) -> None:
    """Drop the packed copies of `model`'s weights."""
    for module in model.modules():
        if isinstance(module, TunedLinear):
            module.release_packed()


def settle_packed(model: nn.Module) -> None:
    """Packed copies of the weights exactly while `model`'s plan uses them: packed now
    rather than in the first verify pass that needs them, dropped when nothing does."""
    for module in model.modules():
        if isinstance(module, TunedLinear):
            if uses_packed(module.kernel_plan, module):
                module.packed_weight()
            else:
                module.release_packed()


def packed_bytes(model: nn.Module) -> int:
    """Bytes held by the packed copies of `model`'s weights."""
    return sum(
        m.packed.numel() * m.packed.element_size()
        for m in model.modules()
        if isinstance(m, TunedLinear) and m.packed is not None
    )


def kernel_plan(model: nn.Module) -> KernelPlan | None:
    """The plan `model`'s linear layers follow, if they were swapped."""
    for module in model.modules():
        if isinstance(module, TunedLinear):
            return module.kernel_plan
    return None


def measure_kernel_plan(
    runner: CachedModel,
    prompt_ids: Sequence[int],
    *,
    max_rows: int = MAX_ROWS,
    repeats: int = 3,
    layouts: Sequence[str] = LAYOUTS,
) -> KernelPlan | None:
    """Time T(n) of the whole model under each weight layout (of `layouts`) and strategy;
    keep the layout whose fastest strategies have the smaller geometric mean of T(n) over
    n (a 10% change at one row weighs as much as at eight), and its fastest strategy per n.

    Layouts and strategies take turns sweep by sweep, so load changes hit them alike.
    Updates and returns the model's plan (None when its layers were not swapped).
    """
    plan = kernel_plan(runner.model)
    if plan is None or plan.row_invariant is not None:
        return plan  # a row-invariant plan's kernels are fixed (invariant.py)
    rows = min(max_rows, MAX_ROWS)
    timed = [s for s in STRATEGIES if s != PACKED or packing_allowed()]
    sweeps: dict[tuple[str, str], list[tuple[float, ...]]] = {}
    saved = plan.by_rows, plan.layout
    try:
        for _ in range(repeats):
            for layout in layouts:
                set_weight_layout(runner.model, layout)
                for strategy in timed:
                    plan.by_rows = dict.fromkeys(range(1, rows + 1), strategy)
                    if strategy == PACKED:
                        pack_weights(runner.model)  # not inside the timed forwards
                    sweeps.setdefault((layout, strategy), []).append(
                        measure_verify_costs(runner, prompt_ids, max_tokens=rows, repeats=1)
                    )
    except BaseException:
        plan.by_rows = saved[0]  # an interrupted measurement leaves the plan as it was
        set_weight_layout(runner.model, saved[1])
        settle_packed(runner.model)
        raise
    medians = {k: [statistics.median(t) for t in zip(*v, strict=True)] for k, v in sweeps.items()}
    best: dict[str, dict[int, str]] = {
        layout: {n: min(timed, key=lambda s: medians[layout, s][n - 1]) for n in range(1, rows + 1)}
        for layout in layouts
    }

    def log_total(layout: str) -> float:  # every row count weighs alike, in relative terms
        return sum(math.log(max(medians[layout, s][n - 1], 1e-9)) for n, s in best[layout].items())

    layout = min(layouts, key=log_total)
    set_weight_layout(runner.model, layout)
    plan.by_rows = best[layout]
    settle_packed(runner.model)
    return plan


@contextmanager
def stock_kernels(*models: nn.Module | None) -> Iterator[None]:
    """Run `models` with F.linear everywhere, their weights as loaded and their attention as
    loaded for a while: how other engines (Hugging Face's generate) run them."""
    swapped = [(m, plan) for m in filter(None, models) if (plan := kernel_plan(m)) is not None]
    saved = [(plan.disabled, plan.layout, m.config._attn_implementation) for m, plan in swapped]
    for model, plan in swapped:
        plan.disabled = True
        set_weight_layout(model, "out-major")  # as loaded
        if plan.stock_attention is not None:
            model.set_attn_implementation(plan.stock_attention)
    try:
        yield
    finally:
        for (model, plan), (was, layout, attention) in zip(swapped, saved, strict=True):
            plan.disabled = was
            set_weight_layout(model, layout)
            if model.config._attn_implementation != attention:
                model.set_attn_implementation(attention)
