"""How often draft models agree with the target's own greedy answers, per group,
teacher-forced: the target answers each prompt greedily (plain decoding, in --dtype), then
each draft reads prompt and answer in one forward and its argmax at every position that
predicts an answer token is compared with that token (for MTP heads, the token 2, 3, ...
ahead). The LM head's figure is the acceptance a one-token chain (`DRAFT@1`) would see if
every draft step had the same context.

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
from specmtp.draft_model import DraftLM
from specmtp.drafter_specs import load_small_draft
from specmtp.models import DTYPES, load_model


def agreement(draft: DraftLM, ids: list[int], prompt_len: int) -> list[tuple[int, int]]:
    """(hits, rows) for the LM head, then for each MTP head: row t of the LM head predicts
    ids[t + 1], of head i ids[t + 2 + i]; only rows predicting an answer token count."""
    x = torch.tensor([ids])
    with torch.no_grad():
        hidden = draft.hidden(x)
        predicted = [draft.projection.to_full_logits(draft.projection(hidden))[0].argmax(-1)]
        if draft.heads is not None:
            for logits in draft.head_logits(hidden)[0]:
                predicted.append(draft.projection.to_full_ids(logits.argmax(-1)))
    result = []
    for ahead, guesses in enumerate(predicted, start=1):
        rows = [t for t in range(len(ids)) if prompt_len <= t + ahead < len(ids)]
        truth = x[0, [t + ahead for t in rows]]
        result.append((int((guesses[rows] == truth).sum()), len(rows)))
    return result


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
    drafts = [load_small_draft(spec, target).eval() for spec in args.draft]
    base = GenerationConfig(max_new_tokens=args.max_new_tokens)
    ar = bench_runners.build_runner("ar", target, base)
    selection = bench.BenchConfig(prompts=(args.prompts,), limit=args.limit)
    # [group][draft][LM head, heads...] -> [hits, rows]
    counts: dict[str, list[list[list[int]]]] = defaultdict(
        lambda: [[[0, 0] for _ in range(1 + d.draft_config.mtp_heads)] for d in drafts]
    )
    for prompt in bench._load_prompts(selection, target):
        ids = bench._encode(ar.gen, prompt)
        answer, _ = ar.run(ids, base)
        scores = [agreement(draft, ids + answer, len(ids)) for draft in drafts]
        for group in (prompt.group, "all"):
            for k, per_head in enumerate(scores):
                for i, (hits, rows) in enumerate(per_head):
                    counts[group][k][i][0] += hits
                    counts[group][k][i][1] += rows
    print("top-1 agreement, teacher-forced, for each --draft in order (LM head, then its MTP")
    print("heads' tokens 2, 3, ... ahead):", " | ".join(args.draft))
    for group, per_draft in counts.items():
        cells = [" ".join(f"{h / max(n, 1):.3f}" for h, n in heads) for heads in per_draft]
        line = f"{group:28s} " + "  |  ".join(cells)
        print(line + f"   ({per_draft[0][0][1]} positions)", flush=True)


if __name__ == "__main__":
    main()
