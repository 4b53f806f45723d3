"""Per weight shape of the default model in bfloat16: which ways of computing x @ W^T give
every row the same bits at every row count (the probe of `invariant.rows_invariant`, for
each way), and what each costs for 1 to 16 rows (median of --repeats calls, the ways
interleaved so that a busy machine slows them alike; 1 thread). The ways:

    flat        F.linear on the rows (what a row-invariant model uses where it passes)
    padded16    F.linear on blocks of exactly 16 rows, the last zero-padded ("padded")
    padded8/4   the same with blocks of 8 and 4 rows
    transposed  (W @ x^T)^T: the weight as the left operand
    rows        one F.linear per row (invariant whenever one row's product is deterministic)

    python scripts/product_kinds.py [--repeats 30] [--rows 1,2,3,4,5,6,8,12,16]

Prints one line per shape and way (invariant or not, then µs per row count); JSON last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specmtp.invariant import PROBE_ROWS
from specmtp.models import load_model

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def blocks(height: int) -> Product:
    def product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if m % height:
            x = torch.cat([x, x.new_zeros(height - m % height, x.shape[1])])
        return torch.cat([F.linear(block, weight) for block in x.split(height)])[:m]

    return product


PRODUCTS: dict[str, Product] = {
    "flat": F.linear,
    "padded16": blocks(16),
    "padded8": blocks(8),
    "padded4": blocks(4),
    "transposed": lambda x, weight: (weight @ x.T).T.contiguous(),
    "rows": lambda x, weight: torch.cat([F.linear(row, weight) for row in x.split(1)]),
}


def invariant(product: Product, weight: torch.Tensor, seeds: int = 2) -> bool:
    """Every row gets its bits of the full call at every row count and every place."""
    for seed in range(seeds):
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(PROBE_ROWS, weight.shape[1], generator=generator).to(weight.dtype)
        full = product(x, weight)
        for m in range(1, PROBE_ROWS):
            if not torch.equal(product(x[:m], weight), full[:m]):
                return False
            if not torch.equal(product(x[m : m + 1], weight), full[m : m + 1]):
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rows", default="1,2,3,4,5,6,8,12,16")
    args = parser.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(1)
    model = load_model("default", dtype=torch.bfloat16).model
    weights = {
        m.weight.shape: m.weight.detach() for m in model.modules() if isinstance(m, nn.Linear)
    }
    result = {}
    with torch.inference_mode():
        for shape, weight in weights.items():
            name = "x".join(map(str, shape))
            passes = {kind: invariant(p, weight) for kind, p in PRODUCTS.items()}
            times: dict[str, dict[int, list[float]]] = {
                k: {r: [] for r in row_counts} for k in PRODUCTS
            }
            inputs = {r: torch.randn(r, shape[1]).to(weight.dtype) for r in row_counts}
            for _ in range(args.repeats + 3):
                for rows in row_counts:
                    for kind, product in PRODUCTS.items():
                        start = time.perf_counter()
                        product(inputs[rows], weight)
                        times[kind][rows].append(time.perf_counter() - start)
            result[name] = {}
            for kind in PRODUCTS:
                us = {r: statistics.median(times[kind][r][3:]) * 1e6 for r in row_counts}
                result[name][kind] = {"invariant": passes[kind], "us": us}
                cells = " ".join(f"{r}:{us[r]:.0f}" for r in row_counts)
                print(f"{name:>10} {kind:>10} {'yes' if passes[kind] else 'no ':>3} {cells}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
