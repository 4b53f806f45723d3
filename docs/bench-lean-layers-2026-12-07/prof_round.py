"""cProfile around the 15-node #int4 draft tree's propose (Qwen2.5-Coder 1.5B target, 0.5B
draft, bfloat16, 2 threads) on 3 training instructions x 64 tokens, γ 4 (argument), after a
warm-up; the 25 functions with the most own time. Run from the repository root:
python docs/bench-lean-layers-2026-12-07/prof_round.py 4"""
"""Profile the 15-node int4 draft tree's propose() on training instructions."""
import cProfile, json, os, pstats, sys, time
import torch
from specmtp.api import SpecGenerator
from specmtp.models import load_model
torch.set_num_threads(2)
Q = os.path.expanduser("~/.cache/specmtp/qwen2.5-coder/")
D = Q + "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
target = load_model(Q + "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", dtype=torch.bfloat16)
g = SpecGenerator(target, draft=f"{D}#int4#nodes=15", dtype=torch.bfloat16)
drafter = g.decoder.drafter
rows = [json.loads(l) for l in open("../shared/train_prompts/self_instruct_en/seed_tasks.jsonl")][10:14]
orig = drafter.propose
times = []
prof = cProfile.Profile()
def wrapped(*a, **k):
    t = time.perf_counter(); prof.enable()
    try: return orig(*a, **k)
    finally:
        prof.disable(); times.append(time.perf_counter() - t)
drafter.propose = wrapped
g.generate(rows[0]["instruction"], chat=True, max_new_tokens=16, gamma=4)  # warm
times.clear(); prof = cProfile.Profile()
for r in rows[1:]:
    c = g.generate(r["instruction"], chat=True, max_new_tokens=64, gamma=int(sys.argv[1]) if len(sys.argv)>1 else 4)
    print(f"tau {c.stats.mean_accepted_tokens:.2f} draft_s {c.stats.draft_s:.2f} verify_s {c.stats.verify_s:.2f}")
print("rounds", len(times), "ms/propose", 1000*sum(times)/len(times))
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
