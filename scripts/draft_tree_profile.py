"""Where a draft tree's rounds go: a draft model's tree (`MODEL#int8#nodes=7` by default)
drafting ten rounds on a chat prompt under torch's profiler, the top operators by their own
time. Each round takes the top path's first two tokens and one more, as a verify pass
would. docs/draft-models.md ("One copy of a draft per form") has the Qwen 0.5B's figures.

    python scripts/draft_tree_profile.py $Q/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specmtp.config import SamplingConfig
from specmtp.drafter_specs import build_drafter
from specmtp.drafters import Drafter
from specmtp.models import load_model

PROMPT = (
    "<|im_start|>user\nWrite a detailed essay about the history of the printing press and its "
    "effects on Europe.<|im_end|>\n<|im_start|>assistant\n"
)


def rounds(drafter: Drafter, context: torch.Tensor, count: int, k: int) -> torch.Tensor:
    """`count` rounds of at most `k` deep; returns the context they grew."""
    for _ in range(count):
        tokens = drafter.propose(context, k, SamplingConfig(), None).tokens[0].tolist()
        context = torch.cat([context, torch.tensor([[*tokens[:2], tokens[0]]])], 1)
    return context


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("draft")
    parser.add_argument("--options", default="#int8#nodes=7")
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.draft, dtype=torch.bfloat16)  # its own target: same tokenizer
    drafter, _ = build_drafter(args.draft + args.options, model, dtype=torch.bfloat16)
    assert drafter is not None
    context = torch.tensor([model.tokenizer(PROMPT).input_ids])
    context = rounds(drafter, context, 2, args.depth)  # warm up
    start = time.perf_counter()
    context = rounds(drafter, context, 10, args.depth)
    print(f"{(time.perf_counter() - start) * 100:.1f} ms a round")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        rounds(drafter, context, 10, args.depth)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
