"""int4 weights for a draft model's layers (`#int4` in a draft spec): cheaper drafts again.

`#int8` (int8.py) halves the bytes a bfloat16 draft step reads; a draft model's decoder
layers can go to 4 bits (a scale and a zero per 32 weights of a row, round to nearest:
the groups GGUF's Q4 formats use) through torch's CPU int4 product
(`_weight_int4pack_mm_for_cpu`, inputs in the model's dtype). On the project's Intel Xeon
(2 threads, weights out of cache) Qwen2.5-0.5B's 4864 x 896 product of one row takes
0.28 ms against 0.37 ms in int8 and 0.86 ms in bfloat16; its 151,936 x 896 output matrix
takes as long in int4 as in int8 (6.6 / 6.5 ms), so the output matrix, and any layer the
kernel does not take (an output size not a multiple of 16, an input size not a multiple of
32), stays int8.

Drafts only, as for int8: the target verifies, so greedy output is plain decoding's and
sampling stays lossless whatever the rounding does to the drafts.
"""

from __future__ import annotations

import torch
from torch import nn

from specmtp.errors import SpecMTPError
from specmtp.heads import VocabProjection
from specmtp.int8 import Int8Linear, quantize_projection

INT4 = "#int4"  # the draft spec option
GROUP = 32  # weights of a row sharing a scale and a zero
LEVELS = 15  # 4 bits: 0..15, stored as q with w ≈ (q - 8) * scale + zero


def int4_fits(linear: nn.Linear) -> bool:
    """Whether the int4 kernel takes this layer's shape."""
    return linear.out_features % 16 == 0 and linear.in_features % GROUP == 0


class Int4Product:
    """x @ W^T + b with W in 4 bits per weight, a scale and a zero per GROUP weights of a
    row (asymmetric, round to nearest), in the weight's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        if weight.device.type != "cpu":
            raise SpecMTPError(f"{INT4} products run on CPU; this drafter is on {weight.device}")
        out_features, in_features = weight.shape
        w = weight.detach().float().reshape(out_features, in_features // GROUP, GROUP)
        low, high = w.amin(-1), w.amax(-1)  # [out, in/G]
        scale = ((high - low) / LEVELS).clamp_min(1e-12)  # [out, in/G]
        q = ((w - low[..., None]) / scale[..., None]).round().clamp(0, LEVELS)  # [out, in/G, G]
        zero = low + 8 * scale  # (q - 8) * scale + zero = low + q * scale
        self.dtype = weight.dtype
        # [in/G, out, 2], the kernel's layout, in the dtype of the inputs it will take
        self.scales_and_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()
        self.scales_and_zeros = self.scales_and_zeros.to(self.dtype)
        levels = q.reshape(out_features, in_features).int()  # [out, in] in 0..15
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1)
        self.bias = None if bias is None else bias.detach().to(self.dtype)
        self.out_features, self.in_features = out_features, in_features

    def dequantized(self) -> torch.Tensor:
        """The weights the product uses, [out, in] in its dtype: (q - 8) * scale + zero, read
        back through the kernel itself (the identity's product)."""
        identity = torch.eye(self.in_features, dtype=self.dtype)  # [in, in]
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            identity, self.packed, GROUP, self.scales_and_zeros
        ).T  # [out, in]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(self.dtype)  # [M, in]
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.packed, GROUP, self.scales_and_zeros
        )  # [M, out]
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """A linear layer on an Int4Product. Its buffers are what the kernel reads, the packed
    4-bit weights and the groups' scales and zeros, so weight fingerprints and memory
    reports see them; it has no `weight` of [out, in]."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.product = Int4Product(linear.weight, linear.bias)
        self.register_buffer("packed", self.product.packed)
        self.register_buffer("scales_and_zeros", self.product.scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)


def use_int4_products(model: nn.Module) -> nn.Module:
    """A draft model's layers in int4 where the kernel takes them, in int8 otherwise; its
    output matrix (the LM head, or a VocabProjection) in int8. In place; returns `model`."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                swap = Int4Linear if child is not output and int4_fits(child) else Int8Linear
                setattr(parent, name, swap(child))
            elif isinstance(child, VocabProjection) and child.int8 is None:
                quantize_projection(child)
    return model
