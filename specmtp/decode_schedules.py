"""The draft-length schedules of one decoder (`decode.SpecDecoder`).

Which schedule each drafter arm of a sequence runs (`schedule.py`,
`adaptive_schedule.py`), the cost model the measured schedules (adaptive, guarded) steer
by, and what greedy sequences learned that the next sequence starts from. Costs come from a
tuning profile, from T(n) timed in this process (greedy: kernels and load differ between
processes), or from the timing store (sampled runs: a seed must give the same output in
every process, `timings.py`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import torch

from specmtp.adaptive_schedule import AdaptiveGamma, GuardedGamma
from specmtp.cache import CachedModel
from specmtp.config import MEASURED_SCHEDULES, GenerationConfig, SamplingConfig
from specmtp.costmodel import CostModel, measure_verify_costs
from specmtp.drafters import (
    LOOKUP_ARM,
    MODEL_ARM,
    Drafter,
    drafter_catch_up,
    has_arms,
)
from specmtp.kernels import MAX_ROWS
from specmtp.mtp_drafter import drafter_depth, drafter_tree
from specmtp.schedule import FixedGamma, HeuristicGamma, Schedule
from specmtp.timings import TimingStore

# Resets the target and the drafter and reads a context [1, n] into them (all but the last
# token), as a sequence's prefill does.
Prefill = Callable[[torch.Tensor], None]


class DecodeSchedules:
    """Schedules for the sequences of one target and drafter."""

    def __init__(
        self,
        target: CachedModel,
        drafter: Drafter | None,
        *,
        context_length: int,
        prefill: Prefill,
        cost_model: CostModel | None = None,
        prior_alphas: Sequence[float] = (),
        arm_priors: Mapping[str, Sequence[float]] | None = None,
        prior_sampling: SamplingConfig | None = None,
        timings: TimingStore | None = None,
        draft_timings: TimingStore | None = None,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.context_length = context_length
        self.prefill = prefill
        # Measured costs (from `specmtp tune`, or measured on first use) and prior
        # acceptances per draft position.
        self.given_cost_model = cost_model
        self._measured: CostModel | None = None
        # For sampled runs: T(n) and the drafter's D(k), the same in every process.
        self.timings = timings
        self.draft_timings = draft_timings
        self.prior_alphas = tuple(prior_alphas)
        # Per drafter arm (a tuning profile's arm_alphas); other arms start from prior_alphas
        self.arm_priors = {arm: tuple(a) for arm, a in (arm_priors or {}).items()}
        # The sampling the priors were measured under (a profile's temperature; None: any).
        # Acceptance falls as the temperature rises: at temperature 1.0 on random tokens a
        # prior tuned greedy (0.76 at the first position) kept a lookup-first tree drafting
        # about 10 rounds a sequence with nothing accepted (0.94x). Other sampling starts
        # from the schedule's neutral prior; the profile's costs hold at any temperature.
        self.prior_sampling = prior_sampling
        # Per drafter arm: seconds per draft token as greedy runs' schedules learned them
        # (no cost model gave them), at the machine's speed when T(n) was timed. The next
        # sequence starts from it: a drafter too dear to pay is then not tried again on
        # every sequence (its first round also reads the prompt: a whole extra prefill for
        # a draft model).
        self.learned_draft_s: dict[str, float] = {}
        # Per drafter arm, the same for a draft model's catch-up (AdaptiveGamma's
        # catch_up_record): without it every sequence would probe a drafter whose prompt
        # read cannot be repaid, to learn that again.
        self.learned_catch_up: dict[str, tuple[float, float]] = {}
        # The machine's speed against the T(n) timed in this process (measured over
        # modelled seconds), as the last greedy sequence's schedule left it. The next
        # starts from it: started from 1 while another process slowed every forward, a
        # sequence's first rounds stored T(1) dear and the drafts cheap (the speed factor
        # takes about ten rounds to catch up), and the target drafting for itself drafted.
        self.machine_speed = 1.0

    def costs(self, prompt_ids: Sequence[int], config: GenerationConfig) -> CostModel | None:
        """The cost model a measured schedule (adaptive, guarded) steers by; None for the
        others. T(n) is timed on first use: a benchmark calls this before its timed runs."""
        if config.schedule not in MEASURED_SCHEDULES or self.drafter is None:
            return None
        top = max(self.arm_gamma(config, arm) for arm in self._arms())
        return self.cost_model(prompt_ids, top, fresh=config.sampling.greedy)

    def _arms(self) -> tuple[str, ...]:
        return (LOOKUP_ARM, MODEL_ARM) if has_arms(self.drafter) else ("",)

    def arm_gamma(self, config: GenerationConfig, arm: str) -> int:
        """The largest γ a measured schedule of a drafter arm may ask: the config's (the
        model arm of a lookup-first drafter: `model_gamma` if given), but no more than the
        arm proposes.
        T(n) is timed up to the largest arm's γ + 1: `--gamma auto` allows up to 8, and for
        three MTP heads timing 9 sizes took 4.3-4.8 s of a one-shot `generate`, 4 sizes
        1.8-2.0 s (the default model, one thread)."""
        gamma = _config_gamma(config, arm)
        if arm == LOOKUP_ARM:
            return gamma
        depth = drafter_depth(getattr(self.drafter, "fallback", self.drafter))
        return gamma if depth is None else min(gamma, depth)

    def verify_rows(self, config: GenerationConfig) -> int:
        """The most rows one verify pass of `config` can hold, kernels.MAX_ROWS at most: 1
        without a drafter, the largest arm's γ + 1 (three MTP heads: 4 rows under `--gamma
        auto`, whose largest γ is 8), MAX_ROWS for trees and Hugging Face's heuristic (no
        bound). The kernel plan is measured for 1..this many rows."""
        if self.drafter is None:
            return 1
        if config.schedule == "heuristic" or drafter_tree(self.drafter) is not None:
            return MAX_ROWS
        return min(max(self.arm_gamma(config, arm) for arm in self._arms()) + 1, MAX_ROWS)

    def for_arm(self, config: GenerationConfig, arm: str, cost: CostModel | None) -> Schedule:
        """The schedule of one drafter arm. The model arm of a lookup-first drafter starts
        from `model_gamma`; the lookup arm, whose drafts cost next to nothing, learns its own
        draft cost rather than take the model drafter's."""
        gamma = _config_gamma(config, arm)
        if config.schedule == "heuristic":
            return HeuristicGamma(gamma)
        if cost is None:
            return FixedGamma(gamma)
        gamma = self.arm_gamma(config, arm)  # choices past what the arm proposes: none
        if arm == LOOKUP_ARM:
            cost = replace(cost, draft_fixed_s=0.0, draft_per_token_s=0.0, catch_up_per_token_s=0.0)
        # Sampling: γ must not depend on wall-clock timings, or a seed would not fix
        # the output (γ decides how the generator's numbers are used).
        measured = GuardedGamma if config.schedule == "guarded" else AdaptiveGamma
        schedule = measured(
            cost,
            max_gamma=gamma,
            prior=self.prior(config.sampling, arm),
            timing_feedback=config.sampling.greedy,
        )
        if config.sampling.greedy:
            schedule.target_speed = self.machine_speed
            schedule.catch_up_record = self.learned_catch_up.get(arm, schedule.catch_up_record)
            if schedule.learn_draft:
                schedule.draft_per_token_s = self.learned_draft_s.get(arm, 0.0)
        return schedule

    def prior(self, sampling: SamplingConfig, arm: str) -> tuple[float, ...]:
        """The α prior of an arm's schedule: the profile's, under the sampling it was tuned
        with; else none (the schedule's own neutral start)."""
        if self.prior_sampling is not None and sampling != self.prior_sampling:
            return ()
        return self.arm_priors.get(arm, self.prior_alphas)

    def learn(self, arm: str, schedule: Schedule) -> None:
        """Keep what a round taught a greedy schedule, for the next sequence to start from."""
        if isinstance(schedule, AdaptiveGamma) and schedule.timing_feedback:
            self.machine_speed = schedule.target_speed
            self.learned_catch_up[arm] = schedule.catch_up_record
            if schedule.learn_draft:
                self.learned_draft_s[arm] = schedule.unit_draft_s()

    def cost_model(self, prompt_ids: Sequence[int], gamma: int, *, fresh: bool = True) -> CostModel:
        """T(n) measured in this process (once; kernels and load differ between processes)
        with the given model's draft costs, if any. With fresh=False (sampling: a seed must
        give the same output in every process) the given model as it is, when it covers γ,
        else T(n) from the timing store when there is one (timings.py).
        Without draft costs the adaptive schedule learns them while generating."""
        given = self.given_cost_model
        wanted = min(gamma + 1, self.context_length - 1)
        if not fresh and given is not None and len(given.verify_s) >= wanted:
            return given
        if not fresh and self.timings is not None:
            return self._stored_cost_model(prompt_ids, gamma, wanted)
        measured = self._measure(prompt_ids, gamma)
        return measured if given is None else replace(given, verify_s=measured.verify_s)

    def _stored_cost_model(self, prompt_ids: Sequence[int], gamma: int, wanted: int) -> CostModel:
        """T(1)..T(wanted) and the draft costs from the timing stores, timed and stored
        first where they hold fewer."""
        assert self.timings is not None
        given = self.given_cost_model
        stored = self.timings.load()
        if len(stored) < wanted:
            stored = self.timings.keep(self._measure(prompt_ids, gamma).verify_s)
        # The first `wanted` sizes only: a tree's larger verify passes are extrapolated
        # from them, the same way whatever later runs appended.
        verify_s = stored[:wanted]
        cost = CostModel(verify_s) if given is None else replace(given, verify_s=verify_s)
        if cost.draft_s(1) > 0 or self.draft_timings is None:
            return cost
        # Without timing feedback nothing learns what a draft costs: taken as free,
        # the target drafting for itself drafted γ 8 every round at 0.71x. Nor what
        # its catch-up costs: taken as free, it probed after plain rounds at 0.92x.
        draft = self.draft_timings.load()
        if len(draft) < 3:
            draft = self.draft_timings.keep(self.measure_draft_cost(prompt_ids))
        a, b, read = draft[:3]
        return replace(cost, draft_fixed_s=a, draft_per_token_s=b, catch_up_per_token_s=read)

    def _measure(self, prompt_ids: Sequence[int], gamma: int) -> CostModel:
        """T(1)..T(γ + 1) timed in this process, once (again for a larger γ)."""
        wanted = min(gamma + 1, self.context_length - 1)
        measured = self._measured
        if measured is None or len(measured.verify_s) < wanted:
            # Measured after (part of) this prompt, leaving room for gamma + 1 more tokens;
            # a context too short for that measures what fits (the model extrapolates).
            ids = list(prompt_ids)[: max(2, self.context_length - gamma - 1)]
            ids = ids * 2 if len(ids) < 2 else ids
            largest = max(1, min(gamma + 1, self.context_length - len(ids) + 1))
            costs = measure_verify_costs(self.target, ids, max_tokens=largest, repeats=3)
            self._measured = measured = CostModel(costs)
            # Timed now, at the machine's current speed: what was learned against the
            # earlier timings moves to the new ones.
            self.learned_draft_s = {
                arm: s / self.machine_speed for arm, s in self.learned_draft_s.items()
            }
            self.learned_catch_up = {
                arm: (s / self.machine_speed, read)
                for arm, (s, read) in self.learned_catch_up.items()
            }
            self.machine_speed = 1.0
        return measured

    @torch.inference_mode()
    def measure_draft_cost(
        self, prompt_ids: Sequence[int], k: int = 3
    ) -> tuple[float, float, float]:
        """(a, b) of D(k) = a + b·k for the drafter (a lookup-first drafter's model arm),
        from proposals of 1 and k tokens after a prefill of the prompt, and the seconds per
        token of its catch-up: what a proposal of k that first reads the prompt takes beyond
        D(k), over the tokens read. Medians of 3 each."""
        ids = list(prompt_ids)[: max(2, self.context_length - k - 1)]
        context = torch.tensor([ids * 2 if len(ids) < 2 else ids], device=self.target.device)
        drafter = getattr(self.drafter, "fallback", self.drafter)
        assert drafter is not None  # only measured schedules with a drafter ask
        greedy = SamplingConfig()
        self.prefill(context)
        catch_up = drafter_catch_up(drafter, context)
        reads: list[float] = []
        for _ in range(3 if catch_up else 1):  # the first proposal reads the prompt
            drafter.reset()
            if drafter.needs_target_hidden:
                self.prefill(context)
            start = time.perf_counter()
            drafter.propose(context, k, greedy, None)
            reads.append(time.perf_counter() - start)
        times: dict[int, list[float]] = {1: [], k: []}
        for _ in range(3):
            for size, seconds in times.items():
                start = time.perf_counter()
                drafter.propose(context, size, greedy, None)
                seconds.append(time.perf_counter() - start)
        self.target.reset()
        drafter.reset()
        one, many = (statistics.median(times[size]) for size in (1, k))
        per_token = max(0.0, (many - one) / (k - 1))
        fixed = max(0.0, one - per_token)
        read_s = statistics.median(reads) - (fixed + per_token * k)
        return fixed, per_token, max(0.0, read_s) / catch_up if catch_up else 0.0


def _config_gamma(config: GenerationConfig, arm: str) -> int:
    """The γ the config gives an arm: `model_gamma`, if given, for the model arm."""
    if arm == MODEL_ARM and config.model_gamma is not None:
        return config.model_gamma
    return config.gamma
