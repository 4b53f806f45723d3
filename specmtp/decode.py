"""The decode loop: draft -> verify -> accept -> commit -> observe, one round at a time.

Invariant between rounds: `context` [1, n] holds the prompt and every committed token;
the target's cache holds positions 0..n-2, and the last committed token is pending,
fed at the start of the next verify pass together with the drafts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specmtp.cache import CachedModel, kv_bytes_per_token, module_tensors, tensor_bytes
from specmtp.config import GenerationConfig, SamplingConfig
from specmtp.costmodel import CostModel
from specmtp.decode_schedules import DecodeSchedules
from specmtp.drafters import (
    Drafter,
    Outcome,
    Proposal,
    drafter_arm,
    drafter_catch_up,
    drafter_packed_bytes,
    empty_proposal,
    has_arms,
)
from specmtp.errors import SpecMTPError
from specmtp.kernels import packed_bytes
from specmtp.mtp_drafter import single_path
from specmtp.sampling import logits_to_probs
from specmtp.schedule import RoundRecord, Schedule
from specmtp.stats import GenerationStats
from specmtp.timings import TimingStore
from specmtp.tree import commit_tree_path, tree_forward
from specmtp.tree_verification import TreeVerdict, verify_tree_greedy, verify_tree_sampling
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
        prior_sampling: SamplingConfig | None = None,
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
        self.schedules = DecodeSchedules(
            self.target, drafter, context_length=context_length, prefill=self._prefill,
            cost_model=cost_model, prior_alphas=prior_alphas, arm_priors=arm_priors,
            prior_sampling=prior_sampling, timings=timings, draft_timings=draft_timings,
        )  # fmt: skip

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
        cost = self.schedules.costs(prompt_ids, config)  # before the prefill: may time T(n)
        arm_schedules: dict[str, Schedule] = {}  # one per drafter arm (drafters.drafter_arm)
        start = time.perf_counter()
        device = self.target.device
        generator = torch.Generator(device=device).manual_seed(config.seed)
        context = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)  # [1, n]
        self._prefill(context)
        stats.prompt_tokens = context.shape[1]
        stats.prefill_s = time.perf_counter() - start
        generated: list[int] = []
        while not stats.finish_reason:
            limit = self._draft_limit(context.shape[1], len(generated), config, max_positions)
            arm = drafter_arm(self.drafter, context) if self.drafter is not None else ""
            if arm not in arm_schedules:
                arm_schedules[arm] = self.schedules.for_arm(config, arm, cost)
            schedule = arm_schedules[arm]
            catch_up = drafter_catch_up(self.drafter, context) if self.drafter is not None else 0
            k = schedule.next_gamma(limit, catch_up) if limit > 0 else 0
            checking = k > 0 and schedule.checking  # a check: a tree drafter's top path alone
            with single_path(self.drafter) if checking else nullcontext():
                proposal, draft_s = self._draft(context, k, config, generator, max_positions)
            verdict, verify_s = self._verify(context, proposal, config, generator, stats)
            outcome = self._commit(context, proposal, verdict, k, stats)
            accepted = outcome.num_accepted
            if arm:
                stats.record_arm(arm, proposal.depth, accepted, k, draft_s)
            schedule.update(
                RoundRecord(
                    k, proposal.depth, accepted, outcome.verified, draft_s, verify_s,
                    caught_up=catch_up if k else 0, checking=checking,
                    accept_probs=_reached_probs(verdict, accepted, proposal.depth),
                )
            )  # fmt: skip
            self.schedules.learn(arm, schedule)
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

    def _prefill(self, context: torch.Tensor) -> None:
        """Reset the target and the drafter and read the context but its last token."""
        self.target.reset()
        if self.drafter is not None:
            self.drafter.reset()
        if context.shape[1] > 1:
            self.target.forward(context[:, :-1], last_only=True)
            if self.drafter is not None and self.drafter.needs_target_hidden:
                # The prompt's hidden states: MTP heads draft from the first round on.
                hidden = self.target.last_hidden  # [B, n-1, H]
                self.drafter.observe(Outcome(context, 0, hidden, verified=hidden.shape[1]))

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
        # Packed copies of weights (kernels.py) count too.
        packed = packed_bytes(self.target.model) + drafter_packed_bytes(self.drafter)
        weights = tensor_bytes(tensors) + packed
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


def _reached_probs(verdict: Verdict | TreeVerdict, accepted: int, depth: int) -> tuple[float, ...]:
    """The acceptance probabilities of the draft positions a round reached (its accepted
    drafts and the first rejected one), where the verdict knows them (sampling)."""
    if verdict.accept_probs is None:
        return ()
    return tuple(verdict.accept_probs[0, : min(accepted + 1, depth)].tolist())


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"
