"""amx.c's bfloat16 product on AMX tiles (the `amx` row-invariant product): its sums, each
row's bits at every row count, its packed copy, and where invariant.py takes it."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from specmtp import invariant, kernels, native
from specmtp.amx import amx_available, amx_linear, amx_pack
from specmtp.kernels import AMX, TunedLinear, use_tuned_linear
from specmtp.models import load_model

needs_amx = pytest.mark.skipif(not amx_available(), reason="no AMX here (or no C compiler)")


def _bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).bfloat16()


@needs_amx
@pytest.mark.parametrize(
    ("out_features", "in_features"),
    [(64, 32), (24, 48), (130, 100), (256, 1536)],
    ids=["whole-tiles", "narrow", "ragged", "qwen-kv"],
)
@pytest.mark.parametrize("with_bias", [True, False])
def test_amx_product_is_x_times_w_plus_b(
    out_features: int, in_features: int, with_bias: bool
) -> None:
    """Against float64: within the float32 sums' and one bfloat16 rounding's error, for
    shapes that are and are not whole tiles (64 outputs, 32 inputs), 1-40 rows."""
    weight = _bf16(out_features, in_features, seed=0, scale=in_features**-0.5)
    bias = _bf16(out_features, seed=1) if with_bias else None
    packed = amx_pack(weight)
    for rows in (1, 2, 15, 16, 17, 40):
        x = _bf16(rows, in_features, seed=rows)
        got = amx_linear(x, packed, out_features, bias)
        want = x.double() @ weight.double().T + (0 if bias is None else bias.double())
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        error = (got.double() - want).abs()
        assert (error <= want.abs() * 2**-8 + 1e-5 * in_features).all()


@needs_amx
def test_amx_product_gives_a_row_the_same_bits_at_every_row_count() -> None:
    """Rows alone, in any prefix, and among other rows (1-40, across blocks of 16), and
    inputs with leading dimensions: the bits of the full call."""
    weight = _bf16(200, 96, seed=2, scale=0.1)
    bias = _bf16(200, seed=3)
    packed = amx_pack(weight)
    x = _bf16(40, 96, seed=4)
    full = amx_linear(x, packed, 200, bias)
    for m in range(1, 40):
        assert torch.equal(amx_linear(x[:m], packed, 200, bias), full[:m])
        assert torch.equal(amx_linear(x[m : m + 1], packed, 200, bias), full[m : m + 1])
    assert torch.equal(amx_linear(x.reshape(1, 40, 96), packed, 200, bias)[0], full)
    assert invariant.rows_invariant(weight, product=AMX)


@needs_amx
def test_amx_pack_reads_either_weight_layout() -> None:
    weight = _bf16(70, 64, seed=5)
    in_major = weight.t().contiguous().t()  # the same values stored [in, out]
    assert torch.equal(amx_pack(weight), amx_pack(in_major))


@needs_amx
def test_a_layer_with_the_amx_product_packs_its_own_copy_and_follows_its_weight() -> None:
    """A row-invariant layer whose product is `amx` keeps amx.c's layout (not oneDNN's, which
    the same layer under another product keeps), packed again when its weight changes."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(96, 80)).bfloat16()
    plan = use_tuned_linear(layer)
    plan.row_invariant = AMX
    linear = layer[0]
    assert isinstance(linear, TunedLinear)
    linear.invariant_product = AMX
    x = _bf16(5, 96, seed=6)
    with torch.inference_mode():
        first = layer(x)
        packed = linear.packed
        assert kernels.uses_packed(plan, linear)
        assert packed is not None and torch.equal(packed, amx_pack(linear.weight))
        assert torch.equal(first, amx_linear(x, packed, 80, linear.bias))
        linear.weight.mul_(2)
        again = layer(x)
        assert linear.packed is not packed
        assert torch.equal(again, amx_linear(x, amx_pack(linear.weight), 80, linear.bias))
        if kernels.PACKING_AVAILABLE:  # the same layer with oneDNN's product: its own copy
            amx_copy = linear.packed
            linear.invariant_product = kernels.PACKED
            want = kernels.packed_linear(x, kernels.pack_weight(linear.weight), linear.bias)
            assert torch.equal(layer(x), want)
            assert linear.packed is not amx_copy


def test_amx_is_offered_for_bfloat16_weights_only_and_only_where_it_runs() -> None:
    kinds = invariant.product_kinds()
    assert (AMX in kinds) == (amx_available() and kernels.packing_allowed())
    weight = _bf16(24, 32, seed=7)
    assert invariant.invariant_product(weight.float(), (AMX, "padded")) == "padded"
    assert invariant.invariant_product(weight, (AMX, "padded")) == (
        AMX if amx_available() else "padded"
    )
    with kernels.without_packing():
        assert AMX not in invariant.product_kinds()


@needs_amx
@pytest.mark.skipif(not kernels.PACKING_AVAILABLE, reason="no oneDNN packed product")
def test_amx_products_between_onednns_own_tile_kernels(tiny_target: Path) -> None:
    """amx.c configures the tiles at each call and releases them after; oneDNN's packed
    products (and the fused attention of a prompt) configure their own. Layers taking turns
    between the two, over a prompt long enough for the fused attention, still give the
    bits of one-token steps."""
    model = load_model(str(tiny_target), dtype=torch.bfloat16).model
    layers = [m for m in model.modules() if isinstance(m, TunedLinear)]
    for i, layer in enumerate(layers):  # oneDNN's only where it passes its own probe
        packs = i % 2 == 0 and invariant.rows_invariant(layer.weight, product=kernels.PACKED)
        layer.invariant_product = kernels.PACKED if packs else AMX
    kernels.settle_packed(model)
    assert {m.invariant_product for m in layers} == {AMX, kernels.PACKED}
    assert invariant.forwards_agree(model, prompt=40, rows=6)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_amx_c_builds_for_a_cpu_without_amx_and_then_offers_nothing(tmp_path: Path) -> None:
    """Built for plain x86-64 (or any CPU whose compiler does not target AMX-BF16), amx.c
    still compiles; its kernel then says it cannot run (2) and the process is not offered
    the tiles, so invariant.py keeps the other products."""
    library = tmp_path / "amx.so"
    flags = [f for f in native.FLAGS if f != "-march=native"]
    subprocess.run(
        ["cc", *flags, "-fopenmp", str(native.AMX_SOURCE), "-o", str(library)], check=True
    )
    built = ctypes.CDLL(str(library))
    assert built.specmtp_amx_ready() == 0
    built.specmtp_amx_linear.restype = ctypes.c_int
    assert built.specmtp_amx_linear(None, 0, 0, None, 0, None, None, 1) == 2
