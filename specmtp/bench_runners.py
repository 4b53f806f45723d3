"""How a bench method spec becomes a runner: our decoder with a draft, or one of Hugging
Face's own speculative methods.

A method is named by a spec:
- `ar`: plain decoding by our decoder, the baseline.
- `DRAFT[@GAMMA]`: our decoder with a draft (see drafter_specs.build_drafter); GAMMA is N, `auto`
  (adaptive schedule, from the pair's tuning profile if any), `best` (the profile's fastest
  fixed γ), `hf` (Hugging Face's +2/-1 schedule run by our engine) or `guard:N` (N behind
  the never-slower guard: plain rounds while N is predicted not to pay); default: --gamma.
- `hf-assisted:MODEL[@N]`: transformers' own assisted generation with MODEL as assistant,
  N drafts per round; `@default` runs HF's own defaults instead (draft length, schedule and
  the confidence threshold that stops drafting early), as a user who sets nothing gets.
- `hf-prompt-lookup[:N][@N]`: transformers' prompt lookup (longest n-gram N).
- `hf-plain`: transformers' plain `generate()`, the decoding a user without speculation
  runs: stock kernels and attention in the run's dtype. In half precision our `ar` is
  row-invariant (exact, slower per step); this row shows what that costs, in the same run.
Hugging Face's methods run with stock kernels (F.linear), as its users run them; ours use
the measured kernel plan unless --plain-kernels.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

from specmtp.api import SpecGenerator, eos_token_ids, gamma_settings, reads_profile
from specmtp.bench_results import BASELINE
from specmtp.config import GenerationConfig
from specmtp.drafter_specs import load_draft_model
from specmtp.drafters import has_arms
from specmtp.errors import SpecMTPError
from specmtp.hf_baselines import HFGenerator, HFRun, HFSettings, hf_default_assisted
from specmtp.kernels import stock_kernels
from specmtp.models import LoadedModel, dtype_name
from specmtp.profile import Profile, find_profile
from specmtp.stats import GenerationStats, resident_bytes

HF_PREFIX = "hf-"
HF_DEFAULTS = "default"  # hf-assisted:MODEL@default: transformers' own assisted settings
HF_PLAIN = "hf-plain"


class Runner(Protocol):
    schedule: str  # how γ is chosen, for the report
    has_rounds: bool  # per-round statistics (τ, acceptance) exist
    profile: Profile | None  # the tuning profile it started from

    def run(self, ids: list[int], config: GenerationConfig) -> tuple[list[int], GenerationStats]:
        """Generate; the stats' total_s is the latency."""


class SpecRunner:
    """Our decoder, with the method's draft-length settings applied to every request."""

    has_rounds = True

    def __init__(self, gen: SpecGenerator, settings: dict[str, Any]) -> None:
        self.gen, self.settings = gen, settings
        self.schedule = _schedule_name(settings)
        self.profile = gen.profile

    def run(self, ids: list[int], config: GenerationConfig) -> tuple[list[int], GenerationStats]:
        result = self.gen.decoder.generate(ids, replace(config, **self.settings))
        return result.tokens, result.stats

    def prepare(self, ids: list[int], config: GenerationConfig) -> None:
        """Times what the schedule's cost model needs (T(n)) now, not inside a timed run."""
        self.gen.decoder.schedules.costs(ids, replace(config, **self.settings))


class HFRunner:
    """transformers' generate(): no per-round statistics, only tokens and timings."""

    has_rounds = False
    profile = None

    def __init__(self, gen: HFGenerator, schedule: str) -> None:
        self.gen, self.schedule = gen, schedule

    def run(self, ids: list[int], config: GenerationConfig) -> tuple[list[int], GenerationStats]:
        # As a Hugging Face user runs it: stock kernels, not our measured kernel plan.
        with stock_kernels(self.gen.target, self.gen.assistant):
            out = self._generate(ids, config)
        stats = GenerationStats(gamma=0, prompt_tokens=len(ids), new_tokens=len(out.tokens))
        stats.total_s, stats.first_token_s = out.latency_s, out.ttft_s
        stats.peak_rss_bytes = resident_bytes()
        return out.tokens, stats

    def _generate(self, ids: list[int], config: GenerationConfig) -> HFRun:
        s = config.sampling
        return self.gen.generate(
            ids,
            max_new_tokens=config.max_new_tokens,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            seed=config.seed,
        )


