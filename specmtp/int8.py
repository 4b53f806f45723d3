"""int8 products for drafters (`#int8` in a draft spec): cheaper drafts, the same output.

A draft only proposes tokens; the target's verification decides what is written, so a
drafter's products need not be exact, only cheap and close. On CPU a drafter's step reads
all its weights for a few rows: a memory-bound product, whose cost is the bytes read. With
int8 weights (one scale per output row) and the input rows quantized at each call, a
product reads half the bytes of bfloat16 and a quarter of float32. Two kernels:

- int8.c (native.py compiles it), where the CPU has AVX512-VNNI: each input row quantized
  to 8 bits by its own range (so a row's output does not depend on the call's other rows),
  the weights streamed once for all rows. For the Qwen2.5 0.5B draft's matrices (2 threads,
  this Intel Xeon, weights out of cache) 18-53% less time than fbgemm's for 1-8 rows, the
  least for the 151,936-row LM head (scripts/int8_products.py; docs/draft-models.md).
- fbgemm's dynamic product elsewhere (the input quantized per tensor). On the project's AMD
  EPYC (1 thread, weights not in cache) the shipped heads' 8192 x 576 output product of
  1-5 rows takes about 0.4 ms against 1.2 ms in bfloat16.

What changes is the drafts' logits, by quantization error: a close second candidate may
swap with the first. Greedy output stays token-identical to plain decoding (the target
verifies), and sampling stays lossless: a sampled chain's q is the distribution the int8
drafter drew from.

`use_int8_products(module)` swaps every linear layer of a drafter's module (nn.Linear, the
kernel-planned TunedLinear, the heads' and drafts' VocabProjection) for its int8 form, in
place; the float weights are dropped. Inference only: the swapped module cannot train.

torch 2.13 marks its quantized tensors deprecated (pytorch/pytorch#184982) and the project
pins that version. Where a torch build lacks the engine, `#int8` is refused with one line.
"""

from __future__ import annotations

import ctypes
import warnings
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from specmtp import native
from specmtp.errors import SpecMTPError
from specmtp.heads import VocabProjection
from specmtp.specs import split_flag

if TYPE_CHECKING:
    from specmtp.int4 import Int4Product

INT8 = "#int8"  # the draft spec option
BLOCK = 16  # int8.c's output rows per block


def int8_products_available() -> bool:
    """Whether this torch build has a CPU engine for the dynamic int8 product."""
    return torch.backends.quantized.engine not in ("none", "") and hasattr(
        torch.ops.quantized, "linear_dynamic"
    )


