"""lean.py: the lean draft forward gives transformers' logits (up to rounding) for chains,
trees and the cache it leaves behind; its C steps against slow references; stacked int8
products; what it refuses; drafting with it keeps greedy output identical."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache, PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from specmtp import lean_layers, native
from specmtp.api import SpecGenerator
from specmtp.cache import CachedModel
from specmtp.int4 import use_int4_products
from specmtp.int8 import BLOCK, Int8Product, use_int8_products
from specmtp.lean import LeanForward, agrees, correlation, lean_forward, unsupported
from specmtp.models import load_model
from specmtp.tree import additive_mask

pytestmark = pytest.mark.skipif(
    native.int8_kernel() is None or native.lean_kernels() is None,
    reason="lean.py needs int8.c (AVX512-VNNI) and lean.c (a C compiler)",
)


def int8_model(
    arch: str, dtype: torch.dtype, *, seed: int = 0, int4: bool = False
) -> PreTrainedModel:
    """A tiny random model the lean forward takes (head size 16, every projection a whole
    number of int8.c's blocks), its weights widened so its logits are far from uniform;
    with int4, its decoder layers' products in int4.c's."""
    model = tiny_model(arch, seed=seed, head_dim=16)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(4 if parameter.dim() == 2 else 1)
    model = model.to(dtype)
    return use_int8_products(use_int4_products(model) if int4 else model)


def both_logits(
    model: PreTrainedModel,
    tokens: torch.Tensor,
    past: int,
    *,
    mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, DynamicCache, DynamicCache]:
    """transformers' and the lean forward's logits [n, V] for tokens[past:] after tokens[:past]
    (fed through transformers), and the two caches after."""
    lean = LeanForward(model)
    fresh = tokens[:, past:]
    if positions is None:
        positions = torch.arange(past, tokens.shape[1])[None]
    out, caches = [], []
    for use_lean in (False, True):
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=tokens[:, :past], cache=cache)
            if use_lean:
                logits = lean(fresh, cache, position_ids=positions, attention_mask=mask)
            else:
                logits = model(
                    input_ids=fresh, position_ids=positions, attention_mask=mask, cache=cache
                ).logits
        out.append(logits[0].float())
        caches.append(cache)
    return out[0], out[1], caches[0], caches[1]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4])
def test_chain_logits_and_cache_match_transformers(
    arch: str, dtype: torch.dtype, rows: int
) -> None:
    model = int8_model(arch, dtype)
    assert unsupported(model) is None
    tokens = torch.randint(
        0, model.config.vocab_size, (1, 10 + rows), generator=torch.Generator().manual_seed(1)
    )
    reference, lean, reference_cache, lean_cache = both_logits(model, tokens, 10)
    assert lean.shape == reference.shape == (rows, model.config.vocab_size)
    assert correlation(lean, reference).min() > 0.999
    assert (lean.argmax(-1) == reference.argmax(-1)).all()
    # The keys and values it appends are transformers' (rotated the same way), so the two
    # forwards share one cache.
    for mine, theirs in zip(lean_cache.layers, reference_cache.layers, strict=True):
        assert mine.keys.dtype == theirs.keys.dtype == dtype
        assert mine.keys.shape == theirs.keys.shape
        torch.testing.assert_close(mine.keys.float(), theirs.keys.float(), atol=0.1, rtol=0.03)
        torch.testing.assert_close(mine.values.float(), theirs.values.float(), atol=0.1, rtol=0.03)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tree_mask_and_positions_match_transformers(arch: str) -> None:
    """Three nodes after a 9-token context: two children of the last context token (same
    position) and a grandchild under the first; each sees the context and its ancestors."""
    model = int8_model(arch, torch.bfloat16)
    tokens = torch.randint(
        0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2)
    )
    allowed = torch.ones(3, 12, dtype=torch.bool)
    allowed[:, 9:] = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)
    mask = additive_mask(allowed, torch.bfloat16)[None, None]  # [1, 1, 3, 12]
    positions = torch.tensor([[9, 9, 10]])
    reference, lean, _, _ = both_logits(model, tokens, 9, mask=mask, positions=positions)
    assert correlation(lean, reference).min() > 0.999
    assert (lean.argmax(-1) == reference.argmax(-1)).all()
    # The mask was applied, not ignored: a chain's rows 2 and 3 are further from the tree's.
    _, chain, _, _ = both_logits(model, tokens, 9)
    assert (lean - reference)[1:].abs().max() < 0.5 * (chain - reference)[1:].abs().max()


def test_last_only_is_the_last_row() -> None:
    model = int8_model("qwen2", torch.bfloat16)
    lean = LeanForward(model)
    tokens = torch.randint(
        0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(3)
    )
    rows = []
    for last_only in (False, True):
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=tokens[:, :5], cache=cache)
            rows.append(
                lean(
                    tokens[:, 5:], cache, position_ids=torch.arange(5, 8)[None], last_only=last_only
                )
            )
    assert rows[1].shape == (1, 1, model.config.vocab_size)
    assert torch.equal(rows[1][0, 0], rows[0][0, -1])


@pytest.mark.parametrize("int4", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_in_c_give_the_python_steps_bits(
    int4: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lean.c's specmtp_lean_layers against layer_step called from Python (the reference):
    the same logits and cached bits over calls that grow the buffers past their capacity,
    verify a tree, keep its path, crop, and let transformers' forward append in between."""
    monkeypatch.setattr(lean_layers, "MIN_CAPACITY", 4)
    model = int8_model("qwen2", dtype, int4=int4)
    lean, vocab = LeanForward(model), model.config.vocab_size
    runners = {in_c: CachedModel(model, vocab_size=vocab) for in_c in (True, False)}
    tokens = torch.randint(0, vocab, (1, 40), generator=torch.Generator().manual_seed(8))
    allowed = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)

    def step(in_c: bool, call: str, n: int) -> torch.Tensor | None:
        runner = runners[in_c]
        runner.lean, lean.in_c = (None if call == "transformers" else lean), in_c
        fresh, past = tokens[:, runner.length : runner.length + n], runner.length
        if call == "keep":  # the tree's first and third nodes: a path of two
            runner.keep(past - 3, torch.tensor([past - 3, past - 1]))
        elif call == "crop":
            runner.crop(past - n)
        elif call == "tree":
            mask = torch.cat([torch.ones(3, past, dtype=torch.bool), allowed], 1)
            positions = torch.tensor([[past, past, past + 1]])
            mask = additive_mask(mask, dtype)[None, None]
            return runner.forward(fresh, attention_mask=mask, position_ids=positions)
        else:
            return runner.forward(fresh)
        return None

    script = [("transformers", 5), ("lean", 3), ("lean", 1), ("tree", 3), ("keep", 0),
              ("lean", 2), ("crop", 2), ("lean", 4), ("transformers", 6), ("lean", 1),
              ("tree", 3), ("lean", 9)]  # fmt: skip
    for call, n in script:
        logits = [step(in_c, call, n) for in_c in (True, False)]
        if logits[0] is not None:
            assert torch.equal(logits[0], logits[1]), (call, n)
    c_cache, reference = (runners[in_c].cache for in_c in (True, False))
    assert runners[True].length == runners[False].length == c_cache.get_seq_length() == 34
    for mine, theirs in zip(c_cache.layers, reference.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    # The C path's cache is views of buffers grown to 8, 16, 32 and 64 positions, which
    # its runner reports as the bytes it holds.
    buffers = lean._buffers[c_cache]
    assert buffers.capacity == 64 and c_cache.layers[0].keys.data_ptr() == buffers.pointers[0][0]
    assert runners[True].kv_bytes() == buffers.nbytes() > runners[False].kv_bytes()


def test_agrees_refuses_a_wrong_forward() -> None:
    model = int8_model("llama", torch.bfloat16)
    lean = LeanForward(model)
    assert agrees(model, lean)
    lean.layers[0].input_norm = -lean.layers[0].input_norm.roll(1)  # a wrong norm weight
    assert not agrees(model, lean)


def test_add_rms_norm_against_float64() -> None:
    norm = native.lean_kernels().norm
    generator = torch.Generator().manual_seed(4)
    x, delta = torch.randn(3, 48, generator=generator), torch.randn(3, 48, generator=generator)
    weight, out = torch.randn(48, generator=generator), torch.empty(3, 48)
    expected_x = x.double() + delta.double()
    rms = expected_x.pow(2).mean(-1, keepdim=True).add(1e-5).rsqrt()
    norm(x.data_ptr(), delta.data_ptr(), 3, 48, weight.data_ptr(), 1e-5, out.data_ptr())
    torch.testing.assert_close(x.double(), expected_x)
    torch.testing.assert_close(out.double(), expected_x * rms * weight.double())
    norm(x.data_ptr(), None, 3, 48, weight.data_ptr(), 1e-5, out.data_ptr())  # no delta
    torch.testing.assert_close(out.double(), expected_x * rms * weight.double())


def test_silu_mul_against_float64() -> None:
    """Every vector lane and the scalar tail (width 40 = 2 x 16 + 8), large and tiny gates
    included (exp's range limits)."""
    silu_mul = native.lean_kernels().silu_mul
    generator = torch.Generator().manual_seed(6)
    gate_up = torch.randn(3, 80, generator=generator) * 4
    gate_up[0, :6] = torch.tensor([-120.0, -90.0, -87.5, 90.0, 0.0, 30.0])
    out = torch.full((3, 40), float("nan"))
    silu_mul(gate_up.data_ptr(), 3, 40, out.data_ptr())
    gate, up = gate_up.double().split(40, -1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("bf16", [False, True])
def test_split_rotary_against_transformers(bf16: bool) -> None:
    rotate = native.lean_kernels().rotary
    n, heads, kv_heads, d = 3, 4, 2, 16
    generator = torch.Generator().manual_seed(5)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=generator)
    angles = torch.rand(n, d // 2, generator=generator) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [n, d]
    kv_dtype = torch.bfloat16 if bf16 else torch.float32
    q, k = torch.empty(n, heads, d), torch.empty(1, kv_heads, n, d, dtype=kv_dtype)
    v = torch.empty_like(k)
    rotate(qkv.data_ptr(), n, heads, kv_heads, d, cos.data_ptr(), sin.data_ptr(),
           q.data_ptr(), k.data_ptr(), v.data_ptr(), int(bf16))  # fmt: skip
    q_in, k_in, v_in = qkv.view(n, -1, d).split([heads, kv_heads, kv_heads], 1)  # [n, h, d]
    q_out, k_out = apply_rotary_pos_emb(
        q_in.transpose(0, 1)[None], k_in.transpose(0, 1)[None], cos[None], sin[None]
    )  # [1, h, n, d]
    torch.testing.assert_close(q.transpose(0, 1)[None], q_out)
    torch.testing.assert_close(k, k_out.to(kv_dtype))
    assert torch.equal(v, v_in.transpose(0, 1)[None].to(kv_dtype))


def test_stacked_products_are_the_parts_side_by_side() -> None:
    generator = torch.Generator().manual_seed(6)
    weights = [torch.randn(rows, 40, generator=generator) for rows in (2 * BLOCK, BLOCK, BLOCK)]
    products = [Int8Product(w, torch.randn(len(w), generator=generator) if i != 1 else None)
                for i, w in enumerate(weights)]  # fmt: skip
    x = torch.randn(5, 40, generator=generator)
    alone = [p(x) for p in products]
    stacked = Int8Product.stacked(products)
    assert torch.equal(stacked(x), torch.cat(alone, -1))
    # The parts now read the stacked copy, and still give what they gave.
    for part, before in zip(products, alone, strict=True):
        assert (
            part.packed.untyped_storage().data_ptr() == stacked.packed.untyped_storage().data_ptr()
        )
        assert torch.equal(part(x), before)
    with pytest.raises(ValueError, match="whole blocks"):
        Int8Product.stacked([Int8Product(torch.randn(BLOCK + 1, 40), None), products[0]])


def test_unsupported_names_what_it_does_not_take() -> None:
    float_model = tiny_model("llama", seed=0, head_dim=16)
    assert "int8" in unsupported(float_model)
    assert "model type 'gpt2'" in unsupported(use_int8_products(tiny_model("gpt2", seed=0)))
    gelu = tiny_model("llama", seed=0, head_dim=16)
    gelu.config.hidden_act = "gelu"
    assert "SiLU" in unsupported(use_int8_products(gelu))
    narrow = use_int8_products(tiny_model("llama", seed=0))  # heads 8 wide: k, v 16 rows
    assert unsupported(narrow) is not None
    assert lean_forward(narrow) is None


@pytest.fixture(scope="module")
def lean_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 the lean forward takes, with the default model's tokenizer."""
    tokenizer = load_model("default").tokenizer
    path = tmp_path_factory.mktemp("lean-target")
    model = tiny_model("qwen2", seed=7, vocab_size=len(tokenizer), context=512, head_dim=16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drafting_with_it_keeps_greedy_output(
    lean_target: Path, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A draft tree and a chain whose draft is the target itself in int8 (so it agrees
    often): with and without the lean forward, the output is the target's greedy one, and
    the lean forward drafts what transformers' does (same acceptance)."""
    target = load_model(str(lean_target), dtype=dtype)
    prompt = torch.randint(100, 5000, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    expected = SpecGenerator(target).generate(prompt, max_new_tokens=30).tokens
    for spec in ("#int8#nodes=4", "#int8", "#int4#nodes=4"):
        accepted = {}
        for enabled in ("1", "0"):
            monkeypatch.setenv("SPECMTP_LEAN", enabled)
            generator = SpecGenerator(target, draft=f"{lean_target}{spec}")
            assert (generator.decoder.drafter.runner.lean is not None) == (enabled == "1")
            done = generator.generate(prompt, max_new_tokens=30, gamma=3)
            assert done.tokens == expected
            accepted[enabled] = done.stats.accepted_tokens
        assert accepted["1"] > 0
        assert accepted["1"] == pytest.approx(accepted["0"], abs=3)
    # Sampling: the lean draft's float32 logits are q; drafts are still taken.
    monkeypatch.setenv("SPECMTP_LEAN", "1")
    generator = SpecGenerator(target, draft=f"{lean_target}#int8")
    done = generator.generate(prompt, max_new_tokens=30, gamma=3, temperature=0.8, seed=1)
    assert len(done.tokens) == 30 and done.stats.accepted_tokens > 0
