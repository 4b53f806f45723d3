"""Target T(n) (ms, 2 threads unless THREADS is set) with amx.c's product against the products
it replaced, in turn in one process: the same model, each layer's product switched and its
packed copy made again. After a 120-token prompt, medians over 5 sweeps. Usage: python
docs/bench-amx-2026-12-08/t_ab.py MODEL (t_ab.txt)."""
import json, statistics, sys, time
import torch
from transformers import DynamicCache
from specmtp.models import load_model
from specmtp import invariant, kernels
from specmtp.kernels import TunedLinear, settle_packed, packed_bytes, kernel_plan

import os; torch.set_num_threads(int(os.environ.get("THREADS", "2")))
path = sys.argv[1]
t0 = time.perf_counter()
model = load_model(path, dtype=torch.bfloat16).model
print("load", time.perf_counter() - t0, kernel_plan(model).row_invariant, flush=True)
layers = [m for m in model.modules() if isinstance(m, TunedLinear)]
amx = {id(m): m.invariant_product for m in layers}
weights = {(m.weight.shape, m.weight.dtype): m.weight for m in layers}
kinds = [k for k in invariant.product_kinds() if k != kernels.AMX]
old = {key: invariant.invariant_product(w, kinds) for key, w in weights.items()}
old = invariant._widened(old, weights)
print("old products", invariant.describe_products(old), flush=True)

def use(which):
    for m in layers:
        m.invariant_product = amx[id(m)] if which == "amx" else old[m.weight.shape, m.weight.dtype]
    settle_packed(model)

ids = torch.randint(1000, 20000, (1, 121))
rows_list = [1, 4, 8, 9, 16, 32]
res = {w: {n: [] for n in rows_list} for w in ("amx", "before")}
logits = {}
with torch.inference_mode():
    for sweep in range(5):
        for which in ("amx", "before"):
            use(which)
            cache = DynamicCache(config=model.config)
            model(input_ids=ids[:, :120], cache=cache, use_cache=True)
            for n in rows_list:
                x = torch.randint(1000, 20000, (1, n))
                for rep in range(2):
                    t = time.perf_counter()
                    out = model(input_ids=x, cache=cache, use_cache=True).logits
                    dt = time.perf_counter() - t
                    cache.crop(-n)
                    if rep:
                        res[which][n].append(dt * 1000)
        print(sweep, {w: {n: round(statistics.median(v), 1) for n, v in r.items()} for w, r in res.items()}, flush=True)
    use("amx"); print("packed bytes amx", packed_bytes(model))
    use("before"); print("packed bytes before", packed_bytes(model))
med = {w: {n: statistics.median(v) for n, v in r.items()} for w, r in res.items()}
for w in med:
    print(w, " ".join(f"T({n})={v:.1f} ({v/med[w][1]:.3f})" for n, v in med[w].items()))
