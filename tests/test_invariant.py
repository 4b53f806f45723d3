"""Row-invariant numerics (specmtp/invariant.py): in bfloat16 a forward over n tokens gives
each token the bits that one-token steps give it, so greedy speculative decoding stays
token-identical to plain decoding."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specmtp import invariant, kernels
from specmtp.amx import amx_available
from specmtp.api import SpecGenerator
from specmtp.cache import CachedModel
from specmtp.errors import SpecMTPError
from specmtp.invariant import (
    ATTENTION,
    forwards_agree,
    row_invariant_attention,
    rows_invariant,
    use_row_invariant,
)
from specmtp.kernels import (
    INVARIANT,
    TunedLinear,
    apply_kernel_plan,
    kernel_plan,
    padded_linear,
    stock_kernels,
)
from specmtp.models import load_model
from specmtp.tree import TokenTree, tree_forward

STEPS = 40


@pytest.fixture(scope="module")
def bf16_runner(tiny_target: Path) -> CachedModel:
    loaded = load_model(str(tiny_target), dtype=torch.bfloat16)
    return CachedModel(loaded.model, vocab_size=loaded.model.config.vocab_size)


def _prompt(seed: int, length: int = 12) -> torch.Tensor:
    return torch.randint(5, 4000, (1, length), generator=torch.Generator().manual_seed(seed))


def _greedy_steps(runner: CachedModel, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain decoding one token at a time: the tokens [1, P+STEPS] and, per new position,
    the logits its one-token forward gave [STEPS, V]."""
    runner.reset()
    logits = runner.forward(prompt)[:, -1]  # [1, V]
    seq, rows = prompt, []
    for _ in range(STEPS):
        nxt = logits.argmax(-1, keepdim=True)  # [1, 1]
        seq = torch.cat([seq, nxt], 1)
        logits = runner.forward(nxt)[:, -1]
        rows.append(logits[0])
    return seq, torch.stack(rows)


def test_the_loaded_bf16_model_is_row_invariant_and_float32_is_left_alone(
    bf16_runner: CachedModel, tiny_target: Path
) -> None:
    assert bf16_runner.model.config._attn_implementation == ATTENTION
    products = {
        m.invariant_product for m in bf16_runner.model.modules() if isinstance(m, TunedLinear)
    }
    assert products and products <= {"amx", "packed", "flat", "padded", "padded16"}
    assert kernel_plan(bf16_runner.model).row_invariant.split(",")[0] in products
    plain = load_model(str(tiny_target)).model
    assert plain.config._attn_implementation != ATTENTION
    assert kernel_plan(plain).row_invariant is None


@pytest.mark.parametrize("seed", [0, 1])
def test_chunks_of_any_size_give_the_bits_of_one_token_steps(
    bf16_runner: CachedModel, seed: int
) -> None:
    prompt = _prompt(seed)
    seq, steps = _greedy_steps(bf16_runner, prompt)
    rng = random.Random(seed)
    P = prompt.shape[1]
    bf16_runner.reset()
    bf16_runner.forward(prompt)
    done = 0
    while done < STEPS:
        n = min(rng.randint(1, 9), STEPS - done)
        logits = bf16_runner.forward(seq[:, P + done : P + done + n])[0]  # [n, V]
        assert torch.equal(logits, steps[done : done + n]), f"chunk of {n} at {done}"
        done += n


def test_tree_rows_give_the_bits_of_their_paths_decoded_step_by_step(
    bf16_runner: CachedModel,
) -> None:
    prompt = _prompt(2)
    seq, steps = _greedy_steps(bf16_runner, prompt)
    P = prompt.shape[1]
    # Nodes (0,), (0, 0), (0, 0, 0) follow plain decoding's path; (1,), (0, 1) branch off.
    tree = TokenTree(((0,), (1,), (0, 0), (0, 1), (0, 0, 0)))
    chain = seq[0, P + 2 : P + 5].tolist()
    nodes = torch.tensor([[chain[0], 7, chain[1], 9, chain[2]]])  # [1, 5] in node order
    bf16_runner.reset()
    bf16_runner.forward(seq[:, : P + 1])
    logits = tree_forward(bf16_runner, tree, seq[:, P + 1 : P + 2], nodes)[0]  # [6, V]
    assert torch.equal(logits[0], steps[1])  # the root: the last committed token
    for row, step in [(1, 2), (3, 3), (5, 4)]:
        assert torch.equal(logits[row], steps[step]), tree.paths[row - 1]