@cache
def reduce_input_range() -> bool:
    """Whether the input rows are quantized to 7 bits, not 8: on x86 without VNNI (or AMX)
    fbgemm sums pairs of u8 x s8 products in 16 bits, which 8-bit inputs could saturate.
    With VNNI the sums are 32-bit, and the 8th bit keeps the drafts closer to the float
    ones (shipped heads, 12 held-out prompts: acceptance at position 1 0.677 with 8 bits,
    0.663 with 7, 0.684 in bfloat16)."""
    if torch.backends.quantized.engine not in ("x86", "fbgemm"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    return not any(flag in flags for flag in ("avx512_vnni", "avx_vnni", "amx_int8"))


class Int8Product:
    """x @ W^T + b with W stored as int8, one scale per output row (symmetric), and x
    quantized per call: int8.c's product where native.int8_kernel() gives it (or where
    `kernel` is passed), else fbgemm's (or the engine's) dynamic product, in float32; the
    result in x's dtype."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        kernel: ctypes._CFuncPtr | Literal["auto"] | None = "auto",
    ) -> None:
        if weight.device.type != "cpu":
            raise SpecMTPError(f"{INT8} products run on CPU; this drafter is on {weight.device}")
        self.kernel = native.int8_kernel() if kernel == "auto" else kernel
        if self.kernel is None and not int8_products_available():
            raise SpecMTPError(f"{INT8}: this torch build has no quantized CPU engine")
        w = weight.detach().float()  # [out, in]
        scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).double()  # [out]
        zeros = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # deprecated in torch 2.13 (see the module's note)
            warnings.filterwarnings("ignore", message="torch.quantize_per_tensor, torch.quant")
            quantized = torch.quantize_per_channel(w, scale, zeros, 0, torch.qint8)
        # [out, in] int8, for reports and fingerprints; the engine packs its own copy
        self.weight = quantized.int_repr()
        self.scale = scale.float()  # [out]
        self.out_features, self.in_features = w.shape
        self.bias = None if bias is None else bias.detach().float().contiguous()
        if self.kernel is not None:
            self.packed = interleave(self.weight)
            self.wsum = _padded(self.weight.sum(1, dtype=torch.int32))
            self.padded_scale = _padded(self.scale)
            return
        self.reduce_range = reduce_input_range()
        self.packed = torch.ops.quantized.linear_prepack(quantized, self.bias)

    @classmethod
    def stacked(cls, products: list[Int8Product]) -> Int8Product:
        """One product whose output rows are those of `products` in turn (one call reads
        them all, one quantization of the input); each of `products` then reads its rows of
        the stacked copy, so the weights are not held twice. int8.c's products only, each
        a whole number of blocks, all with the same inputs."""
        first = products[0]
        if any(p.kernel is None or p.out_features % BLOCK for p in products) or any(
            p.in_features != first.in_features for p in products
        ):
            raise ValueError("only int8.c's products of whole blocks and equal inputs stack")
        stacked = cls.__new__(cls)
        stacked.kernel, stacked.in_features = first.kernel, first.in_features
        stacked.out_features = sum(p.out_features for p in products)
        for name in ("weight", "scale", "packed", "wsum", "padded_scale"):
            setattr(stacked, name, torch.cat([getattr(p, name) for p in products]))
        biases = [
            p.bias if p.bias is not None else p.scale.new_zeros(p.out_features) for p in products
        ]
        has_bias = any(p.bias is not None for p in products)
        stacked.bias = torch.cat(biases) if has_bias else None
        start = 0
        for p in products:
            rows, blocks = (
                slice(start, start + p.out_features),
                slice(start // BLOCK, (start + p.out_features) // BLOCK),
            )
            p.weight, p.scale, p.packed = (
                stacked.weight[rows],
                stacked.scale[rows],
                stacked.packed[blocks],
            )
            p.wsum, p.padded_scale = stacked.wsum[rows], stacked.padded_scale[rows]
            p.bias = None if p.bias is None else stacked.bias[rows]
            start += p.out_features
        return stacked

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return product_of_rows(self, x)
        rows = x.reshape(-1, x.shape[-1]).float()  # [M, in]
        out = torch.ops.quantized.linear_dynamic(rows, self.packed, self.reduce_range)  # [M, out]
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def into(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """out [M, out] = the product of rows [M, in]; both contiguous, both float32 or both
        bfloat16 (lean.py's forward keeps its outputs from step to step)."""
        if self.kernel is None:
            out.copy_(self(rows))
            return
        failed = self.kernel(
            rows.data_ptr(), int(rows.dtype == torch.bfloat16), rows.shape[0],
            self.in_features, self.packed.data_ptr(), self.out_features,
            self.padded_scale.data_ptr(), self.wsum.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(), out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError(f"int8 product of {rows.shape[0]} rows: out of memory")


def product_of_rows(product: Int8Product | Int4Product, x: torch.Tensor) -> torch.Tensor:
    """x [..., in] through a native product's `into` (as 2-D rows, float32 or bfloat16), the
    result [..., out] in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])  # [M, in]
    rows = (rows if x.dtype == torch.bfloat16 else rows.float()).contiguous()
    out = torch.empty(rows.shape[0], product.out_features, dtype=rows.dtype)  # [M, out]
    product.into(rows, out)
    return out.to(x.dtype).reshape(*x.shape[:-1], product.out_features)


def interleave(weight: torch.Tensor) -> torch.Tensor:
    """int8.c's layout of an [out, in] int8 matrix: [ceil(out/16), in/4, 16, 4], each
    dimension padded with zeros (packed[b, j, r, t] = weight[16b + r, 4j + t])."""
    out_features, in_features = weight.shape
    rows, columns = -(-out_features // BLOCK) * BLOCK, -(-in_features // 4) * 4
    padded = torch.zeros(rows, columns, dtype=torch.int8)
    padded[:out_features, :in_features] = weight
    return padded.view(rows // BLOCK, BLOCK, columns // 4, 4).permute(0, 2, 1, 3).contiguous()


def _padded(values: torch.Tensor) -> torch.Tensor:
    """values [out] with zeros up to a multiple of int8.c's block of 16 rows."""
    return torch.cat([values, values.new_zeros(-len(values) % BLOCK)]).contiguous()


class Int8Linear(nn.Module):
    """A linear layer on an Int8Product. `weight` is the int8 matrix it reads ([out, in],
    so code that reads a layer's shape still can), `scale` its row scales."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.product = Int8Product(linear.weight, linear.bias)
        self.register_buffer("weight", self.product.weight)
        self.register_buffer("scale", self.product.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)


def use_int8_products(module: nn.Module) -> nn.Module:
    """Swap every linear layer and vocabulary projection of `module` (a drafter's heads or
    draft model) for its int8 form, in place; returns `module`. A projection shared by two
    owners (a draft's heads and its LM head) is swapped once."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child))
            elif isinstance(child, VocabProjection) and child.int8 is None:
                _quantize_projection(child)
    return module


def _quantize_projection(projection: VocabProjection) -> None:
    """The projection's product in int8: its float rows give way to the int8 ones."""
    product = Int8Product(projection.weight, None)
    if isinstance(projection.weight, nn.Parameter):
        del projection.weight  # a trained copy: a buffer from now on
    projection.register_buffer("weight", product.weight, persistent=False)
    projection.register_buffer("scale", product.scale, persistent=False)
    projection.int8 = product


def split_int8(spec: str) -> tuple[str, bool]:
    """`SPEC#int8` (the option anywhere among SPEC's `#` options) -> (SPEC without it, True);
    a spec without it -> (spec, False)."""
    return split_flag(spec, INT8)
