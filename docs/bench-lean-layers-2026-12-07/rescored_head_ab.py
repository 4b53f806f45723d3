"""Tried and dropped: the #int4 draft's LM head as a 4-bit pass plus the 32 likeliest
rescored from the int8 weights, against the int8 head, in the lean step (1 and 4 rows after
a 200-token random context, medians of 14). Run from the repository root:
python docs/bench-lean-layers-2026-12-07/rescored_head_ab.py"""
import os, statistics, time, torch
from transformers import DynamicCache
from specmtp import int4, int8
from specmtp import native
from specmtp.int4 import Int4Product
from specmtp.lean import lean_forward
from specmtp.models import load_model
torch.set_num_threads(2)


class RescoredHead:
    """Tried and dropped: every logit from a 4-bit copy of the int8 head, then each row's 32
    largest recomputed from the int8 weights in float32."""

    def __init__(self, head, *, candidates=32):
        self.head, self.candidates = head, candidates
        self.coarse = Int4Product(head.weight.float() * head.scale[:, None], head.bias)
        self.top_k = native.lean_kernels().top_k

    def __call__(self, x):
        logits = self.coarse(x)
        n, vocab = logits.shape
        k = min(self.candidates, vocab)
        values, indices = torch.empty(n, k), torch.empty(n, k, dtype=torch.int64)
        self.top_k(logits.data_ptr(), n, vocab, k, values.data_ptr(), indices.data_ptr(), None)
        rows = self.head.weight[indices.view(-1)].view(n, k, -1).float()
        exact = torch.bmm(rows, x[:, :, None]).squeeze(-1) * self.head.scale[indices]
        return logits.scatter_(1, indices, exact)

m = load_model(os.path.expanduser("~/.cache/specmtp/qwen2.5-coder/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"), dtype=torch.bfloat16).model
int4.use_int4_products(m); int8.use_int8_products(m)
lean = lean_forward(m); assert lean is not None
heads = {"int8": lean.lm_head, "rescored": RescoredHead(lean.lm_head)}
V = m.config.vocab_size
ctx = torch.randint(0, V, (1, 200), generator=torch.Generator().manual_seed(0))
cache = DynamicCache(config=m.config)
with torch.inference_mode(): m(input_ids=ctx, cache=cache)
times = {(c, r): [] for c in heads for r in (1, 4)}
agree = []
for it in range(15):
    for r in (1, 4):
        tokens = torch.randint(0, V, (1, r)); pos = torch.arange(200, 200 + r)[None]
        outs = {}
        for c in (list(heads) if it % 2 else list(heads)[::-1]):
            lean.lm_head = heads[c]
            t = time.perf_counter(); outs[c] = lean(tokens, cache, position_ids=pos)[0]
            times[c, r].append(time.perf_counter() - t); cache.crop(-r)
        agree.append(torch.equal(outs["int8"].topk(4, -1).indices, outs["rescored"].topk(4, -1).indices))
for (c, r), ts in times.items():
    print(f"head={c} rows={r}: {1000*statistics.median(ts[1:]):.2f} ms a step")
print("same top-4 (random-token steps):", sum(agree), "of", len(agree))
