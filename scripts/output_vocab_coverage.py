"""How much of a target's answers a reduced output vocabulary of N tokens covers: the first N
ids (`MODEL#vocab=N`, output_vocab.py) against the N tokens most frequent in other answers
(FR-Spec's ranking, filled up with the first ids), on answers held out of that count. Reads
a `distill --data-only` cache (the target's answers to training prompts). docs/draft-models.md
("One copy of a draft per form") has the Qwen pair's figures.

    python scripts/output_vocab_coverage.py --cache ~/.cache/specmtp/runs/qwen15-data
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from itertools import pairwise
from pathlib import Path

import torch
from safetensors.torch import load_file


def answers(cache: Path) -> list[list[int]]:
    """Each sample's answer tokens (the positions its loss mask marks)."""
    manifest = json.loads((cache / "manifest.json").read_text())
    found = []
    for shard in manifest["shards"]:
        tensors = load_file(cache / shard["file"])
        offsets = tensors["offsets"].tolist()
        ids, mask = tensors["input_ids"], tensors["loss_mask"].bool()
        for start, end in pairwise(offsets):
            found.append(ids[start:end][mask[start:end]].tolist())
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--held-out", type=int, default=40, help="answers left out of the count")
    parser.add_argument("--sizes", type=int, nargs="+", default=[16384, 32768, 65536])
    args = parser.parse_args()
    samples = answers(args.cache)
    order = list(range(len(samples)))
    random.Random(0).shuffle(order)
    held, counted = order[: args.held_out], order[args.held_out :]
    counts = Counter(t for i in counted for t in samples[i])
    test = torch.tensor([t for i in held for t in samples[i]])
    ranked = [token for token, _ in counts.most_common()]
    result = {"answers": len(samples), "counted_tokens": sum(counts.values()),
              "distinct": len(counts), "held_out_tokens": len(test)}  # fmt: skip
    for size in args.sizes:
        kept = set(ranked[:size])
        fill = (t for t in range(2 * size) if t not in kept)  # the first ids not yet kept
        kept |= {next(fill) for _ in range(size - len(kept))}
        frequent = torch.tensor([t in kept for t in test.tolist()])
        result[f"first_{size}"] = round((test < size).float().mean().item(), 4)
        result[f"frequent_{size}"] = round(frequent.float().mean().item(), 4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
