"""Where one generation's time goes, per method: prefill, drafts, verify passes, and the
rest (the decode loop itself: schedule, acceptance, bookkeeping), for one Spec-Bench
question, methods interleaved per repetition. Used in docs/tuning-and-measurement.md,
section 15, to look for the adaptive schedule's own cost.

    python scripts/loop_cost.py 121 --repeats 3 --methods ar mtp@2 mtp@auto
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from specmtp import bench, bench_runners
from specmtp.config import GenerationConfig
from specmtp.kernels import measure_kernel_plan
from specmtp.models import load_model

QUESTIONS = Path("../shared/prompts/eval/spec_bench/question.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("question_id", type=int)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--methods", nargs="+", default=["ar", "mtp@2", "mtp@auto"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = [line for line in QUESTIONS.read_text().splitlines() if line.strip()]
    chosen = [line for line in lines if json.loads(line)["question_id"] == args.question_id]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "question.jsonl"
        path.write_text(chosen[0] + "\n")
        target = load_model("default")
        base = GenerationConfig(max_new_tokens=args.max_new_tokens)
        runners = {m: bench_runners.build_runner(m, target, base) for m in args.methods}
        plain = runners[args.methods[0]]
        assert isinstance(plain, bench_runners.SpecRunner)
        prompts = bench._load_prompts(bench.BenchConfig(prompts=(str(path),)), target)
    ids = bench._encode(plain.gen, prompts[0])
    measure_kernel_plan(plain.gen.decoder.target, ids, max_rows=5)
    for runner in runners.values():  # as the bench does: T(n) before any timed run
        if isinstance(runner, bench_runners.SpecRunner):
            runner.prepare(ids, base)
    for _ in range(args.repeats):
        for name, runner in runners.items():
            _, st = runner.run(ids, base)
            rest = st.total_s - st.prefill_s - st.draft_s - st.verify_s
            print(f"{name:10s} total {st.total_s:.3f} s  prefill {st.prefill_s:.3f}  "
                  f"draft {st.draft_s:.3f}  verify {st.verify_s:.3f}  rest {rest:.3f}  "
                  f"rounds {st.rounds}  γ {dict(st.requested_gammas)}")  # fmt: skip


if __name__ == "__main__":
    main()
