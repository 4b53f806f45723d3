"""Does a forward over n tokens give each token the bits of one-token steps, and what does
it cost? For the default model in bfloat16, stock (Hugging Face's SDPA attention, F.linear)
against row-invariant (specmtp/invariant.py), with float32 beside for the cost. Usage:

    python scripts/row_invariance.py [--target default] [--sweeps 9] [--pad-rows 16]

--pad-rows adds a row-invariant mode whose padded products (the weight shapes that need
them) run on blocks of that many rows instead of kernels.PAD_ROWS; repeatable.

1. Per mode, greedy continuations of three prompts (64 tokens, one-token steps), then the
   same tokens fed again in chunks of random sizes 1-8 (seeded) after the same prefill:
   how many chunks' logits differ from the steps' and by how much at most.
2. T(n), whole-model forwards of n = 1 2 4 8 12 16 tokens after a short prompt, in ms:
   modes take turns sweep by sweep, each point the median over sweeps (the first two
   dropped) of the median of 3 timed forwards.
Prints both tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from specmtp import kernels
from specmtp.api import SpecGenerator
from specmtp.cache import CachedModel
from specmtp.kernels import stock_kernels
from specmtp.models import load_model

PROMPTS = (
    "Write a short story about a robot who learns to paint.",
    "What is 17 times 23? Explain step by step.",
    "Write a Python function that reverses a linked list.",
)
NEW_TOKENS = 64
ROWS = (1, 2, 4, 8, 12, 16)


def chunk_differences(
    runner: CachedModel, prompts: list[torch.Tensor], rng: random.Random
) -> tuple[int, int, float]:
    """(chunks, chunks whose logits differ from one-token steps, largest difference)."""
    chunks = differing = 0
    largest = 0.0
    for ids in prompts:
        runner.reset()
        logits = runner.forward(ids)[:, -1]
        seq, steps = ids, []
        for _ in range(NEW_TOKENS):
            token = logits.argmax(-1, keepdim=True)  # [1, 1]
            seq = torch.cat([seq, token], 1)
            logits = runner.forward(token)[:, -1]
            steps.append(logits[0])
        reference = torch.stack(steps)  # [NEW_TOKENS, V]
        for _ in range(3):
            runner.reset()
            runner.forward(ids)
            done = 0
            while done < NEW_TOKENS:
                n = min(rng.randint(1, 8), NEW_TOKENS - done)
                start = ids.shape[1] + done
                got = runner.forward(seq[:, start : start + n])[0]  # [n, V]
                diff = (got.float() - reference[done : done + n].float()).abs().max().item()
                chunks, differing, largest = chunks + 1, differing + (diff > 0), max(largest, diff)
                done += n
    return chunks, differing, largest


def verify_costs(
    runners: dict[str, tuple[CachedModel, Callable[[], AbstractContextManager[None]]]],
    ids: torch.Tensor,
    sweeps: int,
) -> dict[str, list[float]]:
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(sweeps):
        for name, (runner, mode) in runners.items():
            with mode():
                runner.reset()
                runner.forward(ids[:, :-1])
                past = runner.length
                for n in ROWS:
                    tokens = ids[:, -1:].repeat(1, n)
                    forwards = []
                    for _ in range(4):  # the first warms the shape up
                        start = time.perf_counter()
                        runner.forward(tokens)
                        forwards.append(time.perf_counter() - start)
                        runner.crop(past)
                    times.setdefault((name, n), []).append(statistics.median(forwards[1:]))
    return {
        name: [round(1000 * statistics.median(times[name, n][2:]), 1) for n in ROWS]
        for name in runners
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--sweeps", type=int, default=9)
    parser.add_argument("--pad-rows", type=int, action="append", default=[])
    args = parser.parse_args()
    torch.set_num_threads(1)
    half = SpecGenerator(load_model(args.target, dtype=torch.bfloat16))
    full = SpecGenerator(load_model(args.target))
    prompts = [torch.tensor([half.encode(p, chat=True)]) for p in PROMPTS]
    target = half.decoder.target

    def stock() -> AbstractContextManager[None]:
        return stock_kernels(target.model)

    @contextmanager
    def blocks(rows: int) -> Iterator[None]:
        kept, kernels.PAD_ROWS = kernels.PAD_ROWS, rows
        try:
            yield
        finally:
            kernels.PAD_ROWS = kept

    modes = {"bfloat16 stock": stock, "bfloat16 row-invariant": nullcontext}
    for rows in args.pad_rows:
        modes[f"row-invariant, {rows}-row blocks"] = lambda rows=rows: blocks(rows)
    exactness = {}
    for name, mode in modes.items():
        with mode():
            exactness[name] = chunk_differences(target, prompts, random.Random(0))
    print("mode                              chunks  differing  largest |logit difference|")
    for name, (chunks, differing, largest) in exactness.items():
        print(f"{name:<32} {chunks:>7} {differing:>10}  {largest:.4g}")
    runners = {"float32": (full.decoder.target, nullcontext)}
    runners |= {name: (target, mode) for name, mode in modes.items()}
    costs = verify_costs(runners, prompts[0], args.sweeps)
    print("\nT(n) ms, n =", " ".join(map(str, ROWS)))
    for name, row in costs.items():
        print(f"{name:<32}", " ".join(f"{t:6.1f}" for t in row))
    print(json.dumps({"rows": ROWS, "exactness": exactness, "verify_ms": costs}))


if __name__ == "__main__":
    main()
