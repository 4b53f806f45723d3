"""Kernel plans: the transposed product equals F.linear, TunedLinear dispatches to it for
exactly the modules its plan names, swapped models decode exactly as plain ones, and
measure_kernel_plan keeps the fastest strategy per row count."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_VOCAB, hf_greedy, perturbed_copy, tiny_model
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

import specmtp.kernels as kernels
from specmtp.cache import CachedModel
from specmtp.config import GenerationConfig
from specmtp.decode import SpecDecoder
from specmtp.draft_model_drafter import DraftModelDrafter
from specmtp.drafters import LookupFirstDrafter, drafter_packed_bytes
from specmtp.errors import SpecMTPError
from specmtp.kernels import (
    LAYOUTS,
    MAX_ROWS,
    STRATEGIES,
    KernelPlan,
    TunedLinear,
    kernel_plan,
    measure_kernel_plan,
    set_tuned_linear,
    set_weight_layout,
    transposed_linear,
    tuned_linear_enabled,
    use_tuned_linear,
)
from specmtp.models import load_model

PROMPT = [5, 17, 3, 88, 41, 5, 17, 3, 60, 2]
ROW_COUNTS = [1, 2, 3, 5, 8, 9]  # below, inside and above the planned range 2..MAX_ROWS
# Plain nn.Linear modules of conftest's tiny models: 7 per layer (q, k, v, o, gate, up,
# down) in 2 layers plus the LM head; GPT-2's layers are Conv1D, so only its LM head.
LINEARS = {"llama": 15, "qwen2": 15, "gpt2": 1}


def swapped(arch: str, strategy: str | None = None, *, seed: int = 0) -> PreTrainedModel:
    """A tiny model with TunedLinear layers, following `strategy` for 2..MAX_ROWS rows."""
    model = tiny_model(arch, seed=seed)
    plan = use_tuned_linear(model)
    if strategy is not None:
        plan.by_rows = dict.fromkeys(range(2, MAX_ROWS + 1), strategy)
    return model


def tuned_modules(model: nn.Module) -> list[TunedLinear]:
    return [m for m in model.modules() if isinstance(m, TunedLinear)]


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The weights transposed_linear is called with, in order; it still computes."""
    calls: list[torch.Tensor] = []

    def recording(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, even: bool = False
    ) -> torch.Tensor:
        calls.append(weight)
        return transposed_linear(x, weight, bias, even=even)

    monkeypatch.setattr(kernels, "transposed_linear", recording)
    return calls


