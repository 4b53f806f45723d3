"""4-bit products for draft models (`#int4` in a draft spec): a draft step reads fewer bytes.

A draft model's step on CPU is memory-bound: its cost is the bytes of weights it reads
(int8.py). `#int4` stores the decoder layers' matrices in 4 bits, with one scale and one
midpoint (fp16) per 32 inputs of an output row, 0.625 bytes a weight against int8's 1; the LM
head stays in int8 (`#int4` implies `#int8` for what it does not cover). The product is
int4.c's (AVX512-VNNI): each input row quantized to 8 bits by its own range, as int8.c.

What changes is the draft's logits, by a coarser rounding than int8's: drafts may be
accepted less often; greedy output stays token-identical to plain decoding and sampling
stays lossless, as for every drafter. A GGUF draft stored in Q4_K (4 bits, a scale and a
minimum per 32 weights, as the 0.5B Qwen draft's Q4_K_M file mostly is) already lies on a
4-bit grid per group; ours is that grid where a group uses both ends of its range (how
often it does was not measured).
"""

from __future__ import annotations

import ctypes
from typing import Literal

import torch
from torch import nn

from specmtp import native
from specmtp.errors import SpecMTPError
from specmtp.int8 import product_of_rows
from specmtp.specs import split_flag

INT4 = "#int4"  # the draft spec option
BLOCK = 16  # output rows per record (int4.c)
GROUP_SIZE = 32  # inputs per step and midpoint
LEVELS = 15  # q in 0 .. LEVELS


class Int4Product:
    """x @ W^T + b with W in 4 bits (a step and a midpoint per GROUP_SIZE inputs of a row),
    x quantized per row and call; int4.c's product, the result in x's dtype."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        kernel: ctypes._CFuncPtr | Literal["auto"] = "auto",
    ) -> None:
        self.kernel = native.int4_kernel() if kernel == "auto" else kernel
        if self.kernel is None:
            raise SpecMTPError(f"{INT4} needs a C compiler and a CPU with AVX512-VNNI")
        self.out_features, self.in_features = weight.shape
        if self.in_features % GROUP_SIZE:
            raise SpecMTPError(f"{INT4}: {self.in_features} inputs, not a multiple of {GROUP_SIZE}")
        self.records, self.qsums = quantize(weight.detach().float())
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @classmethod
    def stacked(cls, products: list[Int4Product]) -> Int4Product:
        """One product whose output rows are those of `products` in turn; each of them then
        reads its rows of the stacked copy (as int8.Int8Product.stacked)."""
        first = products[0]
        if any(p.out_features % BLOCK or p.in_features != first.in_features for p in products):
            raise ValueError("only products of whole blocks and equal inputs stack")
        stacked = cls.__new__(cls)
        stacked.kernel, stacked.in_features = first.kernel, first.in_features
        stacked.out_features = sum(p.out_features for p in products)
        stacked.records = torch.cat([p.records for p in products])
        stacked.qsums = torch.cat([p.qsums for p in products])
        biases = [
            p.bias if p.bias is not None else p.qsums.new_zeros(p.out_features) for p in products
        ]
        has_bias = any(p.bias is not None for p in products)
        stacked.bias = torch.cat(biases) if has_bias else None
        start = 0
        for p in products:
            rows = slice(start, start + p.out_features)
            p.records = stacked.records[start // BLOCK : (start + p.out_features) // BLOCK]
            p.qsums = stacked.qsums[rows]
            p.bias = None if p.bias is None else stacked.bias[rows]
            start += p.out_features
        return stacked

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return product_of_rows(self, x)

    def into(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """out [M, out] = the product of rows [M, in]; both contiguous, both float32 or both
        bfloat16 (lean.py's forward keeps its outputs from step to step)."""
        failed = self.kernel(
            rows.data_ptr(), int(rows.dtype == torch.bfloat16), rows.shape[0],
            self.in_features, self.records.data_ptr(), self.out_features,
            self.qsums.data_ptr(), None if self.bias is None else self.bias.data_ptr(),
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError(f"int4 product of {rows.shape[0]} rows: out of memory")


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [n, k] float32 -> int4.c's records [ceil(n/16), k/32, 320] uint8 and C
    [ceil(n/16) * 16] float32 (see int4.c). Per 32 inputs of a row: the minimum and the
    step a = range / 15 and the midpoint b = minimum + 8 a, each rounded to fp16, then
    q = round((w - b) / a) + 8, so that w ~ a * (q - 8) + b."""
    n, k = weight.shape
    rows = -(-n // BLOCK) * BLOCK
    padded = torch.zeros(rows, k)
    padded[:n] = weight
    groups = padded.view(rows, k // GROUP_SIZE, GROUP_SIZE)  # [N, G, 32]
    low = groups.amin(-1).half()  # [N, G]
    step = ((groups.amax(-1) - low.float()) / LEVELS).half()
    middle = (low.float() + 8 * step.float()).half()  # [N, G]
    scale, base = step.float()[..., None], (middle.float() - 8 * step.float())[..., None]
    q = ((groups - base) / scale.where(scale > 0, 1.0)).round().clamp(0, LEVELS)
    q = q.where(scale > 0, 8.0).to(torch.uint8)  # [N, G, 32]; a constant group: its midpoint
    centred = q.sum(-1, dtype=torch.int32) - 8 * GROUP_SIZE  # sum of q - 8 per group
    qsums = (step.float() * centred.float()).sum(-1)  # [N]
    # nibbles: [blocks, 16 r, G, 4 jj, 2 halves, 4 t] -> [blocks, G, jj, r, t]
    halves = q.view(rows // BLOCK, BLOCK, k // GROUP_SIZE, 4, 2, 4)
    nibbles = (halves[..., 0, :] | (halves[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)
    nibbles = nibbles.reshape(rows // BLOCK, k // GROUP_SIZE, 4 * BLOCK * 4)  # [B, G, 256]

    def per_block(values: torch.Tensor) -> torch.Tensor:  # [N, G] fp16 -> [B, G, 32] bytes
        blocked = values.view(rows // BLOCK, BLOCK, k // GROUP_SIZE).transpose(1, 2)
        return blocked.contiguous().view(torch.uint8)

    records = torch.cat([nibbles, per_block(step), per_block(middle)], -1).contiguous()
    return records, qsums.contiguous()


class Int4Linear(nn.Module):
    """A linear layer on an Int4Product (its records and C as buffers)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.product = Int4Product(linear.weight, linear.bias)
        self.register_buffer("records", self.product.records)
        self.register_buffer("qsums", self.product.qsums)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)


def use_int4_products(model: nn.Module) -> nn.Module:
    """Swap the linear layers of a draft model's decoder layers for 4-bit ones, in place
    (the LM head and anything outside `model.model.layers` are left to int8.py); returns
    `model`."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise SpecMTPError(f"{INT4} applies to Hugging Face decoder models (model.model.layers)")
    for parent in list(layers.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int4Linear(child))
    return model


def split_int4(spec: str) -> tuple[str, bool]:
    """`SPEC#int4` -> (SPEC without it, True); a spec without it -> (spec, False)."""
    return split_flag(spec, INT4)
