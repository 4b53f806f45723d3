import torch, time, statistics
import torch.nn.functional as F
torch.set_num_threads(1)
from specmtp.models import load_model
from specmtp.kernels import TunedLinear, pack_weight, packed_linear
from specmtp.kernels import kernel_plan
t = load_model("default", dtype=torch.bfloat16)
print("plan", kernel_plan(t.model).row_invariant)
W = [m.weight.detach() for m in t.model.modules() if isinstance(m, TunedLinear)]
P = [pack_weight(w) for w in W]
res = {"flinear": {}, "packed": {}}
with torch.inference_mode():
  for r in range(4):
    for n in (1, 2, 4, 8):
        xs = {i: torch.randn(n, i, dtype=torch.bfloat16) for i in (576, 1536)}
        for kind in res:
            s = time.perf_counter()
            for w, p in zip(W, P):
                x = xs[w.shape[1]]
                F.linear(x, w) if kind == "flinear" else packed_linear(x, p, None)
            res[kind].setdefault(n, []).append(time.perf_counter() - s)
for k, v in res.items(): print(k, {n: round(1e3 * statistics.median(t[1:]), 1) for n, t in v.items()})
# invariance of packed bf16 across row counts
x = torch.randn(8, 576, dtype=torch.bfloat16)
ok = all(torch.equal(packed_linear(x[:n], p, None), packed_linear(x, p, None)[:n]) for p, w in zip(P, W) if w.shape[1] == 576 for n in (1, 2, 3, 5))
print("packed bf16 row-invariant over 1..8 rows:", ok)