@pytest.fixture
def packed_spy(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The packed weights packed_linear is called with, in order; it still computes."""
    calls: list[torch.Tensor] = []
    packed_linear = kernels.packed_linear

    def recording(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        calls.append(packed)
        return packed_linear(x, packed, bias)

    monkeypatch.setattr(kernels, "packed_linear", recording)
    return calls


needs_packing = pytest.mark.skipif(
    not kernels.PACKING_AVAILABLE, reason="this torch has no oneDNN packed product"
)


@pytest.fixture
def restore_tuned_linear() -> Iterator[None]:
    """set_tuned_linear changes the process; keep it from leaking into other tests."""
    enabled = tuned_linear_enabled()
    yield
    set_tuned_linear(enabled)


# --- transposed_linear -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("lead", [(), (2,)], ids=["2d", "3d"])
def test_transposed_linear_equals_f_linear(
    dtype: torch.dtype, with_bias: bool, lead: tuple[int, ...]
) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(24, 48, generator=generator) / 48**0.5).to(dtype)  # [out, in]
    bias = torch.randn(24, generator=generator).to(dtype) if with_bias else None
    # bfloat16 keeps 8 bits of mantissa, and the two kernels add in different orders.
    tolerance = (
        {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    )
    for rows in range(1, 11):
        x = torch.randn(*lead, rows, 48, generator=generator).to(dtype)  # [..., rows, in]
        got = transposed_linear(x, weight, bias)
        want = F.linear(x, weight, bias)
        assert got.shape == want.shape == (*lead, rows, 24)
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, **tolerance)


# --- KernelPlan ------------------------------------------------------------------------


def test_default_plan_uses_the_head_for_few_rows_only() -> None:
    plan = KernelPlan()
    assert [plan.strategy(n) for n in range(2, MAX_ROWS + 1)] == ["head"] * (MAX_ROWS - 1)
    for rows in (0, 1, MAX_ROWS + 1, 64):
        assert plan.strategy(rows) == "plain"


def test_plan_by_rows_overrides_the_default_inside_the_range_only() -> None:
    plan = KernelPlan({2: "all", 3: "plain", 1: "all", 0: "all", MAX_ROWS + 1: "all"})
    assert plan.strategy(1) == plan.strategy(2) == "all"
    assert plan.strategy(3) == "plain"
    assert plan.strategy(4) == "head"  # not named: the default
    assert plan.strategy(0) == plan.strategy(MAX_ROWS + 1) == "plain"  # outside: F.linear


# --- use_tuned_linear / kernel_plan -----------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_use_tuned_linear_swaps_classes_in_place(arch: str) -> None:
    model = tiny_model(arch, seed=0)
    params = dict(model.named_parameters(remove_duplicate=False))
    head = model.get_output_embeddings()
    tied = head.weight is model.get_input_embeddings().weight
    conv1d = sum(isinstance(m, Conv1D) for m in model.modules())
    assert kernel_plan(model) is None

    plan = use_tuned_linear(model)

    tuned = tuned_modules(model)
    assert len(tuned) == LINEARS[arch]
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert sum(isinstance(m, Conv1D) for m in model.modules()) == conv1d  # left alone
    assert all(m.kernel_plan is plan for m in tuned)  # one shared plan
    assert [m for m in tuned if m.is_head] == [head]
    assert model.get_output_embeddings() is head
    assert kernel_plan(model) is plan
    # The parameters are the very same tensors: nothing copied, ties kept.
    after = dict(model.named_parameters(remove_duplicate=False))
    assert after.keys() == params.keys()
    assert all(after[name] is params[name] for name in params)
    assert (head.weight is model.get_input_embeddings().weight) == tied
    assert tied == (arch == "gpt2")


def test_use_tuned_linear_twice_returns_the_plan_the_modules_follow() -> None:
    model = tiny_model("llama", seed=0)
    use_tuned_linear(model)
    assert use_tuned_linear(model) is kernel_plan(model)


# --- dispatch --------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_transposed_kernel_runs_for_exactly_the_planned_modules(
    strategy: str, spy: list[torch.Tensor], packed_spy: list[torch.Tensor]
) -> None:
    model = swapped("llama", strategy)
    head = model.get_output_embeddings().weight
    every = [m.weight for m in tuned_modules(model)]
    for rows in ROW_COUNTS:
        spy.clear()
        packed_spy.clear()
        with torch.no_grad():
            model(input_ids=torch.tensor([PROMPT[:rows] + [7] * (rows - len(PROMPT))]))
        planned = 2 <= rows <= MAX_ROWS
        packed = [m.packed for m in tuned_modules(model)]  # the packed strategy's weights
        expected = {"plain": [], "head": [head], "all": every, "even": every, "packed": []}
        expected = expected[strategy] if planned else []
        assert len(spy) == len(expected), (strategy, rows)
        assert {id(w) for w in spy} == {id(w) for w in expected}, (strategy, rows)
        expected_packed = packed if planned and strategy == "packed" else []
        assert len(packed_spy) == len(expected_packed), (strategy, rows)
        assert {id(w) for w in packed_spy} == {id(w) for w in expected_packed}, (strategy, rows)
    if strategy != "packed":
        assert all(m.packed is None for m in tuned_modules(model))  # nothing packed


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_even_pads_odd_row_counts_and_drops_the_padding(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []  # rows of the products the transposed kernel computed
    matmul = torch.Tensor.__matmul__

    def counting(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        seen.append(b.shape[-1])
        return matmul(a, b)

    torch.manual_seed(0)
    layer = nn.Linear(16, 8)
    x = torch.randn(1, rows, 16)
    with torch.no_grad():
        want = F.linear(x, layer.weight, layer.bias)
        monkeypatch.setattr(torch.Tensor, "__matmul__", counting)
        got = transposed_linear(x, layer.weight, layer.bias, even=True)
        plain = transposed_linear(x, layer.weight, layer.bias)
    assert seen == [rows + rows % 2, rows]
    assert got.shape == want.shape == (1, rows, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plain, want, rtol=1e-5, atol=1e-6)


def test_no_transposed_kernel_when_training_and_gradients_match(spy: list[torch.Tensor]) -> None:
    plain, tuned = tiny_model("llama", seed=0), swapped("llama", "all")
    tokens = torch.tensor([PROMPT[:4]])
    losses = [model(input_ids=tokens).logits.square().mean() for model in (plain, tuned)]
    for loss in losses:
        loss.backward()
    assert spy == []  # weights that need gradients: F.linear everywhere
    torch.testing.assert_close(losses[1], losses[0])
    for (name, want), got in zip(plain.named_parameters(), tuned.parameters(), strict=True):
        assert got.grad is not None, name
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("weights_need_grad", [True, False])
def test_dispatch_follows_grad_mode_and_gradients_flow(
    weights_need_grad: bool, spy: list[torch.Tensor]
) -> None:
    """The transposed kernel only where no weight gradient is wanted; the input's gradient
    is F.linear's either way."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(16, 8))
    plan = use_tuned_linear(layer)
    plan.by_rows = {3: "all"}
    linear = layer[0]
    linear.requires_grad_(weights_need_grad)

    with torch.no_grad():
        layer(torch.randn(3, 16))
    assert len(spy) == 1  # inference: transposed, whatever requires_grad says

    spy.clear()
    x = torch.randn(3, 16, requires_grad=True)
    out = layer(x)
    assert len(spy) == (0 if weights_need_grad else 1)
    x_ref = x.detach().clone().requires_grad_(True)
    weight_ref = linear.weight.detach().clone().requires_grad_(True)
    want = F.linear(x_ref, weight_ref, linear.bias.detach())
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    upstream = torch.randn(3, 8)
    out.backward(upstream)
    want.backward(upstream)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    if weights_need_grad:
        torch.testing.assert_close(linear.weight.grad, weight_ref.grad, rtol=1e-5, atol=1e-6)
    else:
        assert linear.weight.grad is None


# --- whole models ----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tuned_logits_equal_plain_for_chains_of_1_to_8(
    arch: str, strategy: str, spy: list[torch.Tensor]
) -> None:
    plain = CachedModel(tiny_model(arch, seed=0), vocab_size=TINY_VOCAB)
    tuned = CachedModel(swapped(arch, strategy), vocab_size=TINY_VOCAB)
    for runner in (plain, tuned):
        runner.forward(torch.tensor([PROMPT]))  # 10 rows: F.linear for both
    past = plain.length
    generator = torch.Generator().manual_seed(1)
    for n in range(1, MAX_ROWS + 1):
        chain = torch.randint(TINY_VOCAB, (1, n), generator=generator)  # [1, n]
        want, got = plain.forward(chain), tuned.forward(chain)  # [1, n, V]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        for runner in (plain, tuned):
            runner.crop(past)
    # The comparison is not vacuous: the transposed (or packed) kernel ran as planned.
    per_chain = {"plain": 0, "head": 1, "all": LINEARS[arch], "even": LINEARS[arch]}
    assert len(spy) == per_chain.get(strategy, 0) * (MAX_ROWS - 1)
    if strategy == "packed":
        assert all(m.packed is not None for m in tuned_modules(tuned.model))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_spec_decoding_a_swapped_model_equals_hf_greedy(
    spy: list[torch.Tensor], layout: str
) -> None:
    target = swapped("llama", "all")
    set_weight_layout(target, layout)
    draft = perturbed_copy(target, scale=0.3, seed=1)
    use_tuned_linear(draft).by_rows = dict.fromkeys(range(2, MAX_ROWS + 1), "all")
    decodes_as_hf_greedy(target, draft)
    assert spy  # verify passes of 5 rows went through the transposed kernel


