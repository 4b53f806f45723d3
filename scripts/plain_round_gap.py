"""Per-round time of the target's forward in plain decoding (`ar`) and in the plain rounds
of a guarded or adaptive method, on random-token prompts, methods interleaved per prompt.
Used in docs/tuning-and-measurement.md, section 16: the bench timed the self-draft's plain
rounds slower than `ar`'s steps; this asks whether the decoder does, without the bench.

    python scripts/plain_round_gap.py --methods ar default@guard:2 --repeats 2
"""

from __future__ import annotations

import argparse
import statistics

import torch

from specmtp import bench_runners
from specmtp.config import GenerationConfig
from specmtp.models import load_model
from specmtp.prompts import random_prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", nargs="+", default=["ar", "default@guard:2"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = load_model("default")
    base = GenerationConfig(max_new_tokens=args.max_new_tokens)
    runners = {m: bench_runners.build_runner(m, target, base) for m in args.methods}
    vocab = target.model.config.vocab_size
    prompts = [list(p.ids or ()) for p in random_prompts(vocab_size=vocab, count=args.prompts,
                                                         length=64, seed=0)]  # fmt: skip
    for runner in runners.values():  # as the bench does: T(n) before any timed run
        if isinstance(runner, bench_runners.SpecRunner):
            runner.prepare(prompts[0], base)
    per_round: dict[str, list[float]] = {m: [] for m in args.methods}
    for _ in range(args.repeats):
        for ids in prompts:
            for name, runner in runners.items():
                _, st = runner.run(ids, base)
                if set(st.requested_gammas) == {0}:  # only plain rounds: comparable
                    per_round[name].append(st.verify_s / st.rounds)
    baseline = statistics.median(per_round[args.methods[0]])
    for name, times in per_round.items():
        if times:
            median = statistics.median(times)
            print(f"{name:18s} {len(times):3d} all-plain runs  median {1e3 * median:.1f} ms "
                  f"per round  ({median / baseline:.3f} of {args.methods[0]})")  # fmt: skip
        else:
            print(f"{name:18s} no run without drafts")


if __name__ == "__main__":
    main()
