"""A draft model drafting a token tree: SpecInfer's draft-model trees, grown as in EAGLE-2.

A chain from a draft model stakes a round on the draft's top-1 token at every depth; where
the draft hesitates between two tokens, the second is lost. A tree keeps the likeliest
continuations instead: the draft's probabilities rank every path (the product along it),
and the target verifies the `nodes` likeliest in one tree forward
(`tree_verification`), as it does MTP heads' dynamic trees.

Growing the tree (batch 1, one draft forward per depth, as a chain of the same depth):
    forward the tokens committed since the last round     -> depth 1's top BEAM tokens
    for depth d = 1 .. k-1:
        expand the depth-d nodes among the `nodes` likeliest so far (BEAM at most): one
        forward of those rows, each seeing the context, its ancestors and itself (a 4-D
        mask over the draft's cache, which holds the context then every node fed so far)
                                                          -> each one's top BEAM children
    propose the `nodes` likeliest paths; the nodes fed stay in the draft's cache
A node outside the likeliest `nodes` is not expanded: its children rank below it, so none
could enter. With `min_probability` P (`MODEL#nodes=N#min-p=P`), growth also stops at the
first depth whose likeliest node to expand has a path probability below P: a forward
spent on paths the draft itself doubts. The tree's tokens are fixed choices (the draft's
top ones), verified with one-hot q at temperature > 0, which keeps sampling lossless.

Next round, the accepted path's nodes that were fed (every one but a leaf) stay in the
draft's cache, moved down behind the context (`CachedModel.keep`, as the target keeps its
accepted path), and the rest of the tree leaves it: each such node's keys and values were
computed at its own position over the context and its ancestors, as a chain would have.
The forward that reads the new token then feeds only the tokens the tree had not fed (the
target's own token, and an accepted leaf), not the whole accepted path again: a row or two
where it fed about τ (`catch_up` counts those).
"""

from __future__ import annotations

import math

import torch
from transformers import PreTrainedModel

from specmtp.config import SamplingConfig
from specmtp.datastore import TIMING_RANK_PROBS
from specmtp.draft_model import DraftLM
from specmtp.draft_model_drafter import DraftModelDrafter
from specmtp.drafters import (
    Outcome,
    Proposal,
    TokenPath,
    check_nodes_known,
    empty_proposal,
    paths_proposal,
)
from specmtp.errors import SpecMTPError
from specmtp.sampling import logits_to_probs, top_log_probs
from specmtp.tree import TokenTree, additive_mask, best_tree, check_tree_attention

BEAM = 4  # nodes expanded per depth, and children kept per expanded node
TIMING_DEPTH = 8  # the depth of the typical shape T(n) is timed with


