"""The row-invariant attention kernel in C (specmtp/attention.c, compiled by native.py): all
query rows of a layer in one call, each row's output the bits of that row computed alone,
and what SDPA computes up to rounding. Where this machine has no C compiler there is nothing
to test (and invariant.py keeps its torch loop, tested in test_invariant.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from specmtp import invariant, native
from specmtp.api import SpecGenerator
from specmtp.cache import CachedModel
from specmtp.invariant import (
    attention_path,
    forwards_agree,
    kernel_takes,
    row_invariant_attention,
)
from specmtp.kernels import kernel_plan
from specmtp.models import load_model
from specmtp.tree import TokenTree, tree_forward

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here"
)
MODULE = torch.nn.Module()  # what the attention interface passes; the kernel reads nothing of it


def _random_visibility(n: int, keys: int, generator: torch.Generator) -> torch.Tensor:
    """[n, keys] bool: each row sees a prefix of at least one key, then random keys past it
    (as a tree row sees the committed tokens, then its ancestors)."""
    prefixes = torch.randint(1, keys - n + 1, (n,), generator=generator)
    visible = torch.rand(n, keys, generator=generator) < 0.4
    return visible | (torch.arange(keys) < prefixes[:, None])


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor):
    mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    mask = mask[None, None].expand(query.shape[0], 1, *visible.shape)  # [B, 1, n, S]
    return row_invariant_attention(MODULE, query, key, value, mask, scaling=0.3)[0]


def test_the_kernel_is_built_and_taken_for_the_shapes_it_serves() -> None:
    assert native.attention_kernel() is not None
    assert native.kernel_name() == native.NATIVE
    assert kernel_takes(head_dim=64, heads=9, kv_heads=3, dtype=torch.bfloat16)  # the default's
    assert not kernel_takes(head_dim=8, heads=4, kv_heads=2, dtype=torch.bfloat16)
    assert not kernel_takes(head_dim=64, heads=9, kv_heads=3, dtype=torch.float16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(4, 2, 16), (9, 3, 64), (2, 2, 32)])
def test_each_row_gets_the_bits_of_its_own_keys_attended_alone(
    dtype: torch.dtype, heads: int, kv_heads: int, d: int
) -> None:
    """Rows seeing random prefixes plus random later keys, in one call, against each row
    alone over exactly its visible keys gathered into a row of their own: a tree row
    against the one-token step of its path."""
    generator = torch.Generator().manual_seed(heads * d)
    n, keys = 7, 90
    query = torch.randn(1, heads, n, d, generator=generator).to(dtype)  # [B, H, n, d]
    key, value = (torch.randn(1, kv_heads, keys, d, generator=generator).to(dtype) for _ in "kv")
    visible = _random_visibility(n, keys, generator)
    together = _attend(query, key, value, visible)  # [1, n, H, d]
    assert together.dtype == dtype
    for row in range(n):
        seen = visible[row].nonzero().squeeze(-1)
        alone = row_invariant_attention(
            MODULE,
            query[:, :, row : row + 1],
            key[:, :, seen],
            value[:, :, seen],
            None,
            scaling=0.3,
        )[0]
        assert torch.equal(alone[0, 0], together[0, row]), f"row {row}"


@pytest.mark.parametrize("mask_kind", ["causal", "tree"])
def test_the_kernel_computes_what_sdpa_computes(mask_kind: str) -> None:
    generator = torch.Generator().manual_seed(2)
    query = torch.randn(2, 6, 5, 32, generator=generator)  # [B, H, n, d]
    key, value = (torch.randn(2, 3, 40, 32, generator=generator) for _ in "kv")  # [B, Hkv, S, d]
    visible = torch.ones(5, 40, dtype=torch.bool).tril(diagonal=35)  # the last 5 of 40
    if mask_kind == "tree":
        visible[4, 36:38] = False
    reference = F.scaled_dot_product_attention(
        query, key, value, attn_mask=visible, scale=0.3, enable_gqa=True
    ).transpose(1, 2)
    if mask_kind == "causal":
        ours = row_invariant_attention(MODULE, query, key, value, None, scaling=0.3)[0]
    else:
        ours = _attend(query, key, value, visible)
    torch.testing.assert_close(ours, reference)
    low = row_invariant_attention(
        MODULE, query.bfloat16(), key.bfloat16(), value.bfloat16(), None, scaling=0.3
    )[0]
    if mask_kind == "causal":
        torch.testing.assert_close(low.float(), reference, atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module")
def wide_heads_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with 16-wide heads, which the kernel takes (test_invariant's has 8)."""
    path = tmp_path_factory.mktemp("tiny-wide-heads")
    tokenizer = load_model("default").tokenizer
    model = tiny_model("llama", seed=3, vocab_size=len(tokenizer), context=512, head_dim=16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_bf16_model_with_the_kernel_verifies_chains_and_trees_exactly(
    wide_heads_target: Path,
) -> None:
    loaded = load_model(str(wide_heads_target), dtype=torch.bfloat16)
    assert attention_path(loaded.model) == native.NATIVE
    assert forwards_agree(loaded.model, prompt=30, rows=9)
    runner = CachedModel(loaded.model, vocab_size=loaded.model.config.vocab_size)
    prompt = torch.randint(5, 4000, (1, 40), generator=torch.Generator().manual_seed(0))
    runner.forward(prompt[:, :30])
    steps = [runner.forward(prompt[:, i : i + 1])[0, -1] for i in range(30, 40)]
    runner.reset()
    runner.forward(prompt[:, :30])
    # a tree whose first branch is the prompt's own continuation, beside other tokens
    tree = TokenTree(((0,), (1,), (0, 0), (0, 1), (0, 0, 0)))
    nodes = torch.tensor([[prompt[0, 31].item(), 7, prompt[0, 32].item(), 9, prompt[0, 33].item()]])
    logits = tree_forward(runner, tree, prompt[:, 30:31], nodes)[0]  # [6, V]
    for row, step in [(0, 0), (1, 1), (3, 2), (5, 3)]:
        assert torch.equal(logits[row], steps[step]), f"tree row {row}"


def test_speculative_greedy_output_with_the_kernel_equals_plain_decoding(
    wide_heads_target: Path,
) -> None:
    prompt = torch.randint(5, 4000, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = SpecGenerator(str(wide_heads_target), dtype=torch.bfloat16)
    spec = SpecGenerator(str(wide_heads_target), draft="ngram", dtype=torch.bfloat16)
    expected = plain.generate(prompt, max_new_tokens=80)
    done = spec.generate(prompt, max_new_tokens=80, gamma=4)
    assert done.tokens == expected.tokens
    assert 0 < done.stats.accepted_tokens < done.stats.drafted_tokens


def test_a_row_that_sees_no_key_gets_zeros_as_in_the_torch_loop() -> None:
    """A padded batch row's query may see nothing: zeros (not 0 / 0) on both paths."""
    generator = torch.Generator().manual_seed(4)
    for d in (16, 8):  # the kernel's width, then the loop's
        query = torch.randn(1, 2, 3, d, generator=generator)
        key, value = (torch.randn(1, 1, 10, d, generator=generator) for _ in "kv")
        visible = torch.ones(3, 10, dtype=torch.bool).tril(diagonal=7)
        visible[1] = False
        out = _attend(query, key, value, visible)  # [1, 3, 2, d]
        assert torch.equal(out[0, 1], torch.zeros(2, d)), d
        assert out[0, [0, 2]].abs().sum() > 0


def test_a_kernel_that_disagrees_at_load_gives_way_to_the_torch_loop(
    wide_heads_target: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Were the kernel's forwards ever to disagree with its one-token steps on a machine, the
    model loads with the torch loop (said on stderr), and the process keeps to it."""
    monkeypatch.setattr(native, "_refused", False)  # restored after the test
    monkeypatch.setattr(
        invariant, "forwards_agree", lambda model: native.attention_kernel() is None
    )
    loaded = load_model(str(wide_heads_target), dtype=torch.bfloat16)
    assert kernel_plan(loaded.model).row_invariant_attention == native.LOOP
    assert native.attention_kernel() is None
    assert "not row-invariant here" in capfd.readouterr().err


@pytest.mark.parametrize(("variable", "value"), [("CC", "/nonexistent/cc"), (native.ENABLE, "0")])
def test_without_a_compiler_or_when_turned_off_attention_stays_in_torch(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    native._compiled.cache_clear()
    try:
        assert native.attention_kernel() is None
        assert native.kernel_name() == native.LOOP
    finally:
        monkeypatch.undo()
        native._compiled.cache_clear()
    assert native.attention_kernel() is not None
