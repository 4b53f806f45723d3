"""One-shot `specmtp generate` at temperature > 0: plain vs fixed γ 4 vs auto vs guard:4,
one process per run, alternating configs within each prompt. Prompts: the last of each
training prompt source after source_prompts(seed=0) (not the eval sets)."""
import json, subprocess, sys, time
sys.path.insert(0, "/work/main")
from specmtp.train_prompts import source_prompts

T = sys.argv[1]
repeat = sys.argv[2]
SOURCES = ["self_instruct_en", "mbpp", "gsm8k_train"]
prompts = {s: source_prompts(f"/work/main/../shared/train_prompts/{s}", seed=0)[-1] for s in SOURCES}
CONFIGS = [None] + [(d, g) for d in ("mtp", "distilled", "ngram") for g in ("4", "auto", "guard:4")]
out = open(f"/tmp/gd/results-T{T}.jsonl", "a")
for source, prompt in prompts.items():
    for cfg in CONFIGS:
        cmd = ["/work/main/.venv/bin/specmtp", "generate", prompt, "--chat", "--max-new-tokens", "128",
               "--threads", "1", "--temperature", T, "--seed", repeat, "--json"]
        if cfg:
            cmd += ["--draft", cfg[0], "--gamma", cfg[1]]
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
        wall = time.perf_counter() - start
        if done.returncode:
            print("FAILED", cmd, done.stderr[-500:]); continue
        stats = json.loads(done.stdout.strip().splitlines()[-1])
        rec = {"T": T, "repeat": repeat, "source": source, "draft": cfg and cfg[0], "gamma": cfg and cfg[1],
               "wall_s": round(wall, 2), "total_s": stats.get("total_s"), "new_tokens": stats.get("new_tokens"),
               "tau": stats.get("mean_accepted_tokens"), "gammas": stats.get("requested_gammas"), "drafted": stats.get("drafted_tokens")}
        print(json.dumps(rec), flush=True)
        out.write(json.dumps(rec) + "\n"); out.flush()