class DraftTreeDrafter(DraftModelDrafter):
    """A draft model proposing the `nodes` likeliest paths of at most k tokens a round (a
    token tree; one path is proposed as a chain). Drafts with the model's LM head alone."""

    def __init__(
        self,
        model: PreTrainedModel | DraftLM,
        *,
        vocab_size: int,
        nodes: int | None,
        name: str = "draft",
        output_ids: torch.Tensor | None = None,
        beam: int = BEAM,
        min_probability: float = 0.0,
        tuned_nodes: bool = False,
    ) -> None:
        if (nodes is None) != tuned_nodes or beam < 1:
            raise SpecMTPError("a draft tree needs nodes >= 1 (or tuned ones) and beam >= 1")
        check_tree_attention(model)  # the draft attends over its own tree too
        super().__init__(
            model, vocab_size=vocab_size, name=name, output_ids=output_ids,
            min_probability=min_probability,
        )  # fmt: skip
        self.most_beam = beam
        self.tuned_nodes = tuned_nodes  # `#nodes=auto`: the count comes from a tuning profile
        self.nodes = nodes
        # Set by the decode loop for a round that only checks whether drafting pays
        # (mtp_drafter.single_path): the draft's likeliest path alone, a chain.
        self.single_path = False
        # The last round's tree nodes in the draft's cache, in the order they were fed
        # after the context (`tree_past` positions; the context is `self.fed`).
        self.tree_fed: list[TokenPath] = []
        self.tree_past = 0

    def reset(self) -> None:
        super().reset()
        self.tree_fed = []

    def observe(self, outcome: Outcome) -> None:
        self._keep_accepted_path(outcome.context)
        super().observe(outcome)

    def catch_up(self, context: torch.Tensor) -> int:
        """Tokens the next round's first forward feeds beyond the one it must: the accepted
        path's nodes still in the cache are not fed again."""
        return max(0, super().catch_up(context) - len(self._accepted_nodes(context)))

    @property
    def nodes(self) -> int | None:
        return self._nodes

    @nodes.setter
    def nodes(self, nodes: int | None) -> None:
        """Set by the spec, or later by a tuning profile or `specmtp tune` (`#nodes=auto`)."""
        if nodes is not None and nodes < 1:
            raise SpecMTPError(f"a draft tree needs nodes >= 1, got {nodes}")
        self._nodes = nodes
        self.beam = self.most_beam if nodes is None else min(self.most_beam, nodes)
        # What drafter_tree gives: a typical shape, for timing T(n) only (trees change
        # every round); none until the count is known.
        self.timing_tree: TokenTree | None = (
            None if nodes is None else best_tree([TIMING_RANK_PROBS] * TIMING_DEPTH, nodes)
        )

    def check_nodes_known(self) -> None:
        """`#nodes=auto` drafts only once a profile (or tune) has set the node count."""
        check_nodes_known(self.name, self.tuned_nodes, self.nodes)

    @torch.inference_mode()
    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        self.check_nodes_known()
        if context.shape[0] != 1:
            raise SpecMTPError("a draft tree drafts one sequence at a time (batch size 1)")
        if k < 1:
            return empty_proposal(1, context.device)
        self._keep_accepted_path(context)
        self._rollback_to_prefix_of(context[:, :-1])  # the last token must be fed for logits
        fresh = context[:, self.fed.shape[1] :]  # [1, u], u >= 1
        logits = self.runner.forward(fresh, last_only=True)[:, -1]  # [1, V or N]
        self.fed = context
        self.expected = context
        past = self.runner.length
        # A single path is a tree of k nodes, one child each: the draft's top-1 chain.
        nodes, beam = (k, 1) if self.single_path else (self.nodes, self.beam)
        scores = self._children({(): 0.0}, logits, sampling, beam)  # depth 1
        fed: list[TokenPath] = []  # tree nodes in the draft's cache after `past`, in order
        for depth in range(1, k):
            expand = [p for p in self._likeliest(scores, nodes) if len(p) == depth][:beam]
            if not expand or math.exp(scores[expand[0]]) < self.min_probability:
                break  # nothing at this depth can enter the tree, or the draft doubts it all
            logits = self._tree_step(expand, fed, past)  # [E, V or N]
            fed += expand
            scores |= self._children({p: scores[p] for p in expand}, logits, sampling, beam)
        self.tree_past, self.tree_fed = past, fed  # kept until the next round's context
        chosen = self._likeliest(scores, nodes)
        return paths_proposal({path: scores[path] for path in chosen}, context.device)

    def _accepted_nodes(self, context: torch.Tensor) -> list[int]:
        """The cache positions of the last round's nodes that spell the tokens `context` [1,
        n] adds to that round's context, from the first on (one per depth, ascending)."""
        past = self.tree_past
        if not self.tree_fed or context.shape[1] <= past or self.fed.shape[1] != past:
            return []
        if not torch.equal(context[0, :past], self.fed[0]):
            return []
        position = {path: past + i for i, path in enumerate(self.tree_fed)}
        added = tuple(context[0, past:].tolist())
        kept = []
        for depth in range(1, len(added) + 1):
            if added[:depth] not in position:
                break
            kept.append(position[added[:depth]])
        return kept

    def _keep_accepted_path(self, context: torch.Tensor) -> None:
        """Drop the last round's tree from the draft's cache but the nodes `context` took."""
        if not self.tree_fed:
            return
        kept = self._accepted_nodes(context)
        self.runner.keep(self.tree_past, torch.tensor(kept, dtype=torch.long))
        if kept:  # else the cache holds the last context (`self.fed`) alone again
            self.fed = context[:, : self.tree_past + len(kept)]
            self.expected = self.fed  # what catch_up counts from: the cache's tokens
        self.tree_fed = []

    def _likeliest(self, scores: dict[TokenPath, float], nodes: int | None) -> list[TokenPath]:
        """The `nodes` likeliest paths; on ties the shorter first, so a path never ranks
        below its child (whose log-probability is at most its own) and they form a tree."""
        return sorted(scores, key=lambda p: (-scores[p], len(p)))[:nodes]

    def _children(
        self,
        parents: dict[TokenPath, float],
        logits: torch.Tensor,
        sampling: SamplingConfig,
        beam: int,
    ) -> dict[TokenPath, float]:
        """Each parent's `beam` likeliest children with their paths' log-probabilities.
        logits [P, V], or [P, N] over a reduced output vocabulary: row i after the i-th
        parent. Greedy ranks by the draft's own distribution, over the N ids alone when the
        vocabulary is reduced (the others have probability 0: the same ranks, without
        spreading N logits over V); sampling by the one it samples from (temperature,
        top-k, top-p), over the full vocabulary."""
        if sampling.greedy:
            top_values, top_tokens = top_log_probs(logits, beam)  # [P, beam]
            if self.output_ids is not None:
                top_tokens = self.output_ids.to(top_tokens.device)[top_tokens]
        else:
            logprob = logits_to_probs(self._full(logits), sampling).log()  # [P, V]; -inf off
            top_values, top_tokens = logprob.topk(beam, dim=-1)  # [P, beam]   top-k/top-p
        children: dict[TokenPath, float] = {}
        for (path, score), values, tokens in zip(
            parents.items(), top_values.tolist(), top_tokens.tolist(), strict=True
        ):
            for value, token in zip(values, tokens, strict=True):
                if value > float("-inf"):
                    children[(*path, token)] = score + value
        return children

    def _tree_step(self, expand: list[TokenPath], fed: list[TokenPath], past: int) -> torch.Tensor:
        """One draft forward of the nodes `expand` (all one depth d), after the context
        (`past` positions) and the nodes `fed` before them; their logits [E, V]. Each row
        sees the context, its ancestors among `fed` and itself; position past + d - 1.
        Logits over the output ids when the vocabulary is reduced ([E, N])."""
        n, depth = len(expand), len(expand[0])
        ancestor = torch.tensor(
            [[path[: len(node)] == node for node in fed] for path in expand], dtype=torch.bool
        ).reshape(n, len(fed))  # [E, F]
        allowed = torch.cat(
            [torch.ones(n, past, dtype=torch.bool), ancestor, torch.eye(n, dtype=torch.bool)], 1
        )  # [E, past + F + E]
        device = self.runner.device
        mask = additive_mask(allowed.to(device), self.runner.model.dtype)[None, None]
        tokens = torch.tensor([[path[-1] for path in expand]], device=device)  # [1, E]
        positions = torch.full((1, n), past + depth - 1, device=device)  # [1, E]
        logits = self.runner.forward(tokens, attention_mask=mask, position_ids=positions)
        return logits[0]
