"""Whole-model T(n) under each weight layout and strategy (specmtp/kernels.py): layouts and
strategies take turns sweep by sweep; each point is the median over the sweeps (the first
two dropped as warm-up) of the median of 3 timed forwards. Usage:

    python scripts/kernel_layouts.py [--target default] [--sweeps 12]

Prints one line per layout and strategy (T(n) in ms for n = 1 2 3 4 6 8), the fastest per
n, what `measure_kernel_plan` picks, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specmtp.api import SpecGenerator
from specmtp.kernels import LAYOUTS, kernel_plan, measure_kernel_plan, set_weight_layout
from specmtp.models import load_model

PROMPT = "Explain in a few paragraphs how a key-value cache speeds up text generation."
ROWS = (1, 2, 3, 4, 6, 8)
STRATEGIES = ("plain", "head")  # F.linear everywhere, or the transposed product for the head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--sweeps", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = SpecGenerator(load_model(args.target))
    runner = gen.decoder.target
    plan = kernel_plan(runner.model)
    if plan is None:
        raise SystemExit("the target's linear layers were not swapped (tuned kernels are off)")
    ids = torch.tensor([gen.encode(PROMPT, chat=True)])  # [1, P]
    runner.reset()
    runner.forward(ids[:, :-1], last_only=True)
    past = runner.length
    times: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(args.sweeps):
        for layout in LAYOUTS:
            set_weight_layout(runner.model, layout)
            for strategy in STRATEGIES:
                plan.by_rows = dict.fromkeys(range(1, 9), strategy)
                for n in ROWS:
                    tokens = ids[:, -1:].repeat(1, n)  # [1, n]
                    forwards = []
                    for _ in range(4):  # the first of each point warms its shape up
                        start = time.perf_counter()
                        runner.forward(tokens)
                        forwards.append(time.perf_counter() - start)
                        runner.crop(past)
                    times.setdefault((layout, strategy, n), []).append(
                        statistics.median(forwards[1:])
                    )
    table = {
        f"{layout} {strategy}": [
            round(statistics.median(times[layout, strategy, n][2:]) * 1e3, 1) for n in ROWS
        ]
        for layout in LAYOUTS
        for strategy in STRATEGIES
    }
    fastest = {
        layout: [min(table[f"{layout} {s}"][i] for s in STRATEGIES) for i in range(len(ROWS))]
        for layout in LAYOUTS
    }
    print("T(n) ms for n = " + " ".join(map(str, ROWS)))
    for name, row in {**table, **{f"{k} fastest": v for k, v in fastest.items()}}.items():
        print(f"{name:>18}: " + " ".join(f"{t:6.1f}" for t in row))
    runner.reset()
    picked = measure_kernel_plan(runner, ids[0].tolist())
    print(f"measure_kernel_plan picks {picked.layout if picked else None}")
    print(json.dumps({"rows": ROWS, "ms": table, "picked": picked.layout if picked else None}))


if __name__ == "__main__":
    main()