def decodes_as_hf_greedy(target: PreTrainedModel, draft: PreTrainedModel) -> None:
    """Speculative decoding with a partly agreeing draft gives Hugging Face's greedy tokens."""
    decoder = SpecDecoder(
        target,
        drafter=DraftModelDrafter(draft, vocab_size=TINY_VOCAB),
        vocab_size=TINY_VOCAB,
        context_length=256,
    )
    result = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=40, gamma=4))
    assert 0 < result.stats.accepted_tokens < result.stats.drafted_tokens  # partly accepting
    assert result.tokens == hf_greedy(target, PROMPT, 40)


# --- measure_kernel_plan ---------------------------------------------------------------


def test_measure_kernel_plan_needs_swapped_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: object, **kwargs: object) -> tuple[float, ...]:
        raise AssertionError("nothing to measure for an unswapped model")

    monkeypatch.setattr(kernels, "measure_verify_costs", never)
    runner = CachedModel(tiny_model("llama", seed=0), vocab_size=TINY_VOCAB)
    assert measure_kernel_plan(runner, PROMPT) is None


def test_measure_kernel_plan_on_a_tiny_model() -> None:
    model = swapped("llama")
    runner = CachedModel(model, vocab_size=TINY_VOCAB)
    plan = measure_kernel_plan(runner, PROMPT, repeats=1)
    assert plan is kernel_plan(model)
    assert sorted(plan.by_rows) == list(range(1, MAX_ROWS + 1))
    assert set(plan.by_rows.values()) <= set(STRATEGIES)
    assert runner.length == 0 and runner.cache.get_seq_length() == 0


