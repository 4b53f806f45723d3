"""Where a bfloat16 verify pass's extra rows go: one forward of n tokens after a 250-token
context against a one-token step (default model, 1 thread), timed whole and around the
row-invariant attention alone (median of 9), then `torch.profiler`'s top operators over 5
forwards of 1 and of 16 rows. docs/exact-bfloat16.md ("Where a 16-row verify pass goes")
has one machine's figures.

    python scripts/verify_row_profile.py
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AttentionInterface, DynamicCache

from specmtp import invariant
from specmtp.models import load_model

CONTEXT = 250


def main() -> None:
    torch.set_num_threads(1)
    model = load_model("default", dtype=torch.bfloat16).model
    ids = torch.randint(1000, (1, CONTEXT + 16), generator=torch.Generator().manual_seed(0))
    spent = [0.0]  # seconds inside the attention during the timed forward

    def timed_attention(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        out = invariant.row_invariant_attention(*args, **kwargs)  # type: ignore[arg-type]
        spent[0] += time.perf_counter() - start
        return out

    AttentionInterface.register(invariant.ATTENTION, timed_attention)
    for n in (1, 2, 4, 8, 16):
        whole, attention = [], []
        for _ in range(9):
            cache = DynamicCache(config=model.config)
            with torch.inference_mode():
                model(input_ids=ids[:, :CONTEXT], cache=cache, use_cache=True)
                spent[0] = 0.0
                start = time.perf_counter()
                model(input_ids=ids[:, CONTEXT : CONTEXT + n], cache=cache, use_cache=True)
                whole.append(time.perf_counter() - start)
                attention.append(spent[0])
        print(
            f"{n:2d} rows: forward {statistics.median(whole) * 1e3:.1f} ms, "
            f"attention {statistics.median(attention) * 1e3:.1f} ms"
        )
    AttentionInterface.register(invariant.ATTENTION, invariant.row_invariant_attention)
    for n in (1, 16):
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=ids[:, :CONTEXT], cache=cache, use_cache=True)
            for _ in range(3):  # warm up, each rolled back
                model(input_ids=ids[:, CONTEXT : CONTEXT + n], cache=cache, use_cache=True)
                cache.crop(-n)
            with profile(activities=[ProfilerActivity.CPU]) as profiled:
                for _ in range(5):
                    model(input_ids=ids[:, CONTEXT : CONTEXT + n], cache=cache, use_cache=True)
                    cache.crop(-n)
        print(f"{n} rows, 5 forwards:")
        print(profiled.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
