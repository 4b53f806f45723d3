"""How well MTP heads predict the target's own answers to evaluation prompts, per group,
teacher-forced: the target answers each prompt greedily (plain decoding, float32), then
each depth's top-1 is compared with the answer's token (the target's hidden states of the
whole sequence, as in training). With --loop, also the first position's acceptance of
`mtp@1` decoding the same prompt with the first heads (it equals depth 0's teacher-forced
accuracy when drafting is right). Several --heads are compared on the same answers.

    python scripts/acceptance_gap.py --prompts ../shared/prompts/eval/spec_bench/question.jsonl \
        --per-category 2 --max-new-tokens 64 --heads DIR_A --heads DIR_B [--loop]

Used in docs/mtp-heads.md ("Where the acceptance goes") to find where the shipped heads' acceptance
on Spec-Bench (0.3-0.4) falls short of their held-out top-1 on training answers (0.64).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from specmtp import bench, bench_runners
from specmtp.config import GenerationConfig
from specmtp.heads import Heads, target_features
from specmtp.heads_io import load_heads, shipped_heads_dir
from specmtp.models import LoadedModel, load_model


def teacher_forced(
    target: LoadedModel, heads: Heads, ids: list[int], prompt_len: int
) -> list[tuple[int, int]]:
    """Per depth: (hits, rows) over the rows predicting an answer token after the first
    (the first answer token is the target's own, never drafted)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = target.model(x, output_hidden_states=True, logits_to_keep=1)
        hidden = target_features(out.hidden_states, heads.config.feature_layers).float()
        logits = heads.forward_all(hidden, x)
    result = []
    for i, depth_logits in enumerate(logits):
        predicted = heads.to_full_ids(depth_logits.argmax(-1))[0]  # row t: x[t + 2 + i]
        rows = [t for t in range(predicted.shape[0]) if prompt_len < t + 2 + i < len(ids)]
        truth = x[0, [t + 2 + i for t in rows]]
        result.append((int((predicted[rows] == truth).sum()), len(rows)))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--per-category", type=int)
    parser.add_argument("--limit", type=int)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--heads", action="append", help="heads directory; repeatable")
    parser.add_argument("--loop", action="store_true", help="also decode with mtp@1")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = load_model("default")
    dirs = args.heads or [str(shipped_heads_dir())]
    all_heads = [load_heads(d, target_model=target.model)[0].float().eval() for d in dirs]
    base = GenerationConfig(max_new_tokens=args.max_new_tokens)
    ar = bench_runners.build_runner("ar", target, base)
    mtp = bench_runners.build_runner(f"mtp:{dirs[0]}@1", target, base) if args.loop else None
    selection = bench.BenchConfig(
        prompts=(args.prompts,), per_category=args.per_category, limit=args.limit
    )
    # [group][heads][depth] -> [hits, rows]; the loop's [accepted, rounds] per group
    counts: dict[str, list[list[list[int]]]] = defaultdict(
        lambda: [[[0, 0] for _ in range(3)] for _ in all_heads]
    )
    loop: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for prompt in bench._load_prompts(selection, target):
        ids = bench._encode(ar.gen, prompt)
        answer, _ = ar.run(ids, base)
        scores = [teacher_forced(target, heads, ids + answer, len(ids)) for heads in all_heads]
        drafted = mtp.run(ids, base)[1] if mtp is not None else None
        for group in (prompt.group, "all"):
            for k, per_depth in enumerate(scores):
                for i, (hits, rows) in enumerate(per_depth):
                    counts[group][k][i][0] += hits
                    counts[group][k][i][1] += rows
            if drafted is not None:
                loop[group][0] += drafted.position_accepted[0]
                loop[group][1] += drafted.position_reached[0]
    print("top-1 per depth, teacher-forced, for each --heads in order", end="")
    print(", then mtp@1's first-position acceptance" if mtp is not None else "")
    for group, per_heads in counts.items():
        cells = [" ".join(f"{h / max(n, 1):.3f}" for h, n in depths) for depths in per_heads]
        line = f"{group:28s} " + "  |  ".join(cells)
        if mtp is not None:
            line += f"  |  loop {loop[group][0] / max(loop[group][1], 1):.3f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
