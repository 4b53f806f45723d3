"""Drafters: cheap proposers of the next k tokens, behind one interface.

A drafter sees the committed context and proposes up to k tokens, with the distribution it
drew each from when it has one (q for rejection sampling). After the target has verified
them, it observes the new committed context, so it can roll its own state back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specmtp.cache import CachedModel, kv_bytes_per_token, module_tensors
from specmtp.config import SamplingConfig
from specmtp.draft_model import DraftLM
from specmtp.errors import SpecMTPError
from specmtp.heads import Heads, ParallelHeads, SequentialMTP
from specmtp.mtp_cache import SequentialDraftCache
from specmtp.output_vocab import restrict_output_vocab
from specmtp.sampling import choose, greedy_tokens, logits_to_probs
from specmtp.tree import Candidates, TokenTree, build_tree_tokens, likeliest_subtree


@dataclass(frozen=True)
class Proposal:
    """A chain of k' <= k draft tokens, or a token tree of depth <= k.

    For a tree, `tokens` holds one token per node in the tree's node order, and `probs` is
    None: tree candidates are verified as fixed choices (see tree.verify_tree_sampling).
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


class NoMemory:
    """For drafters that hold no weights or cache of their own."""

    def weight_tensors(self) -> list[torch.Tensor]:
        return []

    def kv_bytes(self) -> int:
        return 0

    def kv_bytes_per_token(self) -> int:
        return 0


