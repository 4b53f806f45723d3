"""A row-invariant bfloat16 product on AMX tiles (amx.c): the `amx` product of invariant.py.

Exact bfloat16 decoding needs every product to give a row the bits a one-row step gives it,
whatever the row count of the verify pass (invariant.py). oneDNN's product on packed weights
does so for most of the Qwen2.5-Coder 1.5B's shapes but not its 8960 -> 1536 down
projection, which then ran F.linear on zero-padded blocks of 8 or 16 rows: a one-row step
paid for 8, a 9-16-row pass for 16 (T(9..16) 1.10-1.15 of T(1)). amx.c computes rows in
blocks of 16 on the tiles, each row from its own inputs alone, so a row's bits never depend
on the others by construction (the probe checks it all the same), and 16 rows cost about
what one does. It reads a copy of the weights in the tiles' layout, made once per layer as
oneDNN's packed copy is (TunedLinear.packed_weight), and only bfloat16 weights.
"""

from __future__ import annotations

import torch

from specmtp import native


def amx_available() -> bool:
    """Whether this machine and process run amx.c (a CPU with AMX, a C compiler)."""
    return native.amx_kernels() is not None


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] (bfloat16, either layout) in the tiles' layout (amx.c)."""
    kernels = native.amx_kernels()
    if kernels is None or weight.dtype != torch.bfloat16:
        raise ValueError("amx_pack needs amx.c and bfloat16 weights")
    n, k = weight.shape
    rows = weight.detach()
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    packed = torch.empty(kernels.packed_values(n, k), dtype=torch.bfloat16)
    kernels.pack(rows.data_ptr(), n, k, rows.stride(0), packed.data_ptr())
    return packed


def amx_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ W^T + b for x [..., in] bfloat16 and W packed by amx_pack."""
    kernels = native.amx_kernels()
    if kernels is None:
        raise ValueError("amx_linear needs amx.c")
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if bias is not None:
        bias = bias.detach().to(torch.bfloat16).contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=torch.bfloat16)
    failed = kernels.linear(
        rows.data_ptr(), rows.shape[0], rows.shape[1], packed.data_ptr(), out_features,
        None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("amx.c could not allocate its input blocks")
    return out.reshape(*x.shape[:-1], out_features)
