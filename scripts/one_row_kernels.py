"""Plain decoding's one-row step under each kernel strategy (specmtp/kernels.py): T(1) of the
whole target and plain-decoding tokens/s, strategies taking turns, medians. Usage:

    python scripts/one_row_kernels.py [--target default] [--repeats 5] [--new-tokens 64]

Prints one line per strategy and the plan `measure_kernel_plan` picks, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specmtp.api import SpecGenerator
from specmtp.config import GenerationConfig
from specmtp.costmodel import measure_verify_costs
from specmtp.kernels import STRATEGIES, kernel_plan, measure_kernel_plan
from specmtp.models import load_model

PROMPT = "Explain in a few paragraphs how a key-value cache speeds up text generation."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = SpecGenerator(load_model(args.target))
    runner = gen.decoder.target
    plan = kernel_plan(runner.model)
    if plan is None:
        raise SystemExit("the target's linear layers were not swapped (tuned kernels are off)")
    ids = gen.encode(PROMPT, chat=True)
    config = GenerationConfig(max_new_tokens=args.new_tokens, stop_on_eos=False)
    t1: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    rate: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    gen.decoder.generate(ids, config)  # warm-up
    for _ in range(args.repeats):
        for strategy in STRATEGIES:
            plan.by_rows = {1: strategy}
            t1[strategy].append(measure_verify_costs(runner, ids, max_tokens=1, repeats=3)[0])
            start = time.perf_counter()
            out = gen.decoder.generate(ids, config)
            rate[strategy].append(len(out.tokens) / (time.perf_counter() - start))
    result = {
        s: {"t1_ms": statistics.median(t1[s]) * 1e3, "tokens_per_s": statistics.median(rate[s])}
        for s in STRATEGIES
    }
    for s, r in result.items():
        print(f"{s:>5}: T(1) {r['t1_ms']:.1f} ms, plain decoding {r['tokens_per_s']:.1f} tokens/s")
    chosen = measure_kernel_plan(runner, ids, max_rows=3)
    print(f"measure_kernel_plan picks: {chosen.by_rows if chosen else None}")
    print(json.dumps({"one_row": result, "plan": chosen.by_rows if chosen else None}))


if __name__ == "__main__":
    main()
