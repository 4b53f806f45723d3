"""How often a model's greedy token at the held-out answer positions of a data cache is the
cached answer's next token, on windows cut to --seq-len (a long sample keeps its last
tokens) and on whole samples only (what `train-mtp --joint` trains and scores on).

    python scripts/heldout_agreement.py --cache runs/heads/data --model default \
        --model runs/joint/model --seq-len 320 --heldout-fraction 0.1

Prints the cache's sample lengths, then one line per model and window rule; JSON last.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

from specmtp.data import DistillCache, iter_batches, split_indices
from specmtp.train_joint import HeldoutAgreement, JointModule, trainable_trunk


def agreement(spec: str, cache: DistillCache, args: argparse.Namespace, whole: bool) -> float:
    trunk = trainable_trunk(spec)
    counter = HeldoutAgreement(JointModule(trunk.model, nn.Identity(), None), lambda b: None)
    with torch.no_grad():
        for batch in iter_batches(
            cache, batch_size=8, seq_len=args.seq_len, seed=None, split="heldout",
            heldout_fraction=args.heldout_fraction, whole=whole,
        ):  # fmt: skip
            counter(batch)
    return counter.rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--seq-len", type=int, default=384)
    parser.add_argument("--heldout-fraction", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cache = DistillCache.open(args.cache)
    lengths = sorted(cache.sample_length(i) for i in range(cache.num_samples))
    held = split_indices(cache, "heldout", args.heldout_fraction)
    fitting = split_indices(cache, "heldout", args.heldout_fraction, args.seq_len)
    summary: dict = {
        "samples": len(lengths),
        "within_seq_len": sum(n <= args.seq_len for n in lengths),
        "length_median": lengths[len(lengths) // 2],
        "length_max": lengths[-1],
        "heldout": len(held),
        "heldout_within_seq_len": len(fitting),
        "agreement": {},
    }
    print({k: v for k, v in summary.items() if k != "agreement"})
    for spec in args.model:
        rates = {rule: agreement(spec, cache, args, rule == "whole") for rule in ("cut", "whole")}
        print(
            f"{spec}: windows cut to {args.seq_len}: {rates['cut']}, whole only: {rates['whole']}"
        )
        summary["agreement"][spec] = rates
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
