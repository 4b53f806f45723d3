"""Which path of a token tree the target accepts: greedy, or lossless at temperature > 0.

Vocabulary as in `specmtp.verification`: the accepted path's tokens are accepted tokens; the
token drawn after its last node is the recovered token (some child was there but none was
accepted) or the bonus token (the path ends at a leaf). A round emits len(path) + 1 tokens.
Node i sits at position i + 1 of the verify pass, the root at 0 (`specmtp.tree`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmtp.sampling import greedy_tokens, sample
from specmtp.tree import TokenTree
from specmtp.verification import residual


@dataclass(frozen=True)
class TreeVerdict:
    path_nodes: torch.Tensor  # [B, D] int64: accepted nodes, root to leaf; -1 past num_accepted
    num_accepted: torch.Tensor  # [B] int64 in 0..D
    next_tokens: torch.Tensor  # [B] int64: the recovered token, or the bonus token at a leaf
    # [B, D] float, sampling with one-hot drafts only: at each depth the walk reached,
    # P(some child of its node is accepted) = the target's probability of the children's
    # tokens (0 past the walk). The expected value of each depth's outcome, without the
    # coin's noise (verification.Verdict.accept_probs). None when greedy.
    accept_probs: torch.Tensor | None = None

    def accepted_path(self, row: int = 0) -> list[int]:
        return self.path_nodes[row, : int(self.num_accepted[row])].tolist()


def verify_tree_greedy(
    tree: TokenTree, node_tokens: torch.Tensor, target_logits: torch.Tensor
) -> TreeVerdict:
    """Temperature 0: the longest root-to-node path whose every token is the target's argmax
    after its parent; the next token is the argmax after the path's last node.

    node_tokens   [B, N]
    target_logits [B, N+1, V]: row i scores the token after position i (0: the root)
    """
    device = node_tokens.device
    target_argmax = greedy_tokens(target_logits)  # [B, N+1]
    parents = torch.tensor(tree.parents, device=device)  # [N]
    match = node_tokens == target_argmax[:, parents]  # [B, N]
    # A node is accepted when it and all its ancestors match.
    ancestors = tree.ancestor_mask[1:, 1:].to(device)  # [N, N]
    accepted = ~(ancestors & ~match[:, None, :]).any(-1)  # [B, N]
    depth = accepted * torch.tensor(tree.depths, device=device)  # [B, N]
    best = depth.argmax(-1)  # [B]: the deepest accepted node (the first one on ties)
    num_accepted = depth.gather(1, best[:, None]).squeeze(1)  # [B]: 0 when none is accepted
    path_nodes = tree.path_table.to(device)[best]  # [B, D]
    path_nodes = path_nodes.masked_fill((num_accepted == 0)[:, None], -1)
    last = torch.where(num_accepted > 0, best + 1, 0)  # [B] position of the path's end
    next_tokens = target_argmax.gather(1, last[:, None]).squeeze(1)  # [B]
    return TreeVerdict(path_nodes, num_accepted, next_tokens)


def multi_candidate_rejection(
    p: torch.Tensor,
    tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    valid: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One tree node: SpecInfer's multi-step speculative sampling over its children.

    Try the children in rank order: accept x_c with probability min(1, p(x_c) / q_c(x_c));
    on rejection replace p by normalize(max(0, p - q_c)) and try the next child. With q_c
    one-hot (draft_probs None) that is: accept with probability p(x_c), else remove x_c
    from p and renormalise.

    p           [B, V] target distribution at the node
    tokens      [B, C] children's tokens in rank order
    draft_probs [B, C, V] or None
    valid       [B, C] bool: which child slots hold a child to try
    Returns the accepted slot [B] (-1: none) and the residual [B, V] to draw the recovered
    token from when none is accepted.
    """
    batch, width = tokens.shape
    choice = torch.full((batch,), -1, dtype=torch.long, device=p.device)
    for c in range(width):
        x = tokens[:, c : c + 1]  # [B, 1]
        if draft_probs is None:
            q = torch.nn.functional.one_hot(x[:, 0], p.shape[-1]).to(p.dtype)  # [B, V]
        else:
            q = draft_probs[:, c]  # [B, V]
        p_x, q_x = p.gather(1, x)[:, 0], q.gather(1, x)[:, 0]  # [B]
        r = torch.rand(batch, generator=generator, device=p.device)  # [B]
        trying = valid[:, c] & (choice < 0)
        accept = trying & (r * q_x < p_x)  # r < p/q without the division
        choice = torch.where(accept, c, choice)
        p = torch.where((trying & ~accept)[:, None], residual(p, q), p)
    return choice, p


