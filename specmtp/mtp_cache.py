"""Drafting with sequential MTP depths over the whole history, as they were trained.

Training runs every depth's block with causal attention over all earlier positions
(`SequentialMTP.forward_all`). Drafting from the last position alone would feed each block a
one-position sequence it never saw in training: measured on the default model's held-out
answers, top-1 per depth drops from 0.48 / 0.46 / 0.45 to 0.37 / 0.29 / 0.27. So the drafter
keeps, for each depth, the keys, values and output states of every committed position, and
runs only the new positions each round.

Positions (0-based). Committed tokens x_0 .. x_{T-1}; x_{T-1} is pending (the target has
not read it yet), so the target's hidden states h_s exist for s <= T-2. Depth i at
position s reads depth i-1's state at s (depth -1: h_s) and the embedding of x_{s+1+i}, and
predicts x_{s+2+i}. A draft round runs depth i at the positions after its cache up to
s = T-2, where it proposes d_{i+1} = x_{T+i} from the tokens x_{T-1+i} (a draft for i >= 1).
Positions whose inputs are all committed tokens (s <= T-2-i) may join depth i's cache (all
but the last of them do); the others depend on drafts and are recomputed next round, so the
cache never holds a guess.
What it computes at s = T-2 is then exactly what `forward_all` computes on the sequence
x_0 .. x_{T-1}, d_1 .. d_k (tests/test_mtp_cache.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmtp.errors import SpecMTPError
from specmtp.heads import KV, SequentialMTP
from specmtp.tree import Path, TokenTree


@dataclass(frozen=True)
class DraftedTree:
    """A drafted tree: each path's token [B], and the log-probability [B] (float32) the
    depths gave the path's tokens, each given the ones before it (a dynamic tree keeps the
    likeliest paths)."""

    tokens: dict[Path, torch.Tensor]
    logprob: dict[Path, torch.Tensor]


class SequentialDraftCache:
    """Per-depth keys, values and states of the committed positions, for one sequence."""

    def __init__(self, heads: SequentialMTP) -> None:
        self.heads = heads
        self.reset()

    def reset(self) -> None:
        self.fused: torch.Tensor | None = None  # [B, L, H]: depth 0's input at h_0 .. h_{L-1}
        self.unfused: list[torch.Tensor] = []  # [B, m, F] each: features added since
        depths = len(self.heads.depths)
        self.kv: list[KV | None] = [None] * depths  # each [B, heads, L_i, d]
        self.states: list[torch.Tensor | None] = [None] * depths  # each [B, L_i, H]

    def add_hidden(self, hidden: torch.Tensor) -> None:
        """The target's features [B, m, F] at the next m positions it has verified. They
        are fused to depth 0's input (heads reading several layers) when next needed, all
        at once: a round of plain decoding adds one position, and fusing it there took
        0.7 ms of a 55 ms step (the default model's heads, one thread)."""
        self.unfused.append(hidden)

    @property
    def hidden(self) -> torch.Tensor | None:
        """Depth 0's input [B, T-1, H] at the target's h_0 .. h_{T-2}."""
        if self.unfused:
            with torch.no_grad():
                new = self.heads.fuse(torch.cat(self.unfused, 1))
            self.fused = new if self.fused is None else torch.cat([self.fused, new], 1)
            self.unfused = []
        return self.fused

    def crop(self, tokens: int) -> None:
        """Keep only what depends on the first `tokens` tokens alone: their hidden states
        h_0 .. h_{tokens-1}, and depth i's positions s <= tokens-2-i (s reads x_{s+1+i}).
        For a draft model, whose hidden states cover every token it has read and whose
        fed tokens may be rolled back."""
        if self.hidden is not None:
            self.fused = self.hidden[:, :tokens] if tokens > 0 else None
        for i in range(len(self.heads.depths)):
            keep = max(0, min(self.cached(i), tokens - 1 - i))
            kv, states = self.kv[i], self.states[i]
            if kv is None or states is None or keep == states.shape[1]:
                continue
            self.kv[i] = None if keep == 0 else (kv[0][:, :, :keep], kv[1][:, :, :keep])
            self.states[i] = None if keep == 0 else states[:, :keep]

    def bytes_per_position(self) -> int:
        """Bytes a position adds at most: its hidden state (the target's features, one
        state per layer read, until fused), and each depth's key, value and state."""
        config = self.heads.config
        element = self.heads.projection.weight.element_size()
        features = len(config.feature_layers or (None,))
        return config.hidden_size * (features + 3 * config.num_heads) * element

    def cached(self, depth: int) -> int:
        """Positions in this depth's cache (0 .. L_i - 1)."""
        states = self.states[depth]
        return 0 if states is None else states.shape[1]

    def nbytes(self) -> int:
        tensors = [t for kv in self.kv if kv is not None for t in kv]
        tensors += [t for t in [self.fused, *self.unfused, *self.states] if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.no_grad()
    def draft(self, context: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A greedy chain of k drafts after context [B, T] (its last token pending).

        Returns the drafts [B, k] (full ids x_T .. x_{T+k-1}) and each depth's logits
        [B, k, V'] at position T-2.
        """
        if not 1 <= k <= len(self.heads.depths):
            raise SpecMTPError(f"cannot draft {k} tokens with {len(self.heads.depths)} MTP depths")
        self._check(context)
        drafts, below, logits = context[:, :0], self.hidden, []
        for i in range(k):
            below, depth_logits, new = self._run(i, below, context, drafts)
            self._commit(i, context, *new)
            logits.append(depth_logits)
            drafts = torch.cat([drafts, self._top(depth_logits, 1)], 1)
        return drafts, torch.stack(logits, dim=1)

    @torch.no_grad()
    def draft_tree(self, context: torch.Tensor, tree: TokenTree) -> DraftedTree:
        """Each tree node's token [B] after context [B, T], by its path of ranks, and the
        path's log-probability under the depths.

        A node's children are the top candidates of the next depth run on that node's own
        path (EAGLE-style), not on the greedy chain. Depth i runs once per level, over all
        of the level's parents stacked along the batch (one forward, not one per parent),
        and its cache takes the committed positions once per level.
        """
        if tree.max_depth > len(self.heads.depths):
            raise SpecMTPError(
                f"the tree is {tree.max_depth} deep; the heads have {len(self.heads.depths)} depths"
            )
        self._check(context)
        batch = context.shape[0]
        tokens: dict[Path, torch.Tensor] = {}
        logprob: dict[Path, torch.Tensor] = {(): torch.zeros(batch, device=context.device)}
        drafted: dict[Path, torch.Tensor] = {(): context[:, :0]}  # [B, len(path)]
        below: dict[Path, torch.Tensor] = {(): self.hidden}  # states the next depth reads
        for i in range(tree.max_depth):
            children = [path for path in tree.paths if len(path) == i + 1]
            parents = list(dict.fromkeys(path[:-1] for path in children))
            states, logits, new = self._run(
                i,
                torch.cat([below[p] for p in parents]),  # [m*B, T-1, H], parent-major
                context.repeat(len(parents), 1),
                torch.cat([drafted[p] for p in parents]),
            )
            width = max(path[-1] for path in children) + 1
            ranked = logits.topk(width, dim=-1).indices  # [m*B, width] draft vocabulary
            top = self.heads.to_full_ids(ranked)
            chance = logits.float().log_softmax(-1).gather(1, ranked)  # [m*B, width]
            for j, parent in enumerate(parents):
                rows = slice(j * batch, (j + 1) * batch)
                for rank in [path[-1] for path in children if path[:-1] == parent]:
                    path = (*parent, rank)
                    tokens[path] = top[rows, rank]
                    logprob[path] = logprob[parent] + chance[rows, rank]
                    drafted[path] = torch.cat([drafted[parent], top[rows, rank : rank + 1]], 1)
                    below[path] = states[rows]
            # the committed part is the same under every parent: the first's
            self._commit(i, context, *(t[:batch] for t in new))
        del logprob[()]
        return DraftedTree(tokens, logprob)

    def _check(self, context: torch.Tensor) -> None:
        last = context.shape[1] - 2  # the last position with a target hidden state
        if self.hidden is None or self.hidden.shape[1] != last + 1:
            known = 0 if self.hidden is None else self.hidden.shape[1]
            raise SpecMTPError(
                f"the MTP cache holds {known} hidden states; the context needs {last + 1}"
            )

    def _run(
        self, i: int, below: torch.Tensor, context: torch.Tensor, drafted: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """Depth i at the positions after its cache up to T-2, after the drafted tokens
        [B', i] of one path per row; below [B', T-1, H] is what it reads at every position.
        B' may be a multiple m of the cache's batch B (m paths stacked, path-major): the
        cache is shared by all of them.

        Returns this depth's states at every position [B', T-1, H] (for depth i+1), its
        logits at T-2 [B', V'], and the new positions' states, keys and values."""
        heads, start, last = self.heads, self.cached(i), context.shape[1] - 2
        tokens = torch.cat([context, drafted], 1)  # x_0 .. x_{T-1+i}
        past, cached = self.kv[i], self.states[i]
        if past is not None and cached is not None and below.shape[0] != cached.shape[0]:
            paths = below.shape[0] // cached.shape[0]
            past = (past[0].repeat(paths, 1, 1, 1), past[1].repeat(paths, 1, 1, 1))
            cached = cached.repeat(paths, 1, 1)
        state, normed, (keys, values) = heads.depths[i](
            below[:, start:], heads.embed(tokens[:, start + 1 + i : last + 2 + i]), past
        )  # state, normed [B', last+1-start, H]; keys, values [B', heads, same, d]
        states = state if cached is None else torch.cat([cached, state], 1)
        return states, heads.projection(normed[:, -1]), (state, keys, values)

    def _top(self, logits: torch.Tensor, width: int) -> torch.Tensor:
        """The top `width` candidates of draft-vocabulary logits [B, V'], as full ids."""
        return self.heads.to_full_ids(logits.topk(width, dim=-1).indices)  # [B, width]

    def _commit(
        self,
        depth: int,
        context: torch.Tensor,
        state: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Cache this depth's new positions with committed inputs (s <= T-2-depth), all but
        the last of them, so that a repeated draft from the same context has one to run."""
        count = max(0, context.shape[1] - 2 - depth - self.cached(depth))
        if count == 0:
            return
        new = (state[:, :count], keys[:, :, :count], values[:, :, :count])
        old_kv, old_states = self.kv[depth], self.states[depth]
        if old_kv is None or old_states is None:
            self.states[depth], self.kv[depth] = new[0], (new[1], new[2])
            return
        self.states[depth] = torch.cat([old_states, new[0]], 1)
        self.kv[depth] = (torch.cat([old_kv[0], new[1]], 2), torch.cat([old_kv[1], new[2]], 2))
