"""γ pairs for a drafter with arms (`specmtp tune --draft ngram+SPEC`): one γ for the
rounds prompt lookup drafts, one for the model's, by coordinate search, and the profile
that keeps the fastest pair with α per arm."""

from __future__ import annotations

from collections.abc import Sequence

from specmtp.api import SpecGenerator
from specmtp.config import GenerationConfig
from specmtp.costmodel import CostModel, conditional_acceptance, expected_tokens, fit_draft_cost
from specmtp.drafters import LOOKUP_ARM
from specmtp.profile import Profile
from specmtp.stats import GenerationStats
from specmtp.tune_runs import (
    Log,
    TuneConfig,
    generation,
    model_round_draft_s,
    pair_generation,
    pooled_alphas,
    predicted_speedup,
    run_once,
    sweep_row,
    tokens_per_s,
    tune_meta,
)

Pair = tuple[int, int]  # (lookup γ, model γ); (0, 0) is plain decoding

PLAIN: Pair = (0, 0)


def sweep_pair_runs(
    plain: SpecGenerator,
    spec: SpecGenerator,
    prompt_ids: Sequence[list[int]],
    config: TuneConfig,
    log: Log,
) -> dict[Pair, list[GenerationStats]]:
    """γ pairs for a drafter with arms, by coordinate search: first the model rounds' γ
    M = 1..max_gamma (MTP heads: up to their depth) with the lookup rounds at the default γ,
    then the lookup rounds' γ N = 1..max_gamma with M at the fastest of the first pass.
    Plain decoding runs with every prompt of both passes, interleaved, so load changes hit
    every point alike."""
    runs: dict[Pair, list[GenerationStats]] = {PLAIN: []}
    lookup = min(GenerationConfig().gamma, config.max_gamma)
    top = range(1, config.max_gamma + 1)
    # MTP heads draft at most one token per depth: a longer model γ would repeat the deepest.
    depth = getattr(spec.decoder.drafter.fallback, "max_depth", config.max_gamma)
    first = [(lookup, m) for m in top if m <= depth]
    _pair_pass(plain, spec, prompt_ids, config, first, runs, log, "model γ")
    model = max(first, key=lambda pair: tokens_per_s(runs[pair]))[1]
    second = [(n, model) for n in top if (n, model) not in runs]
    _pair_pass(plain, spec, prompt_ids, config, second, runs, log, f"lookup γ (model γ {model})")
    return runs


def _pair_pass(
    plain: SpecGenerator,
    spec: SpecGenerator,
    prompt_ids: Sequence[list[int]],
    config: TuneConfig,
    pairs: Sequence[Pair],
    runs: dict[Pair, list[GenerationStats]],
    log: Log,
    varied: str,
) -> None:
    for i, ids in enumerate(prompt_ids, 1):
        for pair in (PLAIN, *pairs):
            gen = plain if pair == PLAIN else spec
            config_i = generation(config, 1) if pair == PLAIN else pair_generation(config, pair)
            runs.setdefault(pair, []).append(run_once(gen, ids, config_i))
        line = " ".join(f"{n}/{m}:{runs[(n, m)][-1].tokens_per_s:.1f}" for n, m in (PLAIN, *pairs))
        log(f"[{i}/{len(prompt_ids)}] {varied}: tokens/s by N/M {line}")


def arm_alphas(runs: Sequence[GenerationStats], max_gamma: int) -> dict[str, tuple[float, ...]]:
    """α_i per drafter arm over every run, counts summed before dividing; positions never
    reached get 0."""
    alphas: dict[str, tuple[float, ...]] = {}
    for arm in sorted({arm for s in runs for arm in s.arm_reached}):
        reached, accepted = [0] * max_gamma, [0] * max_gamma
        for s in runs:
            for i, (r, a) in enumerate(zip(s.arm_reached.get(arm, []), s.arm_accepted.get(arm, []),
                                           strict=True)):  # fmt: skip
                if i < max_gamma:
                    reached[i] += r
                    accepted[i] += a
        alphas[arm] = tuple(a or 0.0 for a in conditional_acceptance(reached, accepted))
    return alphas


def build_pair_profile(
    config: TuneConfig, runs: dict[Pair, list[GenerationStats]], verify_s: tuple[float, ...]
) -> Profile:
    """The profile of a γ pair sweep. The draft cost model is the model arm's alone (the
    lookup arm's drafts cost next to nothing, and the adaptive schedule learns them); the
    prediction for a pair weighs each arm's E(γ) by its share of the rounds."""
    drafting = {pair: rs for pair, rs in runs.items() if pair != PLAIN}
    samples = [(m, d) for (_, m), rs in drafting.items() for s in rs
               if (d := model_round_draft_s(s)) is not None]  # fmt: skip
    cost = CostModel(verify_s, *fit_draft_cost(samples))
    every = [s for rs in drafting.values() for s in rs]
    alphas, per_arm = pooled_alphas(every, config.max_gamma), arm_alphas(every, config.max_gamma)
    plain = tokens_per_s(runs[PLAIN])
    sweep = [sweep_row(runs[PLAIN], plain, 1.0, gamma=0, model_gamma=0)]
    for (n, m), rs in drafting.items():
        rounds = {arm: sum(s.arm_counts.get(arm, [0])[0] for s in rs) for arm in per_arm}
        total = sum(rounds.values()) or 1
        expected = sum(rounds[arm] / total * expected_tokens(per_arm[arm], n if arm == LOOKUP_ARM
                       else m) for arm in per_arm)  # fmt: skip
        row = sweep_row(rs, plain, predicted_speedup(cost, expected, rs), gamma=n, model_gamma=m)
        row["arm_rounds"] = rounds
        sweep.append(row)
    best = max(sweep[1:], key=lambda row: row["measured_speedup"])
    meta = tune_meta(config, len(runs[PLAIN]) // 2)  # plain runs once per prompt and pass
    first = [row for row in sweep[1:] if row["gamma"] == sweep[1]["gamma"]]
    meta["pair_search"] = {
        "lookup_gamma_while_model_varies": sweep[1]["gamma"],
        "model_gamma_while_lookup_varies": max(first, key=lambda r: r["measured_speedup"])[
            "model_gamma"
        ],
    }
    return Profile(
        config.target, config.draft, cost, alphas, int(best["gamma"]), tuple(sweep), meta,
        model_gamma=int(best["model_gamma"]), arm_alphas=per_arm,
    )  # fmt: skip
