"""The multi-token-prediction objective: Σ_i λ_i · CE_i over heads (or depths).

Head (or depth) i at position t predicts x_{t+2+i}: the target's own LM head already
predicts x_{t+1}. Only positions whose label lies inside the sequence and is marked by the
loss mask (answer tokens in self-distillation) count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specmtp.heads import Heads, ParallelHeads


def decaying_weights(num_heads: int, decay: float = 0.8) -> list[float]:
    """λ_i = decay^i: near heads matter most, since a chain stops at its first miss."""
    return [decay**i for i in range(num_heads)]


@dataclass(frozen=True)
class HeadLosses:
    loss: torch.Tensor  # scalar: Σ_i λ_i CE_i
    per_head_ce: list[float]
    per_head_accuracy: list[float]  # top-1 against the label
    per_head_count: list[int]  # positions scored per head


def head_logits(heads: Heads, input_ids: torch.Tensor, hidden: torch.Tensor) -> list[torch.Tensor]:
    """Per head i, logits [B, n-1-i, V] (rows t = 0..n-2-i); the last rows have no label yet."""
    n = input_ids.shape[1]
    if isinstance(heads, ParallelHeads):
        return [logits[:, : n - 1 - i] for i, logits in enumerate(heads(hidden).unbind(1))]
    return heads.forward_all(hidden, input_ids)


def mtp_losses(
    heads: Heads,
    input_ids: torch.Tensor,  # [B, n]
    hidden: torch.Tensor,  # [B, n, H] the frozen target's final hidden states
    loss_mask: torch.Tensor,  # [B, n] True where a token may serve as a label
    weights: Sequence[float],
) -> HeadLosses:
    n = input_ids.shape[1]
    total = hidden.new_zeros(())
    ces, accs, counts = [], [], []
    for i, logits in enumerate(head_logits(heads, input_ids, hidden)):
        if n - 2 - i <= 0:
            break
        logits = heads.to_full_logits(logits[:, : n - 2 - i])  # [B, n-2-i, V]
        labels = input_ids[:, 2 + i :]  # [B, n-2-i]
        mask = loss_mask[:, 2 + i :]
        # A reduced draft vocabulary cannot learn labels outside it: they count as misses
        # in the accuracy but stay out of the cross-entropy (which would be infinite).
        learnable = mask & torch.isfinite(logits.gather(-1, labels[..., None]).squeeze(-1))
        count = int(mask.sum())
        hits = (logits.argmax(-1) == labels) & mask
        ce = F.cross_entropy(logits[learnable], labels[learnable]) if learnable.any() else None
        if ce is not None:
            total = total + weights[i] * ce
        ces.append(float(ce.detach()) if ce is not None else 0.0)
        accs.append(float(hits.sum()) / count if count else 0.0)
        counts.append(count)
    return HeadLosses(total, ces, accs, counts)
