"""How far a jointly trained model (`train-mtp --joint`) strays from the original target.

Both models answer the same prompts greedily (plain decoding, chat template); per prompt,
whether the answers are identical and where they first differ. Prints one line per prompt
and a JSON summary last:

    python scripts/joint_divergence.py --original default --trained runs/joint/model \
        --prompts ../shared/prompts/eval/spec_bench/question.jsonl --per-category 2 \
        --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from specmtp.api import SpecGenerator
from specmtp.prompts import load_prompt_spec


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two answers differ (a shorter one differs where it ends)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--original", default="default")
    parser.add_argument("--trained", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--per-category", type=int, default=None)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    original, trained = SpecGenerator(args.original), SpecGenerator(args.trained)
    prompts = load_prompt_spec(
        args.prompts, limit=args.limit, per_category=args.per_category,
        vocab_size=len(original.target.tokenizer), exclude=[],
    )  # fmt: skip
    firsts: list[int] = []
    identical = 0
    for prompt in prompts:
        ids = original.encode(prompt.text, chat=True)
        a = original.generate(ids, max_new_tokens=args.max_new_tokens).tokens
        b = trained.generate(ids, max_new_tokens=args.max_new_tokens).tokens
        where = first_difference(a, b)
        identical += where is None
        firsts.append(len(a) if where is None else where)
        print(f"{prompt.category}: {'identical' if where is None else f'differs at {where}'}")
    print(json.dumps({
        "prompts": len(prompts), "identical": identical,
        "median_first_difference": statistics.median(firsts),
        "max_new_tokens": args.max_new_tokens,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
