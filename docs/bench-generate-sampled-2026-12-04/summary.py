import json, statistics, sys
from collections import defaultdict
for T in ("0.7", "1.0"):
    try:
        rows = [json.loads(l) for l in open(f"/tmp/gd/results-T{T}.jsonl")]
    except FileNotFoundError:
        continue
    plain = {(r["source"], r["repeat"]): r for r in rows if r["draft"] is None}
    ratios = defaultdict(list); walls = defaultdict(list); taus = defaultdict(list)
    for r in rows:
        base = plain.get((r["source"], r["repeat"]))
        if base is None:
            continue
        key = "plain" if r["draft"] is None else f'{r["draft"]}@{r["gamma"]}'
        ms = 1000 * r["total_s"] / r["new_tokens"]; base_ms = 1000 * base["total_s"] / base["new_tokens"]
        ratios[key].append(base_ms / ms); walls[key].append(r["wall_s"] - base["wall_s"]); taus[key].append(r["tau"])
    print(f"T={T}: speedup of generation time per token against plain in the same prompt and seed")
    for key in ratios:
        rs = ratios[key]
        print(f"  {key:20s} n={len(rs)} median {statistics.median(rs):.2f}x  range {min(rs):.2f}-{max(rs):.2f}  "
              f"tau {statistics.median(taus[key]):.2f}  wall minus plain's {statistics.median(walls[key]):+.1f} s")