# Seconds per forward by strategy, sweep and row count n (index n - 1). Sweeps disagree so
# that only the median per n ranks them as intended: "all" at 1-3 rows, "head" at 4-8.
# At 5 rows the minimum would pick "plain" and the mean "all".
FAKE_TIMES = {
    "plain": [
        [1, 5, 5, 5, 0.5, 5, 5, 5],
        [1, 5, 5, 5, 9, 5, 5, 5],
        [0.2, 5, 5, 5, 9, 5, 5, 5],
    ],
    "head": [
        [1, 3, 3, 2, 1, 2, 2, 2],
        [1, 3, 3, 2, 1, 2, 2, 2],
        [1, 3, 9, 2, 9, 9, 2, 2],
    ],
    "all": [
        [0.5, 1, 1, 4, 2, 4, 4, 4],
        [0.5, 9, 1, 4, 2, 4, 4, 4],
        [0.5, 1, 1, 4, 2, 4, 4, 4],
    ],
    "even": [  # fastest once at 1 and 2 rows, slower by the median
        [0.1, 0.1, 9, 9, 9, 9, 9, 9],
        [0.9, 9, 9, 9, 9, 9, 9, 9],
        [0.9, 9, 9, 9, 9, 9, 9, 9],
    ],
    "packed": [  # fastest once at 4 rows, slower by the median
        [9, 9, 9, 0.1, 9, 9, 9, 9],
        [9, 9, 9, 9, 9, 9, 9, 9],
        [9, 9, 9, 9, 9, 9, 9, 9],
    ],
}


