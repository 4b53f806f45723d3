"""How often draft models agree with the target's own greedy answers, per group,
teacher-forced: the target answers each prompt greedily (plain decoding, in --dtype), then
each draft reads prompt and answer in one forward and its argmax at every position that
predicts an answer token is compared with that token. This is the acceptance a one-token
chain (`DRAFT@1`) would see if every draft step had the same context.

    python scripts/draft_agreement.py --prompts PROMPTS.jsonl --max-new-tokens 64 \
        --draft distilled --draft draft:DIR [--dtype bfloat16]

Used in docs/draft-models.md to choose between drafts on held-out training-source prompts
(never on evaluation prompts).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from specmtp import bench, bench_runners
from specmtp.config import GenerationConfig
from specmtp.draft_model import DraftLM, load_draft, shipped_drafts_dir
from specmtp.models import DTYPES, load_model


def agreement(draft: DraftLM, ids: list[int], prompt_len: int) -> tuple[int, int]:
    """(hits, rows) over the rows predicting an answer token: row t predicts ids[t + 1]."""
    x = torch.tensor([ids])
    with torch.no_grad():
        predicted = draft(x, use_cache=False).logits[0].argmax(-1)
    rows = list(range(prompt_len - 1, len(ids) - 1))
    truth = x[0, [t + 1 for t in rows]]
    return int((predicted[rows] == truth).sum()), len(rows)


def draft_dir(spec: str) -> str:
    """`draft:DIR` or the name of a shipped draft."""
    return spec.removeprefix("draft:") if spec.startswith("draft:") else str(
        shipped_drafts_dir() / spec
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--limit", type=int)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--draft", action="append", required=True, help="repeatable")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = load_model("default", dtype=DTYPES[args.dtype])
    drafts = [load_draft(draft_dir(s), target=target.model).eval() for s in args.draft]
    base = GenerationConfig(max_new_tokens=args.max_new_tokens)
    ar = bench_runners.build_runner("ar", target, base)
    selection = bench.BenchConfig(prompts=(args.prompts,), limit=args.limit)
    counts: dict[str, list[list[int]]] = defaultdict(lambda: [[0, 0] for _ in drafts])
    for prompt in bench._load_prompts(selection, target):
        ids = bench._encode(ar.gen, prompt)
        answer, _ = ar.run(ids, base)
        scores = [agreement(draft, ids + answer, len(ids)) for draft in drafts]
        for group in (prompt.group, "all"):
            for k, (hits, rows) in enumerate(scores):
                counts[group][k][0] += hits
                counts[group][k][1] += rows
    print("next-token agreement, teacher-forced, for each --draft in order:", " | ".join(args.draft))
    for group, per_draft in counts.items():
        cells = [f"{h / max(n, 1):.3f}" for h, n in per_draft]
        print(f"{group:28s} " + "  ".join(cells) + f"   ({per_draft[0][1]} positions)", flush=True)


if __name__ == "__main__":
    main()
