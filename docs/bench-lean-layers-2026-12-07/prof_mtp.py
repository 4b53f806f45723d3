"""Where the default model's MTP drafting round goes: cProfile around the drafter's propose for
`ngram+mtp-tree#nodes=6#int8` (bfloat16, 1 thread, γ 3) on 5 training instructions x 96
tokens after a warm-up. Run from the repository root:
python docs/bench-lean-layers-2026-12-07/prof_mtp.py (prof_mtp.txt: its first lines)"""
import cProfile, json, pstats, time, torch
from specmtp.api import SpecGenerator
from specmtp.models import load_model
torch.set_num_threads(1)
target = load_model("default", dtype=torch.bfloat16)
g = SpecGenerator(target, draft="ngram+mtp-tree#nodes=6#int8", dtype=torch.bfloat16)
drafter = g.decoder.drafter
rows = [json.loads(l) for l in open("../shared/train_prompts/self_instruct_en/seed_tasks.jsonl")][50:56]
orig = drafter.propose
times = []; prof = cProfile.Profile()
def wrapped(*a, **k):
    t = time.perf_counter(); prof.enable()
    try: return orig(*a, **k)
    finally: prof.disable(); times.append(time.perf_counter() - t)
drafter.propose = wrapped
g.generate(rows[0]["instruction"], chat=True, max_new_tokens=16, gamma=3)
times.clear(); prof = cProfile.Profile()
tot_v = tot_d = 0; n_tok = 0; rounds = 0
for r in rows[1:]:
    c = g.generate(r["instruction"], chat=True, max_new_tokens=96, gamma=3)
    s = c.stats; tot_v += s.verify_s; tot_d += s.draft_s; n_tok += len(c.tokens); rounds += sum(s.verify_sizes.values())
print(f"rounds {rounds} tau {n_tok/rounds:.2f} verify ms/round {1000*tot_v/rounds:.1f} draft ms/round {1000*tot_d/rounds:.1f} propose ms {1000*sum(times)/len(times):.2f}")
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
