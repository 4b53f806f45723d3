"""One tree from two drafts: a lookup's copied continuation united with MTP heads' drafts.

A lookup-first drafter (`ngram+mtp-tree`) chooses each round between copying (the context's
last tokens occurred before, or the store continues them) and the heads. When the copy is
wrong the round is lost, though the heads might have been right; when the heads are wrong,
a copy would often have been. Verifying both in the same forward costs a few more rows
(nearly free up to the row-invariant block size in bfloat16, docs/exact-bfloat16.md), and
the round then accepts the longer of the two, as SpecInfer does with the trees of several
drafters.

`ngram|SPEC` and `store|SPEC` (SPEC: `mtp`, `mtp-tree`, either with `:PATH` or `#nodes=N`)
draft the union: the copied continuation (γ tokens) first, then the heads' nodes by their
own log-probability, `#nodes` in all when the heads' tree has a node budget. Rounds without
a copy are the heads' alone. The nodes are fixed choices, verified as any token tree
(greedy: argmax; sampled: recursive rejection with one-hot q), so the output is the
target's.
"""

from __future__ import annotations

import torch

from specmtp.config import SamplingConfig
from specmtp.drafters import (
    CopyDrafter,
    LookupFirstDrafter,
    Proposal,
    TokenPath,
    copy_first,
    paths_proposal,
)
from specmtp.mtp_drafter import MTPDrafter
from specmtp.tree import TokenTree, best_tree

# The tree a merged drafter's verify passes are timed with when its heads draft chains:
# a copied path and a chain beside it (only the row count and the mask matter).
TIMING_RANK_PROBS = (0.6, 0.3)
TIMING_DEPTH = 8


class MergedDrafter(LookupFirstDrafter):
    """Each round, when `lookup` continues the context, the tree of its continuation's
    first k tokens and the heads' drafts (at most `nodes` nodes, the copied ones first);
    otherwise the heads' proposal alone. Its arms are the lookup-first drafter's: a round
    with a copy is the lookup arm's (γ = the copied length; the heads draft their own full
    depth beside it), one without is the model arm's."""

    def __init__(self, fallback: MTPDrafter, *, lookup: CopyDrafter) -> None:
        super().__init__(fallback, lookup=lookup)
        self.heads: MTPDrafter = fallback
        self.name = f"{lookup.name}|{fallback.name}"
        # What drafter_tree gives: the shape T(n) is timed with. Not `tree`: `specmtp tune`
        # sweeps tree budgets for drafters with one, and γ pairs for this one's two arms.
        self.timing_tree: TokenTree = fallback.tree or best_tree(
            [TIMING_RANK_PROBS] * TIMING_DEPTH, TIMING_DEPTH + fallback.max_depth
        )
        self.single_path = False  # a round that only checks: the copy alone (mtp_drafter)

    @property
    def nodes(self) -> int | None:
        """The tree's node budget, copied nodes included: the heads' own (None: no cap)."""
        return self.heads.nodes

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        if self.single_path:  # a round that only checks: the copy alone, or the heads' chain
            return super().propose(context, k, sampling, generator)
        found = self._continuation(context)
        if found is None or k == 0:
            self.fallback_rounds += 1
            return self.heads.propose(context, k, sampling, generator)
        self.lookup_rounds += 1
        return paths_proposal(self.united(found[:k].tolist(), context, k), context.device)

    def united(self, copied: list[int], context: torch.Tensor, k: int) -> dict[TokenPath, float]:
        """The copied path's nodes, then the heads' by their priority, `nodes` at most, none
        deeper than k (the decoder's limit: new tokens, context, memory)."""
        return copy_first(copied, self.heads.drafted_paths(context, k), self.nodes)
