"""The adaptive schedule's current rules against the rules before commit 2e93f79, in one
bench run: `specmtp bench` with one more method, `DRAFT@auto-before`, which runs DRAFT's
adaptive schedule under the old rules (the fallback reading the recent ~20 rounds alone,
no standard error; the profile's later priors unscaled; see schedule_replay.py). Every
method decodes the same prompts interleaved, so machine noise hits both rule sets alike.
After the bench's own output, prints the per-group comparison against the best fixed γ and
the heuristic for each rule set.

    python scripts/schedule_ab.py --threads 1 \
        --prompts ../shared/prompts/eval/spec_bench/question.jsonl --per-category 2 \
        --max-new-tokens 64 --repeats 3 --draft mtp@1 --draft mtp@2 --draft mtp@auto \
        --draft mtp@auto-before --draft mtp@hf --out DIR
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path
from typing import Any

from schedule_replay import BeforeRules

from specmtp import bench, bench_runners, cli
from specmtp.adaptive_schedule import AdaptiveGamma, AdaptiveSettings
from specmtp.report_values import methods_of
from specmtp.schedule_report import schedule_rows, schedule_summary

SCRIPT = "scripts/schedule_ab.py"
BEFORE = "@auto-before"
BEFORE_SETTINGS = AdaptiveSettings(long_decay=AdaptiveSettings.decay, confidence=0.0)
build_runner = bench_runners.build_runner


def build_runner_with_before(spec: str, *args: Any, **kwargs: Any) -> bench_runners.Runner:
    if not spec.endswith(BEFORE):
        return build_runner(spec, *args, **kwargs)
    runner = build_runner(spec.removesuffix(BEFORE) + "@auto", *args, **kwargs)
    assert isinstance(runner, bench_runners.SpecRunner)
    decoder = runner.gen.decoder
    schedule_of = decoder.schedules.for_arm

    def before_schedule(*a: Any, **k: Any) -> Any:
        schedule = schedule_of(*a, **k)
        if not isinstance(schedule, AdaptiveGamma):
            return schedule
        return BeforeRules(
            schedule.cost,
            max_gamma=schedule.max_gamma,
            prior=schedule.prior,
            settings=BEFORE_SETTINGS,
            timing_feedback=schedule.timing_feedback,
        )

    decoder.schedules.for_arm = before_schedule  # type: ignore[method-assign]
    return runner


def summarise(data: dict[str, Any]) -> None:
    methods = methods_of(data)
    for label, rename in (("current rules", None), ("rules before 2e93f79", BEFORE)):
        chosen = {
            (name.removesuffix(BEFORE) + "@auto" if rename and name.endswith(BEFORE) else name): m
            for name, m in methods.items()
            if (name.endswith(BEFORE) if rename else not name.endswith(BEFORE))
            or not name.endswith(("@auto", BEFORE))
        }
        print(f"\n{label}")
        print("drafter  group                        best fixed   adaptive  /best   hf     /hf")
        for r in schedule_rows(chosen):
            hf = "-" if r.hf_speedup is None else f"{r.hf_speedup:5.2f}x {r.auto_vs_hf:5.2f}"
            print(f"{r.drafter:8s} {r.group:28s} {r.best_fixed:10s} {r.best_fixed_speedup:5.2f}x"
                  f"  {r.auto_speedup:5.2f}x {r.auto_vs_best:5.2f}  {hf}")  # fmt: skip
        print("\n".join(schedule_summary(schedule_rows(chosen))))


def main(argv: list[str]) -> int:
    bench.build_runner = build_runner_with_before  # run_bench looks it up in bench
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["bench", *argv])
    text = out.getvalue()
    print(text, end="")
    if "--out" in argv:  # the report names its command "specmtp ARGS": it was this script
        report = Path(argv[argv.index("--out") + 1]) / "report.md"
        args = " ".join(argv)
        text_now = report.read_text()
        report.write_text(text_now.replace(f"specmtp {args}", f"python {SCRIPT} {args}", 1))
    if code == 0:
        summarise(json.loads(text.strip().splitlines()[-1]))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
