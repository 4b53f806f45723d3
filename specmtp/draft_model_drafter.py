"""Drafting with a separate small LM: a draft model with the target's tokenizer, with its
own KV cache, optionally its own MTP heads and a reduced output vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specmtp.cache import CachedModel, kv_bytes_per_token, module_tensors
from specmtp.config import SamplingConfig
from specmtp.draft_model import DraftLM
from specmtp.drafters import Outcome, Proposal, empty_proposal
from specmtp.errors import SpecMTPError
from specmtp.heads import Heads, ParallelHeads, SequentialMTP
from specmtp.kernels import packed_bytes
from specmtp.mtp_cache import SequentialDraftCache
from specmtp.output_vocab import restrict_output_vocab
from specmtp.sampling import choose, greedy_tokens, logits_to_probs


class DraftModelDrafter:
    """A small causal LM with the target's tokenizer drafts k tokens autoregressively,
    keeping its own KV cache. Its cache holds `fed`, the ids it has seen; after each
    round it is cropped back to the part of `fed` that the target committed.

    With `multi_token` (a `draft_model.DraftLM` whose own MTP heads are used) or `heads`
    (MTP heads trained on this model by `specmtp train-mtp --target`), each draft forward
    proposes 1 + K tokens: the next one from its LM head, the K after it from its heads;
    the next forward feeds those tokens at once. Parallel heads read them all off the last
    hidden state. Sequential depths chain from the LM head's token, each over the history
    of this model's own hidden states (mtp_cache.py, as for the target's); their tokens are
    fixed choices given the ones before them, so their q is one-hot.

    With `output_ids` [N] (a reduced output vocabulary), the model's LM head is cut to
    those rows, so each draft step scores N tokens instead of V; its logits are put back
    in the full vocabulary with -inf elsewhere, so q is a distribution over V that is zero
    off those ids.

    With `min_probability` P > 0 (`MODEL#min-p=P`, LM head alone), drafting stops early in a
    round once the drafted path's own probability (the product of its tokens' q, the
    distribution they were drawn from) falls below P: the forward that would extend a path
    the draft itself doubts is skipped; the doubtful token is still proposed (verifying it
    costs a row, not a forward). As assisted generation's confidence threshold, on the
    path rather than the token, since a token is accepted only after all before it.
    """

    def __init__(
        self,
        model: PreTrainedModel | DraftLM,
        *,
        vocab_size: int,
        name: str = "draft",
        multi_token: bool = False,
        heads: Heads | None = None,
        output_ids: torch.Tensor | None = None,
        min_probability: float = 0.0,
    ) -> None:
        if not 0.0 <= min_probability < 1.0:
            raise SpecMTPError(f"a draft's min-p must be in [0, 1), got {min_probability}")
        if min_probability > 0.0 and (multi_token or heads is not None):
            raise SpecMTPError("min-p stops a draft model's own tokens, not its heads' drafts")
        self.min_probability = min_probability
        if multi_token and heads is None:
            heads = getattr(model, "heads", None)
            if heads is None:
                raise ValueError("multi-token drafting needs a draft with MTP heads")
        self.heads = heads
        # Sequential depths attend over this model's hidden states of every position fed.
        self.history = SequentialDraftCache(heads) if isinstance(heads, SequentialMTP) else None
        self.output_ids = output_ids
        if output_ids is not None:
            restrict_output_vocab(model, output_ids)
        self.runner = CachedModel(
            model, vocab_size=vocab_size, name=name, keep_hidden=heads is not None,
            hidden_layers=None if heads is None else heads.config.feature_layers,
        )  # fmt: skip
        self.name = name
        self.needs_target_hidden = False
        self.fed = torch.empty(1, 0, dtype=torch.long)  # [1, runner.length]
        self.expected = self.fed  # [1, m]: the last context it drafted from, then its drafts

    @property
    def multi_token(self) -> bool:
        return self.heads is not None

    def reset(self) -> None:
        self.runner.reset()
        self.fed = torch.empty(1, 0, dtype=torch.long, device=self.runner.device)
        self.expected = self.fed
        if self.history is not None:
            self.history.reset()

    def catch_up(self, context: torch.Tensor) -> int:
        """Tokens of `context` past its last drafts' common prefix, less the newest (a
        corrected or bonus token, read in every round)."""
        return max(0, context.shape[1] - _common_prefix(self.expected, context) - 1)

    def _rollback_to_prefix_of(self, context: torch.Tensor) -> None:
        common = _common_prefix(self.fed, context)
        self.runner.crop(common)
        self.fed = self.fed[:, :common]
        if self.history is not None:
            self.history.crop(common)

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        self._rollback_to_prefix_of(context[:, :-1])  # the last token must be fed for logits
        fresh = context[:, self.fed.shape[1] :]  # [B, u], u >= 1: corrected/bonus tokens too
        self.fed = context[:, : self.fed.shape[1]]
        tokens: list[torch.Tensor] = []  # each [B]
        probs: list[torch.Tensor | None] = []  # each [B, V] (sampling)
        path = torch.ones(context.shape[0])  # [B]: each row's drafted path's probability
        while len(tokens) < k and float(path.max()) >= self.min_probability:
            logits = self._full(self.runner.forward(fresh, last_only=True)[:, -1])  # [B, V]
            self.fed = torch.cat([self.fed, fresh], 1)
            if self.history is not None:
                self.history.add_hidden(self.runner.last_hidden)
            step = self._draft_step(logits, k - len(tokens), sampling, generator)
            tokens += [token for token, _ in step]
            probs += [q for _, q in step]
            fresh = torch.stack(tokens[-len(step) :], 1)  # [B, m]: fed next, if more needed
            if self.min_probability > 0.0:  # one token a step (no heads)
                path = path * _probability_of(tokens[-1], logits, probs[-1]).cpu()
        draft_probs = None if sampling.greedy or not probs else torch.stack(probs, 1)  # [B,k,V]
        if not tokens:
            return empty_proposal(context.shape[0], context.device)
        drafts = torch.stack(tokens, 1)  # [B, k]
        self.expected = torch.cat([context, drafts], 1)
        return Proposal(drafts, draft_probs)

    def _draft_step(
        self,
        logits: torch.Tensor,
        budget: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """What one draft forward proposes, at most `budget` tokens, from the LM head's
        logits [B, V] at the last position fed: each token [B] with its q [B, V] (None when
        greedy)."""
        if self.history is None:  # the LM head and the parallel heads read one hidden state
            rows = [logits, *self._head_logits()][:budget]  # each [B, V]
            return [_draw(row, sampling, generator) for row in rows]
        first, q = _draw(logits, sampling, generator)
        step = [(first, q)]
        depths = min(budget - 1, len(self.history.heads.depths))
        if depths > 0:  # the chain after `first`, one depth per token
            chain, _ = self.history.draft(torch.cat([self.fed, first[:, None]], 1), depths)
            for token in chain.unbind(1):  # [B]: the depth's top-1, a fixed choice
                fixed = None if q is None else F.one_hot(token, q.shape[-1]).to(q.dtype)
                step.append((token, fixed))
        return step

    def _full(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [B, N] over the output ids -> [B, V]; full-vocabulary logits as they are."""
        if self.output_ids is None:
            return logits
        full = logits.new_full((logits.shape[0], self.runner.vocab_size), float("-inf"))
        full[:, self.output_ids] = logits
        return full

    @torch.inference_mode()
    def _head_logits(self) -> list[torch.Tensor]:
        """Parallel heads' full-vocabulary logits at the last fed position, each [B, V]."""
        if not isinstance(self.heads, ParallelHeads):
            return []
        hidden = self.runner.last_hidden[:, -1:]  # [B, 1, H]
        logits = self.heads.to_full_logits(self.heads(hidden)[:, :, -1])  # [B, K, V]
        return list(logits[..., : self.runner.vocab_size].unbind(1))

    def observe(self, outcome: Outcome) -> None:
        self._rollback_to_prefix_of(outcome.context)

    def weight_tensors(self) -> list[torch.Tensor]:
        heads = [] if self.heads is None else module_tensors(self.heads)
        return list({id(t): t for t in module_tensors(self.runner.model) + heads}.values())

    def packed_bytes(self) -> int:
        return packed_bytes(self.runner.model)

    def kv_bytes(self) -> int:
        return self.runner.kv_bytes() + (0 if self.history is None else self.history.nbytes())

    def kv_bytes_per_token(self) -> int:
        own = kv_bytes_per_token(self.runner.model)
        return own if self.history is None else own + self.history.bytes_per_position()


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of token rows a [B, m] and b [B, n]."""
    m = min(a.shape[1], b.shape[1])
    same = (a[:, :m] == b[:, :m]).all(0)  # [m]
    return m if bool(same.all()) else int(same.long().argmin())


def _probability_of(
    token: torch.Tensor, logits: torch.Tensor, q: torch.Tensor | None
) -> torch.Tensor:
    """The probability [B] the draft gave `token` [B]: under q [B, V] when it sampled, under
    its own distribution (softmax of the logits [B, V]) when greedy."""
    dist = torch.softmax(logits.float(), -1) if q is None else q
    return dist.gather(-1, token[:, None])[:, 0].float()


def _draw(
    logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A token [B] from logits [B, V]: the argmax when greedy, else sampled from q [B, V]."""
    if sampling.greedy:
        return greedy_tokens(logits), None
    q = logits_to_probs(logits, sampling)
    return choose(q, sampling, generator), q
