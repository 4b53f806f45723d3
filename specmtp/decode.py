"""The decode loop: draft -> verify -> accept -> commit -> observe, one round at a time.

Invariant between rounds: `context` [1, n] holds the prompt and every committed token;
the target's cache holds positions 0..n-2, and the last committed token is pending,
fed at the start of the next verify pass together with the drafts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from specmtp.cache import CachedModel, kv_bytes_per_token, module_tensors, tensor_bytes
from specmtp.config import MEASURED_SCHEDULES, GenerationConfig, SamplingConfig
from specmtp.costmodel import CostModel, measure_verify_costs
from specmtp.drafters import (
    LOOKUP_ARM,
    MODEL_ARM,
    Drafter,
    Outcome,
    Proposal,
    drafter_arm,
    drafter_catch_up,
    drafter_depth,
    empty_proposal,
    has_arms,
)
from specmtp.errors import SpecMTPError
from specmtp.sampling import logits_to_probs
from specmtp.schedule import (
    AdaptiveGamma,
    FixedGamma,
    GuardedGamma,
    HeuristicGamma,
    RoundRecord,
    Schedule,
)
from specmtp.stats import GenerationStats
from specmtp.timings import TimingStore
from specmtp.tree import (
    TreeVerdict,
    commit_tree_path,
    tree_forward,
    verify_tree_greedy,
    verify_tree_sampling,
)
from specmtp.verification import Verdict, verify_greedy, verify_rejection_sampling

# Decodes token ids to text; needed only for stop strings.
Detokenize = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class GenerationResult:
    tokens: list[int]  # the new tokens only
    stats: GenerationStats


class SpecDecoder:
    """Speculative decoding of one target with one drafter (or none: plain decoding).

    Batch size 1 for now: shapes keep the batch dimension for batched decoding later.
    """

    def __init__(
        self,
        target: PreTrainedModel,
        *,
        drafter: Drafter | None = None,
        vocab_size: int,
        context_length: int,
        eos_token_ids: Sequence[int] = (),
        detokenize: Detokenize | None = None,
        cost_model: CostModel | None = None,
        prior_alphas: Sequence[float] = (),
        arm_priors: Mapping[str, Sequence[float]] | None = None,
        timings: TimingStore | None = None,
        draft_timings: TimingStore | None = None,
    ) -> None:
        self.target = CachedModel(
            target,
            vocab_size=vocab_size,
            name="target",
            keep_hidden=drafter is not None and drafter.needs_target_hidden,
            hidden_layers=getattr(drafter, "target_hidden_layers", None),
        )
        self.drafter = drafter
        self.context_length = context_length
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        # For the adaptive schedule: measured costs (from `specmtp tune`, or measured on
        # first use) and prior acceptances per draft position.
        self._cost_model = cost_model
        self._measured: CostModel | None = None
        # For sampled runs: T(n) and the drafter's D(k), the same in every process.
        self.timings = timings
        self.draft_timings = draft_timings
        self.prior_alphas = tuple(prior_alphas)
        # Per drafter arm (a tuning profile's arm_alphas); other arms start from prior_alphas
        self.arm_priors = {arm: tuple(a) for arm, a in (arm_priors or {}).items()}
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

    def generate(self, prompt_ids: Sequence[int], config: GenerationConfig) -> GenerationResult:
        stats = GenerationStats(gamma=max(config.gamma, config.model_gamma or 0))
        tokens = [t for block in self.run(prompt_ids, config, stats) for t in block]
        return GenerationResult(tokens, stats)

    def run(
        self, prompt_ids: Sequence[int], config: GenerationConfig, stats: GenerationStats
    ) -> Iterator[list[int]]:
        """Yield the tokens committed by each round, with every stop already applied."""
        self.check_request(prompt_ids, config)
        max_positions = self._max_positions(len(prompt_ids), config)
        cost = self.schedule_costs(prompt_ids, config)  # before the prefill: it runs the target
        schedules: dict[str, Schedule] = {}  # one per drafter arm (drafters.drafter_arm)
        start = time.perf_counter()
        device = self.target.device
        generator = torch.Generator(device=device).manual_seed(config.seed)
        context = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)  # [1, n]
        self._prefill(context, stats)
        stats.prefill_s = time.perf_counter() - start
        generated: list[int] = []
        while not stats.finish_reason:
            limit = self._draft_limit(context.shape[1], len(generated), config, max_positions)
            arm = drafter_arm(self.drafter, context) if self.drafter is not None else ""
            if arm not in schedules:
                schedules[arm] = self._schedule(config, arm, cost)
            schedule = schedules[arm]
            catch_up = drafter_catch_up(self.drafter, context) if self.drafter is not None else 0
            k = schedule.next_gamma(limit, catch_up) if limit > 0 else 0
            proposal, draft_s = self._draft(context, k, config, generator, max_positions)
            verdict, verify_s = self._verify(context, proposal, config, generator, stats)
            outcome = self._commit(context, proposal, verdict, k, stats)
            accepted = outcome.num_accepted
            if arm:
                stats.record_arm(arm, proposal.depth, accepted, k, draft_s)
            schedule.update(
                RoundRecord(
                    k, proposal.depth, accepted, outcome.verified, draft_s, verify_s,
                    caught_up=catch_up if k else 0,
                )
            )  # fmt: skip
            if isinstance(schedule, AdaptiveGamma) and schedule.timing_feedback:
                self.machine_speed = schedule.target_speed
                self.learned_catch_up[arm] = schedule.catch_up_record
                if schedule.learn_draft:
                    self.learned_draft_s[arm] = schedule.unit_draft_s()
            if self.drafter is not None:
                self.drafter.observe(outcome)
            new = outcome.context[0, context.shape[1] :].tolist()
            context = outcome.context
            block = self._apply_stops(new, generated, config, stats)
            generated += block
            self._account(stats, context.shape[1], len(generated), draft_s, verify_s, start)
            yield block

    def _account(
        self, stats: GenerationStats, n: int, generated: int, draft_s: float, verify_s: float,
        start: float,
    ) -> None:  # fmt: skip
        """Bring the run's statistics up to date after a round."""
        if not stats.finish_reason and n > self.context_length:
            stats.finish_reason = "context"
        stats.new_tokens = generated
        stats.total_s = time.perf_counter() - start
        stats.draft_s += draft_s
        stats.verify_s += verify_s
        stats.first_token_s = stats.first_token_s or stats.total_s

    def _prefill(self, context: torch.Tensor, stats: GenerationStats) -> None:
        self.target.reset()
        if self.drafter is not None:
            self.drafter.reset()
        stats.prompt_tokens = context.shape[1]
        if context.shape[1] > 1:
            self.target.forward(context[:, :-1], last_only=True)
            if self.drafter is not None and self.drafter.needs_target_hidden:
                # The prompt's hidden states: MTP heads draft from the first round on.
                hidden = self.target.last_hidden  # [B, n-1, H]
                self.drafter.observe(Outcome(context, 0, hidden, verified=hidden.shape[1]))

    def schedule_costs(
        self, prompt_ids: Sequence[int], config: GenerationConfig
    ) -> CostModel | None:
        """The cost model a measured schedule (adaptive, guarded) steers by; None for the
        others. T(n) is timed on first use: a benchmark calls this before its timed runs."""
        if config.schedule not in MEASURED_SCHEDULES or self.drafter is None:
            return None
        top = max(self._arm_gamma(config, arm) for arm in self._arms())
        return self.cost_model(prompt_ids, top, fresh=config.sampling.greedy)

    def _arms(self) -> tuple[str, ...]:
        return (LOOKUP_ARM, MODEL_ARM) if has_arms(self.drafter) else ("",)

    def _arm_gamma(self, config: GenerationConfig, arm: str) -> int:
        """The largest γ a measured schedule of a drafter arm may ask: the config's (the
        model arm of a lookup-first drafter: `model_gamma` if given), but no more than the
        arm proposes.
        T(n) is timed up to the largest arm's γ + 1: `--gamma auto` allows up to 8, and for
        three MTP heads timing 9 sizes took 4.3-4.8 s of a one-shot `generate`, 4 sizes
        1.8-2.0 s (the default model, one thread)."""
        gamma = self._config_gamma(config, arm)
        if arm == LOOKUP_ARM:
            return gamma
        depth = drafter_depth(getattr(self.drafter, "fallback", self.drafter))
        return gamma if depth is None else min(gamma, depth)

    @staticmethod
    def _config_gamma(config: GenerationConfig, arm: str) -> int:
        """The γ the config gives an arm: `model_gamma`, if given, for the model arm."""
        if arm == MODEL_ARM and config.model_gamma is not None:
            return config.model_gamma
        return config.gamma

    def _schedule(self, config: GenerationConfig, arm: str, cost: CostModel | None) -> Schedule:
        """The schedule of one drafter arm. The model arm of a lookup-first drafter starts
        from `model_gamma`; the lookup arm, whose drafts cost next to nothing, learns its own
        draft cost rather than take the model drafter's."""
        gamma = self._config_gamma(config, arm)
        if config.schedule == "heuristic":
            return HeuristicGamma(gamma)
        if cost is not None:
            gamma = self._arm_gamma(config, arm)  # choices past what the arm proposes: none
            if arm == LOOKUP_ARM:
                cost = replace(
                    cost, draft_fixed_s=0.0, draft_per_token_s=0.0, catch_up_per_token_s=0.0
                )
            # Sampling: γ must not depend on wall-clock timings, or a seed would not fix
            # the output (γ decides how the generator's numbers are used).
            measured = GuardedGamma if config.schedule == "guarded" else AdaptiveGamma
            schedule = measured(
                cost,
                max_gamma=gamma,
                prior=self.arm_priors.get(arm, self.prior_alphas),
                timing_feedback=config.sampling.greedy,
            )
            if config.sampling.greedy:
                schedule.target_speed = self.machine_speed
                schedule.catch_up_record = self.learned_catch_up.get(arm, schedule.catch_up_record)
                if schedule.learn_draft:
                    schedule.draft_per_token_s = self.learned_draft_s.get(arm, 0.0)
            return schedule
        return FixedGamma(gamma)

    def cost_model(self, prompt_ids: Sequence[int], gamma: int, *, fresh: bool = True) -> CostModel:
        """T(n) measured in this process (once; kernels and load differ between processes)
        with the given model's draft costs, if any. With fresh=False (sampling: a seed must
        give the same output in every process) the given model as it is, when it covers γ,
        else T(n) from the timing store when there is one (timings.py).
        Without draft costs the adaptive schedule learns them while generating."""
        given = self._cost_model
        wanted = min(gamma + 1, self.context_length - 1)
        if not fresh and given is not None and len(given.verify_s) >= wanted:
            return given
        if not fresh and self.timings is not None:
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
        measured = self._measure(prompt_ids, gamma)
        return measured if given is None else replace(given, verify_s=measured.verify_s)

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
        self._prefill(context, GenerationStats(gamma=k))
        catch_up = drafter_catch_up(drafter, context)
        reads: list[float] = []
        for _ in range(3 if catch_up else 1):  # the first proposal reads the prompt
            drafter.reset()
            if drafter.needs_target_hidden:
                self._prefill(context, GenerationStats(gamma=k))
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

    def check_request(self, prompt_ids: Sequence[int], config: GenerationConfig) -> None:
        """A one-line error for a request that cannot run (before any work on it)."""
        if config.model_gamma is not None and not has_arms(self.drafter):
            raise SpecMTPError(
                "a second gamma (for the model's rounds) needs an ngram+SPEC drafter"
            )
        if len(prompt_ids) == 0:
            raise SpecMTPError("the prompt is empty")
        if len(prompt_ids) >= self.context_length:
            raise SpecMTPError(
                f"the prompt has {len(prompt_ids)} tokens; the model's context is "
                f"{self.context_length} tokens"
            )
        if config.stop_strings and self.detokenize is None:
            raise SpecMTPError("stop strings need a tokenizer")
        self._max_positions(len(prompt_ids), config)  # a memory budget too small: refused

    def _draft_limit(
        self, n: int, generated: int, config: GenerationConfig, max_positions: int | None
    ) -> int:
        """Most drafts worth proposing: none past max_new_tokens, the model's context or
        the memory budget (a verify pass over k drafts fills the cache to n + k)."""
        if self.drafter is None:
            return 0
        limit = min(config.max_new_tokens - generated - 1, self.context_length - n)
        return limit if max_positions is None else min(limit, max_positions - n)

    def _max_positions(self, prompt_tokens: int, config: GenerationConfig) -> int | None:
        """Cache positions the memory budget allows; an error now if plain decoding of the
        whole request would not fit, rather than running out of memory later."""
        budget = config.max_memory_bytes
        if budget is None:
            return None
        tensors = module_tensors(self.target.model)
        per_token = kv_bytes_per_token(self.target.model)
        if self.drafter is not None:
            tensors += self.drafter.weight_tensors()
            per_token += self.drafter.kv_bytes_per_token()
        weights = tensor_bytes(tensors)
        positions = (budget - weights) // per_token
        # The cache peaks at the prompt plus every new token but the last (never fed back).
        needed = prompt_tokens + config.max_new_tokens - 1
        if positions < needed:
            raise SpecMTPError(
                f"max-memory {_size(budget)} is too small: weights take {_size(weights)} and "
                f"the KV cache of {prompt_tokens} prompt + {config.max_new_tokens} new tokens "
                f"{_size(needed * per_token)} (at most {max(0, positions - prompt_tokens + 1)} "
                "new tokens fit)"
            )
        return positions

    def _draft(
        self,
        context: torch.Tensor,
        k: int,
        config: GenerationConfig,
        generator: torch.Generator,
        max_positions: int | None,
    ) -> tuple[Proposal, float]:
        if k == 0:
            return empty_proposal(context.shape[0], context.device), 0.0
        start = time.perf_counter()
        proposal = self.drafter.propose(context, k, config.sampling, generator)
        seconds = time.perf_counter() - start
        if (
            max_positions is not None
            and context.shape[1] + proposal.tokens.shape[1] > max_positions
        ):
            # A tree wider than the memory left: verify no drafts this round.
            proposal = empty_proposal(context.shape[0], context.device)
        return proposal, seconds

    def _verify(
        self,
        context: torch.Tensor,
        proposal: Proposal,
        config: GenerationConfig,
        generator: torch.Generator,
        stats: GenerationStats,
    ) -> tuple[Verdict | TreeVerdict, float]:
        """One target forward over [last committed, *drafts], then the acceptance rule."""
        start = time.perf_counter()
        root = context[:, -1:]  # [1, 1]
        if proposal.tree is None:
            logits = self.target.forward(torch.cat([root, proposal.tokens], 1))  # [1, k+1, V]
        else:
            logits = tree_forward(self.target, proposal.tree, root, proposal.tokens)  # [1, N+1, V]
        verdict = self._accept(proposal, logits, config, generator)
        seconds = time.perf_counter() - start
        # The cache's high-water mark: before the rollback of rejected drafts.
        drafter_kv = 0 if self.drafter is None else self.drafter.kv_bytes()
        stats.record_memory(self.target.kv_bytes() + drafter_kv)
        return verdict, seconds

    @staticmethod
    def _accept(
        proposal: Proposal,
        logits: torch.Tensor,
        config: GenerationConfig,
        generator: torch.Generator,
    ) -> Verdict | TreeVerdict:
        tokens, tree = proposal.tokens, proposal.tree
        if config.sampling.greedy:
            if tree is None:
                return verify_greedy(tokens, logits)
            return verify_tree_greedy(tree, tokens, logits)
        target_probs = logits_to_probs(logits, config.sampling)  # [1, k+1 or N+1, V]
        if tree is None:
            return verify_rejection_sampling(tokens, proposal.probs, target_probs, generator)
        return verify_tree_sampling(tree, tokens, target_probs, generator)

    def _commit(
        self,
        context: torch.Tensor,
        proposal: Proposal,
        verdict: Verdict | TreeVerdict,
        requested: int,
        stats: GenerationStats,
    ) -> Outcome:
        """Keep the accepted drafts and the next token; roll the target cache back to match.

        The target's cache keeps the previous last token and the accepted drafts; the new
        next token stays pending for the next round.
        """
        past = context.shape[1] - 1  # the previous last token sits at this position
        if proposal.tree is None:
            kept = list(range(int(verdict.num_accepted[0]) + 1))  # rows of the verify pass
            self.target.crop(past + len(kept))
            accepted = proposal.tokens[:, : len(kept) - 1]
        else:
            path = verdict.accepted_path(0)
            kept = [0] + [node + 1 for node in path]
            commit_tree_path(self.target, past, path)
            stats.record_tree(proposal.tree.paths, path)
            accepted = proposal.tokens[:, path]
        hidden = self.target.last_hidden
        verified = proposal.tokens.shape[1] + 1
        stats.record_round(proposal.depth, len(kept) - 1, verified, requested)
        return Outcome(
            context=torch.cat([context, accepted, verdict.next_tokens[:, None]], 1),
            num_accepted=len(kept) - 1,
            target_hidden=None if hidden is None else hidden[:, kept],
            verified=verified,
        )

    def _apply_stops(
        self, new: list[int], generated: list[int], config: GenerationConfig, stats: GenerationStats
    ) -> list[int]:
        """The prefix of `new` up to and including the first stop; sets finish_reason."""
        for i, token in enumerate(new):
            total = len(generated) + i + 1
            if config.stop_on_eos and token in self.eos_token_ids:
                stats.finish_reason = "eos"
            elif config.stop_strings and self._hits_stop_string(generated + new[: i + 1], config):
                stats.finish_reason = "stop_string"
            elif total >= config.max_new_tokens:
                stats.finish_reason = "length"
            if stats.finish_reason:
                return new[: i + 1]
        return new

    def _hits_stop_string(self, tokens: list[int], config: GenerationConfig) -> bool:
        # A stop string ends in the newest token, so only a tail of the text matters; a
        # character can take up to 4 byte-level tokens.
        window = 4 * max(len(s) for s in config.stop_strings) + 4
        tail = self.detokenize(tokens[-window:])
        return any(s in tail for s in config.stop_strings)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"
