"""int8.c against fbgemm's product and bfloat16 for many rows (a draft's prefill), weights
in cache, 2 threads, medians of 10. Run from the repository root:
python docs/bench-int8c-2026-12-07/many_rows.py"""

import time
import warnings

import torch

from specmtp import int8, native

warnings.filterwarnings("ignore")
torch.set_num_threads(2)


def ms(product, reps=10):
    product()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        product()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[len(times) // 2]


for n, k in [(896, 896), (4864, 896), (896, 4864), (151936, 896)]:
    weight = torch.randn(n, k) * 0.02
    natively = int8.Int8Product(weight, None, kernel=native.int8_kernel())
    fbgemm = int8.Int8Product(weight, None, kernel=None)
    half = weight.bfloat16()
    for m in (17, 64, 400):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        print(
            f"{n}x{k} M={m}: native {ms(lambda: natively(x)):.2f}  fbgemm {ms(lambda: fbgemm(x)):.2f}"
            f"  bf16 {ms(lambda: torch.nn.functional.linear(x, half)):.2f} ms",
            flush=True,
        )
