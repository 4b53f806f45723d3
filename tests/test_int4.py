"""int4.py / int4.c: 4-bit draft products against a float64 reference of the same rounding,
the weights' grid, row invariance, stacking, and greedy output kept with `#int4` drafts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specmtp import native
from specmtp.errors import SpecMTPError
from specmtp.int4 import BLOCK, GROUP_SIZE, LEVELS, Int4Product, quantize

pytestmark = pytest.mark.skipif(
    native.int4_kernel() is None, reason="int4.c needs a C compiler and AVX512-VNNI"
)


def decoded(records: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, ...]:
    """The records read back slowly: q [n, k] (0 .. 15), step and midpoint [n, k / 32]
    float64 (a weight is step * (q - 8) + midpoint)."""
    blocks, groups = records.shape[:2]
    nibbles = records[..., :256].reshape(blocks, groups, 4, BLOCK, 4)  # [B, G, jj, r, t]
    halves = torch.stack([nibbles & 15, nibbles >> 4], -2)  # [B, G, jj, r, 2, t]
    q = halves.permute(0, 3, 1, 2, 4, 5).reshape(blocks * BLOCK, k)[:n]

    def values(start: int) -> torch.Tensor:  # [B, G, 16] fp16 -> [n, G]
        fp16 = records[..., start : start + 32].contiguous().view(torch.float16)
        return fp16.transpose(1, 2).reshape(blocks * BLOCK, groups)[:n].double()

    return q.long(), values(256), values(288)


def reference(x: torch.Tensor, product: Int4Product, weight_rows: int) -> torch.Tensor:
    """int4.c's arithmetic in float64: each input row as low + step * u (u8), dotted with
    the decoded weights a * q + b (the minimum's part from x itself)."""
    q, step, middle = decoded(product.records, weight_rows, product.in_features)
    x = x.double()
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    s = ((hi - lo).float() / 255).double()  # float32 in the kernel
    s = torch.where(s > 0, s, torch.ones_like(s))
    u = ((x.float() - lo.float()) / s.float()).round().clamp(0, 255).double()  # [m, k]
    a = step.repeat_interleave(GROUP_SIZE, 1)  # [n, k]
    b = middle.repeat_interleave(GROUP_SIZE, 1)
    return (s * u + lo) @ (a * (q - 8)).T + x @ b.T


@pytest.mark.parametrize("n", [16, 48, 40])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9, 37])
def test_product_equals_its_float64_reference(n: int, rows: int) -> None:
    generator = torch.Generator().manual_seed(n * 10 + rows)
    weight = torch.randn(n, 96, generator=generator) * 0.1
    bias = torch.randn(n, generator=generator)
    product = Int4Product(weight, bias)
    x = torch.randn(rows, 96, generator=generator)
    expected = reference(x, product, n) + bias.double()
    torch.testing.assert_close(product(x).double(), expected, rtol=1e-4, atol=1e-4)
    # bfloat16 in and out: the same sums, rounded once at the end
    x16 = x.bfloat16()
    expected16 = (reference(x16.float(), product, n) + bias.double()).bfloat16()
    torch.testing.assert_close(product(x16), expected16, rtol=8e-3, atol=8e-3)


def test_weights_sit_on_their_group_grid() -> None:
    """Every weight decodes to within half a step of itself; a group already on a 4-bit grid
    (as a Q4_K GGUF's weights are) decodes exactly; a constant group is its minimum."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(BLOCK, 2 * GROUP_SIZE, generator=generator)
    on_grid = torch.randint(0, LEVELS + 1, (GROUP_SIZE,), generator=generator).float()
    on_grid[:2] = torch.tensor([0.0, LEVELS])
    weight[0, :GROUP_SIZE] = -0.5 + 0.125 * on_grid  # fp16-exact step and minimum
    weight[1, :GROUP_SIZE] = 0.75
    records, _ = quantize(weight)
    q, step, middle = decoded(records, BLOCK, 2 * GROUP_SIZE)
    rebuilt = step.repeat_interleave(GROUP_SIZE, 1) * (q - 8) + middle.repeat_interleave(
        GROUP_SIZE, 1
    )
    half_step = step.repeat_interleave(GROUP_SIZE, 1) / 2
    assert ((rebuilt - weight.double()).abs() <= half_step * 1.01 + 1e-3).all()
    assert torch.equal(rebuilt[0, :GROUP_SIZE], weight[0, :GROUP_SIZE].double())
    assert torch.equal(
        rebuilt[1, :GROUP_SIZE], torch.full((GROUP_SIZE,), 0.75, dtype=torch.float64)
    )


def test_a_row_gets_the_same_bits_alone_or_with_others_and_on_any_thread_count() -> None:
    generator = torch.Generator().manual_seed(2)
    product = Int4Product(torch.randn(80, 128, generator=generator), None)
    x = torch.randn(7, 128, generator=generator)
    together = product(x)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for i in range(7):
                assert torch.equal(product(x[i : i + 1])[0], together[i])
    finally:
        torch.set_num_threads(threads)


def test_stacked_products_are_the_parts_side_by_side() -> None:
    generator = torch.Generator().manual_seed(3)
    weights = [torch.randn(rows, 64, generator=generator) for rows in (2 * BLOCK, BLOCK)]
    parts = [Int4Product(w, torch.randn(len(w), generator=generator)) for w in weights]
    x = torch.randn(5, 64, generator=generator)
    alone = [p(x) for p in parts]
    stacked = Int4Product.stacked(parts)
    assert torch.equal(stacked(x), torch.cat(alone, -1))
    assert all(torch.equal(p(x), before) for p, before in zip(parts, alone, strict=True))


def test_inputs_not_a_multiple_of_the_group_are_refused() -> None:
    with pytest.raises(SpecMTPError, match="multiple of 32"):
        Int4Product(torch.randn(16, 40), None)


def test_an_int4_draft_keeps_greedy_output(tiny_target: Path) -> None:
    from specmtp.api import SpecGenerator

    plain = SpecGenerator(str(tiny_target))
    prompt = torch.randint(100, 5000, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    expected = plain.generate(prompt, max_new_tokens=30).tokens
    for spec in ("#int4", "#int4#nodes=4"):
        drafted = SpecGenerator(str(tiny_target), draft=f"{tiny_target}{spec}")
        done = drafted.generate(prompt, max_new_tokens=30, gamma=4)
        assert done.tokens == expected
        assert done.stats.accepted_tokens > 0


def test_int4_spec_errors(tiny_target: Path) -> None:
    from specmtp.drafter_specs import build_drafter
    from specmtp.models import load_model

    target = load_model(str(tiny_target))
    for spec, message in [
        ("ngram#int4", "applies to draft models"),
        (f"{tiny_target}#int4#int8", "not both"),
        ("#int4", "follows a drafter's name"),
    ]:
        with pytest.raises(SpecMTPError, match=message):
            build_drafter(spec, target)
    drafter, _ = build_drafter(f"{tiny_target}#int4", target)
    assert drafter.name.endswith("#int4")
