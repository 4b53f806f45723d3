"""The C attention kernel against the torch loop, in one process: bfloat16 forwards of the
default model (1 thread) of n tokens after a context, both paths of invariant.py timed
alternately on the same cache (each forward rolled back), median of REPEATS. Prints T(n)
per path, the kernel's time as a fraction of the loop's, and T(n) / T(1) per path (what a
verify pass costs against a plain step, which is what speculative decoding pays).
docs/exact-bfloat16.md ("Attention in C") has one machine's figures.

    python scripts/attention_kernel_timing.py [--contexts 250,1000,4000] [--rows 1,2,4,8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from specmtp import native
from specmtp.models import load_model

REPEATS = 15


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="250,1000,4000")
    parser.add_argument("--rows", default="1,2,4,8")
    args = parser.parse_args()
    torch.set_num_threads(1)
    kernel = native.attention_kernel()
    if kernel is None:
        raise SystemExit("no attention kernel here (no C compiler, or SPECMTP_NATIVE=0)")
    model = load_model("default", dtype=torch.bfloat16).model
    paths = {"kernel": lambda: kernel, "loop": lambda: None}
    rows = [int(n) for n in args.rows.split(",")]
    for context in (int(c) for c in args.contexts.split(",")):
        ids = torch.randint(
            1000, (1, context + max(rows)), generator=torch.Generator().manual_seed(0)
        )
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=ids[:, :context], cache=cache, use_cache=True)
            timed = {(path, n): [] for path in paths for n in rows}
            for _ in range(REPEATS):
                for n in rows:
                    for path, choose in paths.items():
                        native.attention_kernel = choose  # what invariant.py asks for
                        start = time.perf_counter()
                        model(input_ids=ids[:, context : context + n], cache=cache, use_cache=True)
                        timed[path, n].append(time.perf_counter() - start)
                        cache.crop(-n)
        native.attention_kernel = paths["kernel"]
        t = {key: statistics.median(values) * 1e3 for key, values in timed.items()}
        for n in rows:
            print(
                f"context {context:5d}, {n} rows: kernel {t['kernel', n]:6.1f} ms, "
                f"loop {t['loop', n]:6.1f} ms ({t['kernel', n] / t['loop', n]:.3f}); "
                f"T({n})/T(1) kernel {t['kernel', n] / t['kernel', 1]:.3f}, "
                f"loop {t['loop', n] / t['loop', 1]:.3f}"
            )


if __name__ == "__main__":
    main()