def verify_tree_sampling(
    tree: TokenTree,
    node_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> TreeVerdict:
    """Temperature > 0: recursive rejection sampling down the tree (SpecInfer's multi-step
    speculative sampling, Miao et al. 2024; with one-hot drafts, sequential elimination of
    deterministic top-k candidates).

    From the root, `multi_candidate_rejection` at the current node either accepts one child,
    which becomes the current node, or rejects all and the recovered token is drawn from the
    residual; at a leaf the bonus token is drawn from p after it.

    Why it is lossless: at a node with prefix s, the token emitted there is distributed as
    p(. | s). One child x with q one-hot: P(x) = p(x); otherwise, with probability 1 - p(x),
    the rest runs on p with x removed and renormalised, which by induction over the
    remaining children yields y != x with probability p(y) / (1 - p(x)), so P(y) = p(y).
    With x_c drawn from q_c the same induction runs on the one-draft identity
    min(p, q_c) + (1 - sum min(p, q_c)) * normalize(max(0, p - q_c)) = p.
    An accepted child c becomes the node, and its target row is p(. | s, x_c); so a round's
    tokens follow the target's chain rule, and so do all rounds.
    Conditions: the tree's tokens are drafted from the context alone, before verification
    draws anything; q_c is the distribution child c was drawn from, independently of its
    siblings. Candidates chosen any other way (top-k, sampling without replacement) must be
    passed with draft_probs None: one-hot q is exact for any fixed tokens, duplicates
    included (a rejected token has p = 0 afterwards).

    node_tokens  [B, N]
    target_probs [B, N+1, V]: row i is the target's distribution after position i
    draft_probs  [B, N, V] or None: node i's q (the drafter's distribution at its parent)
    """
    batch, vocab = node_tokens.shape[0], target_probs.shape[-1]
    device = node_tokens.device
    rows = torch.arange(batch, device=device)
    children = tree.children.to(device)  # [N+1, C]
    position = torch.zeros(batch, dtype=torch.long, device=device)  # [B] current node
    live = torch.ones(batch, dtype=torch.bool, device=device)  # [B] still walking down
    path_nodes = torch.full((batch, tree.max_depth), -1, dtype=torch.long, device=device)
    accept_probs = torch.zeros(batch, tree.max_depth, device=device)
    p = target_probs[:, 0]  # [B, V]
    for depth in range(tree.max_depth):
        kids = children[position]  # [B, C]
        slots = kids.clamp_min(0)  # [B, C] gatherable indices
        tokens, valid = node_tokens.gather(1, slots), (kids >= 0) & live[:, None]
        q = None
        if draft_probs is not None:
            q = draft_probs.gather(1, slots[..., None].expand(-1, -1, vocab))  # [B, C, V]
        else:
            accept_probs[:, depth] = _children_mass(p, tokens, valid)
        choice, leftover = multi_candidate_rejection(p, tokens, q, valid, generator)
        live = choice >= 0
        node = slots.gather(1, choice.clamp_min(0)[:, None]).squeeze(1)  # [B]
        path_nodes[:, depth] = torch.where(live, node, -1)
        position = torch.where(live, node + 1, position)
        p = torch.where(live[:, None], target_probs[rows, position], leftover)
    next_tokens = sample(p, generator)  # [B]
    num_accepted = (path_nodes >= 0).sum(-1)
    known = accept_probs if draft_probs is None else None  # sampled children: not computed
    return TreeVerdict(path_nodes, num_accepted, next_tokens, known)


def _children_mass(p: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """p's mass on the distinct valid tokens: with one-hot drafts, the probability that
    sequential elimination accepts one of them (the token it emits is distributed as p,
    and is a child exactly when one is accepted).
    p [B, V], tokens [B, C], valid [B, C] -> [B]."""
    earlier = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool, device=p.device)
    earlier = earlier.tril(-1)  # [C, C]: slot c' before slot c
    same = (tokens[:, :, None] == tokens[:, None, :]) & valid[:, None, :] & earlier  # [B, C, C]
    first = valid & ~same.any(-1)  # [B, C]: a valid slot whose token no earlier slot holds
    return (p.gather(1, tokens) * first).sum(-1)
