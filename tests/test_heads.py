"""MTP heads: identity start, shapes, reduced vocabulary, save/load checks, training."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_VOCAB, tiny_model
from safetensors.torch import load_file
from transformers import PreTrainedModel

from specmtp.errors import SpecMTPError
from specmtp.heads import Heads, ParallelHeads, SequentialMTP, build_heads, describe_target
from specmtp.heads_config import HeadsConfig
from specmtp.heads_io import HEADS_CONFIG, HEADS_WEIGHTS, load_heads, save_heads
from specmtp.trunk import TRUNK_FILE

KINDS = ("parallel", "sequential")


@pytest.fixture(scope="module")
def target() -> PreTrainedModel:
    return tiny_model("llama", seed=0)


def config_for(model: PreTrainedModel, kind: str = "parallel", **overrides: object) -> HeadsConfig:
    fields: dict = {
        "kind": kind,
        "num_heads": 3,
        "hidden_size": model.config.hidden_size,
        "vocab_size": TINY_VOCAB,
        "base_model": describe_target(model),
        "num_layers": 2,
    }
    return HeadsConfig(**(fields | overrides))


def tokens_and_hidden(
    model: PreTrainedModel, *, seed: int, n: int = 10
) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(1, TINY_VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[-1]  # [B, n, H]
    return ids, hidden


def run_heads(heads: Heads, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    if isinstance(heads, ParallelHeads):
        return heads(hidden)  # [B, K, n, V']
    return torch.cat(heads.forward_all(hidden, ids), dim=1)  # [B, sum(n-1-i), V']


def test_last_hidden_state_is_after_the_final_norm(target: PreTrainedModel) -> None:
    ids = torch.randint(0, TINY_VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        assert torch.equal(target.lm_head(out.hidden_states[-1]), out.logits)


def test_fresh_shared_parallel_heads_reproduce_the_target_logits(target: PreTrainedModel) -> None:
    torch.manual_seed(0)
    heads = build_heads(config_for(target, "parallel"), target)
    _, hidden = tokens_and_hidden(target, seed=2)
    with torch.no_grad():
        logits = heads(hidden)  # [B, K, n, V]
        expected = target.lm_head(hidden)  # [B, n, V]
    assert logits.shape == (2, 3, 10, TINY_VOCAB)
    for i in range(3):
        assert torch.equal(logits[:, i], expected)


def test_sequential_shapes_and_cached_block(target: PreTrainedModel) -> None:
    torch.manual_seed(0)
    heads = build_heads(config_for(target, "sequential"), target)
    assert isinstance(heads, SequentialMTP)
    ids, hidden = tokens_and_hidden(target, seed=3)
    with torch.no_grad():
        depth0 = heads(hidden[:, :-1], ids[:, 1:])
        every = heads.forward_all(hidden, ids)
    assert depth0.shape == (2, 9, TINY_VOCAB)
    assert [tuple(x.shape) for x in every] == [(2, 9 - i, TINY_VOCAB) for i in range(3)]
    assert torch.equal(every[0], depth0)

    # A block attending through `attend` to keys kept from an earlier part of the positions
    # equals one causal pass over them all.
    kept: list[torch.Tensor] = []

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not kept:
            kept.extend([k, v])
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        n, past = k.shape[2], kept[0].shape[2]
        mask = torch.ones(n, past + n, dtype=torch.bool).tril(past)
        keys, values = torch.cat([kept[0], k], 2), torch.cat([kept[1], v], 2)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

    with torch.no_grad():
        first, second = (heads.embed(ids[:, :4]), heads.embed(ids[:, 4:]))
        whole, _ = heads.depths[0](hidden, heads.embed(ids))
        head, _ = heads.depths[0](hidden[:, :4], first, attend)
        tail, _ = heads.depths[0](hidden[:, 4:], second, attend)
    torch.testing.assert_close(torch.cat([head, tail], 1), whole)


@pytest.mark.parametrize("kind", KINDS)
def test_reduced_vocabulary_scatters_to_minus_inf(target: PreTrainedModel, kind: str) -> None:
    torch.manual_seed(0)
    draft_vocab = [5, 1, 40, 77, 12]
    heads = build_heads(config_for(target, kind, draft_vocab=draft_vocab), target)
    ids, hidden = tokens_and_hidden(target, seed=4)
    with torch.no_grad():
        reduced = run_heads(heads, ids, hidden)  # [..., 5]
    assert reduced.shape[-1] == 5
    full = heads.to_full_logits(reduced)  # [..., V]
    assert full.shape == (*reduced.shape[:-1], TINY_VOCAB)
    outside = torch.ones(TINY_VOCAB, dtype=torch.bool)
    outside[draft_vocab] = False
    assert torch.isneginf(full[..., outside]).all()
    assert torch.equal(full[..., draft_vocab], reduced)
    probs = full.softmax(-1)
    assert torch.allclose(probs.sum(-1), torch.ones(()), atol=1e-6)
    picked = heads.to_full_ids(reduced.argmax(-1))
    assert torch.equal(picked, full.argmax(-1))
    if kind == "parallel":  # shared head: reduced logits are the target's own rows
        expected = target.lm_head(hidden)[..., draft_vocab]  # rows in another matmul order
        assert torch.allclose(reduced[:, 0], expected, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("share", [True, False])
def test_save_load_round_trip(
    target: PreTrainedModel, tmp_path: Path, kind: str, share: bool
) -> None:
    torch.manual_seed(0)
    config = config_for(target, kind, share_lm_head=share, draft_vocab=[3, 9, 2, 50])
    heads = build_heads(config, target)
    with torch.no_grad():  # move off the identity start so the round trip means something
        for param in heads.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    save_heads(heads, config, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [HEADS_CONFIG, HEADS_WEIGHTS]

    loaded, loaded_config = load_heads(tmp_path, target_model=target)
    assert loaded_config == config
    assert HeadsConfig.from_json(config.to_json()) == config
    ids, hidden = tokens_and_hidden(target, seed=5)
    with torch.no_grad():
        assert torch.equal(run_heads(loaded, ids, hidden), run_heads(heads, ids, hidden))
    saved = set(loaded.state_dict())
    assert saved == {name for name, _ in heads.named_parameters()}
    assert all("embed_weight" not in name for name in saved)  # the shared embedding
    assert ("projection.weight" in saved) is not share


def test_load_refuses_a_different_target(target: PreTrainedModel, tmp_path: Path) -> None:
    config = config_for(target, "parallel")
    save_heads(build_heads(config, target), config, tmp_path)
    others = {
        "vocab size": tiny_model("llama", seed=0, vocab_size=TINY_VOCAB + 8),
        "base model": tiny_model("qwen2", seed=0),  # same hidden and vocab sizes
    }
    wider = dataclasses.replace(config, hidden_size=16)
    (tmp_path / HEADS_CONFIG).write_text(wider.to_json())
    with pytest.raises(SpecMTPError, match="hidden size 16"):
        load_heads(tmp_path, target_model=target)
    (tmp_path / HEADS_CONFIG).write_text(config.to_json())
    for what, other in others.items():
        with pytest.raises(SpecMTPError, match=what):
            load_heads(tmp_path, target_model=other)


def test_load_refuses_another_checkpoint_of_the_architecture_but_not_another_dtype(
    target: PreTrainedModel, tmp_path: Path
) -> None:
    config = config_for(target, "sequential")
    save_heads(build_heads(config, target), config, tmp_path, dtype=torch.float16, trunk=target)
    assert load_file(str(tmp_path / TRUNK_FILE))["sample"].numel() == 16 * len(
        list(target.parameters())
    )
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # the same weights, rounded
        load_heads(tmp_path, target_model=copy.deepcopy(target).to(dtype))
    fine_tuned = copy.deepcopy(target)  # one layer moved by 1%, as a short fine-tune moves it
    with torch.no_grad():
        weight = fine_tuned.model.layers[1].mlp.down_proj.weight
        weight.mul_(1 + 0.01 * torch.randn_like(weight))
    for other in (fine_tuned, tiny_model("llama", seed=1)):  # a fine-tune, another training
        assert describe_target(other) == config.base_model  # base_model alone passes them
        with pytest.raises(SpecMTPError, match="trained on other weights of this architecture"):
            load_heads(tmp_path, target_model=other)
    (tmp_path / TRUNK_FILE).write_bytes(b"\0" * 64)
    with pytest.raises(SpecMTPError, match="cannot read heads"):
        load_heads(tmp_path, target_model=target)
    (tmp_path / TRUNK_FILE).unlink()  # heads saved before the sample was recorded still load
    load_heads(tmp_path, target_model=fine_tuned)


def test_load_refuses_corrupt_or_missing_files(target: PreTrainedModel, tmp_path: Path) -> None:
    config = config_for(target, "sequential")
    save_heads(build_heads(config, target), config, tmp_path)
    weights = tmp_path / HEADS_WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(SpecMTPError, match="cannot read heads"):
        load_heads(tmp_path, target_model=target)
    (tmp_path / HEADS_CONFIG).write_text("{not json")
    with pytest.raises(SpecMTPError, match="not valid JSON"):
        load_heads(tmp_path, target_model=target)
    with pytest.raises(SpecMTPError, match="cannot read heads"):
        load_heads(tmp_path / "absent", target_model=target)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": "tree"}, "kind"),
        ({"num_heads": 0}, "num_heads"),
        ({"draft_vocab": [1, 1]}, "more than once"),
        ({"draft_vocab": [TINY_VOCAB]}, "draft_vocab"),
        ({"kind": "sequential", "attention_heads": 5}, "divide"),
    ],
)
def test_config_validation(target: PreTrainedModel, fields: dict, message: str) -> None:
    with pytest.raises(SpecMTPError, match=message):
        config_for(target, **({"kind": "parallel"} | fields))


@pytest.mark.parametrize("kind", KINDS)
def test_training_steps_reduce_the_loss_and_leave_the_target_alone(
    target: PreTrainedModel, kind: str
) -> None:
    torch.manual_seed(0)
    heads = build_heads(config_for(target, kind), target)
    lm_head_before = target.lm_head.weight.detach().clone()
    embed_before = target.get_input_embeddings().weight.detach().clone()
    ids, hidden = tokens_and_hidden(target, seed=6, n=16)
    optimizer = torch.optim.Adam(heads.parameters(), lr=3e-2)
    losses = []
    for _ in range(30):
        loss = mtp_loss(heads, ids, hidden)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]
    assert target.lm_head.weight.grad is None
    assert target.get_input_embeddings().weight.grad is None
    assert torch.equal(target.lm_head.weight, lm_head_before)
    assert torch.equal(target.get_input_embeddings().weight, embed_before)
    assert all(p.grad is not None for p in heads.parameters())


def mtp_loss(heads: Heads, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over heads: head or depth i at position t predicts x_{t+2+i}."""
    n = ids.shape[1]
    if isinstance(heads, ParallelHeads):
        per_head = heads(hidden).unbind(1)  # K x [B, n, V]
    else:
        per_head = heads.forward_all(hidden, ids)  # [B, n-1-i, V]
    losses = [
        F.cross_entropy(logits[:, : n - 2 - i].flatten(0, 1), ids[:, 2 + i :].flatten())
        for i, logits in enumerate(per_head)
    ]
    return torch.stack(losses).mean()
