"""Verification of drafted tokens: the acceptance rules of speculative decoding.

Vocabulary (as in the papers and vLLM):
- draft tokens: the k tokens the drafter proposed, x_1..x_k.
- accepted tokens: the longest prefix of the draft that the rule keeps.
- recovered token: at the first rejected position j, a token drawn from the target's
  residual there (greedy: the target's argmax); replaces x_j.
- bonus token: when all k drafts are accepted, a token drawn from the target's
  distribution after x_k (the (k+1)-th row of the verify pass).
Every round therefore emits num_accepted + 1 tokens.

All functions are pure and batched: each row of B is verified independently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmtp.sampling import greedy_tokens, sample


@dataclass(frozen=True)
class Verdict:
    num_accepted: torch.Tensor  # [B] int64 in 0..k
    next_tokens: torch.Tensor  # [B] int64: the recovered token, or the bonus token if all passed
    # [B, k] float, sampling only: P(draft i accepted | drafts before it accepted), i.e.
    # sum_v min(p_i, q_i) (p_i(x_i) for one-hot drafts). The expected value of each
    # accept/reject outcome, without the coin's noise: what the adaptive schedule learns α
    # from. None when greedy (the outcome is exact there).
    accept_probs: torch.Tensor | None = None


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)) over the last dim; p itself where that has no mass.

    No mass means p == q there, where rejection has probability 0: only float round-off
    gets here, and p is then the residual's limit.
    """
    excess = (p - q).clamp_min(0)
    mass = excess.sum(-1, keepdim=True)
    return torch.where(mass > 0, excess / mass.clamp_min(1e-30), p)


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row of accept [B, k] -> [B]."""
    return accept.long().cumprod(-1).sum(-1)


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Temperature 0: accept while the draft equals the target argmax.

    draft_tokens  [B, k]
    target_logits [B, k+1, V]: row i scores the token after draft i (row 0: after the context)
    """
    k = draft_tokens.shape[1]
    target_argmax = greedy_tokens(target_logits)  # [B, k+1]
    num_accepted = _accepted_prefix(draft_tokens == target_argmax[:, :k])  # [B]
    next_tokens = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)  # [B]
    return Verdict(num_accepted, next_tokens)


def verify_rejection_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """Temperature > 0: speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

    Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection draw
    the recovered token from normalize(max(0, p_i - q_i)); if all pass, draw the bonus
    token from p_{k+1}. The emitted tokens are then distributed exactly as the target's.

    A drafter without probabilities (n-gram lookup) proposed x_i deterministically, so
    q_i is one-hot: accept with probability p_i(x_i), and on rejection draw from p_i with
    x_i removed, renormalised. That is the same formula with q one-hot, so it is lossless.

    draft_tokens [B, k]
    draft_probs  [B, k, V] or None (one-hot drafts)
    target_probs [B, k+1, V]
    """
    batch, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_tokens, vocab).to(target_probs.dtype)
    p_x = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    q_x = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    r = torch.rand(batch, k, generator=generator, device=target_probs.device)  # [B, k]
    # r < p/q written without the division; q_x > 0 because x was drawn from q.
    num_accepted = _accepted_prefix(r * q_x < p_x)  # [B]

    # Row k of the padded q is zero, so its "residual" is p_{k+1} itself: the bonus.
    q_padded = torch.nn.functional.pad(draft_probs, (0, 0, 0, 1))  # [B, k+1, V]
    rows = num_accepted[:, None, None].expand(batch, 1, vocab)  # [B, 1, V]
    p_row = target_probs.gather(1, rows).squeeze(1)  # [B, V]
    q_row = q_padded.gather(1, rows).squeeze(1)  # [B, V]
    next_tokens = sample(residual(p_row, q_row), generator)  # [B]
    # P(x_i accepted) before x_i was drawn: sum_v min(p_i, q_i), Leviathan et al.'s β
    # (p_i(x_i) when q_i is one-hot).
    accept_probs = torch.minimum(target_probs[:, :k], draft_probs).sum(-1).float()  # [B, k]
    return Verdict(num_accepted, next_tokens, accept_probs)
