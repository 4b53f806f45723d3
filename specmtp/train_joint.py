"""`specmtp train-mtp --joint`: continued MTP training, the target trained with its heads.

By default `train-mtp` freezes the target, so its outputs never change (train.py). The joint
mode trains the target's decoder layers and final norm together with the heads and keeps
its next-token loss (Gloeckle et al. 2024; DeepSeek-V3's MTP objective):

    loss = L_next + Σ_i λ_i L_i

L is the cross-entropy on the target's own answer tokens (with `--objective kl`, the KL to
its cached top-k) at the answer positions the heads learn; the trunk's learning rate is its
own (`--trunk-lr`). The input embedding and LM head stay frozen: the heads share them as
buffers (heads.py), and in a small model they are a large share of the weights
(SmolLM2-135M: 28 M of 135 M).

The result is a new model, not the target: `OUT/model/` (safetensors, config, tokenizer),
whose greedy output can differ from the original's. The heads in OUT are checked against
it (trunk.safetensors), so they draft for `--target OUT/model --draft mtp:OUT`, and the
report says how often the new model's greedy token on held-out answers is still the
original's (`next_token_agreement`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specmtp.data import DistillBatch
from specmtp.heads import Heads, target_features
from specmtp.kernels import set_tuned_linear, tuned_linear_enabled
from specmtp.models import LoadedModel, load_model
from specmtp.mtp_loss import mtp_losses, topk_kl
from specmtp.trainer import Logged

JOINT_MODEL_DIR = "model"  # OUT/model: the jointly trained target


def trainable_trunk(spec: str) -> LoadedModel:
    """The target in float32 with plain kernels (F.linear: gradients flow, and the weights
    stay as loaded), its decoder layers and final norm trainable."""
    previous = tuned_linear_enabled()
    set_tuned_linear(False)
    try:
        trunk = load_model(spec, dtype=torch.float32)
    finally:
        set_tuned_linear(previous)
    model = trunk.model
    model.requires_grad_(True)
    model.get_input_embeddings().requires_grad_(False)
    model.get_output_embeddings().requires_grad_(False)
    return trunk


class JointModule(nn.Module):
    """The trunk and its heads as one module: what the loop trains and checkpoints."""

    def __init__(
        self, trunk: nn.Module, heads: Heads, feature_layers: tuple[int, ...] | None
    ) -> None:
        super().__init__()
        self.trunk, self.heads = trunk, heads
        self.feature_layers = feature_layers

    def forward(self, batch: DistillBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The trunk's final (normed) hidden states [B, T, H] and what the heads read."""
        out = self.trunk.get_decoder()(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask.long(),
            output_hidden_states=True,
        )
        states = out.hidden_states
        return states[-1], target_features(states, self.feature_layers).float()

    def optimizer_groups(self, trunk_lr_scale: float) -> list[dict[str, Any]]:
        """The heads at the run's learning rate, the trunk at `trunk_lr_scale` times it."""
        return [
            {"params": [p for p in self.heads.parameters() if p.requires_grad]},
            {
                "params": [p for p in self.trunk.parameters() if p.requires_grad],
                "lr_scale": trunk_lr_scale,
            },
        ]


def _next_targets(
    batch: DistillBatch, labels: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which positions predict an answer token ([B, T] bool: position t predicts x_{t+1})
    and the token each should predict ([B, T]; `labels` shifted, else the next input)."""
    truth = batch.input_ids if labels is None else labels
    predicts = torch.zeros_like(batch.loss_mask)
    predicts[:, :-1] = batch.loss_mask[:, 1:]
    following = torch.zeros_like(truth)
    following[:, :-1] = truth[:, 1:]
    return predicts, following


def next_token_loss(
    module: JointModule,
    final: torch.Tensor,
    batch: DistillBatch,
    *,
    kl: bool,
    labels: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The trunk's own next-token loss at the answer positions, and how often its argmax
    there is the original target's greedy token (agreement, detached). The LM head runs on
    those rows alone: the full [B, T, V] logits of a 49k vocabulary would not be needed."""
    predicts, following = _next_targets(batch, labels)
    rows = final[predicts]  # [M, H]
    log_q = torch.log_softmax(module.trunk.get_output_embeddings()(rows).float(), dim=-1)
    truth = following[predicts]  # [M]
    if kl:
        assert batch.topk_values is not None and batch.topk_indices is not None
        loss = topk_kl(log_q, batch.topk_values[predicts], batch.topk_indices[predicts])
    else:
        loss = F.nll_loss(log_q, truth)
    agreement = (log_q.argmax(-1) == truth).float().mean()
    return loss, agreement.detach()


def joint_losses(
    module: JointModule,
    batch: DistillBatch,
    *,
    weights: list[float],
    kl: bool,
    target_topk: tuple[torch.Tensor, torch.Tensor] | None,
    labels: torch.Tensor | None,
) -> tuple[torch.Tensor, Logged]:
    """One step's loss L_next + Σ λ_i L_i, and its values for the log."""
    final, features = module(batch)
    next_loss, agreement = next_token_loss(module, final, batch, kl=kl, labels=labels)
    heads = mtp_losses(
        module.heads, batch.input_ids, features, batch.loss_mask, weights,
        target_topk=target_topk, label_ids=labels,
    )  # fmt: skip
    loss = next_loss + heads.loss
    logged: Logged = {
        "loss": loss.item(),
        "next_loss": next_loss.item(),
        "next_acc": agreement.item(),
        "ce": list(heads.per_head_ce),
        "acc": list(heads.per_head_accuracy),
    }
    return loss, logged


class HeldoutAgreement:
    """What the heads read from the trained trunk (`train.Features`) for held-out scoring,
    counting from the same trunk pass how often its greedy token at the answer positions
    is the original target's: one pass over the held-out split gives both. A sample longer
    than the run's --seq-len is seen without the start of its prompt, as in training, so
    the original itself agrees less there."""

    def __init__(
        self, module: JointModule, labels: Callable[[DistillBatch], torch.Tensor | None]
    ) -> None:
        self.module, self.labels = module, labels
        self.agreed = self.total = 0

    def __call__(self, batch: DistillBatch) -> torch.Tensor:
        final, features = self.module(batch)
        predicts, following = _next_targets(batch, self.labels(batch))
        best = self.module.trunk.get_output_embeddings()(final[predicts]).argmax(-1)
        self.agreed += int((best == following[predicts]).sum())
        self.total += int(predicts.sum())
        return features

    @property
    def rate(self) -> float:
        return round(self.agreed / max(self.total, 1), 4)


def save_trunk(trunk: LoadedModel, directory: Path) -> None:
    """The trained model and its tokenizer as a model directory (`--target DIR`), replacing
    any earlier one whole: built beside it, then renamed into place."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    old = staging.with_name(staging.name + ".old")
    try:
        trunk.model.save_pretrained(staging)
        trunk.tokenizer.save_pretrained(staging)
        if directory.exists():
            os.replace(directory, old)
        os.replace(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
