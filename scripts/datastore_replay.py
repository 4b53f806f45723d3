"""Replay retrieval drafting over a data cache's greedy answers, without running a model.

A greedy answer is the target's argmax at every position, so the tokens a chain draft
would get accepted are its common prefix with the rest of the answer: this replays
`DatastoreDrafter` (prompt lookup, then the store) round by round at a fixed γ and prints
τ, drafted tokens per round and acceptance per drafted token, per `--min-p`. Exact for a
cache answered by the target in the dtype the decoder runs; use held-out prompts, not the
ones the store was built from.

    python scripts/datastore_replay.py --store store.safetensors --cache runs/heldout/data \\
        --gamma 3 --min-p 0,0.3,0.6
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specmtp.config import SamplingConfig
from specmtp.data import DistillCache
from specmtp.datastore import Datastore, DatastoreDrafter, StoreTreeDrafter
from specmtp.drafters import Proposal


def accepted_length(proposal: Proposal, truth: torch.Tensor) -> int:
    """How many drafts greedy verification keeps: a chain's common prefix with the truth,
    a tree's longest root-to-node path that matches it."""
    draft = proposal.tokens[0]
    if proposal.tree is None:
        return int(torch.cumprod(draft[: len(truth)] == truth[: len(draft)], 0).sum())
    best = 0
    for node, path in enumerate(proposal.tree.paths):
        nodes = proposal.tree.path_table[node, : len(path)]
        if len(path) <= len(truth) and bool((draft[nodes] == truth[: len(path)]).all()):
            best = max(best, len(path))
    return best


def replay(drafter: DatastoreDrafter, cache: DistillCache, gamma: int) -> dict[str, float]:
    rounds = committed = drafted = 0
    for index in range(cache.num_samples):
        sample = cache.sample(index)
        ids, mask = sample["input_ids"].long(), sample["loss_mask"]
        position = int(mask.nonzero()[0])  # the first answer token
        while position < len(ids):
            proposal = drafter.propose(ids[None, :position], gamma, SamplingConfig(), None)
            accepted = accepted_length(proposal, ids[position : position + gamma])
            rounds, drafted = rounds + 1, drafted + proposal.tokens.shape[1]
            committed += accepted + 1
            position += accepted + 1
    return {
        "tau": committed / rounds,
        "drafted_per_round": drafted / rounds,
        "accepted_per_drafted": (committed - rounds) / max(drafted, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--cache", type=Path, required=True, help="held-out greedy answers")
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--min-p", default="0", help="comma-separated, e.g. 0,0.3,0.6")
    parser.add_argument(
        "--last-token-lookup", action="store_true",
        help="after the store, the context's last token (what `--draft store` alone does)",
    )  # fmt: skip
    parser.add_argument(
        "--nodes",
        default="0",
        help="comma-separated tree sizes; 0: a chain (what --draft store#nodes=N drafts)",
    )
    args = parser.parse_args()
    store = Datastore.load(args.store)
    cache = DistillCache.open(args.cache)
    print(f"{store.documents} documents, {store.num_tokens} tokens; {cache.num_samples} answers")
    for min_p in (float(p) for p in args.min_p.split(",")):
        for nodes in (int(n) for n in args.nodes.split(",")):
            options = {"min_probability": min_p, "last_token_lookup": args.last_token_lookup}
            drafter = (
                StoreTreeDrafter(store, nodes=nodes, **options)
                if nodes
                else DatastoreDrafter(store, **options)
            )
            found = replay(drafter, cache, args.gamma)
            print(
                f"gamma {args.gamma} min-p {min_p} nodes {nodes or 'chain'}: "
                + ", ".join(f"{k} {v:.3f}" for k, v in found.items())
            )


if __name__ == "__main__":
    main()
