"""The 0.5B draft's 7-node tree with its decoder layers in int8 and in 4 bits (#int4; the
LM head int8 in both), one process, one loaded 1.5B target, in turn on 4 training
instructions (96 tokens, γ = 3, greedy), outputs checked against each other. Run from the
repository root: python docs/bench-lean-2026-12-07/int4_ab.py"""
import json
import os
import time

import torch

from specmtp.api import SpecGenerator
from specmtp.models import load_model

torch.set_num_threads(2)
Q = os.path.expanduser("~/.cache/specmtp/qwen2.5-coder/")
D = Q + "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
target = load_model(Q + "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", dtype=torch.bfloat16)
gens = {name: SpecGenerator(target, draft=f"{D}#{name}#nodes=7", dtype=torch.bfloat16) for name in ("int8", "int4")}
assert all(g.decoder.drafter.runner.lean is not None for g in gens.values())
rows = [json.loads(line) for line in open("../shared/train_prompts/self_instruct_en/seed_tasks.jsonl")][:4]
for prompt in [r["instruction"] for r in rows]:
    texts = {}
    for name, gen in gens.items():
        start = time.perf_counter()
        c = gen.generate(prompt, chat=True, max_new_tokens=96, gamma=3)
        s, texts[name] = c.stats, c.text
        rounds = sum(s.verify_sizes.values())
        print(f"{name}: {time.perf_counter() - start:.2f}s draft {s.draft_s:.2f} verify {s.verify_s:.2f} "
              f"rounds {rounds} ms/round draft {1000 * s.draft_s / rounds:.1f} "
              f"verify {1000 * s.verify_s / rounds:.1f} tau {s.mean_accepted_tokens:.2f}", flush=True)
    print("same output:", texts["int8"] == texts["int4"], flush=True)
