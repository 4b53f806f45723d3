"""`#int8` drafters: int8 products within their error bound, every product of a drafter
swapped, and drafts that still leave greedy output exactly plain decoding's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, hf_greedy, tiny_model
from test_decode_tree import TREE
from test_mtp_drafter import PROMPT, trained_heads
from torch import nn
from transformers import PreTrainedModel

from specmtp import kernels, native
from specmtp.api import SpecGenerator, build_drafter
from specmtp.config import GenerationConfig
from specmtp.decode import SpecDecoder
from specmtp.draft_model_drafter import DraftModelDrafter
from specmtp.drafters import LookupFirstDrafter
from specmtp.errors import SpecMTPError
from specmtp.heads import VocabProjection
from specmtp.int8 import Int8Linear, Int8Product, reduce_input_range, split_int8, use_int8_products
from specmtp.models import load_model
from specmtp.mtp_drafter import MTPDrafter

NATIVE = native.int8_kernel()
KERNELS = [
    pytest.param("native", marks=pytest.mark.skipif(NATIVE is None, reason="no int8.c here")),
    "fbgemm",
]


def _product(
    weight: torch.Tensor, bias: torch.Tensor | None, kernel: str
) -> tuple[Int8Product, int]:
    """The product on `kernel`, and the levels its input quantization spreads a range over
    (int8.c: 255 per row; fbgemm: 255 per call, 127 where it sums in 16 bits)."""
    if kernel == "native":
        return Int8Product(weight, bias, kernel=NATIVE), 255
    return Int8Product(weight, bias, kernel=None), 127 if reduce_input_range() else 255


def _dequantized(weight: torch.Tensor) -> torch.Tensor:
    """The slow reference's weights: each row rounded to 255 levels of its largest value."""
    scale = weight.abs().amax(1, keepdim=True) / 127
    return (weight / scale).round() * scale


@pytest.mark.parametrize("kernel", KERNELS)
def test_an_int8_product_of_inputs_on_its_grid_is_the_rounded_weights_product(kernel: str) -> None:
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=generator), torch.randn(96, generator=generator)
    product, levels = _product(weight, bias, kernel)
    # inputs the per-call quantization represents exactly: multiples of 0.05 from 0 up to
    # its top level, each row holding both ends (int8.c quantizes each row by its range)
    x = torch.randint(0, levels + 1, (5, 64), generator=generator).float()
    x[:, :2] = torch.tensor([0.0, levels])
    x = x * 0.05
    out = product(x)
    reference = x @ _dequantized(weight).T + bias
    assert torch.allclose(out, reference, rtol=1e-4, atol=1e-3)
    assert not torch.allclose(out, x @ weight.T + bias, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_product_stays_within_its_quantization_bound(
    dtype: torch.dtype, kernel: str
) -> None:
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=generator), torch.randn(96, generator=generator)
    product, levels = _product(weight, bias, kernel)
    x = torch.randn(2, 5, 64, generator=generator).to(dtype)
    out = product(x)
    assert out.shape == (2, 5, 96) and out.dtype == dtype
    # Inputs off the grid: each is rounded to its nearest level, so the error against the
    # rounded weights' product is at most half a step times the row's absolute weights,
    # plus the output's own rounding.
    rows, dequantized = x.float().reshape(-1, 64), _dequantized(weight)
    reference = rows @ dequantized.T + bias
    step = (rows.max().clamp_min(0) - rows.min().clamp_max(0)) / levels
    bound = step / 2 * dequantized.abs().sum(1) + reference.abs() * 2**-7 + 1e-4
    assert ((out.float().reshape(-1, 96) - reference).abs() <= bound).all()


def _native_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """int8.c's product, slowly: each row of x rounded to 255 steps of its own range from
    its minimum, times the rounded weights, in float64."""
    x = x.double()
    low, high = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    step = (high - low) / 255
    rounded = low + ((x - low) / step).round().clamp(0, 255) * step
    return rounded @ _dequantized(weight).double().T + bias.double()


@pytest.mark.skipif(NATIVE is None, reason="no int8.c here")
@pytest.mark.parametrize(
    ("out_features", "in_features", "rows"),
    # padded rows and columns; tiles of 4, 3 and 2 blocks; several groups of rows
    [(96, 64, 1), (100, 70, 9), (17, 4, 3), (40, 200, 70), (56, 64, 6)],
)
def test_the_native_product_is_its_slow_reference_row_by_row(
    out_features: int, in_features: int, rows: int
) -> None:
    generator = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator) * 3 + 1
    product = Int8Product(weight, bias, kernel=NATIVE)
    out = product(x)
    reference = _native_reference(x, weight, bias)
    assert torch.allclose(out.double(), reference, rtol=1e-5, atol=1e-4)
    for i in (0, rows - 1):  # a row's output is the same whatever else the call holds
        assert torch.equal(product(x[i : i + 1]), out[i : i + 1])
    unbiased = Int8Product(weight, None, kernel=NATIVE)(x)
    assert torch.allclose(unbiased + bias, out, rtol=1e-6, atol=1e-5)
    threads = torch.get_num_threads()
    try:  # each output is summed by one thread, whichever
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(product(x), out)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(NATIVE is None, reason="no int8.c here")
def test_the_native_product_takes_constant_rows_and_bfloat16() -> None:
    generator = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(33, 48, generator=generator), torch.randn(33, generator=generator)
    product = Int8Product(weight, bias, kernel=NATIVE)
    x = torch.randn(4, 48, generator=generator)
    x[1] = 0.5  # a constant row: its range is 0
    x[2] = 0.0
    reference = x.double() @ _dequantized(weight).double().T + bias.double()
    assert torch.allclose(product(x)[1:3].double(), reference[1:3], rtol=1e-5, atol=1e-4)
    half = product(x.bfloat16())
    assert half.dtype == torch.bfloat16
    assert torch.equal(half, product(x.bfloat16().float()).bfloat16())  # one rounding, at the end


