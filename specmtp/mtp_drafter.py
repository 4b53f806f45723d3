"""Self-speculation: MTP heads draft from the target's own hidden states, as a chain or a
token tree; and what their shape tells the rest of the package (the tree verified, the most
tokens drafted per round)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from specmtp.cache import module_tensors
from specmtp.config import SamplingConfig
from specmtp.draft_tree_drafter import DraftTreeDrafter
from specmtp.drafters import (
    Drafter,
    LookupFirstDrafter,
    Outcome,
    Proposal,
    TokenPath,
    check_nodes_known,
    empty_proposal,
)
from specmtp.errors import SpecMTPError
from specmtp.heads import Heads, SequentialMTP
from specmtp.mtp_cache import SequentialDraftCache
from specmtp.sampling import choose, greedy_tokens, logits_to_probs
from specmtp.tree import Candidates, Path, TokenTree, build_tree_tokens, likeliest_subtree


class MTPDrafter:
    """Self-speculation: MTP heads read the target's own last hidden state and draft the
    tokens after the pending one (head i: x_{t+2+i} from h_t), as a chain or a token tree.

    Parallel heads give every depth's candidates from h_t at once; sequential MTP depths
    run over the history with their own caches (mtp_cache.py), greedily for a chain and on
    each node's own path for a tree.
    Tree candidates and sequential drafts are fixed choices (verified with one-hot q);
    a sampled chain from parallel heads carries its q for rejection sampling. With `nodes`,
    each round drafts the whole tree and verifies only its `nodes` likeliest nodes by the
    heads' own probabilities (a dynamic tree). With `tuned_nodes` (`mtp-tree#nodes=auto`)
    `nodes` is set later, from a tuning profile (`use_profile_nodes`) or by `specmtp tune`
    sweeping it; drafting before then is an error.
    """

    def __init__(
        self,
        heads: Heads,
        *,
        tree: TokenTree | None = None,
        nodes: int | None = None,
        tuned_nodes: bool = False,
        name: str = "mtp",
    ) -> None:
        if (nodes is not None or tuned_nodes) and (
            tree is None or (nodes is not None and nodes < 1)
        ):
            raise SpecMTPError("a dynamic tree needs a tree to draft and nodes >= 1")
        self.heads = heads.eval()
        self.tree = tree
        self.nodes = nodes
        self.tuned_nodes = tuned_nodes
        # Set by the decode loop for a round that only checks whether drafting pays
        # (single_path below): a tree drafter drafts the heads' chain instead.
        self.single_path = False
        self.name = name
        self.needs_target_hidden = True
        self.target_hidden_layers = heads.config.feature_layers
        self.hidden: torch.Tensor | None = None  # [B, 1, H] at the last verified position
        # Sequential depths attend over the history, as in training: they keep a cache.
        self.history = SequentialDraftCache(heads) if isinstance(heads, SequentialMTP) else None

    @property
    def max_depth(self) -> int:
        return self.heads.config.num_heads

    def reset(self) -> None:
        self.hidden = None
        if self.history is not None:
            self.history.reset()

    def weight_tensors(self) -> list[torch.Tensor]:
        return module_tensors(self.heads)

    def kv_bytes(self) -> int:
        # Parallel heads draft from the target's last hidden state alone: no cache.
        return 0 if self.history is None else self.history.nbytes()

    def kv_bytes_per_token(self) -> int:
        return 0 if self.history is None else self.history.bytes_per_position()

    def observe(self, outcome: Outcome) -> None:
        assert outcome.target_hidden is not None  # the loop keeps it: needs_target_hidden
        self.hidden = outcome.target_hidden[:, -1:]
        if self.history is not None:
            self.history.add_hidden(outcome.target_hidden)

    @torch.inference_mode()
    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        k = min(k, self.max_depth)
        if self.hidden is None or k == 0:  # the first round has no verified hidden state yet
            return empty_proposal(context.shape[0], context.device)
        if self.tree is not None and not self.single_path:
            return self._tree_proposal(context, k)
        if self.history is not None:  # sequential depths: their greedy chain
            return Proposal(self.history.draft(context, k)[0], None)
        logits = self._head_logits(k)  # [B, k, V] full vocabulary
        if sampling.greedy:
            return Proposal(greedy_tokens(logits), None)
        q = logits_to_probs(logits, sampling)  # [B, k, V]: each head's own distribution
        return Proposal(choose(q, sampling, generator), q)

    def check_nodes_known(self) -> None:
        """`#nodes=auto` drafts only once a profile (or tune) has set the node count."""
        check_nodes_known(self.name, self.tuned_nodes, self.nodes)

    def _head_logits(self, k: int) -> torch.Tensor:
        """Parallel heads' logits over the full vocabulary for depths 1..k: [B, k, V]."""
        logits = self.heads(self.hidden)[:, :k, -1]  # [B, K, 1, V'] -> [B, k, V']
        return self.heads.to_full_logits(logits)

    def _tree_proposal(self, context: torch.Tensor, k: int) -> Proposal:
        self.check_nodes_known()
        tree, candidates, logprob = self._drafted_tree(context, k)
        if self.nodes is not None:  # one tree for the batch: the paths' mean log-probability
            tree = likeliest_subtree({p: float(lp.mean()) for p, lp in logprob.items()}, self.nodes)
        return Proposal(build_tree_tokens(tree, candidates), None, tree=tree)

    def _drafted_tree(
        self, context: torch.Tensor, k: int
    ) -> tuple[TokenTree, Candidates, dict[Path, torch.Tensor]]:
        """The tree drafted this round (pruned to depth k), its candidates and each path's
        log-probability [B] under the heads. Parallel heads: every depth's candidates from
        h_t, whatever the parent. Sequential depths: each node's children come from the
        depth run on that node's own path."""
        assert self.tree is not None
        tree = self.tree.pruned(k)
        if self.history is not None:
            drafted = self.history.draft_tree(context, tree)
            return tree, drafted.tokens, drafted.logprob
        logits = self._head_logits(k)  # [B, k, V]
        width = max(path[-1] for path in tree.paths) + 1
        top = logits.topk(width, dim=-1)  # [B, k, width]
        chance = top.values.float() - logits.float().logsumexp(-1, keepdim=True)
        logprob = {p: sum(chance[:, d, r] for d, r in enumerate(p)) for p in tree.paths}
        return tree, list(top.indices.unbind(1)), logprob  # candidates: k x [B, width]

    @torch.inference_mode()
    def drafted_paths(self, context: torch.Tensor, k: int) -> dict[TokenPath, float]:
        """This round's drafts (batch 1), none deeper than k, as token paths with a priority
        each, for a drafter that unites them with another draft (MergedDrafter): a tree's
        every drafted node with its log-probability under the heads (before `nodes` picks),
        a chain's tokens with minus their depth. Empty when the heads have nothing to draft
        from yet."""
        self.check_nodes_known()
        k = min(k, self.max_depth)
        if self.hidden is None or k == 0:
            return {}
        if self.tree is None:
            chain = self.propose(context, k, SamplingConfig(), None).tokens[0].tolist()
            return {tuple(chain[:d]): -float(d) for d in range(1, len(chain) + 1)}
        tree, candidates, logprob = self._drafted_tree(context, k)
        tokens = build_tree_tokens(tree, candidates)[0].tolist()  # [N] in node order
        token_path = {(): ()}
        for path, token in zip(tree.paths, tokens, strict=True):
            token_path[path] = (*token_path[path[:-1]], token)
        return {token_path[p]: float(logprob[p][0]) for p in tree.paths}


