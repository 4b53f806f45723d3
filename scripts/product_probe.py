"""Per weight shape of the default model in bfloat16: which row-invariant products pass
`invariant.rows_invariant` on this machine, what F.linear and 16-row padded blocks cost
for 1 and 16 rows (median of 100 calls, 1 thread), and, for a shape whose F.linear fails,
the smallest call size at which some row loses its one-row bits, for four random inputs
(whether smaller blocks would do). docs/exact-bfloat16.md ("Padding only the weight shapes
that need it") has one machine's figures.

    python scripts/product_probe.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specmtp.invariant import PROBE_ROWS, rows_invariant
from specmtp.kernels import padded_linear
from specmtp.models import load_model


def median_us(call: Callable[..., object], *args: object, repeats: int = 100) -> float:
    for _ in range(5):
        call(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def first_differing_rows(weight: torch.Tensor, seed: int) -> int | None:
    """The fewest rows in one F.linear call at which a row's bits differ from its own
    one-row product (None: never up to PROBE_ROWS)."""
    x = torch.randn(PROBE_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(seed))
    x = x.to(weight.dtype)
    alone = torch.cat([F.linear(row, weight) for row in x.split(1)])
    for m in range(2, PROBE_ROWS + 1):
        if not torch.equal(F.linear(x[:m], weight), alone[:m]):
            return m
    return None


def main() -> None:
    torch.set_num_threads(1)
    model = load_model("default", dtype=torch.bfloat16).model
    weights = {
        m.weight.shape: m.weight.detach() for m in model.modules() if isinstance(m, nn.Linear)
    }
    print("shape        flat padded | 1 row: flat padded µs | 16 rows: flat padded µs")
    with torch.inference_mode():
        for shape, weight in weights.items():
            flat, padded = rows_invariant(weight), rows_invariant(weight, product="padded")
            costs = []
            for rows in (1, 16):
                x = torch.randn(rows, shape[1]).to(weight.dtype)
                costs += [median_us(F.linear, x, weight), median_us(padded_linear, x, weight, None)]
            name = "x".join(map(str, shape))
            print(f"{name:12s} {flat!s:5s} {padded!s:6s} | {costs[0]:8.1f} {costs[1]:8.1f}"
                  f"      | {costs[2]:8.1f} {costs[3]:8.1f}")  # fmt: skip
            if not flat:
                found = [first_differing_rows(weight, seed) for seed in range(4)]
                print(
                    f"  {name}: first call size with a row off its one-row bits, seeds 0-3: {found}"
                )


if __name__ == "__main__":
    main()
