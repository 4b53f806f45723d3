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
predicts x_{s+2+i}. Positions s < P_i = T-2-i read committed tokens only: depth i caches
them (its "catch-up"). Positions P_i .. T-2 (i+1 of them) are run for each drafted path:
the first reads committed tokens too but is left uncached, so that every path has at least
one position to run; the others read the path's drafts, so the cache never holds a guess.
At s = T-2, depth i proposes d_{i+1} = x_{T+i}.

One forward per depth and round. The catch-up positions and every path's positions are
packed along the sequence, after the cached ones, with a mask: catch-up positions attend
causally to the cache and to each other, a path's positions to the cache, the catch-up and
their own path. The cache's tensors grow into spare capacity (`GrowingBuffer`): the new keys
and values are written once after the cached ones and the attention reads the buffer in
place, so a round copies its new positions only, never the history (drafting a 16-node tree
at a 4K-token context copied about 370 MB a round when each path got its own copy).
History window. The depths attend to the positions from a base on, not from 0. When the
last position is two windows past the base (one, with nothing cached: after a prompt), the
base moves to one window before it and the depths' caches are rebuilt from there (a
catch-up of one window per depth, once per window of new tokens). This bounds a round's
attention, and the first round after a long prompt, which would otherwise run every depth
over the whole prompt; and it keeps the depths near
the lengths they were trained on (320 tokens; without positions, attention over far longer
sequences is not what they learnt). The target's fused states are kept from position 0.
What it computes at s = T-2 is exactly what `forward_all` computes on the sequence
x_base .. x_{T-1}, d_1 .. d_k (tests/test_mtp_cache.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specmtp.errors import SpecMTPError
from specmtp.heads import Attend, SequentialMTP
from specmtp.tree import Path, TokenTree

HISTORY_WINDOW = 1024  # positions: how far back the depths attend, at least (module docstring)
_MIN_CAPACITY = 16  # positions a buffer starts with (it then grows by half)


class GrowingBuffer:
    """A tensor that grows along one dimension into spare capacity (nanochat's KV cache):
    appending copies only the new slices, and rolling back is a length change. Slices
    written past the length are scratch until committed."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.data: torch.Tensor | None = None
        self.length = 0

    def view(self, extra: int = 0) -> torch.Tensor | None:
        """The first `length + extra` slices (a view, not a copy)."""
        if self.data is None:
            return None
        return self.data.narrow(self.dim, 0, self.length + extra)

    def write(self, values: torch.Tensor) -> None:
        """Put values just past the length, uncommitted; growing copies the committed part."""
        need = self.length + values.shape[self.dim]
        if self.data is None or self.data.shape[self.dim] < need:
            shape = list(values.shape)
            held = 0 if self.data is None else self.data.shape[self.dim]
            shape[self.dim] = max(need, held + held // 2, _MIN_CAPACITY)
            grown = values.new_empty(shape)
            if self.data is not None:
                grown.narrow(self.dim, 0, self.length).copy_(self.view())
            self.data = grown
        self.data.narrow(self.dim, self.length, values.shape[self.dim]).copy_(values)

    def commit(self, count: int) -> None:
        self.length += count

    def append(self, values: torch.Tensor) -> None:
        self.write(values)
        self.commit(values.shape[self.dim])

    def crop(self, length: int) -> None:
        self.length = max(0, min(self.length, length))

    def nbytes(self) -> int:
        """Bytes held, spare capacity included."""
        return 0 if self.data is None else self.data.numel() * self.data.element_size()


@dataclass(frozen=True)
class DraftedTree:
    """A drafted tree: each path's token [B], and the log-probability [B] (float32) the
    depths gave the path's tokens, each given the ones before it (a dynamic tree keeps the
    likeliest paths)."""

    tokens: dict[Path, torch.Tensor]
    logprob: dict[Path, torch.Tensor]


@dataclass(frozen=True)
class _Parent:
    """A drafted path that the next depth extends: its drafts [B, i] (x_T .. x_{T+i-1})
    and what depth i-1 computed on it, its states at the last positions up to T-2 [B, n, H]
    (none for depth 0, which reads the target's own states)."""

    drafted: torch.Tensor
    tail: torch.Tensor | None


class SequentialDraftCache:
    """Per-depth keys, values and states of the committed positions, for one batch of
    sequences of equal length."""

    def __init__(self, heads: SequentialMTP, *, window: int | None = HISTORY_WINDOW) -> None:
        if window is not None and window < len(heads.depths):
            raise SpecMTPError(
                f"an MTP history window must be >= {len(heads.depths)}, got {window}"
            )
        self.heads = heads
        self.window = window
        self.reset()

    def reset(self) -> None:
        self.base = 0  # the first position the depths attend to (module docstring)
        self.fused = GrowingBuffer(1)  # [B, L, H]: depth 0's input at h_0 .. h_{L-1}
        self.unfused: list[torch.Tensor] = []  # [B, m, F] each: features added since
        depths = range(len(self.heads.depths))
        self.keys = [GrowingBuffer(2) for _ in depths]  # each [B, heads, L_i, d]
        self.values = [GrowingBuffer(2) for _ in depths]
        self.states = [GrowingBuffer(1) for _ in depths]  # each [B, L_i, H]

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
        _ = self.hidden  # fuse what is pending, so that it is cropped too
        self.fused.crop(tokens)
        for i in range(len(self.heads.depths)):
            self._crop_depth(i, tokens - 1 - i - self.base)

    def bytes_per_position(self) -> int:
        """Bytes a position may hold at most: its hidden state (the target's features, one
        state per layer read, until fused), and each depth's key, value and state, twice
        over: a buffer grows by half when full, and holds a round's scratch besides."""
        config = self.heads.config
        element = self.heads.embed_weight.element_size()  # the states' dtype (int8 drafts too)
        features = len(config.feature_layers or (None,))
        return 2 * config.hidden_size * (features + 3 * config.num_heads) * element

    def cached(self, depth: int) -> int:
        """Positions in this depth's cache (base .. base + L_i - 1)."""
        return self.states[depth].length

    def nbytes(self) -> int:
        buffers = [self.fused, *self.keys, *self.values, *self.states]
        pending = sum(t.numel() * t.element_size() for t in self.unfused)
        return pending + sum(b.nbytes() for b in buffers)

    @torch.no_grad()
    def draft(self, context: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A greedy chain of k drafts after context [B, T] (its last token pending).

        Returns the drafts [B, k] (full ids x_T .. x_{T+k-1}) and each depth's logits
        [B, k, V'] at position T-2.
        """
        if not 1 <= k <= len(self.heads.depths):
            raise SpecMTPError(f"cannot draft {k} tokens with {len(self.heads.depths)} MTP depths")
        self._check(context)
        parent, logits = _Parent(context[:, :0], None), []
        for i in range(k):
            tails, depth_logits = self._level(i, context, [parent])
            logits.append(depth_logits[0])
            drafted = torch.cat([parent.drafted, self._top(depth_logits[0], 1)], 1)
            parent = _Parent(drafted, tails[0])
        return parent.drafted, torch.stack(logits, dim=1)

    @torch.no_grad()
    def draft_tree(self, context: torch.Tensor, tree: TokenTree) -> DraftedTree:
        """Each tree node's token [B] after context [B, T], by its path of ranks, and the
        path's log-probability under the depths.

        A node's children are the top candidates of the next depth run on that node's own
        path (EAGLE-style), not on the greedy chain. Depth i runs once per level, over all
        of the level's parents packed along the sequence (one forward, not one per parent).
        """
        if tree.max_depth > len(self.heads.depths):
            raise SpecMTPError(
                f"the tree is {tree.max_depth} deep; the heads have {len(self.heads.depths)} depths"
            )
        self._check(context)
        batch = context.shape[0]
        tokens: dict[Path, torch.Tensor] = {}
        logprob: dict[Path, torch.Tensor] = {(): torch.zeros(batch, device=context.device)}
        parents: dict[Path, _Parent] = {(): _Parent(context[:, :0], None)}
        for i in range(tree.max_depth):
            children = [path for path in tree.paths if len(path) == i + 1]
            level = list(dict.fromkeys(path[:-1] for path in children))
            tails, logits = self._level(i, context, [parents[p] for p in level])  # [m, B, V']
            width = max(path[-1] for path in children) + 1
            ranked = logits.topk(width, dim=-1).indices  # [m, B, width] draft vocabulary
            top = self.heads.to_full_ids(ranked)
            chance = logits.float().log_softmax(-1).gather(-1, ranked)  # [m, B, width]
            for j, parent in enumerate(level):
                for rank in [path[-1] for path in children if path[:-1] == parent]:
                    path = (*parent, rank)
                    tokens[path] = top[j, :, rank]
                    logprob[path] = logprob[parent] + chance[j, :, rank]
                    drafted = torch.cat([parents[parent].drafted, top[j, :, rank : rank + 1]], 1)
                    parents[path] = _Parent(drafted, tails[j])
        del logprob[()]
        return DraftedTree(tokens, logprob)

    def _check(self, context: torch.Tensor) -> None:
        last = context.shape[1] - 2  # the last position with a target hidden state
        if self.hidden is None or self.hidden.shape[1] != last + 1:
            known = 0 if self.hidden is None else self.hidden.shape[1]
            raise SpecMTPError(
                f"the MTP cache holds {known} hidden states; the context needs {last + 1}"
            )
        self._place_window(last)

    def _place_window(self, last: int) -> None:
        """Move the base to `window` positions before the last one when the history has
        grown to twice the window, or to more than one with nothing cached (after a prompt:
        its first round runs one window, not the whole prompt), or when a crop left it past
        what the deepest depth may run (base <= T-1-K); the caches then start from it."""
        if self.window is None:
            return
        depths = range(len(self.heads.depths))
        limit = self.window if all(self.cached(i) == 0 for i in depths) else 2 * self.window
        if last - self.base > limit or self.base > last + 1 - len(depths):
            base = max(0, last - self.window)
            if base != self.base:
                self.base = base
                for i in depths:
                    self._crop_depth(i, 0)

    def _crop_depth(self, i: int, length: int) -> None:
        for buffer in (self.keys[i], self.values[i], self.states[i]):
            buffer.crop(length)

    def _level(
        self, i: int, context: torch.Tensor, parents: list[_Parent]
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Depth i, one forward: its catch-up positions (cached here) and, for each of m
        parent paths, the positions P_i .. T-2 (n of them), packed in that order.

        Returns each parent's states at its n positions ([B, n, H] each, what depth i+1
        reads on the parent's children) and the parents' logits at T-2 [m, B, V']."""
        t, base = context.shape[1], self.base
        first = max(base, t - 2 - i)  # P_i; a short context clamps it
        self._crop_depth(i, first - base)  # a draft model's crop may have kept more
        start, m, n = base + self.cached(i), len(parents), t - 1 - first
        # What depth i reads at each position: the target's (fused) states, held from
        # position 0, or depth i-1's, held from the base.
        source, offset = (self.hidden, 0) if i == 0 else (self.states[i - 1].view(), base)
        assert source is not None and source.shape[1] >= first - offset, "depth i-1 is behind"
        catch_up = first - start
        below = [source[:, start - offset : first - offset]]
        tokens = [context[:, start + 1 + i : first + 1 + i]]
        for parent in parents:
            tail = parent.tail if parent.tail is not None else source[:, :0]
            below.append(
                torch.cat([source[:, first - offset : t - 1 - tail.shape[1] - offset], tail], 1)
            )
            # x_{first+1+i} .. x_{T-1+i}: the context's last n tokens and the path's drafts
            tokens.append(torch.cat([context[:, first + 1 :], parent.drafted], 1)[:, i : i + n])
        # A chain's one path reads what a causal mask shows it: one attention for all rows.
        mask = None if m == 1 else _path_mask(first - base, m, n, context.device)
        attend = self._attend(i, catch_up, mask)
        state, normed = self.heads.depths[i](
            torch.cat(below, 1), self.heads.embed(torch.cat(tokens, 1)), attend
        )  # each [B, catch_up + m*n, H]
        self.keys[i].commit(catch_up)
        self.values[i].commit(catch_up)
        self.states[i].append(state[:, :catch_up])
        paths = state[:, catch_up:].unflatten(1, (m, n))  # [B, m, n, H]
        logits = self.heads.projection(normed[:, catch_up:].unflatten(1, (m, n))[:, :, -1])
        return list(paths.unbind(1)), logits.transpose(0, 1)  # m x [B, n, H]; [m, B, V']

    def _attend(self, i: int, catch_up: int, path_mask: torch.Tensor | None) -> Attend:
        """Depth i's attention: the new positions' keys and values go into its buffers
        just past the cached ones, uncommitted, and the queries read the buffers in place.
        The catch-up positions attend causally to the cache and each other; the paths'
        positions through `path_mask` (None: one path, causal with the rest)."""
        keys, values = self.keys[i], self.values[i]

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys.write(k)
            values.write(v)
            new = k.shape[2]  # q, k, v: [B, heads, catch_up + m*n, d]
            if path_mask is None:
                return _causal(q, keys.view(new), values.view(new))
            now = _causal(q[:, :, :catch_up], keys.view(catch_up), values.view(catch_up))
            ahead = (q[:, :, catch_up:], keys.view(new), values.view(new))
            paths = F.scaled_dot_product_attention(*ahead, attn_mask=path_mask)
            return torch.cat([now, paths], 2)  # [B, heads, catch_up + m*n, d]

        return attend

    def _top(self, logits: torch.Tensor, width: int) -> torch.Tensor:
        """The top `width` candidates of draft-vocabulary logits [B, V'], as full ids."""
        return self.heads.to_full_ids(logits.topk(width, dim=-1).indices)  # [B, width]


def _causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Attention of the last n positions (q [B, heads, n, d]) to keys and values [B, heads,
    L + n, d], query j seeing keys up to L + j; without a mask when L = 0 (after a prompt,
    the one long run, where a mask would cost an L x L tensor)."""
    n, length = q.shape[2], keys.shape[2]
    if n == 0:
        return q
    if length == n:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True)
    mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def _path_mask(before: int, paths: int, n: int, device: torch.device) -> torch.Tensor:
    """Which keys each path's positions may read [paths*n, before + paths*n] (True: may):
    the `before` positions (cached and caught up), then their own path's causally."""
    own = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    mask = torch.zeros(paths * n, before + paths * n, dtype=torch.bool, device=device)
    mask[:, :before] = True
    for j in range(paths):
        at = j * n
        mask[at : at + n, before + at : before + at + n] = own
    return mask
