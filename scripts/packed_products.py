"""Every linear product of a target's forward for 1-8 rows: F.linear on the weights as
loaded against oneDNN's product on weights packed once (specmtp/kernels.py, `packed`); then
the whole model's T(n) under the plans measure_kernel_plan picks without and with the packed
strategy, the two plans taking turns sweep by sweep. Medians. Usage:

    python scripts/packed_products.py [--target default] [--threads 1] [--repeats 8]

Prints a line per kind, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import specmtp.kernels as kernels
from specmtp.cache import CachedModel
from specmtp.costmodel import measure_verify_costs
from specmtp.kernels import TunedLinear, measure_kernel_plan, pack_weight, packed_linear
from specmtp.models import load_model

ROWS = range(1, kernels.MAX_ROWS + 1)


def product_times(weights: list[torch.Tensor], repeats: int) -> dict[str, list[float]]:
    """Milliseconds for one input through every weight, per kind and row count."""
    packed = [pack_weight(w) for w in weights]
    kinds = {
        "f_linear": lambda x, i: F.linear(x, weights[i]),
        "packed": lambda x, i: packed_linear(x, packed[i], None),
    }
    times: dict[str, dict[int, list[float]]] = {kind: {n: [] for n in ROWS} for kind in kinds}
    inputs = {n: {w.shape[1]: torch.randn(n, w.shape[1]) for w in weights} for n in ROWS}
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first sweep warms up and is dropped
            for n in ROWS:
                for kind, product in kinds.items():
                    start = time.perf_counter()
                    for i, w in enumerate(weights):
                        product(inputs[n][w.shape[1]], i)
                    times[kind][n].append(time.perf_counter() - start)
    return {k: [1e3 * statistics.median(t[n][1:]) for n in ROWS] for k, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(args.target)
    weights = [m.weight.detach() for m in target.model.modules() if isinstance(m, TunedLinear)]
    result: dict[str, object] = {"products_ms": product_times(weights, args.repeats)}
    runner = CachedModel(target.model, vocab_size=target.model.config.vocab_size)
    ids = [i % 1000 + 100 for i in range(64)]
    every, plans = kernels.STRATEGIES, {}
    for name, strategies in (("without_packed", every[:4]), ("with_packed", every)):
        kernels.STRATEGIES = strategies
        plan = measure_kernel_plan(runner, ids, repeats=3)
        plans[name] = (dict(plan.by_rows), plan.layout)
        result[name] = {"by_rows": plan.by_rows, "layout": plan.layout}
    kernels.STRATEGIES = every
    sweeps: dict[str, list[tuple[float, ...]]] = {name: [] for name in plans}
    for _ in range(args.repeats):
        for name, (by_rows, layout) in plans.items():
            kernels.apply_kernel_plan(target.model, by_rows, layout)
            sweeps[name].append(
                measure_verify_costs(runner, ids, max_tokens=kernels.MAX_ROWS, repeats=1)
            )
            result[name]["packed_mb"] = kernels.packed_bytes(target.model) / 2**20
    for name, times in sweeps.items():
        result[name]["t_ms"] = [1e3 * statistics.median(t) for t in zip(*times, strict=True)]
    for kind, ms in result["products_ms"].items():
        print(f"products {kind:>14}: " + " ".join(f"{t:.1f}" for t in ms))
    for name in ("without_packed", "with_packed"):
        print(f"T(n) {name:>16}: " + " ".join(f"{t:.1f}" for t in result[name]["t_ms"]))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
