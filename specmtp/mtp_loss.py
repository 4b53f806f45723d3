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

RANKS = 10


def decaying_weights(num_heads: int, decay: float = 0.8) -> list[float]:
    """λ_i = decay^i: near heads matter most, since a chain stops at its first miss."""
    return [decay**i for i in range(num_heads)]


@dataclass(frozen=True)
class HeadLosses:
    loss: torch.Tensor  # scalar: Σ_i λ_i CE_i
    per_head_ce: list[float]
    per_head_accuracy: list[float]  # top-1 against the label
    per_head_count: list[int]  # positions scored per head
    # [head][r]: how often the label was the head's rank-r candidate (r < RANKS); held-out
    # counts of this shape choose the token tree (tree.best_tree).
    per_head_rank_counts: list[list[int]]


def mtp_losses(
    heads: Heads,
    input_ids: torch.Tensor,  # [B, n]
    hidden: torch.Tensor,  # [B, n, H] the frozen target's final hidden states
    loss_mask: torch.Tensor,  # [B, n] True where a token may serve as a label
    weights: Sequence[float],
) -> HeadLosses:
    """Σ_i λ_i CE_i. Parallel heads are scored only at rows that have a label, which on
    prompt-heavy data is most of the saving; sequential depths need whole sequences."""
    n = input_ids.shape[1]
    depth_logits = (
        None if isinstance(heads, ParallelHeads) else heads.forward_all(hidden, input_ids)
    )
    total = hidden.new_zeros(())
    ces, accs, counts, ranks = [], [], [], []
    for i in range(min(heads.config.num_heads, n - 2)):
        rows = loss_mask[:, 2 + i :]  # [B, n-2-i]: label x_{t+2+i} exists and counts
        labels = heads.to_draft_ids(input_ids[:, 2 + i :][rows])  # [M], -1: not in draft vocab
        if depth_logits is None:
            logits = heads.head(i, hidden[:, : n - 2 - i][rows])  # [M, V']
        else:
            logits = depth_logits[i][:, : n - 2 - i][rows]  # [M, V']
        # Labels outside a reduced draft vocabulary count as misses in the accuracy but
        # stay out of the cross-entropy, which could never reach them.
        learnable = labels >= 0
        if learnable.any():
            ce = F.cross_entropy(logits[learnable], labels[learnable])
            total = total + weights[i] * ce
        count = len(labels)
        ces.append(float(ce.detach()) if learnable.any() else 0.0)
        accs.append(float((logits.argmax(-1) == labels).sum()) / count if count else 0.0)
        counts.append(count)
        ranks.append(_rank_counts(logits.detach()[learnable], labels[learnable]))
    return HeadLosses(total, ces, accs, counts, ranks)


def _rank_counts(logits: torch.Tensor, labels: torch.Tensor) -> list[int]:
    """Histogram over r < RANKS of the label's rank among logits [M, V'] (ties favour it)."""
    rank = (logits > logits.gather(-1, labels[:, None])).sum(-1)  # [M]
    return torch.bincount(rank[rank < RANKS], minlength=RANKS).tolist()
