"""A draft LM head cut to the draft tokenizer's most frequent ids in the training texts
(FR-Spec's idea: ranked by measured frequency, not by id), against the full head and the
first 98,304 ids, in turn, one process: the 15-node #int4 tree, 8 training instructions x
96 tokens, γ = 5. Counts: every string in ../shared/train_prompts/ but self_instruct's
seed tasks (the instructions timed here). Run from the repository root:
python docs/bench-amx-2026-12-08/freq_vocab_ab.py (freq_vocab_ab.txt)"""
import csv, json, os, sys, time
from collections import Counter
from pathlib import Path
import torch
import specmtp.drafter_specs as drafter_specs
from specmtp.api import SpecGenerator
from specmtp.models import load_model
from specmtp.output_vocab import output_vocab_ids

torch.set_num_threads(2)
csv.field_size_limit(1 << 30)
Q = os.path.expanduser("~/.cache/specmtp/qwen2.5-coder/")
D = Q + "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
target = load_model(Q + "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", dtype=torch.bfloat16)
tok = target.tokenizer
root = Path("/work/shared/train_prompts")

def strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values(): yield from strings(v)
    elif isinstance(value, list):
        for v in value: yield from strings(v)

texts = []
for path in sorted(root.rglob("*")):
    if path.name == "seed_tasks.jsonl" or path.suffix not in (".jsonl", ".json", ".csv"):
        continue
    raw = path.read_text(encoding="utf-8")
    if path.suffix == ".csv":
        texts += [c for row in csv.reader(raw.splitlines()) for c in row]
    elif path.suffix == ".json":
        texts += list(strings(json.loads(raw)))
    else:
        texts += [s for line in raw.splitlines() if line.strip() for s in strings(json.loads(line))]
counts = Counter()
for i in range(0, len(texts), 512):
    for ids in tok(texts[i : i + 512], add_special_tokens=False)["input_ids"]:
        counts.update(ids)
print(f"{len(texts)} strings, {sum(counts.values())} tokens, {len(counts)} distinct ids", flush=True)
ranked = sorted(range(len(tok)), key=lambda i: (-counts.get(i, 0), i))
FREQ = {}

def patched(draft, size, usable, *, always=()):
    if size not in FREQ:
        return output_vocab_ids(draft, size, usable, always=always)
    first = output_vocab_ids(draft, 1, usable, always=always).tolist()  # specials + always
    ids = sorted(set(i for i in ranked[:size] if i < usable) | set(first))
    return torch.tensor(ids)

drafter_specs.output_vocab_ids = patched
specs = {"full": f"{D}#int4#nodes=15", "first-98304": f"{D}#vocab=98304#int4#nodes=15"}
for n in (32767, 49151):  # odd sizes: these take the frequency ranking
    FREQ[n] = True
    specs[f"freq-{n + 1}"] = f"{D}#vocab={n}#int4#nodes=15"
gens = {k: SpecGenerator(target, draft=v, dtype=torch.bfloat16) for k, v in specs.items()}
rows = [json.loads(l) for l in open(root / "self_instruct_en/seed_tasks.jsonl")]
for g in gens.values(): g.generate(rows[0]["instruction"], chat=True, max_new_tokens=16, gamma=5)
tot = {k: [0.0, 0.0, 0, 0] for k in gens}
for i, r in enumerate(rows[40:48]):
    for name in (list(gens) if i % 2 == 0 else list(gens)[::-1]):
        t = time.perf_counter()
        c = gens[name].generate(r["instruction"], chat=True, max_new_tokens=96, gamma=5)
        dt = time.perf_counter() - t; s = c.stats; rounds = sum(s.verify_sizes.values())
        tot[name][0] += dt; tot[name][1] += s.draft_s; tot[name][2] += rounds; tot[name][3] += len(c.tokens)
        print(f"{name}: {dt:.2f}s draft/round {1000*s.draft_s/rounds:.1f} tau {s.mean_accepted_tokens:.2f}", flush=True)
for k, (dt, d, rounds, n) in tot.items():
    print(f"{k}: {n/dt:.3f} tok/s, draft {1000*d/rounds:.1f} ms/round, tau {n/rounds:.2f}")
