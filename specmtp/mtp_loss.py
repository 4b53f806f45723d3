"""The multi-token-prediction objective: Σ_i λ_i · L_i over heads (or depths).

Head (or depth) i at position t predicts x_{t+2+i}: the target's own LM head already
predicts x_{t+1}. Only positions whose label lies inside the sequence and is marked by the
loss mask (answer tokens in self-distillation) count. L_i is the cross-entropy against
the label (the target's own greedy answer token), or with the target's cached top-k
log-probabilities the KL to the target's distribution of that token, p(x_{t+2+i} | x_{<=t+1+i}),
which the target computed at position t+1+i.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specmtp.heads import Heads, ParallelHeads

RANKS = 10
_TINY = 1e-6  # floor for probabilities that enter a log


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


def topk_kl(
    log_q: torch.Tensor,  # [M, V'] the student's log-probabilities (a draft vocabulary)
    log_p: torch.Tensor,  # [M, k] the target's top-k log-probabilities
    ids: torch.Tensor,  # [M, k] those tokens' ids in the draft vocabulary, -1 outside it
) -> torch.Tensor:
    """Mean KL(p || q) over the partition {each top-k token the student can emit, the rest}:
    a true divergence (>= 0, zero iff q matches p on it) and a lower bound of the full KL,
    computed from k cached values instead of V."""
    log_p = log_p.float()
    inside = ids >= 0
    picked = log_q.gather(-1, ids.clamp_min(0))  # [M, k]
    p = torch.where(inside, log_p.exp(), torch.zeros_like(log_p))
    q = torch.where(inside, picked.exp(), torch.zeros_like(picked))
    terms = torch.where(inside, p * (log_p - picked), torch.zeros_like(p)).sum(-1)  # [M]
    p_rest = (1 - p.sum(-1)).clamp_min(0)
    q_rest = (1 - q.sum(-1)).clamp_min(_TINY)
    rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(_TINY).log() - q_rest.log()), 0)
    return (terms + rest).mean()


def mtp_losses(
    heads: Heads,
    input_ids: torch.Tensor,  # [B, n]
    hidden: torch.Tensor,  # [B, n, H] the frozen target's final hidden states
    loss_mask: torch.Tensor,  # [B, n] True where a token may serve as a label
    weights: Sequence[float],
    target_topk: tuple[torch.Tensor, torch.Tensor] | None = None,  # [B, n, k] values, ids
    label_ids: torch.Tensor | None = None,  # [B, n]; None: input_ids
) -> HeadLosses:
    """Σ_i λ_i L_i: cross-entropy, or KL to the target's top-k when `target_topk` is
    given. Parallel heads are scored only at rows that have a label, which on prompt-heavy
    data is most of the saving; sequential depths need whole sequences.

    The label of position j (cross-entropy, accuracy, ranks) is label_ids[:, j]: by default
    the input token, which on the target's own greedy answers is its top-1; on other text
    the caller passes the target's top-1 instead, the token a draft must match."""
    n = input_ids.shape[1]
    label_ids = input_ids if label_ids is None else label_ids
    depth_logits = (
        None if isinstance(heads, ParallelHeads) else heads.forward_all(hidden, input_ids)
    )
    total = hidden.new_zeros(())
    ces, accs, counts, ranks = [], [], [], []
    for i in range(min(heads.config.num_heads, n - 2)):
        rows = loss_mask[:, 2 + i :]  # [B, n-2-i]: label x_{t+2+i} exists and counts
        labels = heads.to_draft_ids(label_ids[:, 2 + i :][rows])  # [M], -1: not in draft vocab
        if depth_logits is None:
            logits = heads.head(i, hidden[:, : n - 2 - i][rows])  # [M, V']
        else:
            logits = depth_logits[i][:, : n - 2 - i][rows]  # [M, V']
        # Labels outside a reduced draft vocabulary count as misses in the accuracy but
        # stay out of the cross-entropy, which could never reach them.
        learnable = labels >= 0
        if learnable.any():
            ce = F.cross_entropy(logits[learnable], labels[learnable])
            if target_topk is None:
                total = total + weights[i] * ce
        if target_topk is not None and len(labels):
            values, ids = (t[:, 1 + i : n - 1][rows] for t in target_topk)  # [M, k]
            log_q = torch.log_softmax(logits.float(), dim=-1)
            total = total + weights[i] * topk_kl(log_q, values, heads.to_draft_ids(ids))
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
