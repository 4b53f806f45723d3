"""Microbenchmarks behind figures in draft-models.md and mtp-heads.md (medians, weights and
inputs hot in cache): sampling.top_log_probs against log_softmax+topk (2 threads, rows of
151,936); int4.c, int8.c and torch's bfloat16 product on the 0.5B draft's gate_up shape
(9,728 x 896) at 1-128 rows (2 threads); the default model heads' int8 products and an
RMSNorm (1 thread). Run from the repository root:
python docs/bench-lean-layers-2026-12-07/microbench.py"""
import statistics
import time

import torch

from specmtp.int4 import Int4Product
from specmtp.int8 import Int8Product
from specmtp.sampling import top_log_probs


def median_us(call, repeats=50):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


torch.set_num_threads(2)
for rows in (1, 4):
    x = torch.randn(rows, 151936) * 3
    kernel = median_us(lambda: top_log_probs(x, 4))
    plain = median_us(lambda: torch.log_softmax(x, -1).topk(4, -1))
    print(f"top-4 of {rows} x 151936: kernel {kernel / 1000:.2f} ms, log_softmax+topk {plain / 1000:.2f} ms")
w = torch.randn(9728, 896)
products = {"int4": Int4Product(w, None), "int8": Int8Product(w, None)}
linear = torch.nn.Linear(896, 9728, bias=False).bfloat16()
for rows in (1, 32, 128):
    x = torch.randn(rows, 896)
    with torch.inference_mode():
        for name, product in products.items():
            us = median_us(lambda: product(x), 20)
            print(f"{name} 9728x896, {rows} rows: {us / rows:.1f} us a row")
        xb = x.bfloat16()
        us = median_us(lambda: linear(xb), 20)
        print(f"bfloat16 (torch) 9728x896, {rows} rows: {us / rows:.1f} us a row")
torch.set_num_threads(1)
for out_f, in_f in ((1728, 576), (576, 576), (2304, 576), (576, 1152)):
    product = Int8Product(torch.randn(out_f, in_f), None)
    for rows in (1, 6):
        x = torch.randn(rows, in_f).bfloat16()
        out = torch.empty(rows, out_f, dtype=torch.bfloat16)
        print(f"int8 {out_f}x{in_f}, {rows} rows, 1 thread: {median_us(lambda: product.into(x, out), 200):.1f} us")
norm = torch.nn.RMSNorm(576, eps=1e-6).bfloat16()
x = torch.randn(1, 6, 576).bfloat16()
with torch.inference_mode():
    print(f"RMSNorm [1, 6, 576] bfloat16, 1 thread: {median_us(lambda: norm(x), 300):.1f} us")
