"""Would batching a verify pass's query rows keep attention row-invariant on this CPU?

specmtp/invariant.py computes each query row's attention alone, with the shapes of a
one-token step, because a product's bits for one row may depend on how many rows or keys
the call holds. This script probes that directly, in float32 (the attention's working
precision), over the shapes a decoder layer's attention takes: key heads H, query heads per
key head G, head size d, S keys, n query rows. Per check it prints how many shapes failed:

- scores q.K^T: one row's G scores alone against the same row inside a call of n rows
  (both orientations: queries x keys, and keys x queries);
- values P.V at a fixed 64-key width: one row's G rows alone against inside n rows;
- softmax padded with -inf: equal to the softmax over the row's own keys;
- block sum: P.V as a sum over 64-key blocks, with trailing all-zero blocks, equal to the
  same sum without them.

A batched row-invariant attention needs every check it relies on to pass on the machine it
runs on; docs/exact-bfloat16.md has one machine's counts. Then it times, at the default
model's shapes (3 key heads, G = 3, d = 64) after 250 keys, one layer's attention of 16
rows and of 1 row: the per-row loop invariant.py runs, against a batched form (shared score
and block-sum products, the rows' masks as -inf; not exact, see the counts).

    python scripts/attention_batching_probe.py
"""

from __future__ import annotations

import itertools
import time

import torch

BLOCK = 64


def block_sum(weights: torch.Tensor, values: torch.Tensor, blocks: int) -> torch.Tensor:
    """weights [H, M, K], values [H, K, d], K <= blocks * BLOCK: the sum, block by block in
    order, of each block's product (zero-padded to `blocks` blocks)."""
    heads, rows, keys = weights.shape
    pad = blocks * BLOCK - keys
    weights = torch.cat([weights, weights.new_zeros(heads, rows, pad)], -1)
    values = torch.cat([values, values.new_zeros(heads, pad, values.shape[-1])], 1)
    parts = torch.bmm(
        weights.unflatten(-1, (blocks, BLOCK)).transpose(1, 2).reshape(-1, rows, BLOCK),
        values.reshape(-1, BLOCK, values.shape[-1]),
    )  # [H*blocks, M, d]
    return parts.unflatten(0, (heads, blocks)).sum(1)


def main() -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    failed = dict.fromkeys(
        ["scores q.K^T", "scores K.q^T", "values P.V", "softmax -inf pad", "block sum"], 0
    )
    shapes = list(
        itertools.product((1, 3), (1, 2, 3, 4), (8, 16, 64), (6, 60, 70, 130, 300), (2, 4, 9, 16))
    )
    for heads, groups, d, keys, n in shapes:
        q = torch.randn(heads, n * groups, d, generator=generator)
        k = torch.randn(heads, keys, d, generator=generator)
        rows = [slice(j * groups, (j + 1) * groups) for j in range(n)]
        full = torch.bmm(q, k.transpose(1, 2))
        failed["scores q.K^T"] += any(
            not torch.equal(torch.bmm(q[:, r], k.transpose(1, 2)), full[:, r]) for r in rows
        )
        full = torch.bmm(k, q.transpose(1, 2))
        failed["scores K.q^T"] += any(
            not torch.equal(torch.bmm(k, q[:, r].transpose(1, 2)), full[:, :, r]) for r in rows
        )
        p = torch.randn(heads, n * groups, BLOCK, generator=generator)
        v = torch.randn(heads, BLOCK, d, generator=generator)
        full = torch.bmm(p, v)
        failed["values P.V"] += any(
            not torch.equal(torch.bmm(p[:, r], v), full[:, r]) for r in rows
        )
        scores = torch.randn(heads, groups, keys, generator=generator)
        padded = torch.cat([scores, scores.new_full((heads, groups, 2 * BLOCK), float("-inf"))], -1)
        weights = scores.softmax(-1)
        failed["softmax -inf pad"] += not torch.equal(weights, padded.softmax(-1)[..., :keys])
        values = torch.randn(heads, keys, d, generator=generator)
        own = -(-keys // BLOCK)
        failed["block sum"] += not torch.equal(
            block_sum(weights, values, own), block_sum(weights, values, own + 2)
        )
    for check, count in failed.items():
        print(f"{check}: {count} of {len(shapes)} shapes give a row other bits")
    timings()


def per_row_loop(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q [n, H, G, d] for the last n of the keys and values [H, S, d]: invariant.py's loop."""
    n, past, rows = q.shape[0], keys.shape[1] - q.shape[0], []
    for j in range(n):
        k, v = keys[:, : past + j + 1], values[:, : past + j + 1]
        rows.append(torch.bmm(torch.bmm(q[j], k.transpose(1, 2)).softmax(-1), v))
    return torch.stack(rows)  # [n, H, G, d]


def batched(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The same rows in shared calls: scores, a causal -inf mask, block sums; [H, n*G, d]."""
    n, heads, groups, d = q.shape
    length = keys.shape[1]
    scores = torch.bmm(q.transpose(0, 1).reshape(heads, n * groups, d), keys.mT)
    position = torch.arange(length - n, length).repeat_interleave(groups)[:, None]  # [n*G, 1]
    weights = scores.masked_fill(torch.arange(length) > position, float("-inf")).softmax(-1)
    return block_sum(weights, values, -(-length // BLOCK))


def timings(heads: int = 3, groups: int = 3, d: int = 64, past: int = 250) -> None:
    for n in (16, 1):
        keys, values = torch.randn(heads, past + n, d), torch.randn(heads, past + n, d)
        q = torch.randn(n, heads, groups, d)
        for name, run in (("per-row loop", per_row_loop), ("batched", batched)):
            for _ in range(20):
                run(q, keys, values)
            start = time.perf_counter()
            for _ in range(300):
                run(q, keys, values)
            micro = (time.perf_counter() - start) / 300 * 1e6
            print(f"{n} rows, {name}: {micro:.0f} us per layer")


if __name__ == "__main__":
    main()
