"""Token trees: one target forward scores a whole tree of drafts (Medusa, EAGLE, SpecInfer).

A multi-token-prediction drafter proposes, for each of the next D positions, a few candidate
tokens. A tree arranges them: the root is the pending last committed token, and every
root-to-node path is one draft continuation. One forward with a tree attention mask (each
token sees the past and its own ancestors only) and position ids = past length + depth
gives the target's logits after every node at once.

Positions in the verify pass: 0 is the root, node i is at position i + 1. Which path is
accepted, greedy or sampled, is decided in `specmtp.tree_verification`.

Round, for batch size 1 (`past` = cache length, the root pending as in `specmtp.decode`):
    node_tokens = build_tree_tokens(tree, candidates)                   # [B, N]
    logits = tree_forward(target, tree, context[:, -1:], node_tokens)   # [B, N+1, V]
    verdict = verify_tree_greedy(tree, node_tokens, logits)  # tree_verification
    commit_tree_path(target, past, verdict.accepted_path(0))
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path as FilePath

import torch
from transformers import PreTrainedModel

from specmtp.cache import CachedModel
from specmtp.errors import SpecMTPError
from specmtp.invariant import ATTENTION as ROW_INVARIANT_ATTENTION

Path = tuple[int, ...]  # child ranks from the root: (0, 1) = 2nd candidate under the 1st
Candidates = Sequence[torch.Tensor] | Mapping[Path, torch.Tensor]

# Attention implementations that add a custom 4-D float mask to the scores as given. Flash
# attention reads a mask as padding only, so a tree mask would be silently ignored.
TREE_ATTENTION = ("eager", "sdpa", ROW_INVARIANT_ATTENTION)


TREE_FILE = "tree.json"  # the tree shipped beside a set of MTP heads


@dataclass(frozen=True)
class TokenTree:
    """A tree shape as data: root-to-node paths of child ranks (Medusa's `medusa_choices`).

    `TokenTree([(0,), (1,), (0, 0)])`: top-1 and top-2 candidates at depth 1, and the top-1
    candidate at depth 2 under the first. Nodes are ordered by depth, then lexicographically;
    everything else is derived from the paths once, here.
    """

    paths: tuple[Path, ...]
    parents: tuple[int, ...] = field(init=False, repr=False, compare=False)  # [N] position
    depths: tuple[int, ...] = field(init=False, repr=False, compare=False)  # [N] 1..D
    # [N+1, C] child node indices of each position in rank order, -1 padded
    children: torch.Tensor = field(init=False, repr=False, compare=False)
    # [N+1, N+1] bool: [i, j] when position j is position i or one of its ancestors
    ancestor_mask: torch.Tensor = field(init=False, repr=False, compare=False)
    # [N, D] node indices on each node's root-to-node path, root excluded, -1 padded
    path_table: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        paths = _validated_paths(self.paths)
        index = {path: i for i, path in enumerate(paths)}
        parents = tuple(index[p[:-1]] + 1 if len(p) > 1 else 0 for p in paths)
        n, depth = len(paths), len(paths[-1])
        ancestors = torch.eye(n + 1, dtype=torch.bool)
        for i, parent in enumerate(parents):  # parents come first in node order
            ancestors[i + 1] |= ancestors[parent]
        kids = [[i for i, parent in enumerate(parents) if parent == pos] for pos in range(n + 1)]
        width = max(len(k) for k in kids)
        children = torch.tensor([k + [-1] * (width - len(k)) for k in kids])
        table = [[index[p[:d]] for d in range(1, len(p) + 1)] for p in paths]
        path_table = torch.tensor([row + [-1] * (depth - len(row)) for row in table])
        for name, value in [
            ("paths", paths),
            ("parents", parents),
            ("depths", tuple(len(p) for p in paths)),
            ("children", children),
            ("ancestor_mask", ancestors),
            ("path_table", path_table),
        ]:
            object.__setattr__(self, name, value)

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return self.depths[-1]

    def pruned(self, max_depth: int) -> TokenTree:
        """The nodes at depth <= max_depth: for a round near the token or context budget."""
        return TokenTree(tuple(p for p in self.paths if len(p) <= max_depth))

    def to_json(self) -> str:
        return json.dumps([list(p) for p in self.paths])

    @classmethod
    def from_json(cls, text: str) -> TokenTree:
        try:
            paths = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecMTPError(f"a token tree must be JSON (a list of lists): {e}") from e
        if not isinstance(paths, list) or not all(isinstance(p, list) for p in paths):
            raise SpecMTPError("a token tree must be a JSON list of lists of child ranks")
        return cls(tuple(tuple(p) for p in paths))

    @classmethod
    def load(cls, path: str | FilePath) -> TokenTree:
        try:
            text = FilePath(path).read_text()
        except OSError as e:
            raise SpecMTPError(f"cannot read token tree {path}: {e.strerror or e}") from e
        return cls.from_json(text)

    def save(self, path: str | FilePath) -> None:
        FilePath(path).write_text(self.to_json() + "\n")


def _validated_paths(paths: Sequence[Sequence[int]]) -> tuple[Path, ...]:
    """Paths as tuples in node order; SpecMTPError unless they form a non-empty tree."""
    normalised = [tuple(p) for p in paths]
    if not normalised:
        raise SpecMTPError("a token tree needs at least one node")
    for path in normalised:
        if not path or not all(type(r) is int and r >= 0 for r in path):
            raise SpecMTPError(f"tree path {list(path)}: needs one or more ranks, ints >= 0")
    if len(set(normalised)) != len(normalised):
        raise SpecMTPError("the token tree lists a path twice")
    present = set(normalised)
    for path in normalised:
        if len(path) > 1 and path[:-1] not in present:
            raise SpecMTPError(f"tree path {list(path)} has no parent {list(path[:-1])}")
    return tuple(sorted(normalised, key=lambda p: (len(p), p)))


def build_tree_tokens(tree: TokenTree, candidates: Candidates) -> torch.Tensor:
    """The token of every node: [B, N].

    candidates: either per-depth candidates, `candidates[d]` [B, K_d] in rank order for depth
    d + 1 (Medusa heads: a node's token depends on its depth and rank only), or a mapping from
    each path to its tokens [B] (drafters whose candidates depend on the parent, like EAGLE).
    """
    if isinstance(candidates, Mapping):
        missing = [list(p) for p in tree.paths if p not in candidates]
        if missing:
            raise SpecMTPError(f"no candidate tokens for tree paths {missing}")
        return torch.stack([candidates[p] for p in tree.paths], 1)
    if len(candidates) < tree.max_depth:
        raise SpecMTPError(f"the tree is {tree.max_depth} deep; {len(candidates)} depths drafted")
    for path in tree.paths:
        if path[-1] >= candidates[len(path) - 1].shape[1]:
            raise SpecMTPError(
                f"tree path {list(path)} needs {path[-1] + 1} candidates at depth {len(path)}, "
                f"got {candidates[len(path) - 1].shape[1]}"
            )
    return torch.stack([candidates[len(p) - 1][:, p[-1]] for p in tree.paths], 1)


def tree_attention_inputs(
    tree: TokenTree, past_length: int, *, dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The additive mask [1, 1, N+1, past+N+1] and position ids [1, N+1] of a tree forward.

    The mask is 0 where a position may attend (every past position, then its tree ancestors
    and itself) and the dtype's minimum elsewhere, as transformers builds its own. A boolean
    mask would do for SDPA but eager attention adds it to the scores, so it must be float.
    """
    if not dtype.is_floating_point:
        raise SpecMTPError(f"a tree attention mask must be a float dtype, got {dtype}")
    n = tree.num_nodes
    allowed = torch.cat(
        [torch.ones(n + 1, past_length, dtype=torch.bool), tree.ancestor_mask], 1
    ).to(device)  # [N+1, past+N+1]
    positions = past_length + torch.tensor((0, *tree.depths), device=device)  # [N+1]
    return additive_mask(allowed, dtype)[None, None], positions[None]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool [q, kv] -> the additive float mask [q, kv]: 0 where allowed, the dtype's minimum
    elsewhere, as transformers builds its own (eager attention adds it to the scores)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )


def check_tree_attention(model: PreTrainedModel) -> None:
    """Refuse models whose attention would not apply a custom 4-D mask as given."""
    implementation = model.config._attn_implementation
    if implementation not in TREE_ATTENTION:
        raise SpecMTPError(
            f"tree verification needs an attention that applies a 4-D mask "
            f"({', '.join(TREE_ATTENTION)}); this model uses {implementation!r}"
        )


@torch.inference_mode()
def tree_forward(
    target: CachedModel, tree: TokenTree, root: torch.Tensor, node_tokens: torch.Tensor
) -> torch.Tensor:
    """Append the root [B, 1] and the tree's tokens [B, N]; return logits [B, N+1, V].

    Row i scores the token after position i. The cache grows by N + 1 positions; follow with
    `commit_tree_path` to keep the root and the accepted path only.
    """
    check_tree_attention(target.model)
    mask, positions = tree_attention_inputs(
        tree, target.length, dtype=target.model.dtype, device=root.device
    )
    tokens = torch.cat([root, node_tokens], 1)  # [B, N+1]
    return target.forward(tokens, attention_mask=mask, position_ids=positions)


def commit_tree_path(target: CachedModel, past_length: int, path_nodes: Sequence[int]) -> None:
    """After `tree_forward` at `past_length`, keep the root and the accepted path's positions.

    All rows of the batch keep the same path. The token drawn after the path is not in the
    cache: it is the next round's root.
    """
    kept = [past_length] + [past_length + 1 + node for node in path_nodes]
    if any(b <= a for a, b in pairwise(kept)) or kept[-1] >= target.length:
        raise SpecMTPError(
            f"path {list(path_nodes)} is not a tree path in the {target.length - past_length} "
            "positions of the last tree forward"
        )
    target.keep(past_length, torch.tensor(kept))


def best_tree(rank_probs: Sequence[Sequence[float]], budget: int) -> TokenTree:
    """The tree of `budget` nodes with the largest expected accepted length (Medusa's greedy
    construction): rank_probs[d][r] is how often the rank-r candidate of depth d+1 is the
    right token, measured on held-out data. A path's chance is the product along it,
    assuming depths independent; since a child's chance is below its parent's, adding the
    likeliest frontier node each time yields the best tree for every budget.
    """
    if budget < 1 or not rank_probs or not rank_probs[0]:
        raise SpecMTPError("a tree needs a budget >= 1 and rank probabilities for depth 1")
    chosen: list[tuple[int, ...]] = []
    frontier = {(r,): rank_probs[0][r] for r in range(len(rank_probs[0]))}
    while frontier and len(chosen) < budget:
        path = max(frontier, key=lambda p: (frontier[p], [-x for x in p]))
        chance = frontier.pop(path)
        chosen.append(path)
        if len(path) < len(rank_probs):
            for r, prob in enumerate(rank_probs[len(path)]):
                frontier[(*path, r)] = chance * prob
    return TokenTree(tuple(chosen))


def likeliest_subtree(logprob: Mapping[Path, float], budget: int) -> TokenTree:
    """The `budget` likeliest nodes of a drafted tree, by the drafter's own log-probability
    of each path (a dynamic tree, as in EAGLE-2): the same greedy frontier as `best_tree`,
    but per round and from this round's drafts, so a confident depth grows the tree deeper
    and an unsure one wider. Only a node's parent must be in the drafted tree; the
    choice reads the drafts alone, so verification stays exact at any temperature.
    """
    if budget < 1:
        raise SpecMTPError(f"a dynamic tree needs a budget >= 1, got {budget}")
    children: dict[Path, list[Path]] = {}
    for path in logprob:
        children.setdefault(path[:-1], []).append(path)
    chosen: list[Path] = []
    frontier = {path: logprob[path] for path in children.get((), [])}
    while frontier and len(chosen) < budget:
        path = max(frontier, key=lambda p: (frontier[p], [-x for x in p]))
        del frontier[path]
        chosen.append(path)
        frontier.update({child: logprob[child] for child in children.get(path, [])})
    return TokenTree(tuple(chosen))