def test_measure_kernel_plan_keeps_the_median_fastest_per_row_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[dict[int, str], int, int]] = []

    def fake_costs(
        runner: CachedModel, prompt_ids: list[int], *, max_tokens: int, repeats: int
    ) -> tuple[float, ...]:
        plan = kernel_plan(runner.model)
        assert plan is not None
        calls.append((dict(plan.by_rows), max_tokens, repeats))
        layouts.append(plan.layout)
        strategy = plan.by_rows[2]
        sweep = sum(1 for by_rows, _, _ in calls if by_rows[2] == strategy) - 1
        sweep //= len(LAYOUTS)  # each layout has its sweep of every strategy
        # What each row count costs under the strategy the plan holds right now; in-major
        # weights cost 1.2x at 1-3 rows and `in_major_factor` from 4 rows.
        times = FAKE_TIMES[strategy][sweep]
        if plan.layout == "in-major":
            times = [t * (1.2 if n < 3 else in_major_factor) for n, t in enumerate(times)]
        return tuple(float(times[n - 1]) for n in range(1, max_tokens + 1))

    monkeypatch.setattr(kernels, "measure_verify_costs", fake_costs)
    model = swapped("llama")
    runner = CachedModel(model, vocab_size=TINY_VOCAB)
    layouts: list[str] = []
    # Fastest per n: 0.5 1 1 | 2 1 2 2 2. The geometric means decide: in-major changes them
    # by 1.2^3 x 0.8^5 = 0.57 (its plain sum, 3.0 + 7.2 = 10.2, is smaller too)
    in_major_factor = 0.8
    plan = measure_kernel_plan(runner, PROMPT, repeats=3)

    assert plan is kernel_plan(model)
    assert plan.by_rows == {1: "all", 2: "all", 3: "all"} | dict.fromkeys(range(4, 9), "head")
    assert plan.layout == "in-major"  # the smaller sum of the fastest T(n)
    assert not model.model.layers[0].mlp.up_proj.weight.is_contiguous()
    # Layouts and strategies take turns sweep by sweep, each timing the whole plan once.
    per_layout = len(STRATEGIES)
    assert (
        layouts
        == ["out-major"] * per_layout + ["in-major"] * per_layout + layouts[: 2 * per_layout] * 2
    )
    assert [by_rows[2] for by_rows, _, _ in calls] == list(STRATEGIES) * 2 * 3
    for by_rows, max_tokens, repeats in calls:
        assert sorted(by_rows) == list(range(1, MAX_ROWS + 1))
        assert len(set(by_rows.values())) == 1
        assert (max_tokens, repeats) == (MAX_ROWS, 1)
    assert runner.length == 0

    calls.clear()
    # 1.2^3 x 0.93^5 = 1.21: out-major, although in-major's sum is smaller (3.0 + 8.37 <
    # 11.5): one layout's savings at many rows do not buy another's losses at few
    in_major_factor = 0.93
    plan = measure_kernel_plan(runner, PROMPT, repeats=3)
    assert plan.layout == "out-major"
    assert model.model.layers[0].mlp.up_proj.weight.is_contiguous()

    calls.clear()
    plan = measure_kernel_plan(runner, PROMPT, max_rows=3, repeats=3)
    assert plan.by_rows == {1: "all", 2: "all", 3: "all"}
    assert {max_tokens for _, max_tokens, _ in calls} == {3}
    assert plan.strategy(5) == "head"  # unmeasured row counts fall back to the default

    calls.clear()
    plan = measure_kernel_plan(runner, PROMPT, max_rows=50, repeats=3)
    assert sorted(plan.by_rows) == list(range(1, MAX_ROWS + 1))  # capped at MAX_ROWS
    assert {max_tokens for _, max_tokens, _ in calls} == {MAX_ROWS}


# --- load_model ------------------------------------------------------------------------


