"""The default model's shipped MTP heads in int8 behind prompt lookup
(`ngram+mtp-tree#nodes=6#int8`), int8.c against fbgemm's product, one process: two
generators on one loaded target, run in turn on 8 training instructions (128 tokens,
γ = 3, greedy, bfloat16, 1 thread). Run from the repository root:
python docs/bench-int8c-2026-12-07/heads_ab.py"""

import json
import time

import torch

from specmtp import native
from specmtp.api import SpecGenerator
from specmtp.models import load_model

torch.set_num_threads(1)
SPEC = "ngram+mtp-tree#nodes=6#int8"
target = load_model("default", dtype=torch.bfloat16)
gens = {"native": SpecGenerator(target, draft=SPEC, dtype=torch.bfloat16)}
real = native.int8_kernel
native.int8_kernel = lambda: None
gens["fbgemm"] = SpecGenerator(target, draft=SPEC, dtype=torch.bfloat16)
native.int8_kernel = real
plain = SpecGenerator(target, dtype=torch.bfloat16)
path = "../shared/train_prompts/self_instruct_en/seed_tasks.jsonl"
prompts = [json.loads(line)["instruction"] for line in open(path)][4:12]
totals = {name: [0.0, 0.0, 0] for name in [*gens, "ar"]}
for prompt in prompts:
    for name, gen in [*gens.items(), ("ar", plain)]:
        start = time.perf_counter()
        done = gen.generate(prompt, chat=True, max_new_tokens=128, gamma=3)
        seconds = time.perf_counter() - start
        totals[name][0] += seconds
        totals[name][1] += done.stats.draft_s
        totals[name][2] += len(done.tokens)
        s = done.stats
        print(f"{name}: {seconds:.2f} s, draft {s.draft_s:.2f} s, τ {s.mean_accepted_tokens:.2f}")
for name, (seconds, draft, tokens) in totals.items():
    print(f"total {name}: {seconds:.1f} s, draft {draft:.2f} s, {tokens / seconds:.1f} tokens/s")
