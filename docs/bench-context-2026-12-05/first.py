import time, torch
from specmtp.models import load_model
from specmtp.drafter_specs import build_drafter
from specmtp.decode import SpecDecoder
torch.set_num_threads(1)
target = load_model("default", dtype=torch.bfloat16)
drafter, vocab = build_drafter("mtp-tree#nodes=6", target, dtype=torch.bfloat16)
dec = SpecDecoder(target.model, drafter=drafter, vocab_size=vocab, context_length=8192)
g = torch.Generator().manual_seed(0)
for L in (1000, 4000):
    ctx = torch.randint(100, 20000, (1, L), generator=g)
    dec._prefill(ctx)
    s=time.perf_counter(); drafter.history.draft_tree(ctx, drafter.tree); first=time.perf_counter()-s
    s=time.perf_counter(); drafter.history.draft_tree(ctx, drafter.tree); second=time.perf_counter()-s
    print(L, f"first draft_tree {first*1e3:.0f} ms, then {second*1e3:.1f} ms")
