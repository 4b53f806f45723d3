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


class GrowingBuffer:
    """A tensor that grows along `dim` into spare capacity, so appending a round's positions
    copies only them (not the whole history, as torch.cat would), and rolling back is a
    length change."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.data: torch.Tensor | None = None
        self.length = 0

    def view(self) -> torch.Tensor | None:
        """The first `length` entries along `dim` (a view), or None when empty."""
        return None if self.data is None or self.length == 0 else self.data.narrow(
            self.dim, 0, self.length
        )  # fmt: skip

    def append(self, new: torch.Tensor) -> None:
        added = new.shape[self.dim]
        if self.data is None or self.length + added > self.data.shape[self.dim]:
            shape = list(new.shape)
            shape[self.dim] = max(64, 2 * (self.length + added))
            grown = new.new_empty(shape)
            if self.data is not None and self.length:
                grown.narrow(self.dim, 0, self.length).copy_(self.view())
            self.data = grown
        self.data.narrow(self.dim, self.length, added).copy_(new)
        self.length += added

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)


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
        self.fused = GrowingBuffer(1)  # [B, L, H]: depth 0's input at h_0 .. h_{L-1}
        self.unfused: list[torch.Tensor] = []  # [B, m, F] each: features added since
        depths = len(self.heads.depths)
        self.keys = [GrowingBuffer(2) for _ in range(depths)]  # each [B, heads, L_i, d]
        self.values = [GrowingBuffer(2) for _ in range(depths)]
        self.states = [GrowingBuffer(1) for _ in range(depths)]  # each [B, L_i, H]

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
                self.fused.append(self.heads.fuse(torch.cat(self.unfused, 1)))
            self.unfused = []
        return self.fused.view()

    def crop(self, tokens: int) -> None:
        """Keep only what depends on the first `tokens` tokens alone: their hidden states
        h_0 .. h_{tokens-1}, and depth i's positions s <= tokens-2-i (s reads x_{s+1+i}).
        For a draft model, whose hidden states cover every token it has read and whose
        fed tokens may be rolled back."""
        self.hidden  # noqa: B018 (fuses what was added, so the crop counts it)
        self.fused.crop(max(0, tokens))
        for i in range(len(self.heads.depths)):
            keep = max(0, min(self.cached(i), tokens - 1 - i))
            for buffer in (self.keys[i], self.values[i], self.states[i]):
                buffer.crop(keep)

    def bytes_per_position(self) -> int:
        """Bytes a position adds at most: its hidden state (the target's features, one
        state per layer read, until fused), and each depth's key, value and state."""
        config = self.heads.config
        element = self.heads.projection.weight.element_size()
        features = len(config.feature_layers or (None,))
        return config.hidden_size * (features + 3 * config.num_heads) * element

    def cached(self, depth: int) -> int:
        """Positions in this depth's cache (0 .. L_i - 1)."""
        return self.states[depth].length

    def past(self, depth: int) -> KV | None:
        """This depth's cached keys and values, each [B, heads, L_i, d], or None."""
        keys, values = self.keys[depth].view(), self.values[depth].view()
        return None if keys is None or values is None else (keys, values)

    def nbytes(self) -> int:
        buffers = [self.fused, *self.keys, *self.values, *self.states]
        tensors = [t for t in (b.view() for b in buffers) if t is not None] + self.unfused
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
        self._catch_up(context)
        drafts, below, logits = context[:, :0], self._first_input(), []
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
        self._catch_up(context)
        batch = context.shape[0]
        tokens: dict[Path, torch.Tensor] = {}
        logprob: dict[Path, torch.Tensor] = {(): torch.zeros(batch, device=context.device)}
        drafted: dict[Path, torch.Tensor] = {(): context[:, :0]}  # [B, len(path)]
        below: dict[Path, torch.Tensor] = {(): self._first_input()}  # what the next depth reads
        for i in range(tree.max_depth):
            children = [path for path in tree.paths if len(path) == i + 1]
            parents = list(dict.fromkeys(path[:-1] for path in children))
            states, logits, new = self._run(
                i,
                torch.cat([below[p] for p in parents]),  # [m*B, n, H], parent-major
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

    def _catch_up(self, context: torch.Tensor) -> None:
        """Run each depth, once for the batch, over the positions after its cache whose
        inputs are all committed but the last one (s < T-2-i), and cache them: the rounds
        then run only the last committed position and the drafts, for every path. Without
        it a 16-node tree's first round ran depth i over the whole prompt once per parent
        (5 times at depth 3): 6 s more time to first token at a 4K-token prompt."""
        last = context.shape[1] - 2
        for i, depth in enumerate(self.heads.depths):
            start, end = self.cached(i), last - i  # positions start .. end-1
            if end - start < 1:
                continue
            if i == 0:
                hidden = self.hidden
                assert hidden is not None  # _check ran
                below = hidden[:, start:end]
            else:
                below = self.states[i - 1].view()[:, start:end]  # cached up to T-2-i
            state, _, (keys, values) = depth(
                below, self.heads.embed(context[:, start + 1 + i : end + 1 + i]), self.past(i)
            )
            self.states[i].append(state)
            self.keys[i].append(keys)
            self.values[i].append(values)

    def _first_input(self) -> torch.Tensor:
        """What depth 0 reads at the positions after its cache: h_s fused, [B, n, H]."""
        hidden = self.hidden
        assert hidden is not None  # _check ran
        return hidden[:, self.cached(0) :]

    def _run(
        self, i: int, below: torch.Tensor, context: torch.Tensor, drafted: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """Depth i at the positions after its cache up to T-2, after the drafted tokens
        [B', i] of one path per row; below [B', n, H] is what it reads at those n positions.
        B' may be a multiple m of the cache's batch B (m paths stacked, path-major): the
        cache is shared by all of them (heads.attend_after reads it once).

        Returns this depth's states at the positions after depth i+1's cache [B', n', H]
        (what depth i+1 reads), its logits at T-2 [B', V'], and the new positions' states,
        keys and values. Only positions a depth has not cached are passed on: the whole
        history, copied per path every round, cost more than the heads' weights at long
        contexts."""
        heads, start, last = self.heads, self.cached(i), context.shape[1] - 2
        tokens = torch.cat([context, drafted], 1)  # x_0 .. x_{T-1+i}
        state, normed, (keys, values) = heads.depths[i](
            below, heads.embed(tokens[:, start + 1 + i : last + 2 + i]), self.past(i)
        )  # state, normed [B', last+1-start, H]; keys, values [B', heads, same, d]
        after = self.cached(i + 1) if i + 1 < len(heads.depths) else start
        if after >= start:
            passed = state[:, after - start :]
        else:  # the next depth's cache ends earlier: it also reads cached states of this one
            cached = self.states[i].view()
            assert cached is not None  # start > after >= 0
            paths = state.shape[0] // cached.shape[0]
            passed = torch.cat([cached[:, after:start].repeat(paths, 1, 1), state], 1)
        return passed, heads.projection(normed[:, -1]), (state, keys, values)

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
        self.states[depth].append(state[:, :count])
        self.keys[depth].append(keys[:, :, :count])
        self.values[depth].append(values[:, :, :count])
