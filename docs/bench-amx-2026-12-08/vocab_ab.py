"""The 15-node #int4 tree with the draft's full LM head and cut to its first 98,304 and
65,536 ids (`#vocab=N`), in turn, one process, one 1.5B target, 8 training instructions x
96 tokens, γ = 5; the greedy tree ranks a cut head's ids alone (no spreading of N logits
over the full vocabulary). Run from the repository root:
python docs/bench-amx-2026-12-08/vocab_ab.py (vocab_ab.txt)"""
import json, os, time, torch
from specmtp.api import SpecGenerator
from specmtp.models import load_model
torch.set_num_threads(2)
Q = os.path.expanduser("~/.cache/specmtp/qwen2.5-coder/")
D = Q + "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
target = load_model(Q + "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", dtype=torch.bfloat16)
specs = {
    "full": f"{D}#int4#nodes=15",
    "98304": f"{D}#vocab=98304#int4#nodes=15",
    "65536": f"{D}#vocab=65536#int4#nodes=15",
}
gens = {k: SpecGenerator(target, draft=v, dtype=torch.bfloat16) for k, v in specs.items()}
rows = [json.loads(l) for l in open("/work/shared/train_prompts/self_instruct_en/seed_tasks.jsonl")]
for g in gens.values(): g.generate(rows[0]["instruction"], chat=True, max_new_tokens=16, gamma=5)
tot = {k: [0.0, 0.0, 0, 0] for k in gens}
for i, r in enumerate(rows[40:48]):
    order = list(gens) if i % 2 == 0 else list(gens)[::-1]
    for name in order:
        t = time.perf_counter()
        c = gens[name].generate(r["instruction"], chat=True, max_new_tokens=96, gamma=5)
        dt = time.perf_counter() - t; s = c.stats; rounds = sum(s.verify_sizes.values())
        tot[name][0] += dt; tot[name][1] += s.draft_s; tot[name][2] += rounds; tot[name][3] += len(c.tokens)
        print(f"{name}: {dt:.2f}s draft/round {1000*s.draft_s/rounds:.1f} tau {s.mean_accepted_tokens:.2f}", flush=True)
for k, (dt, d, rounds, n) in tot.items():
    print(f"{k}: {n/dt:.3f} tok/s, draft {1000*d/rounds:.1f} ms/round, tau {n/rounds:.2f}")