class NgramDrafter(NoMemory):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens
    (n from max_ngram down to min_ngram) and propose the tokens that followed it."""

    def __init__(self, *, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.name = "ngram"
        self.needs_target_hidden = False

    def reset(self) -> None:
        pass  # stateless: everything it needs is in the context

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        start = self.match(context[0])  # batch 1: lookup is per sequence
        if start is None or k == 0:
            return empty_proposal(context.shape[0], context.device)
        return Proposal(context[:, start : start + k].clone(), None)

    def match(self, ids: torch.Tensor) -> int | None:
        """Where the tokens after the latest earlier occurrence of the longest matching
        suffix (max_ngram down to min_ngram tokens) start in `ids` [L]; None if none."""
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            windows = ids[:-1].unfold(0, n, 1)  # [L-n, n]: earlier windows, the suffix excluded
            hits = (windows == ids[-n:]).all(-1).nonzero().flatten()
            if len(hits):  # the latest; something follows it, as the suffix is excluded
                return int(hits[-1]) + n
        return None

    def observe(self, outcome: Outcome) -> None:
        pass


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


def drafter_tree(drafter: Drafter | None) -> TokenTree | None:
    """The token tree a drafter verifies with (a lookup-first drafter: its fallback's), or
    None for chain drafters."""
    if isinstance(drafter, LookupFirstDrafter):
        return drafter_tree(drafter.fallback)
    return getattr(drafter, "tree", None) if isinstance(drafter, MTPDrafter) else None


def drafter_depth(drafter: Drafter | None) -> int | None:
    """The most tokens a drafter proposes per round, where its own shape bounds that: MTP
    heads drafting a chain propose one per head, whatever γ is asked. None where only γ
    bounds it (lookup, draft models, a lookup arm) or a tree's nodes set the verify size."""
    if isinstance(drafter, MTPDrafter) and drafter.tree is None:
        return drafter.max_depth
    return None


class LookupFirstDrafter:
    """Prompt lookup first, a model drafter otherwise: each round drafts what followed the
    latest earlier occurrence of the context's last n >= 2 tokens when there is one (copied
    text: quotes, code, summaries of the prompt), and asks `fallback` (MTP heads, a draft
    model) when there is none. The fallback observes every round, so its caches and hidden
    states stay in step with the committed context even in rounds it did not draft.
    Its two arms, LOOKUP_ARM and MODEL_ARM, get a γ schedule each (see drafter_arm).
    """

    def __init__(self, fallback: Drafter, *, max_ngram: int = 3, min_ngram: int = 2) -> None:
        self.lookup = NgramDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
        self.fallback = fallback
        self.name = f"ngram+{fallback.name}"
        self.needs_target_hidden = fallback.needs_target_hidden
        self.target_hidden_layers = getattr(fallback, "target_hidden_layers", None)
        self.lookup_rounds = 0  # rounds drafted by lookup, and by the fallback
        self.fallback_rounds = 0
        # The last context looked up and where its match continues: the decoder asks
        # next_arm, then propose, with the same tensor; one lookup serves both.
        self._looked_up: tuple[torch.Tensor | None, int | None] = (None, None)

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
        start = self._match(context)
        if start is not None:
            self.lookup_rounds += 1
            return Proposal(context[:, start : start + k].clone(), None)
        self.fallback_rounds += 1
        return self.fallback.propose(context, k, sampling, generator)

    def next_arm(self, context: torch.Tensor) -> str:
        return MODEL_ARM if self._match(context) is None else LOOKUP_ARM

    def _match(self, context: torch.Tensor) -> int | None:
        if self._looked_up[0] is not context:
            self._looked_up = (context, self.lookup.match(context[0]))
        return self._looked_up[1]

    def catch_up(self, context: torch.Tensor) -> int:
        return 0 if self._match(context) is not None else drafter_catch_up(self.fallback, context)

    def observe(self, outcome: Outcome) -> None:
        self.fallback.observe(outcome)

    def weight_tensors(self) -> list[torch.Tensor]:
        return self.fallback.weight_tensors()

    def kv_bytes(self) -> int:
        return self.fallback.kv_bytes()

    def kv_bytes_per_token(self) -> int:
        return self.fallback.kv_bytes_per_token()


class DraftModelDrafter:
    """A small causal LM with the target's tokenizer drafts k tokens autoregressively,
    keeping its own KV cache. Its cache holds `fed`, the ids it has seen; after each
    round it is cropped back to the part of `fed` that the target committed.

    With `multi_token` (a `draft_model.DraftLM` whose own MTP heads are used) or `heads`
    (MTP heads trained on this model by `specmtp train-mtp --target`), each draft forward
    proposes 1 + K tokens: the next one from its LM head, the K after it from its heads;
    the next forward feeds those tokens at once. Parallel heads read them all off the last
    hidden state. Sequential depths chain from the LM head's token, each over the history
    of this model's own hidden states (mtp_cache.py, as for the target's); their tokens are
    fixed choices given the ones before them, so their q is one-hot.

    With `output_ids` [N] (a reduced output vocabulary), the model's LM head is cut to
    those rows, so each draft step scores N tokens instead of V; its logits are put back
    in the full vocabulary with -inf elsewhere, so q is a distribution over V that is zero
    off those ids.
    """

    def __init__(
        self,
        model: PreTrainedModel | DraftLM,
        *,
        vocab_size: int,
        name: str = "draft",
        multi_token: bool = False,
        heads: Heads | None = None,
        output_ids: torch.Tensor | None = None,
    ) -> None:
        if multi_token and heads is None:
            heads = getattr(model, "heads", None)
            if heads is None:
                raise ValueError("multi-token drafting needs a draft with MTP heads")
        self.heads = heads
        # Sequential depths attend over this model's hidden states of every position fed.
        self.history = SequentialDraftCache(heads) if isinstance(heads, SequentialMTP) else None
        self.output_ids = output_ids
        if output_ids is not None:
            restrict_output_vocab(model, output_ids)
        self.runner = CachedModel(
            model, vocab_size=vocab_size, name=name, keep_hidden=heads is not None,
            hidden_layers=None if heads is None else heads.config.feature_layers,
        )  # fmt: skip
        self.name = name
        self.needs_target_hidden = False
        self.fed = torch.empty(1, 0, dtype=torch.long)  # [1, runner.length]
        self.expected = self.fed  # [1, m]: the last context it drafted from, then its drafts

    @property
    def multi_token(self) -> bool:
        return self.heads is not None

    def reset(self) -> None:
        self.runner.reset()
        self.fed = torch.empty(1, 0, dtype=torch.long, device=self.runner.device)
        self.expected = self.fed
        if self.history is not None:
            self.history.reset()

    def catch_up(self, context: torch.Tensor) -> int:
        """Tokens of `context` past its last drafts' common prefix, less the newest (a
        corrected or bonus token, read in every round)."""
        return max(0, context.shape[1] - _common_prefix(self.expected, context) - 1)

    def _rollback_to_prefix_of(self, context: torch.Tensor) -> None:
        common = _common_prefix(self.fed, context)
        self.runner.crop(common)
        self.fed = self.fed[:, :common]
        if self.history is not None:
            self.history.crop(common)

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        self._rollback_to_prefix_of(context[:, :-1])  # the last token must be fed for logits
        fresh = context[:, self.fed.shape[1] :]  # [B, u], u >= 1: corrected/bonus tokens too
        self.fed = context[:, : self.fed.shape[1]]
        tokens: list[torch.Tensor] = []  # each [B]
        probs: list[torch.Tensor | None] = []  # each [B, V] (sampling)
        while len(tokens) < k:
            logits = self._full(self.runner.forward(fresh, last_only=True)[:, -1])  # [B, V]
            self.fed = torch.cat([self.fed, fresh], 1)
            if self.history is not None:
                self.history.add_hidden(self.runner.last_hidden)
            step = self._draft_step(logits, k - len(tokens), sampling, generator)
            tokens += [token for token, _ in step]
            probs += [q for _, q in step]
            fresh = torch.stack(tokens[-len(step) :], 1)  # [B, m]: fed next, if more needed
        draft_probs = None if sampling.greedy or not probs else torch.stack(probs, 1)  # [B,k,V]
        if not tokens:
            return empty_proposal(context.shape[0], context.device)
        drafts = torch.stack(tokens, 1)  # [B, k]
        self.expected = torch.cat([context, drafts], 1)
        return Proposal(drafts, draft_probs)

    def _draft_step(
        self,
        logits: torch.Tensor,
        budget: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """What one draft forward proposes, at most `budget` tokens, from the LM head's
        logits [B, V] at the last position fed: each token [B] with its q [B, V] (None when
        greedy)."""
        if self.history is None:  # the LM head and the parallel heads read one hidden state
            rows = [logits, *self._head_logits()][:budget]  # each [B, V]
            return [_draw(row, sampling, generator) for row in rows]
        first, q = _draw(logits, sampling, generator)
        step = [(first, q)]
        depths = min(budget - 1, len(self.history.heads.depths))
        if depths > 0:  # the chain after `first`, one depth per token
            chain, _ = self.history.draft(torch.cat([self.fed, first[:, None]], 1), depths)
            for token in chain.unbind(1):  # [B]: the depth's top-1, a fixed choice
                fixed = None if q is None else F.one_hot(token, q.shape[-1]).to(q.dtype)
                step.append((token, fixed))
        return step

    def _full(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [B, N] over the output ids -> [B, V]; full-vocabulary logits as they are."""
        if self.output_ids is None:
            return logits
        full = logits.new_full((logits.shape[0], self.runner.vocab_size), float("-inf"))
        full[:, self.output_ids] = logits
        return full

    @torch.inference_mode()
    def _head_logits(self) -> list[torch.Tensor]:
        """Parallel heads' full-vocabulary logits at the last fed position, each [B, V]."""
        if not isinstance(self.heads, ParallelHeads):
            return []
        hidden = self.runner.last_hidden[:, -1:]  # [B, 1, H]
        logits = self.heads.to_full_logits(self.heads(hidden)[:, :, -1])  # [B, K, V]
        return list(logits[..., : self.runner.vocab_size].unbind(1))

    def observe(self, outcome: Outcome) -> None:
        self._rollback_to_prefix_of(outcome.context)

    def weight_tensors(self) -> list[torch.Tensor]:
        heads = [] if self.heads is None else module_tensors(self.heads)
        return list({id(t): t for t in module_tensors(self.runner.model) + heads}.values())

    def kv_bytes(self) -> int:
        return self.runner.kv_bytes() + (0 if self.history is None else self.history.nbytes())

    def kv_bytes_per_token(self) -> int:
        own = kv_bytes_per_token(self.runner.model)
        return own if self.history is None else own + self.history.bytes_per_position()


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of token rows a [B, m] and b [B, n]."""
    m = min(a.shape[1], b.shape[1])
    same = (a[:, :m] == b[:, :m]).all(0)  # [m]
    return m if bool(same.all()) else int(same.long().argmin())


def _draw(
    logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A token [B] from logits [B, V]: the argmax when greedy, else sampled from q [B, V]."""
    if sampling.greedy:
        return greedy_tokens(logits), None
    q = logits_to_probs(logits, sampling)
    return choose(q, sampling, generator), q


class MTPDrafter:
    """Self-speculation: MTP heads read the target's own last hidden state and draft the
    tokens after the pending one (head i: x_{t+2+i} from h_t), as a chain or a token tree.

    Parallel heads give every depth's candidates from h_t at once; sequential MTP depths
    run over the history with their own caches (mtp_cache.py), greedily for a chain and on
    each node's own path for a tree.
    Tree candidates and sequential drafts are fixed choices (verified with one-hot q);
    a sampled chain from parallel heads carries its q for rejection sampling. With `nodes`,
    each round drafts the whole tree and verifies only its `nodes` likeliest nodes by the
    heads' own probabilities (a dynamic tree).
    """

    def __init__(
        self,
        heads: Heads,
        *,
        tree: TokenTree | None = None,
        nodes: int | None = None,
        name: str = "mtp",
    ) -> None:
        if nodes is not None and (tree is None or nodes < 1):
            raise SpecMTPError("a dynamic tree needs a tree to draft and nodes >= 1")
        self.heads = heads.eval()
        self.tree = tree
        self.nodes = nodes
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
        if self.tree is not None:
            return self._tree_proposal(context, k)
        if self.history is not None:  # sequential depths: their greedy chain
            return Proposal(self.history.draft(context, k)[0], None)
        logits = self._head_logits(k)  # [B, k, V] full vocabulary
        if sampling.greedy:
            return Proposal(greedy_tokens(logits), None)
        q = logits_to_probs(logits, sampling)  # [B, k, V]: each head's own distribution
        return Proposal(choose(q, sampling, generator), q)

    def _head_logits(self, k: int) -> torch.Tensor:
        """Parallel heads' logits over the full vocabulary for depths 1..k: [B, k, V]."""
        logits = self.heads(self.hidden)[:, :k, -1]  # [B, K, 1, V'] -> [B, k, V']
        return self.heads.to_full_logits(logits)

    def _tree_proposal(self, context: torch.Tensor, k: int) -> Proposal:
        """Parallel heads: every depth's candidates from h_t, whatever the parent. Sequential
        depths: each node's children come from the depth run on that node's own path."""
        tree = self.tree.pruned(k)
        if self.history is not None:
            drafted = self.history.draft_tree(context, tree)
            candidates: Candidates = drafted.tokens
            logprob = drafted.logprob
        else:
            logits = self._head_logits(k)  # [B, k, V]
            width = max(path[-1] for path in tree.paths) + 1
            top = logits.topk(width, dim=-1)  # [B, k, width]
            candidates = list(top.indices.unbind(1))  # k x [B, width]
            logprob = {}
            if self.nodes is not None:  # each head's log-probability by rank
                chance = top.values.float() - logits.float().logsumexp(-1, keepdim=True)
                logprob = {p: sum(chance[:, d, r] for d, r in enumerate(p)) for p in tree.paths}
        if self.nodes is not None:  # one tree for the batch: the paths' mean log-probability
            tree = likeliest_subtree({p: float(lp.mean()) for p, lp in logprob.items()}, self.nodes)
        return Proposal(build_tree_tokens(tree, candidates), None, tree=tree)