def test_speculative_bf16_greedy_output_equals_plain_decoding(tiny_target: Path) -> None:
    """The tiny model repeats itself, so the n-gram drafter's rounds accept some drafts and
    miss others; every verify pass has to reproduce plain decoding's bits."""
    prompt = _prompt(3, 20)[0].tolist()
    plain = SpecGenerator(str(tiny_target), dtype=torch.bfloat16)
    spec = SpecGenerator(str(tiny_target), draft="ngram", dtype=torch.bfloat16)
    expected = plain.generate(prompt, max_new_tokens=96)
    for gamma in (2, 5):
        done = spec.generate(prompt, max_new_tokens=96, gamma=gamma)
        assert done.tokens == expected.tokens
        assert 0 < done.stats.accepted_tokens < done.stats.drafted_tokens


@pytest.mark.parametrize("mask_kind", ["causal", "bool", "tree"])
def test_the_attention_computes_what_sdpa_computes(mask_kind: str) -> None:
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 5, 8, generator=generator)  # [B, H, n, d]
    key, value = (torch.randn(2, 2, 11, 8, generator=generator) for _ in range(2))  # [B, Hkv, S, d]
    visible = torch.ones(5, 11, dtype=torch.bool).tril(diagonal=6)  # the last 5 of 11: causal
    if mask_kind == "tree":
        visible[3, 7:9] = False  # row 3 skips two positions: a branch it does not descend from
    mask = None if mask_kind == "causal" else visible[None, None].expand(2, 1, 5, 11)
    if mask_kind == "tree":
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = 2, True, False
    ours, _ = row_invariant_attention(module, query, key, value, mask, scaling=0.3)
    reference = F.scaled_dot_product_attention(
        query, key, value, attn_mask=visible, scale=0.3, enable_gqa=True
    ).transpose(1, 2)
    assert ours.shape == (2, 5, 4, 8)
    torch.testing.assert_close(ours, reference)
    if mask_kind == "bool":  # and the fused path for long inputs is the stock one
        stock, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
        torch.testing.assert_close(ours, stock)


def test_rows_seeing_any_keys_get_sdpa_and_a_mask_changed_in_place_is_read_again() -> None:
    """Rows with random prefixes and random keys past them (the scratch buffer the tree
    rows share is reused in every order), then the same mask tensor changed in place: the
    layers of a forward share what was read from it, so that must not outlive a change."""
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(1, 4, 9, 8, generator=generator)  # [B, H, n, d]
    key, value = (torch.randn(1, 2, 20, 8, generator=generator) for _ in range(2))
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = 2, True, False
    mask = torch.zeros(1, 1, 9, 20)
    for _ in range(3):
        visible = torch.rand(9, 20, generator=generator) < 0.5
        prefixes = torch.randint(1, 20, (9,), generator=generator)
        visible |= torch.arange(20) < prefixes[:, None]
        mask.copy_(torch.zeros(9, 20).masked_fill(~visible, torch.finfo(torch.float32).min))
        for _ in range(2):  # a second layer of the same forward
            ours, _ = row_invariant_attention(module, query, key, value, mask, scaling=0.3)
            reference = F.scaled_dot_product_attention(
                query, key, value, attn_mask=visible, scale=0.3, enable_gqa=True
            ).transpose(1, 2)
            torch.testing.assert_close(ours, reference)


def test_padded_products_equal_plain_ones_and_are_row_invariant() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 40, generator=generator)
    bias = torch.randn(24, generator=generator)
    for rows in (1, 5, 16, 17, 40):
        x = torch.randn(2, rows, 40, generator=generator)
        torch.testing.assert_close(padded_linear(x, weight, bias), F.linear(x, weight, bias))
        wide = padded_linear(x, weight, bias, block=16)
        torch.testing.assert_close(wide, F.linear(x, weight, bias))
    assert rows_invariant(weight.bfloat16(), product="padded")
    assert rows_invariant(weight.bfloat16(), product="padded16")


