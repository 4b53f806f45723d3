"""`#int4` draft models: the 4-bit product is its rounded weights' product, the rounding
within half a step, the layers the kernel takes swapped (int8 for the rest and the output
matrix), and greedy output still plain decoding's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, hf_greedy, tiny_model
from torch import nn

from specmtp.api import SpecGenerator, build_drafter
from specmtp.config import GenerationConfig
from specmtp.decode import SpecDecoder
from specmtp.draft_model_drafter import DraftModelDrafter
from specmtp.draft_tree_drafter import DraftTreeDrafter
from specmtp.errors import SpecMTPError
from specmtp.int4 import GROUP, Int4Linear, Int4Product, use_int4_products
from specmtp.int8 import Int8Linear
from specmtp.models import load_model

PROMPT = [5, 17, 3, 88, 41, 5, 17, 3, 60, 2, 33, 71]


def test_an_int4_product_is_its_rounded_weights_product() -> None:
    """In float32 the kernel's product equals x @ dequantized^T + b; each weight is within
    half a step of its group's 16 levels from the group's smallest to its largest value."""
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 96, generator=generator), torch.randn(48, generator=generator)
    product = Int4Product(weight, bias)
    dequantized = product.dequantized()  # [48, 96]
    groups = weight.reshape(48, -1, GROUP)
    step = (groups.amax(-1) - groups.amin(-1)) / 15  # [48, 96 / G]
    error = (dequantized - weight).reshape(48, -1, GROUP).abs()
    assert (error <= step[..., None] / 2 + 1e-5).all()
    assert (error > 1e-3).any()  # it does round
    x = torch.randn(2, 5, 96, generator=generator)
    out = product(x)
    assert out.shape == (2, 5, 48) and out.dtype == torch.float32
    assert torch.allclose(out, x @ dequantized.T + bias, rtol=1e-5, atol=1e-4)


def test_an_int4_product_in_bfloat16_stays_close() -> None:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(32, 64, generator=generator).bfloat16()
    product = Int4Product(weight, None)
    x = torch.randn(3, 64, generator=generator).bfloat16()
    out = product(x)
    assert out.dtype == torch.bfloat16
    reference = x.float() @ product.dequantized().float().T
    assert ((out.float() - reference).abs() <= reference.abs() * 2**-6 + 0.05).all()


def test_layers_the_kernel_takes_go_to_int4_the_rest_and_the_lm_head_to_int8() -> None:
    model = tiny_model("qwen2", seed=0)  # q/k/v with biases; k and v 16 outputs wide
    head = model.get_output_embeddings()
    use_int4_products(model)
    assert not [m for m in model.modules() if isinstance(m, nn.Linear)]
    int4 = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len(int4) == 2 * 7  # q, k, v, o, gate, up, down in each of 2 layers
    assert isinstance(model.lm_head, Int8Linear) and head is not model.lm_head
    layer = model.model.layers[0].self_attn.q_proj
    assert layer.product.bias is not None  # Qwen2's q/k/v biases are kept


@pytest.mark.parametrize("tree", [False, True])
def test_an_int4_draft_keeps_greedy_output(tree: bool) -> None:
    target = tiny_model("llama", seed=0)
    draft = use_int4_products(tiny_model("llama", seed=0))  # the target's own weights, rounded
    drafter = (
        DraftTreeDrafter(draft, vocab_size=TINY_VOCAB, nodes=4)
        if tree
        else DraftModelDrafter(draft, vocab_size=TINY_VOCAB)
    )
    decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
    result = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=40, gamma=3))
    assert result.tokens == hf_greedy(target, PROMPT, 40)
    assert result.stats.accepted_tokens > 0.5 * result.stats.drafted_tokens


def test_int4_draft_specs(tiny_target: Path) -> None:
    target = load_model(str(tiny_target))
    drafter, _ = build_drafter(f"{tiny_target}#nodes=4#int4", target)
    assert isinstance(drafter, DraftTreeDrafter)
    assert drafter.name == f"{tiny_target}#nodes=4#int4"
    assert [m for m in drafter.runner.model.modules() if isinstance(m, Int4Linear)]
    for spec, message in [
        ("ngram#int4", "applies to draft models"),
        (f"{tiny_target}#int8#int4", "not both"),
    ]:
        with pytest.raises(SpecMTPError, match=message):
            build_drafter(spec, target)


def test_an_int4_self_draft_keeps_greedy_output(tiny_target: Path) -> None:
    plain = SpecGenerator(str(tiny_target))
    drafted = SpecGenerator(str(tiny_target), draft=f"{tiny_target}#int4")
    prompt = torch.randint(100, 5000, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    done = drafted.generate(prompt, max_new_tokens=30, gamma=4)
    assert done.tokens == plain.generate(prompt, max_new_tokens=30).tokens
    assert done.stats.accepted_tokens > 0
