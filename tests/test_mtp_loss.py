"""The heads' objectives: top-k KL against its definition, and KL to one-hot targets being
the cross-entropy on the same tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from test_heads import KINDS, config_for, tokens_and_hidden
from transformers import PreTrainedModel

from specmtp.heads import build_heads
from specmtp.mtp_loss import decaying_weights, mtp_losses, topk_kl


@pytest.fixture(scope="module")
def target() -> PreTrainedModel:
    return tiny_model("llama", seed=0)


def test_topk_kl_is_the_kl_over_the_partition() -> None:
    generator = torch.Generator().manual_seed(0)
    log_p = torch.log_softmax(torch.randn(5, 12, generator=generator), -1)  # [M, V]
    log_q = torch.log_softmax(torch.randn(5, 12, generator=generator), -1)
    # k = V: the exact KL
    ids = torch.arange(12).expand(5, -1)
    exact = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    torch.testing.assert_close(topk_kl(log_q, log_p, ids), exact)
    # k = 3: KL between the 4-cell distributions {top 3, the rest}
    values, top = log_p.topk(3, -1)
    cells_p = torch.cat([values.exp(), 1 - values.exp().sum(-1, keepdim=True)], -1)
    picked = log_q.gather(-1, top).exp()
    cells_q = torch.cat([picked, 1 - picked.sum(-1, keepdim=True)], -1)
    partition = (cells_p * (cells_p.log() - cells_q.log())).sum(-1).mean()
    torch.testing.assert_close(topk_kl(log_q, values, top), partition)
    assert 0 < float(partition) <= float(exact)
    # zero when q matches p
    assert float(topk_kl(log_p, values, top)) == pytest.approx(0.0, abs=1e-6)


def heads_and_data(target: PreTrainedModel, kind: str, seed: int) -> tuple:
    """Fresh heads (seed 0), a sequence of 12 tokens with the target's hidden states, and a
    mask with every position a label."""
    torch.manual_seed(0)
    heads = build_heads(config_for(target, kind), target)
    ids, hidden = tokens_and_hidden(target, seed=seed, n=12)
    return heads, ids, hidden, torch.ones_like(ids, dtype=torch.bool)


@pytest.mark.parametrize("kind", KINDS)
def test_kl_to_one_hot_targets_is_the_cross_entropy(target: PreTrainedModel, kind: str) -> None:
    heads, ids, hidden, mask = heads_and_data(target, kind, seed=3)
    mask[:, :4] = False  # a prompt: its tokens are no labels
    weights = decaying_weights(3)
    # The target "distribution" at position j is certain of x_{j+1}: top-2 = (it, another).
    next_ids = torch.cat([ids[:, 1:], ids[:, :1]], 1)  # [B, n]; the last column is unused
    topk_ids = torch.stack([next_ids, (next_ids + 1) % ids.max()], -1)  # [B, n, 2]
    topk_values = torch.tensor([0.0, -1e4]).expand_as(topk_ids)
    ce = mtp_losses(heads, ids, hidden, mask, weights)
    kl = mtp_losses(heads, ids, hidden, mask, weights, target_topk=(topk_values, topk_ids))
    torch.testing.assert_close(kl.loss, ce.loss, rtol=1e-4, atol=1e-5)
    assert kl.per_head_accuracy == ce.per_head_accuracy
    # A target that is unsure gives a different loss, and its gradient reaches the heads.
    unsure = torch.tensor([-0.1, -2.4]).expand_as(topk_ids)
    soft = mtp_losses(heads, ids, hidden, mask, weights, target_topk=(unsure, topk_ids))
    assert abs(soft.loss.item() - ce.loss.item()) > 1e-3
    soft.loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in heads.parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_labels_are_scored_against_label_ids(target: PreTrainedModel, kind: str) -> None:
    heads, ids, hidden, mask = heads_and_data(target, kind, seed=4)
    weights = decaying_weights(3)
    # Labels set to each depth's own top-1 over the same inputs: every prediction is a hit.
    own = mtp_losses(heads, ids, hidden, mask, weights)
    assert max(own.per_head_accuracy) < 1
    if kind == "parallel":
        top1 = [heads.head(i, hidden).argmax(-1) for i in range(3)]
    else:
        top1 = [logits.argmax(-1) for logits in heads.forward_all(hidden, ids)]
    for i in range(3):  # depth i's row t predicts position t + 2 + i
        labels = ids.clone()
        labels[:, 2 + i :] = heads.to_full_ids(top1[i][:, : ids.shape[1] - 2 - i])
        hits = mtp_losses(heads, ids, hidden, mask, weights, label_ids=labels)
        assert hits.per_head_accuracy[i] == 1.0
