import time, statistics, torch
from specmtp.models import load_model
from specmtp.drafter_specs import build_drafter
from specmtp.decode import SpecDecoder
torch.set_num_threads(1)
target = load_model("default", dtype=torch.bfloat16)
drafter, vocab = build_drafter("mtp-tree#nodes=4", target, dtype=torch.bfloat16)
dec = SpecDecoder(target.model, drafter=drafter, vocab_size=vocab, context_length=8192)
g = torch.Generator().manual_seed(0)
for L in (200, 1000, 2000, 4000):
    ctx = torch.randint(100, 20000, (1, L), generator=g)
    dec._prefill(ctx)
    times=[]
    for _ in range(10):
        s=time.perf_counter(); drafter.history.draft_tree(ctx, drafter.tree); times.append(time.perf_counter()-s)
    t1=[]
    for _ in range(5):
        s=time.perf_counter(); dec.target.forward(ctx[:, -1:]); t1.append(time.perf_counter()-s); dec.target.crop(L-1)
    print(L, f"draft_tree {statistics.median(times)*1e3:.1f} ms", f"T(1) {statistics.median(t1)*1e3:.1f} ms")