def drafter_tree(drafter: Drafter | None) -> TokenTree | None:
    """The token tree a drafter verifies with (a lookup-first drafter: its fallback's; a
    store tree drafter or a merged drafter, whose trees change every round: one of their
    typical shape, `timing_tree` for the latter), or None for chain drafters."""
    tree = getattr(drafter, "timing_tree", None) or getattr(drafter, "tree", None)
    if tree is None and isinstance(drafter, LookupFirstDrafter):
        return drafter_tree(drafter.fallback)
    return tree


def dynamic_tree_drafter(drafter: Drafter | None) -> MTPDrafter | DraftTreeDrafter | None:
    """The drafter of a dynamic tree whose node count is set or tuned (`#nodes=N` or
    `#nodes=auto`): MTP heads (`mtp-tree#nodes=...`) or a draft model's tree
    (`MODEL#nodes=...`), itself or inside a lookup-first or merged drafter; None otherwise."""
    if isinstance(drafter, LookupFirstDrafter):
        return dynamic_tree_drafter(drafter.fallback)
    if isinstance(drafter, MTPDrafter) and (drafter.nodes is not None or drafter.tuned_nodes):
        return drafter
    if isinstance(drafter, DraftTreeDrafter):
        return drafter
    return None


@contextmanager
def single_path(drafter: Drafter | None) -> Iterator[None]:
    """Within it, a drafter of token trees proposes one path alone, a chain: the cheapest
    round of a given depth, for rounds that only check whether drafting pays again (the
    adaptive schedule's probes). A tree's first depth holds several candidates, so a check
    with the tree verifies several rows for the evidence of one. Drafters that draft trees
    (MTP heads with a tree, a draft model's tree, a merged drafter) have a `single_path`
    flag, set here on the drafter and on a lookup-first drafter's fallback."""
    flagged = [d for d in _nested(drafter) if hasattr(d, "single_path")]
    for inner in flagged:
        inner.single_path = True
    try:
        yield
    finally:
        for inner in flagged:
            inner.single_path = False


def _nested(drafter: Drafter | None) -> Iterator[Drafter]:
    """The drafter, and the drafters inside it (a lookup-first drafter's fallback)."""
    if drafter is not None:
        yield drafter
    if isinstance(drafter, LookupFirstDrafter):
        yield from _nested(drafter.fallback)


def drafter_depth(drafter: Drafter | None) -> int | None:
    """The most tokens a drafter proposes per round, where its own shape bounds that: MTP
    heads drafting a chain propose one per head, whatever γ is asked. None where only γ
    bounds it (lookup, draft models, a lookup arm) or a tree's nodes set the verify size."""
    if isinstance(drafter, MTPDrafter) and drafter.tree is None:
        return drafter.max_depth
    return None
