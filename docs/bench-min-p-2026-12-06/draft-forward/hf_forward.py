import time, statistics, torch, os
torch.set_num_threads(2)
from specmtp.models import load_model
from specmtp.int8 import use_int8_products
from specmtp.cache import CachedModel
from specmtp.tree import additive_mask
Q=os.path.expanduser("~/.cache/specmtp/qwen2.5-coder/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
import sys; DT=getattr(torch, sys.argv[1]); d = load_model(Q, dtype=DT)
use_int8_products(d.model)
r = CachedModel(d.model, vocab_size=151936, name="d")
ctx = torch.randint(100, 20000, (1, 400))
def t(f, n=15):
    xs=[]
    for _ in range(n):
        t0=time.perf_counter(); f(); xs.append(time.perf_counter()-t0)
    return statistics.median(xs)*1000
with torch.inference_mode():
    r.forward(ctx, last_only=True)
    past = r.length
    def plain(rows):
        def f():
            r.forward(torch.randint(100,20000,(1,rows)), last_only=True); r.crop(past)
        return f
    def masked(rows):
        def f():
            allowed = torch.ones(rows, past+rows, dtype=torch.bool)
            mask = additive_mask(allowed, DT)[None,None]
            pos = torch.full((1,rows), past)
            r.forward(torch.randint(100,20000,(1,rows)), attention_mask=mask, position_ids=pos); r.crop(past)
        return f
    for rows in (1,2,4):
        print(rows, "plain last_only %.1f ms" % t(plain(rows)), "masked all-rows %.1f ms" % t(masked(rows)))
    # LM head alone
    h = torch.randn(1,4,896, dtype=DT)
    lm = d.model.lm_head
    for rows in (1,4):
        print("lm_head", rows, "%.1f ms" % t(lambda: lm(h[:, :rows])))
    layer = d.model.model.layers[0]
    mlp = layer.mlp
    for rows in (1,4):
        print("mlp", rows, "%.2f ms" % t(lambda: mlp(h[:, :rows])))
