"""The 0.5B draft's 15-node #int4 tree with its layers in one C call (lean.c's
specmtp_lean_layers) and through lean.py's layer_step from Python, in turn, in one process
with one loaded 1.5B target, on training instructions (96 tokens, greedy, γ = 4); outputs
checked against each other. Run from the repository root:
python docs/bench-lean-layers-2026-12-07/round_ab.py [PROMPTS]"""
import json
import os
import sys
import time

import torch

from specmtp.api import SpecGenerator
from specmtp.models import load_model

torch.set_num_threads(2)
Q = os.path.expanduser("~/.cache/specmtp/qwen2.5-coder/")
D = Q + "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
target = load_model(Q + "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", dtype=torch.bfloat16)
generator = SpecGenerator(target, draft=f"{D}#int4#nodes=15", dtype=torch.bfloat16)
lean = generator.decoder.drafter.runner.lean
assert lean is not None
count = int(sys.argv[1]) if len(sys.argv) > 1 else 6
rows = [json.loads(line) for line in open("../shared/train_prompts/self_instruct_en/seed_tasks.jsonl")]
generator.generate(rows[0]["instruction"], chat=True, max_new_tokens=16, gamma=4)  # warm-up
totals = {"C": [0.0, 0.0, 0], "Python": [0.0, 0.0, 0]}
for i, prompt in enumerate(r["instruction"] for r in rows[30 : 30 + count]):
    texts = {}
    for name in ("C", "Python") if i % 2 == 0 else ("Python", "C"):
        lean.in_c = name == "C"
        start = time.perf_counter()
        c = generator.generate(prompt, chat=True, max_new_tokens=96, gamma=4)
        s, texts[name], seconds = c.stats, c.text, time.perf_counter() - start
        rounds = sum(s.verify_sizes.values())
        totals[name][0] += seconds
        totals[name][1] += s.draft_s
        totals[name][2] += rounds
        print(f"{name}: {seconds:.2f}s draft {s.draft_s:.2f} verify {s.verify_s:.2f} "
              f"rounds {rounds} ms/round draft {1000 * s.draft_s / rounds:.1f} "
              f"verify {1000 * s.verify_s / rounds:.1f} tau {s.mean_accepted_tokens:.2f}", flush=True)
    print("same output:", texts["C"] == texts["Python"], flush=True)
for name, (seconds, draft, rounds) in totals.items():
    print(f"{name}: {seconds:.1f} s in all, drafting {1000 * draft / rounds:.1f} ms a round")
