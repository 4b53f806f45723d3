"""Drafters: cheap proposers of the next k tokens, behind one interface.

A drafter sees the committed context and proposes up to k tokens, with the distribution it
drew each from when it has one (q for rejection sampling). After the target has verified
them, it observes the new committed context, so it can roll its own state back.

This module holds the interface, n-gram lookup and the lookup-first wrapper; drafting with a
separate draft model is in draft_model_drafter.py, with MTP heads in mtp_drafter.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specmtp.config import SamplingConfig
from specmtp.errors import SpecMTPError
from specmtp.tree import Path, TokenTree


@dataclass(frozen=True)
class Proposal:
    """A chain of k' <= k draft tokens, or a token tree of depth <= k.

    For a tree, `tokens` holds one token per node in the tree's node order, and `probs` is
    None: tree candidates are verified as fixed choices
    (`tree_verification.verify_tree_sampling`).
    """

    tokens: torch.Tensor  # [B, k'] chain, or [B, N] tree nodes; k' may be 0
    probs: torch.Tensor | None  # [B, k', V] the draft distributions q, or None (one-hot drafts)
    tree: TokenTree | None = None

    @property
    def depth(self) -> int:
        """Draft positions proposed: the chain's length, or the tree's depth."""
        return self.tree.max_depth if self.tree is not None else self.tokens.shape[1]


@dataclass(frozen=True)
class Outcome:
    """What a round committed, for the drafter to catch up with. The prefill gives one
    too, to drafters that need the target's hidden states: every prompt position but the
    last (pending) one is verified then, none accepted."""

    context: torch.Tensor  # [B, n'] every committed token; the last one is not yet verified
    num_accepted: int
    # [B, num_accepted+1, H]: the target's final hidden states at the verified positions
    # kept this round (the previous last token, then the accepted drafts); None unless the
    # drafter sets needs_target_hidden.
    target_hidden: torch.Tensor | None
    verified: int = 0  # tokens in the verify forward: k + 1, or a tree's nodes + 1


def empty_proposal(batch: int, device: torch.device) -> Proposal:
    return Proposal(torch.empty(batch, 0, dtype=torch.long, device=device), None)


TokenPath = tuple[int, ...]  # draft tokens from the root: a node of a tree of token choices


def copy_first(
    copied: Sequence[int], drafted: Mapping[TokenPath, float], nodes: int | None
) -> dict[TokenPath, float]:
    """A tree's nodes as token paths with their priority: every prefix of the copied
    continuation first, then the drafted paths (each one's prefixes among them) by their
    priority, highest first; `nodes` at most (None: all). A path never outranks its parent,
    so the nodes kept form a tree."""
    found = {tuple(copied[:d]): math.inf for d in range(1, len(copied) + 1)}
    for path, priority in drafted.items():
        found.setdefault(path, priority)
    chosen = sorted(found, key=lambda path: (-found[path], len(path)))[:nodes]
    return {path: found[path] for path in chosen}


def paths_proposal(chosen: Mapping[TokenPath, float], device: torch.device) -> Proposal:
    """A batch-1 proposal of the token paths `chosen` (each one's prefixes among them),
    siblings ranked by their priority, highest first: a chain when they form one path."""
    ranks: dict[TokenPath, Path] = {(): ()}
    children: dict[TokenPath, int] = {}
    tokens: dict[Path, int] = {}
    for path in sorted(chosen, key=lambda p: (len(p), -chosen[p], p[-1])):
        parent = path[:-1]
        rank = children.get(parent, 0)
        children[parent] = rank + 1
        ranks[path] = (*ranks[parent], rank)
        tokens[ranks[path]] = path[-1]
    tree = TokenTree(tuple(tokens))
    row = torch.tensor([[tokens[p] for p in tree.paths]], device=device)  # [1, N]
    if all(rank == 0 for path in tree.paths for rank in path):  # one path: a chain
        return Proposal(row, None)
    return Proposal(row, None, tree=tree)


class Drafter(Protocol):
    name: str
    needs_target_hidden: bool  # MTP heads draft from the target's hidden states

    def reset(self) -> None:
        """Forget everything: a new sequence starts."""

    def propose(
        self,
        context: torch.Tensor,  # [B, n] committed tokens
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal: ...

    def observe(self, outcome: Outcome) -> None:
        """The target verified the proposal and committed `outcome.context`."""

    # Memory, for budgets and reports: weights (tensors shared with the target are counted
    # once by the caller), and the KV cache now and per position.
    def weight_tensors(self) -> list[torch.Tensor]: ...

    def kv_bytes(self) -> int: ...

    def kv_bytes_per_token(self) -> int: ...

    # Optional, for drafters with several sources: `next_arm(context) -> str`, the source
    # that drafts the coming round (see drafter_arm).
    # Optional, with needs_target_hidden: `target_hidden_layers`, which of the target's
    # hidden states the drafter reads (heads.target_features); absent or None: the final.
    # Optional, for drafters with a cache of their own: `catch_up(context) -> int`, the
    # tokens it will read before drafting that are not in its cache (see drafter_catch_up).
    # Optional, for drafters with a model of their own: `packed_bytes() -> int`, the bytes
    # of its weights' packed copies (kernels.py; see drafter_packed_bytes).


class NoMemory:
    """For drafters that hold no weights or cache of their own."""

    def weight_tensors(self) -> list[torch.Tensor]:
        return []

    def kv_bytes(self) -> int:
        return 0

    def kv_bytes_per_token(self) -> int:
        return 0


class CopyDrafter(NoMemory):
    """A drafter that copies: each round proposes the first k tokens of `continuation`,
    what follows the context somewhere it has seen it; stateless."""

    def reset(self) -> None:
        pass  # everything it needs is in the context (and in what it copies from)

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        found = self.continuation(context[0]) if k > 0 else None  # batch 1: per sequence
        if found is None:
            return empty_proposal(context.shape[0], context.device)
        return Proposal(found[:k].unsqueeze(0).clone(), None)

    def continuation(self, ids: torch.Tensor) -> torch.Tensor | None:
        raise NotImplementedError

    def observe(self, outcome: Outcome) -> None:
        pass


class NgramDrafter(CopyDrafter):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens
    (n from max_ngram down to min_ngram) and propose the tokens that followed it."""

    def __init__(self, *, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.name = "ngram"
        self.needs_target_hidden = False

    def continuation(self, ids: torch.Tensor) -> torch.Tensor | None:
        """What followed the latest earlier occurrence of the suffix of `ids` [L]; None if
        none (the lookup interface LookupFirstDrafter asks)."""
        start = self.match(ids)
        return None if start is None else ids[start:]

    def match(self, ids: torch.Tensor) -> int | None:
        """Where the tokens after the latest earlier occurrence of the longest matching
        suffix (max_ngram down to min_ngram tokens) start in `ids` [L]; None if none."""
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            windows = ids[:-1].unfold(0, n, 1)  # [L-n, n]: earlier windows, the suffix excluded
            hits = (windows == ids[-n:]).all(-1).nonzero().flatten()
            if len(hits):  # the latest; something follows it, as the suffix is excluded
                return int(hits[-1]) + n
        return None


LOOKUP_ARM = "lookup"  # the arms of a LookupFirstDrafter (see drafter_arm)
MODEL_ARM = "model"


def has_arms(drafter: Drafter | None) -> bool:
    """Whether `drafter` drafts from several sources (has the optional `next_arm`)."""
    return getattr(drafter, "next_arm", None) is not None


def drafter_arm(drafter: Drafter, context: torch.Tensor) -> str:
    """Which of its sources drafts the coming round, for drafters with several; "" for the
    others. The decoder keeps one γ schedule per arm: a lookup hit is worth a long draft, a
    model's guess a short one."""
    return drafter.next_arm(context) if has_arms(drafter) else ""  # type: ignore[attr-defined]


def drafter_catch_up(drafter: Drafter, context: torch.Tensor) -> int:
    """Tokens of `context` the drafter must read before it can draft, besides the newest:
    none while it drafts every round (its drafts are what it read last), the tokens of the
    rounds it sat out, and a whole prompt at a sequence's start. A draft model reads them
    in one forward before its first draft, a cost the schedules price separately from a
    draft's. 0 for n-gram lookup (no cache) and MTP heads: sequential depths do run over
    the positions of the rounds they sat out when they next draft, but in the one call
    that drafts, not priced (default model: a probe after plain rounds took about 7 ms,
    a draft's stored cost is 5.1 ms)."""
    catch_up = getattr(drafter, "catch_up", None)
    return 0 if catch_up is None else catch_up(context)


def drafter_packed_bytes(drafter: Drafter | None) -> int:
    """Bytes of the packed copies of a drafter's weights (kernels.packed_bytes); 0 for
    drafters without a model of their own."""
    packed = getattr(drafter, "packed_bytes", None)
    return 0 if packed is None else packed()


class LookupFirstDrafter:
    """Lookup first, a model drafter otherwise: each round drafts what followed the latest
    earlier occurrence of the context's last n >= 2 tokens when there is one (copied text:
    quotes, code, summaries of the prompt), or what `lookup` finds (a DatastoreDrafter: the
    context, then a store of the target's answers), and asks `fallback` (MTP heads, a
    draft model) when there is none. The fallback observes every round, so its caches and
    hidden states stay in step with the committed context even in rounds it did not draft.
    Its two arms, LOOKUP_ARM and MODEL_ARM, get a γ schedule each (see drafter_arm).
    """

    def __init__(
        self,
        fallback: Drafter,
        *,
        max_ngram: int = 3,
        min_ngram: int = 2,
        lookup: CopyDrafter | None = None,
    ) -> None:
        self.lookup = lookup or NgramDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
        self.fallback = fallback
        self.name = f"{self.lookup.name}+{fallback.name}"
        self.needs_target_hidden = fallback.needs_target_hidden
        self.target_hidden_layers = getattr(fallback, "target_hidden_layers", None)
        self.lookup_rounds = 0  # rounds drafted by lookup, and by the fallback
        self.fallback_rounds = 0
        # The last context looked up and what it continues with: the decoder asks
        # next_arm, then propose, with the same tensor; one lookup serves both.
        self._looked_up: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def reset(self) -> None:
        self.lookup.reset()
        self.fallback.reset()
        self._looked_up = (None, None)

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        found = self._continuation(context)
        if found is not None:
            self.lookup_rounds += 1
            return Proposal(found[:k].unsqueeze(0).clone(), None)
        self.fallback_rounds += 1
        return self.fallback.propose(context, k, sampling, generator)

    def next_arm(self, context: torch.Tensor) -> str:
        return MODEL_ARM if self._continuation(context) is None else LOOKUP_ARM

    def _continuation(self, context: torch.Tensor) -> torch.Tensor | None:
        if self._looked_up[0] is not context:
            self._looked_up = (context, self.lookup.continuation(context[0]))
        return self._looked_up[1]

    def catch_up(self, context: torch.Tensor) -> int:
        found = self._continuation(context)
        return 0 if found is not None else drafter_catch_up(self.fallback, context)

    def observe(self, outcome: Outcome) -> None:
        self.fallback.observe(outcome)

    def weight_tensors(self) -> list[torch.Tensor]:
        return self.fallback.weight_tensors()

    def packed_bytes(self) -> int:
        return drafter_packed_bytes(self.fallback)

    def kv_bytes(self) -> int:
        return self.fallback.kv_bytes()

    def kv_bytes_per_token(self) -> int:
        return self.fallback.kv_bytes_per_token()


def check_nodes_known(name: str, tuned: bool, nodes: int | None) -> None:
    """A dynamic tree with `#nodes=auto` drafts only once a profile (or tune) has set its
    node count."""
    if tuned and nodes is None:
        raise SpecMTPError(
            f"{name} takes its node count from its tuning profile, and no profile gave one: "
            f"run `specmtp tune --draft '{name}'` first, or give #nodes=N"
        )