def _schedule_name(settings: dict[str, Any]) -> str:
    schedule = settings.get("schedule", "fixed")
    if schedule not in ("fixed", "guarded") or "gamma" not in settings:
        return schedule
    model = settings.get("model_gamma")
    return f"{schedule}:{settings['gamma']}" + ("" if model is None else f"/{model}")


def build_runner(
    spec: str, target: LoadedModel, base: GenerationConfig, default_gamma: str | None = None
) -> Runner:
    """The one place a method spec becomes a runner."""
    name, _, asked = spec.partition("@")
    gamma = asked or default_gamma or str(base.gamma)
    if spec == BASELINE:
        runner = SpecRunner(SpecGenerator(target), {})
        runner.schedule = "plain"
        return runner
    if name.startswith(HF_PREFIX):
        return _hf_runner(name, gamma, target, gamma_given=bool(asked))
    dtype = dtype_name(target.model.dtype)
    profile = find_profile(target.spec, name, dtype=dtype) if reads_profile(name, gamma) else None
    settings = gamma_settings(gamma, profile)
    replace(base, **settings)  # a bad γ fails now, not after the baseline has run
    generator = SpecGenerator(target, draft=name, profile=profile)
    if "model_gamma" in settings and not has_arms(generator.decoder.drafter):
        raise SpecMTPError(f"{spec}: a γ pair N/M needs an ngram+SPEC drafter")
    return SpecRunner(generator, settings)


def verify_rows(runners: dict[str, Runner], config: GenerationConfig) -> int:
    """The most rows our methods' verify passes can hold under `config` with each method's
    settings (SpecDecoder's schedules.verify_rows: γ + 1 where the drafter bounds γ, up to
    kernels.MAX_ROWS). The kernel plan is measured, and its weight layout chosen, for 1..this
    many rows."""
    rows = 1
    for runner in runners.values():
        if isinstance(runner, SpecRunner):  # Hugging Face's methods: stock kernels
            settings = replace(config, **runner.settings)
            rows = max(rows, runner.gen.decoder.schedules.verify_rows(settings))
    return rows


def _hf_runner(name: str, gamma: str, target: LoadedModel, *, gamma_given: bool) -> HFRunner:
    method, _, argument = name.partition(":")
    eos = eos_token_ids(target)
    if method == HF_PLAIN:
        if argument or gamma_given:
            raise SpecMTPError(f"bad {name!r}: {HF_PLAIN} drafts nothing, so takes no model or γ")
        return HFRunner(HFGenerator(target.model, settings=HFSettings("plain"),
                                    eos_token_ids=eos), "plain")  # fmt: skip
    if method == "hf-assisted" and gamma == HF_DEFAULTS:
        settings = hf_default_assisted()
        schedule = f"hf-default:{settings.num_tokens},{settings.confidence_threshold}"
    elif gamma.isdigit() and int(gamma) >= 1:
        settings = HFSettings("assisted", num_tokens=int(gamma))  # no early stop of drafting
        schedule = f"fixed:{gamma}"
    else:
        raise SpecMTPError(
            f"{name}: Hugging Face's methods take a fixed γ >= 1 (hf-assisted also "
            f"@{HF_DEFAULTS}: HF's own settings), got {gamma!r}"
        )
    if method == "hf-assisted":
        if not argument:
            raise SpecMTPError("hf-assisted needs its assistant: hf-assisted:MODEL")
        # The same weights as a `--draft` of this model in its plain form, if the bench has one.
        assistant = load_draft_model(argument, dtype=target.model.dtype, form=(None, None)).model
        return HFRunner(HFGenerator(target.model, settings=settings, assistant=assistant,
                                    eos_token_ids=eos), schedule)  # fmt: skip
    if method == "hf-prompt-lookup":
        if argument and not argument.isdigit():
            raise SpecMTPError(f"bad {name!r}: use hf-prompt-lookup or hf-prompt-lookup:N")
        settings = HFSettings(
            "prompt-lookup",
            num_tokens=int(gamma),
            max_matching_ngram_size=int(argument) if argument else None,
        )
        return HFRunner(HFGenerator(target.model, settings=settings, eos_token_ids=eos),
                        f"fixed:{gamma}")  # fmt: skip
    raise SpecMTPError(
        f"unknown Hugging Face method {name!r}: hf-assisted:MODEL, hf-prompt-lookup or hf-plain"
    )