def test_every_product_of_sequential_heads_is_swapped() -> None:
    target = tiny_model("llama", seed=0)
    heads = trained_heads(target, "sequential", steps=0)
    use_int8_products(heads)
    assert not [m for m in heads.modules() if isinstance(m, nn.Linear)]
    assert [m for m in heads.modules() if isinstance(m, Int8Linear)]
    projections = [m for m in heads.modules() if isinstance(m, VocabProjection)]
    assert projections and all(p.int8 is not None for p in projections)
    assert all(p.weight.dtype == torch.int8 for p in projections)


@pytest.mark.parametrize("kind", ["parallel", "sequential"])
@pytest.mark.parametrize("tree", [False, True])
def test_int8_heads_keep_greedy_output_and_most_of_the_acceptance(kind: str, tree: bool) -> None:
    target: PreTrainedModel = tiny_model("llama", seed=0)

    def run(int8: bool) -> tuple[list[int], float]:
        heads = trained_heads(target, kind, steps=60)
        if int8:
            use_int8_products(heads)
        drafter = MTPDrafter(heads, tree=TREE if tree else None)
        decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
        result = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=40, gamma=3))
        return result.tokens, result.stats.mean_accepted_tokens

    (tokens, tau), (int8_tokens, int8_tau) = run(False), run(True)
    assert int8_tokens == tokens == hf_greedy(target, PROMPT, 40)
    assert int8_tau > 1.0 and int8_tau >= tau - 0.5


def test_int8_draft_specs(tiny_target: Path) -> None:
    target = load_model(str(tiny_target))
    drafter, _ = build_drafter(f"{tiny_target}#int8", target)
    assert isinstance(drafter, DraftModelDrafter) and drafter.name == f"{tiny_target}#int8"
    assert not [m for m in drafter.runner.model.modules() if isinstance(m, nn.Linear)]
    lookup_first, _ = build_drafter(f"ngram+{tiny_target}#vocab=3000#int8", target)
    assert isinstance(lookup_first, LookupFirstDrafter)
    assert lookup_first.fallback.name == f"{tiny_target}#vocab=3000#int8"
    for spec, message in [
        ("ngram#int8", "applies to MTP heads and draft models"),
        ("#int8", "follows a drafter's name"),
    ]:
        with pytest.raises(SpecMTPError, match=message):
            build_drafter(spec, target)
    assert split_int8("mtp-tree#int8#nodes=4") == ("mtp-tree#nodes=4", True)
    assert split_int8("mtp-tree#nodes=4") == ("mtp-tree#nodes=4", False)


def test_an_int8_self_draft_keeps_greedy_output(tiny_target: Path) -> None:
    plain = SpecGenerator(str(tiny_target))
    drafted = SpecGenerator(str(tiny_target), draft=f"{tiny_target}#int8")
    prompt = torch.randint(100, 5000, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    expected = plain.generate(prompt, max_new_tokens=30).tokens
    done = drafted.generate(prompt, max_new_tokens=30, gamma=4)
    assert done.tokens == expected
    assert done.stats.accepted_tokens > 0


@pytest.mark.skipif(not kernels.PACKING_AVAILABLE, reason="no oneDNN packed product")
def test_an_int8_draft_in_bfloat16_packs_no_weights(
    tiny_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bfloat16 draft's row-invariant products may pack its weights (kernels.py); an int8
    draft's products all become int8, so its load packs nothing (packing first would hold
    its weights twice for a while), while the same draft in float products does pack."""
    target = load_model(str(tiny_target), dtype=torch.bfloat16)
    packed: list[torch.Size] = []

    def counting(pack: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
        def packing(weight: torch.Tensor) -> torch.Tensor:
            packed.append(weight.shape)
            return pack(weight)

        return packing

    for name in ("pack_weight", "amx_pack"):  # oneDNN's copies and amx.c's
        packing = counting(getattr(kernels, name))
        monkeypatch.setattr(kernels, name, packing)
    build_drafter(f"{tiny_target}#int8", target, dtype=torch.bfloat16)
    assert packed == []
    assert kernels.packing_allowed()  # only while the int8 draft loaded
    drafter, _ = build_drafter(str(tiny_target), target, dtype=torch.bfloat16)
    assert drafter.runner.model.dtype == torch.bfloat16
    assert packed  # its probes, at least