def test_load_model_swaps_layers_only_when_enabled(restore_tuned_linear: None) -> None:
    """The session fixture in conftest has converted the default model into its cache."""
    set_tuned_linear(True)
    model = load_model("default").model
    layers = model.config.num_hidden_layers
    tuned = tuned_modules(model)
    assert len(tuned) == 7 * layers + 1
    assert not any(type(m) is nn.Linear for m in model.modules())
    head = model.get_output_embeddings()
    assert [m for m in tuned if m.is_head] == [head]
    assert kernel_plan(model) == KernelPlan()  # the default plan until measured
    tied = head.weight is model.get_input_embeddings().weight
    assert tied == model.config.tie_word_embeddings
    del model, tuned, head

    set_tuned_linear(False)
    model = load_model("default").model
    assert kernel_plan(model) is None
    assert sum(type(m) is nn.Linear for m in model.modules()) == 7 * layers + 1


def test_stock_kernels_turn_the_plan_off_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hugging Face's methods in the bench run as its users run them: F.linear only."""
    model = tiny_model("llama", seed=0)
    plan = use_tuned_linear(model)
    plan.by_rows = dict.fromkeys(range(2, 9), "all")
    calls: list[int] = []
    real = kernels.transposed_linear
    monkeypatch.setattr(
        kernels, "transposed_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    tokens = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        with kernels.stock_kernels(model, None):
            model(tokens)
            assert calls == [] and plan.disabled
        assert not plan.disabled
        model(tokens)
    assert calls  # the plan applies again afterwards


# --- weight layouts --------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_in_major_weights_keep_values_and_logits(arch: str) -> None:
    """In-major storage moves every weight but the LM head (tied to the embeddings) into
    [in, out] order; values, parameters and logits stay; out-major restores the storage."""
    model = swapped(arch, "head")
    head = model.get_output_embeddings()
    linears = [m for m in tuned_modules(model) if m is not head]
    params = [m.weight for m in linears]
    before = [w.detach().clone() for w in params]
    runner = CachedModel(model, vocab_size=TINY_VOCAB)
    chain = torch.tensor([PROMPT])
    want = runner.forward(chain)
    runner.reset()
    set_weight_layout(model, "in-major")
    assert kernel_plan(model).layout == "in-major"
    for module, param, old in zip(linears, params, before, strict=True):
        assert module.weight is param  # the same parameter, its storage moved
        assert param.stride() == (1, param.shape[0]) and not param.is_contiguous()
        assert torch.equal(param, old)
    assert head.weight.is_contiguous()
    for n in range(1, MAX_ROWS + 1):  # every row count, as a verify pass would
        got = runner.forward(chain[:, :n])
        torch.testing.assert_close(got, want[:, :n], rtol=1e-4, atol=1e-5)
        runner.reset()
    set_weight_layout(model, "out-major")
    assert all(
        p.is_contiguous() and torch.equal(p, old) for p, old in zip(params, before, strict=True)
    )


def test_stock_kernels_run_the_weights_as_loaded() -> None:
    model = swapped("llama")
    set_weight_layout(model, "in-major")
    weight = model.model.layers[0].self_attn.q_proj.weight
    with kernels.stock_kernels(model):
        assert weight.is_contiguous() and kernel_plan(model).layout == "out-major"
    assert not weight.is_contiguous() and kernel_plan(model).layout == "in-major"


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(SpecMTPError, match="kernel layout must be one of"):
        set_weight_layout(swapped("llama"), "diagonal")
    with pytest.raises(ValueError, match="whose linear layers were swapped"):
        set_weight_layout(tiny_model("llama", seed=0), "in-major")


# --- the packed strategy ---------------------------------------------------------------


@needs_packing
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("lead", [(), (2,)], ids=["2d", "3d"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_linear_equals_f_linear(with_bias: bool, lead: tuple[int, ...], layout: str) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 48, generator=generator) / 48**0.5  # [out, in]
    if layout == "in-major":
        weight = weight.t().contiguous().t()
    bias = torch.randn(24, generator=generator) if with_bias else None
    packed = kernels.pack_weight(weight)
    for rows in range(1, 11):
        x = torch.randn(*lead, rows, 48, generator=generator)  # [..., rows, in]
        got = kernels.packed_linear(x, packed, bias)
        want = F.linear(x, weight, bias)
        assert got.shape == want.shape == (*lead, rows, 24)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # A non-contiguous input (a slice of a wider tensor) too.
    wide = torch.randn(3, 96, generator=generator)[:, ::2]
    torch.testing.assert_close(
        kernels.packed_linear(wide, packed, bias),
        F.linear(wide, weight, bias),
        rtol=1e-5,
        atol=1e-6,
    )


@needs_packing
def test_packed_weights_follow_their_weights(packed_spy: list[torch.Tensor]) -> None:
    """A weight changed in place or moved to another layout is packed again, so the packed
    product never runs on stale values; weights that need gradients take F.linear."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(16, 8))
    use_tuned_linear(layer).by_rows = {3: "packed"}
    linear = layer[0]
    x = torch.randn(3, 16)
    with torch.no_grad():
        first = layer(x)
        packed = linear.packed
        assert packed is not None and len(packed_spy) == 1
        assert layer(x) is not None and linear.packed is packed  # unchanged: not packed again
        linear.weight.mul_(2)
        torch.testing.assert_close(layer(x), F.linear(x, linear.weight, linear.bias))
        assert linear.packed is not packed
        packed = linear.packed
        set_weight_layout(layer, "in-major")
        torch.testing.assert_close(layer(x), F.linear(x, linear.weight, linear.bias))
        assert linear.packed is not packed
    assert not torch.allclose(first, layer(x))
    packed_spy.clear()
    out = layer(x)  # gradients wanted (the weights require them): F.linear
    assert packed_spy == [] and out.requires_grad


@needs_packing
def test_packed_copies_are_kept_only_while_the_plan_uses_them() -> None:
    model = swapped("llama")
    assert kernels.packed_bytes(model) == 0
    weights = sum(m.weight.numel() * 4 for m in tuned_modules(model))
    kernels.apply_kernel_plan(model, {"4": "packed", "5": "head"})  # keys as JSON has them
    assert kernels.packed_bytes(model) >= weights  # packed now, not in the first verify pass
    kernels.apply_kernel_plan(model, {"4": "head"})
    assert kernels.packed_bytes(model) == 0
    assert all(m.packed is None for m in tuned_modules(model))


@needs_packing
def test_measure_kernel_plan_keeps_packed_weights_only_when_chosen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The packed strategy is timed on packed weights (packed before its timed forwards),
    and the copies stay only if it wins some row count."""
    packed_wins = True
    sizes: list[int] = []  # packed bytes while each strategy was timed

    def fake_costs(
        runner: CachedModel, prompt_ids: list[int], *, max_tokens: int, repeats: int
    ) -> tuple[float, ...]:
        plan = kernel_plan(runner.model)
        strategy = plan.by_rows[1]
        if strategy == "packed":
            sizes.append(kernels.packed_bytes(runner.model))
        fast = strategy == ("packed" if packed_wins else "head")
        return tuple(1.0 if fast and n >= 3 else 2.0 for n in range(1, max_tokens + 1))

    monkeypatch.setattr(kernels, "measure_verify_costs", fake_costs)
    model = swapped("llama")
    runner = CachedModel(model, vocab_size=TINY_VOCAB)
    plan = measure_kernel_plan(runner, PROMPT, repeats=1)
    assert [plan.by_rows[n] for n in range(3, MAX_ROWS + 1)] == ["packed"] * (MAX_ROWS - 2)
    assert sizes and all(size > 0 for size in sizes)
    assert kernels.packed_bytes(model) > 0
    packed_wins = False
    plan = measure_kernel_plan(runner, PROMPT, repeats=1)
    assert "packed" not in plan.by_rows.values()
    assert kernels.packed_bytes(model) == 0


@needs_packing
def test_spec_decoding_with_packed_products_equals_hf_greedy(
    packed_spy: list[torch.Tensor],
) -> None:
    target = swapped("llama", "packed")
    decodes_as_hf_greedy(target, perturbed_copy(target, scale=0.3, seed=1))
    assert packed_spy  # verify passes of 5 rows went through the packed product


@needs_packing
def test_a_memory_budget_counts_the_packed_copies() -> None:
    """The packed copies hold the weights a second time: a budget that fits the model with
    its weights once, but not twice, is refused once they are packed."""
    target = swapped("llama", "packed")
    decoder = SpecDecoder(target, vocab_size=TINY_VOCAB, context_length=256)
    weights = sum(t.numel() * t.element_size() for t in target.state_dict().values())
    config = GenerationConfig(max_new_tokens=8, max_memory_bytes=int(1.5 * weights))
    assert len(decoder.generate(PROMPT, config).tokens) == 8
    kernels.pack_weights(target)
    with pytest.raises(SpecMTPError, match=r"max-memory .* is too small"):
        decoder.generate(PROMPT, config)


@needs_packing
def test_a_memory_budget_counts_a_draft_models_packed_copies() -> None:
    """A draft model whose products pack holds its weights twice too: its drafter reports
    the copies (behind lookup as well), and a budget that fits both models' weights once
    and a short request, but not the draft's copies, is refused."""
    target = swapped("llama")
    draft = swapped("llama", "packed", seed=1)
    drafter = DraftModelDrafter(draft, vocab_size=TINY_VOCAB)
    assert drafter_packed_bytes(drafter) == 0  # nothing packed yet
    kernels.pack_weights(draft)
    copies = kernels.packed_bytes(draft)
    assert copies > 0 and drafter_packed_bytes(drafter) == copies
    assert drafter_packed_bytes(LookupFirstDrafter(drafter)) == copies
    assert drafter_packed_bytes(None) == 0
    decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
    weights = sum(
        t.numel() * t.element_size() for m in (target, draft) for t in m.state_dict().values()
    )
    config = GenerationConfig(max_new_tokens=8, gamma=2, max_memory_bytes=weights + copies // 2)
    with pytest.raises(SpecMTPError, match=r"max-memory .* is too small"):
        decoder.generate(PROMPT, config)
    kernels.release_packed(draft)
    assert len(decoder.generate(PROMPT, config).tokens) == 8


@needs_packing
def test_no_packed_weights_turns_packing_off_everywhere(
    tiny_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--no-packed-weights`: a plan neither times nor runs `packed` (a stored plan's packed
    rows take the default kernels), and a bfloat16 model loads with other row-invariant
    products; no packed copy is made anywhere."""
    from specmtp import invariant
    from specmtp.cli import main

    assert main(["generate", "x", "--no-packed-weights", "--target", "/nonexistent"]) != 0
    assert not kernels.packing_allowed()  # set by the flag, before the target failed to load
    timed: list[str] = []

    def fake_costs(
        runner: CachedModel, prompt_ids: list[int], *, max_tokens: int, repeats: int
    ) -> tuple[float, ...]:
        timed.append(kernel_plan(runner.model).by_rows[1])
        return tuple(1.0 for _ in range(max_tokens))

    monkeypatch.setattr(kernels, "measure_verify_costs", fake_costs)
    model = swapped("llama")
    measure_kernel_plan(CachedModel(model, vocab_size=TINY_VOCAB), PROMPT, repeats=1)
    assert timed and "packed" not in timed
    kernels.apply_kernel_plan(model, {"4": "packed"})
    assert kernel_plan(model).strategy(4) == "head" and kernels.packed_bytes(model) == 0
    bf16 = load_model(str(tiny_target), dtype=torch.bfloat16).model
    assert "packed" not in invariant.describe_products(
        {(m.weight.shape, m.weight.dtype): m.invariant_product for m in tuned_modules(bf16)}
    )
    assert kernels.packed_bytes(bf16) == 0
    assert main(["generate", "x", "--target", "/nonexistent"]) != 0
    assert kernels.packing_allowed()  # without the flag, packing again
