"""The #int4 draft's prompt (random tokens, 60/120/250) through transformers' forward and
through the lean step in chunks of 32 and 16 rows, two runs each in turn (best of the two, ms);
the last position's argmax printed for each. Run from the repository root:
python docs/bench-lean-layers-2026-12-07/prefill_ab.py"""
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
for T in (60, 120, 250):
    ctx = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(T))
    res = {}
    for way in ("transformers", "lean32", "lean16", "transformers", "lean32", "lean16"):
        cache = DynamicCache(config=m.config)
        t = time.perf_counter()
        with torch.inference_mode():
            if way == "transformers":
                out = m(input_ids=ctx, cache=cache, logits_to_keep=1).logits[0, -1]
            else:
                size = int(way[4:])
                for s in range(0, T, size):
                    piece = ctx[:, s:s + size]
                    out = lean(piece, cache, position_ids=torch.arange(s, s + piece.shape[1])[None], last_only=True)[0, -1]
        res.setdefault(way, []).append(time.perf_counter() - t)
        res.setdefault(way + "_argmax", []).append(int(out.argmax()))
    print(T, {k: (min(v) * 1000 if not k.endswith("argmax") else v) for k, v in res.items()})
