"""Retrieval drafting (REST, He et al. 2023): a datastore of token sequences, usually the
target's own answers, and a drafter that proposes what most often followed the context's
last n tokens there.

The datastore is one int32 array of documents, each followed by a SEPARATOR, and a suffix
index over it: every position sorted by the `max_ngram` tokens that start there (the
separator, -1, sorts first and never matches a token). The n-gram a context ends with is
then a range of that order, found by binary search one column at a time. Its continuation
is built greedily: the token that most often comes next among the range's occurrences,
then, among the occurrences that continue so, the token most often after it, and so on.

Files are safetensors (`tokens`, int32) with the tokenizer's vocabulary digest in the
metadata, so a datastore built for one tokenizer refuses another.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

from specmtp.config import SamplingConfig
from specmtp.drafters import (
    CopyDrafter,
    NgramDrafter,
    Proposal,
    copy_first,
    empty_proposal,
    paths_proposal,
)
from specmtp.errors import SpecMTPError
from specmtp.files import first_line, write_atomically
from specmtp.tree import best_tree

SHIPPED_STORE = "smollm2-135m-store/datastore.safetensors"  # under specmtp/assets
SEPARATOR = -1  # after each document; no token id is negative
FORMAT = "1"
MAX_HITS = 4096  # occurrences read per lookup, evenly spaced: a common n-gram has many
# The store's `min_probability` in `store+SPEC` unless the spec says: below it, SPEC (MTP
# heads) drafts instead. Chosen on held-out training prompts among 0.4, 0.6 and 0.8
# (docs/retrieval-drafting.md); alone, any match beats drafting nothing: 0.
BEFORE_FALLBACK_MIN_PROBABILITY = 0.6


class Datastore:
    """Token sequences and their suffix index, for looking up continuations."""

    def __init__(
        self, documents: Iterable[Sequence[int]], *, vocab_digest: str, max_ngram: int = 4
    ) -> None:
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        parts = [np.append(np.asarray(doc, dtype=np.int64), SEPARATOR) for doc in documents]
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        # the only negative values are the separators, one per document
        if (tokens < 0).sum() != len(parts) or (tokens > np.iinfo(np.int32).max).any():
            raise SpecMTPError("a datastore document holds a token id < 0 or beyond int32")
        tokens = tokens.astype(np.int32)
        self.tokens = tokens  # [L]: the documents, each followed by SEPARATOR
        self.vocab_digest = vocab_digest
        self.max_ngram = max_ngram
        self.documents = len(parts)
        padded = np.concatenate([tokens, np.full(max_ngram, SEPARATOR, dtype=np.int32)])
        starts = np.flatnonzero(tokens != SEPARATOR).astype(np.int32)
        # [max_ngram, P]: column j holds the token j after each start, in suffix order
        columns = np.stack([padded[starts + j] for j in range(max_ngram)])
        order = np.lexsort(columns[::-1])  # sorts by row 0, then row 1, ...
        self._starts = starts[order]
        self._columns = columns[:, order]
        self._padded = padded
        self._radix = int(tokens.max()) + 1 if len(tokens) else 1  # a (node, token) key base

    @property
    def num_tokens(self) -> int:
        return int((self.tokens != SEPARATOR).sum())

    def occurrences(self, ngram: Sequence[int]) -> np.ndarray:
        """Where the tokens right after each occurrence of `ngram` start [hits]."""
        if not 1 <= len(ngram) <= self.max_ngram:
            raise ValueError(f"n-gram length must be 1..{self.max_ngram}, got {len(ngram)}")
        lo, hi = 0, len(self._starts)
        for j, token in enumerate(ngram):  # rows lo:hi agree on columns < j, so j is sorted
            column = self._columns[j, lo:hi]
            lo, hi = (
                lo + int(np.searchsorted(column, token, "left")),
                lo + int(np.searchsorted(column, token, "right")),
            )
            if lo == hi:
                break
        return self._starts[lo:hi] + len(ngram)

    def continuation(
        self,
        context: Sequence[int],
        depth: int,
        *,
        min_ngram: int = 2,
        min_probability: float = 0.0,
    ) -> list[int]:
        """The most frequent continuation, up to `depth` tokens, of the longest suffix of
        `context` (max_ngram down to min_ngram tokens) found in the store, cut where its
        estimated probability falls below `min_probability`; [] if none."""
        for n in range(min(self.max_ngram, len(context)), min_ngram - 1, -1):
            hits = self.occurrences(context[-n:])
            if len(hits):
                return self._most_frequent_path(hits, depth, min_probability)
        return []

    def likeliest_continuations(
        self,
        context: Sequence[int],
        depth: int,
        nodes: int,
        *,
        min_ngram: int = 2,
        min_probability: float = 0.0,
    ) -> dict[tuple[int, ...], float]:
        """The `nodes` likeliest continuations, up to `depth` tokens, of the longest suffix
        of `context` (max_ngram down to min_ngram tokens) found in the store, each with its
        estimated probability: the nodes of a tree (REST's trie), every one's prefixes
        among them. {} if none matches or none reaches `min_probability`."""
        for n in range(min(self.max_ngram, len(context)), min_ngram - 1, -1):
            hits = self.occurrences(context[-n:])
            if len(hits):
                return self._likeliest_prefixes(hits, depth, nodes, min_probability)
        return {}

    def _likeliest_prefixes(
        self, hits: np.ndarray, depth: int, nodes: int, min_probability: float
    ) -> dict[tuple[int, ...], float]:
        """Every prefix of the hits' continuations is a node, its probability estimated as
        the product along it of count / (hits continuing its parent + 1), as in
        _most_frequent_path. A child is always less likely than its parent, so a node below
        the `nodes`-th likeliest found so far cannot be chosen, nor its descendants: dropped
        depth by depth, which keeps common n-grams cheap."""
        if len(hits) > MAX_HITS:
            hits = hits[:: -(-len(hits) // MAX_HITS)]
        found: dict[tuple[int, ...], float] = {}
        paths: list[tuple[int, ...]] = [()]  # each group's path: the hits that follow it
        probability = np.ones(1)  # [groups]
        group = np.zeros(len(hits), dtype=np.int64)  # [hits] the group each hit is in
        for _ in range(depth):
            token = self._padded[hits].astype(np.int64)  # a hit ends at its document's end
            live = token != SEPARATOR
            hits, group, token = hits[live], group[live], token[live]
            if not len(hits):
                break
            keys, first, inverse, counts = np.unique(
                group * self._radix + token,
                return_index=True,
                return_inverse=True,
                return_counts=True,
            )
            parents = group[first]  # [new groups]
            continuing = np.bincount(group, minlength=len(paths))  # [groups]
            chance = probability[parents] * counts / (continuing[parents] + 1)
            floor = min_probability
            pool = np.concatenate([np.fromiter(found.values(), float, len(found)), chance])
            if len(pool) >= nodes:
                floor = max(floor, float(np.partition(pool, -nodes)[-nodes]))
            keep = chance >= floor
            if not keep.any():
                break
            renumber = np.full(len(keys), -1)
            renumber[keep] = np.arange(int(keep.sum()))
            paths = [
                paths[parent] + (int(key % self._radix),)
                for parent, key in zip(parents[keep], keys[keep], strict=True)
            ]
            probability = chance[keep]
            found.update(zip(paths, probability.tolist(), strict=True))
            group = renumber[inverse.reshape(-1)]
            rows = group >= 0
            hits, group = hits[rows] + 1, group[rows]
        chosen = sorted(found, key=lambda path: (-found[path], len(path)))[:nodes]
        return {path: found[path] for path in chosen}

    def _most_frequent_path(
        self, hits: np.ndarray, depth: int, min_probability: float
    ) -> list[int]:
        """Greedy: the likeliest next token among the hits, then among the hits that go on
        so. A token's probability is estimated as count / (hits + 1): one occurrence alone
        is a coin flip, not a certainty; the path's is the product of its tokens'."""
        if len(hits) > MAX_HITS:
            hits = hits[:: -(-len(hits) // MAX_HITS)]
        path: list[int] = []
        probability = 1.0
        for _ in range(depth):
            following = self._padded[hits]  # [hits]: a hit ends at its document's end
            following = following[following != SEPARATOR]
            if not len(following):
                break
            values, counts = np.unique(following, return_counts=True)
            best = int(np.argmax(counts))  # ties: the smallest id
            probability *= counts[best] / (len(following) + 1)
            if probability < min_probability:
                break
            token = int(values[best])
            path.append(token)
            hits = hits[self._padded[hits] == token] + 1
        return path

    def save(self, path: Path | str) -> None:
        """Write the documents as safetensors, atomically; the index is rebuilt at load."""
        metadata = {
            "format": FORMAT,
            "vocab_digest": self.vocab_digest,
            "max_ngram": str(self.max_ngram),
            "documents": str(self.documents),
        }
        final = Path(path)
        write_atomically(
            final,
            lambda temporary: save_file({"tokens": self.tokens}, str(temporary), metadata),
        )

    @classmethod
    def load(cls, path: Path | str, *, vocab_digest: str | None = None) -> Datastore:
        """A saved datastore; with `vocab_digest`, checked to be built for that tokenizer."""
        path = Path(path)
        if not path.is_file():
            raise SpecMTPError(f"no datastore file {path}")
        try:
            with safe_open(str(path), framework="numpy") as handle:
                metadata = handle.metadata() or {}
            tokens = load_file(str(path))["tokens"]
        except (SafetensorError, KeyError, OSError) as exc:
            raise SpecMTPError(f"datastore {path} cannot be read: {first_line(exc)}") from exc
        if metadata.get("format") != FORMAT or tokens.dtype != np.int32 or tokens.ndim != 1:
            raise SpecMTPError(f"{path} is not a specmtp datastore (format {FORMAT})")
        if vocab_digest is not None and metadata.get("vocab_digest") != vocab_digest:
            raise SpecMTPError(
                f"datastore {path} was built for another tokenizer "
                f"(vocabulary {metadata.get('vocab_digest')}, the target's {vocab_digest})"
            )
        ends = np.flatnonzero(tokens == SEPARATOR)
        if len(tokens) and (not len(ends) or ends[-1] != len(tokens) - 1):
            raise SpecMTPError(f"datastore {path} is truncated (its last document has no end)")
        documents = np.split(tokens, ends + 1)[:-1]
        return cls(
            (doc[:-1] for doc in documents),
            vocab_digest=metadata["vocab_digest"],
            max_ngram=int(metadata.get("max_ngram", "4")),
        )


def shipped_store_file() -> Path:
    """The datastore shipped for the default model (its answers to training prompts)."""
    return Path(__file__).parent / "assets" / SHIPPED_STORE


class DatastoreDrafter(CopyDrafter):
    """Prompt lookup first (the context's last 3..2 tokens occurred earlier in it: copied
    text), then the datastore's most frequent continuation of the context's last
    max_ngram..2 tokens (REST), as long as its estimated probability stays at or above
    `min_probability`; with `last_token_lookup`, then what followed the last token's
    previous occurrence in the context (as `ngram` does); nothing when none matches."""

    def __init__(
        self,
        store: Datastore,
        *,
        depth: int = 8,
        min_probability: float = 0.0,
        last_token_lookup: bool = False,
        name: str = "store",
    ) -> None:
        if not 0.0 <= min_probability < 1.0:
            raise SpecMTPError(f"min_probability must be in [0, 1), got {min_probability}")
        self.store = store
        self.depth = depth  # the most tokens looked up; a round takes the first k
        self.min_probability = min_probability
        self.context_lookup = NgramDrafter(max_ngram=3, min_ngram=2)
        self.last_token = NgramDrafter(max_ngram=1) if last_token_lookup else None
        self.name = name
        self.needs_target_hidden = False

    def continuation(self, ids: torch.Tensor) -> torch.Tensor | None:
        """What follows `ids` [L]: its own earlier text, else the store's; None if neither."""
        start = self.context_lookup.match(ids)
        if start is not None:
            return ids[start:]
        suffix = ids[-self.store.max_ngram :].tolist()
        found = self.store.continuation(suffix, self.depth, min_probability=self.min_probability)
        if found:
            return torch.tensor(found, dtype=ids.dtype, device=ids.device)
        return None if self.last_token is None else self.last_token.continuation(ids)


# The tree a store tree drafter's verify passes are timed with (`tree`): what its trees look
# like, a main path with alternatives near the root; only the row count and mask matter.
TIMING_RANK_PROBS = (0.6, 0.2, 0.1, 0.05)


class StoreTreeDrafter(DatastoreDrafter):
    """Retrieval drafting as a token tree (REST verifies a trie of the store's
    continuations): the context's own continuation when it has one (prompt lookup), then
    the store's likeliest continuations of the context's last max_ngram..2 tokens, verified
    in one target forward. A round's γ = k is its node budget as well as its depth: k + 1
    rows to verify, as for a chain of k, so a γ schedule and the cost model T(n) work
    unchanged; `nodes` caps it. A tree that is one path is
    proposed as a chain (a plain forward verifies it); with `last_token_lookup`, the chain
    after the last token's previous occurrence when neither finds anything. Candidates are
    fixed choices: at temperature > 0 they are verified by recursive rejection sampling
    with one-hot q (tree_verification.verify_tree_sampling), which keeps the output
    distribution the target's."""

    def __init__(
        self,
        store: Datastore,
        *,
        nodes: int,
        depth: int = 8,
        min_probability: float = 0.0,
        last_token_lookup: bool = False,
        name: str = "store",
    ) -> None:
        super().__init__(
            store,
            depth=depth,
            min_probability=min_probability,
            last_token_lookup=last_token_lookup,
            name=name,
        )
        if nodes < 1:
            raise SpecMTPError(f"a store tree needs nodes >= 1, got {nodes}")
        self.nodes = nodes
        self.tree = best_tree([TIMING_RANK_PROBS] * depth, nodes)  # for timing T(n) only

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        ids = context[0]  # batch 1: per sequence
        chosen = self.likeliest(ids, min(k, self.depth), min(k, self.nodes))
        if not chosen:
            found = None if self.last_token is None or k == 0 else self.last_token.continuation(ids)
            if found is None:
                return empty_proposal(context.shape[0], context.device)
            return Proposal(found[:k].unsqueeze(0).clone(), None)
        return paths_proposal(chosen, ids.device)

    def likeliest(self, ids: torch.Tensor, depth: int, nodes: int) -> dict[tuple[int, ...], float]:
        """The tree's nodes as token paths with their priority: the copied continuation's
        first, then the store's by estimated probability; `nodes` at most."""
        if depth < 1:
            return {}
        start = self.context_lookup.match(ids)
        copied = () if start is None else tuple(ids[start : start + depth].tolist())
        suffix = ids[-self.store.max_ngram :].tolist()
        stored = self.store.likeliest_continuations(
            suffix, depth, nodes, min_probability=self.min_probability
        )
        return copy_first(copied, stored, nodes)
