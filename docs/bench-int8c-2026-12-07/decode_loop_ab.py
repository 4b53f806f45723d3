"""The #int8 draft tree in the decode loop, int8.c against fbgemm's product, one process:
two generators on one loaded 1.5B target, their 0.5B drafts built with and without the
native kernel, run in turn on 4 training instructions (96 tokens, γ = 3, greedy). Run from
the repository root: python docs/bench-int8c-2026-12-07/decode_loop_ab.py"""
import json
import os
import time

import torch

from specmtp import native
from specmtp.api import SpecGenerator
from specmtp.models import load_model
torch.set_num_threads(2)
Q = os.path.expanduser("~/.cache/specmtp/qwen2.5-coder/")
D = Q + "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
target = load_model(Q + "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", dtype=torch.bfloat16)
gens = {"native": SpecGenerator(target, draft=D + "#int8#nodes=7", dtype=torch.bfloat16)}
real = native.int8_kernel
native.int8_kernel = lambda: None
gens["fbgemm"] = SpecGenerator(target, draft=D + "#int8#nodes=7", dtype=torch.bfloat16)
native.int8_kernel = real
rows = [json.loads(l) for l in open("../shared/train_prompts/self_instruct_en/seed_tasks.jsonl")][:4]
prompts = [r["instruction"] for r in rows]
for p in prompts:
    for name, g in gens.items():
        t = time.perf_counter()
        c = g.generate(p, chat=True, max_new_tokens=96, gamma=3)
        s = c.stats
        rounds = sum(s.verify_sizes.values())
        print(f"{name}: {time.perf_counter()-t:.2f}s draft {s.draft_s:.2f} verify {s.verify_s:.2f} rounds {rounds} ms/round draft {1000*s.draft_s/rounds:.1f} verify {1000*s.verify_s/rounds:.1f} tau {s.mean_accepted_tokens:.2f}", flush=True)