def test_a_padded_shape_takes_wide_blocks_past_8_rows_only_where_their_probe_passes(
    tiny_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shape that pads runs 9 or more rows in blocks of 16 ("padded16") where a row gets
    the same bits in blocks of 8 and of 16 (the probe), else in blocks of 8; either way the
    model's forwards agree with its one-token steps. Past 8 rows the wide product makes one
    call for up to 16 rows, up to 8 rows one block of 8."""
    probe = invariant.rows_invariant
    down = load_model(str(tiny_target)).model.get_decoder().layers[0].mlp.down_proj.weight.shape
    for wide_passes, want in [(True, "padded16"), (False, "padded")]:

        def passes(w: torch.Tensor, *, product: str, ok: bool = wide_passes) -> bool:
            wanted = product == "padded" or (ok and product == "padded16")
            return probe(w, product=product) and (w.shape != down or wanted)

        with monkeypatch.context() as patch:
            patch.setattr(invariant, "rows_invariant", passes)
            model = load_model(str(tiny_target)).model.bfloat16()
            use_row_invariant(model)
            kinds = {
                m.invariant_product
                for m in model.modules()
                if isinstance(m, TunedLinear) and m.weight.shape == down
            }
            assert kinds == {want}
            assert forwards_agree(model, rows=6)
            assert forwards_agree(model, rows=12)  # past 8 rows: blocks of 16 where taken
    calls = []
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: calls.append(x.shape[0]) or x @ w.T)
    weight = torch.randn(24, 40)
    for rows, blocks in [(1, [8]), (8, [8]), (9, [16]), (16, [16]), (17, [16, 16])]:
        calls.clear()
        kernels.invariant_linear(torch.randn(rows, 40), weight, None, "padded16")
        assert calls == blocks


def test_a_machine_without_row_invariant_products_pads_or_is_refused(
    tiny_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(str(tiny_target)).model  # float32: not yet row-invariant
    monkeypatch.setattr(invariant, "rows_invariant", lambda w, *, product: product == "padded")
    assert use_row_invariant(model) == "padded"
    assert kernel_plan(model).strategy(1) == kernel_plan(model).strategy(40) == INVARIANT
    assert {m.invariant_product for m in model.modules() if isinstance(m, TunedLinear)} == {
        "padded"
    }
    monkeypatch.setattr(invariant, "rows_invariant", lambda w, *, product: False)
    with pytest.raises(SpecMTPError, match="use float32"):
        use_row_invariant(load_model(str(tiny_target)).model)
    # Products that pass their probe, in a model whose forwards still disagree.
    monkeypatch.setattr(invariant, "rows_invariant", lambda w, *, product: True)
    monkeypatch.setattr(invariant, "forwards_agree", lambda model: False)
    with pytest.raises(SpecMTPError, match="cannot be made exact here"):
        use_row_invariant(load_model(str(tiny_target)).model)


def test_only_the_weight_shapes_that_fail_their_probe_are_padded(
    tiny_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A BLAS whose one-call products vary with the row count for one weight shape only
    (as bfloat16's 576 x 1536 down projection on an AMD EPYC): that shape pads, the others
    keep F.linear, and the model, made bfloat16, still decodes exactly. Shapes this
    machine's BLAS fails for on its own (the tiny model's 49152 x 32 LM head on an Intel
    Xeon with AMX) pad as well."""
    natural = load_model(str(tiny_target)).model.bfloat16()
    use_row_invariant(natural)
    here = {  # each shape's product on this machine
        m.weight.shape: m.invariant_product for m in natural.modules() if isinstance(m, TunedLinear)
    }
    model = load_model(str(tiny_target)).model.bfloat16()
    down = model.get_decoder().layers[0].mlp.down_proj.weight.shape
    assert here[down] != "padded"  # else the test shows nothing
    probe = invariant.rows_invariant
    monkeypatch.setattr(
        invariant,
        "rows_invariant",
        lambda w, *, product: (
            probe(w, product=product) and (w.shape != down or product == "padded")
        ),
    )
    kinds = use_row_invariant(model)
    assert f"padded for {down[0]}x{down[1]}" in kinds
    for module in model.modules():
        if isinstance(module, TunedLinear):
            want = "padded" if module.weight.shape == down else here[module.weight.shape]
            assert module.invariant_product == want
            assert (module.packed is not None) == (
                want in kernels.PACKED_PRODUCTS
            )  # only where used
    assert forwards_agree(model, rows=6)


def test_the_end_to_end_check_sees_a_row_count_dependence(bf16_runner: CachedModel) -> None:
    model = bf16_runner.model
    assert forwards_agree(model)
    norm = model.get_decoder().norm
    # A last norm that shifts every row by the number of rows in the forward.
    hook = norm.register_forward_hook(lambda module, args, out: out + 0.01 * out.shape[1])
    try:
        assert not forwards_agree(model)
    finally:
        hook.remove()


def test_profiles_and_stock_runs_leave_the_invariant_kernels_alone(
    bf16_runner: CachedModel,
) -> None:
    model = bf16_runner.model
    plan = kernel_plan(model)
    kind = plan.row_invariant
    apply_kernel_plan(model, {"2": "all"}, "in-major")  # a float32 profile's plan
    assert (plan.row_invariant, plan.layout, plan.strategy(2)) == (kind, "out-major", INVARIANT)
    with stock_kernels(model):  # how Hugging Face's generate runs the model
        assert model.config._attn_implementation == "sdpa"
        assert plan.strategy(2) == "plain"
    assert model.config._attn_implementation == ATTENTION
    assert plan.strategy(2) == INVARIANT


def test_attention_features_the_loop_does_not_apply_are_refused() -> None:
    query = torch.randn(1, 2, 1, 4)  # [B, H, n, d]
    key = value = torch.randn(1, 2, 3, 4)
    with pytest.raises(SpecMTPError, match="softcap"):
        row_invariant_attention(torch.nn.Module(), query, key, value, None, softcap=30.0)


def test_invariant_products_are_the_probed_two_dimensional_ones(
    bf16_runner: CachedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe checks 2-D products; a BLAS may take another kernel for a 3-D input."""
    dims: list[int] = []
    linear = F.linear

    def recording(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        dims.append(x.dim())
        return linear(x, weight, bias)

    monkeypatch.setattr(F, "linear", recording)
    bf16_runner.reset()
    bf16_runner.forward(_prompt(4, 6))  # [1, 6]
    bf16_runner.forward(_prompt(5, 1))  # [1, 1]
    products = {
        m.invariant_product for m in bf16_runner.model.modules() if isinstance(m, TunedLinear)
    }
    assert set(dims) <= {2}
    assert dims or products == {"amx"}  # amx.c flattens the rows itself


@pytest.mark.skipif(not kernels.PACKING_AVAILABLE, reason="no oneDNN packed product")
def test_packed_products_that_disagree_end_to_end_give_way_to_flat_ones(
    tiny_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packed products that pass their probes in a model whose forwards still disagree
    with them: the per-shape products without packing come next (not padded blocks
    everywhere), and no packed copy is kept."""
    model = load_model(str(tiny_target)).model.bfloat16()
    layers = [m for m in model.modules() if isinstance(m, TunedLinear)]
    probe = invariant.rows_invariant

    def unpacked_product(weight: torch.Tensor) -> str | None:
        kind = invariant.invariant_product(weight, ("flat", "padded"))
        wide = kind == "padded" and probe(weight, product="padded16")
        return "padded16" if wide else kind  # past 8 rows in blocks of 16 where that passes

    unpacked = {unpacked_product(m.weight) for m in layers}
    monkeypatch.setattr(
        invariant,
        "rows_invariant",
        lambda w, *, product: True if product == "packed" else probe(w, product=product),
    )
    agree = invariant.forwards_agree
    checked: list[set[str]] = []

    def agree_unless_packed(model: torch.nn.Module) -> bool:
        checked.append({m.invariant_product for m in layers})
        return not checked[-1] & set(kernels.PACKED_PRODUCTS) and agree(model)

    monkeypatch.setattr(invariant, "forwards_agree", agree_unless_packed)
    kinds = use_row_invariant(model)
    # Two choices checked: packed everywhere (amx.c's where it runs), then each shape's
    # F.linear or padded blocks.
    first = "amx" if amx_available() else "packed"
    assert checked == [{first}, unpacked]
    assert {m.invariant_product for m in layers} == checked[-1]
    assert all(m.packed is None for m in layers)
    assert kernel_plan(model).row_invariant == kinds
