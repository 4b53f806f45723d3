"""One lean step of the Qwen2.5 0.5B draft (#int4 layers, int8 LM head, bfloat16, 2 threads)
after a 200-token random context, its layers in one C call (lean.c's specmtp_lean_layers)
and through layer_step from Python (the reference), in turn, 1 and 4 rows, medians of 14;
the two paths' logits compared bit for bit. Run from the repository root:
python docs/bench-lean-layers-2026-12-07/step_ab.py"""
import os, statistics, time, torch
from transformers import DynamicCache
from specmtp import int4, int8
from specmtp.lean import lean_forward
from specmtp.models import load_model
torch.set_num_threads(2)
m = load_model(os.path.expanduser("~/.cache/specmtp/qwen2.5-coder/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"), dtype=torch.bfloat16).model
int4.use_int4_products(m); int8.use_int8_products(m)
lean = lean_forward(m); assert lean is not None
V = m.config.vocab_size
ctx = torch.randint(0, V, (1, 200), generator=torch.Generator().manual_seed(0))
caches = {}
for c in (True, False):
    cache = DynamicCache(config=m.config)
    with torch.inference_mode(): m(input_ids=ctx, cache=cache)
    caches[c] = cache
times = {(c, r): [] for c in (True, False) for r in (1, 4)}
same = True
for it in range(15):
    for r in (1, 4):
        tokens = torch.randint(0, V, (1, r))
        pos = torch.arange(200, 200 + r)[None]
        outs = {}
        for c in ((True, False) if it % 2 else (False, True)):
            lean.in_c = c
            t = time.perf_counter()
            outs[c] = lean(tokens, caches[c], position_ids=pos)
            times[c, r].append(time.perf_counter() - t)
            caches[c].crop(-r)
        same &= torch.equal(outs[True], outs[False])
for (c, r), ts in times.items():
    print(f"in_c={c} rows={r}: {1000*statistics.median(ts[1:]):.2f} ms")
print("bit-identical logits:", same)
