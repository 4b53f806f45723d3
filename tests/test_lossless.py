"""Statistical losslessness at temperature > 0: speculative sampling emits exactly the target's
distribution, whatever the drafter proposes.

Two layers, both comparing an empirical joint distribution of the first T generated tokens
with the target's exact joint, computed by enumeration over a tiny vocabulary:

1. Verification level: a first-order Markov chain stands in for the target (p) and another
   for the draft model (q); whole speculative generations of N rows run at once through
   the real `verify_rejection_sampling`. Large N, so a wrong residual or bonus is caught;
   the same check is shown to fail for lossy rules defined here.
2. Loop level: the real `SpecDecoder` with tiny random Llama models (vocabulary 8), one
   seed per generation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from lossless_models import TINY_V, decoder_counts, peaked_target_and_draft, target_joint
from lossless_stats import P_FAIL, START, V, fit, markov_chains, markov_joint
from transformers import PreTrainedModel

from specmtp import decode
from specmtp.config import SamplingConfig
from specmtp.datastore import Datastore, DatastoreDrafter, StoreTreeDrafter
from specmtp.draft_model_drafter import DraftModelDrafter
from specmtp.drafters import (
    Drafter,
    LookupFirstDrafter,
    NgramDrafter,
    NoMemory,
    Outcome,
    Proposal,
)
from specmtp.merged_drafter import MergedDrafter
from specmtp.tree import TokenTree
from specmtp.tree_verification import TreeVerdict, verify_tree_sampling
from specmtp.verification import Verdict, verify_rejection_sampling

Verify = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Generator], Verdict]


# --- the statistic -----------------------------------------------------------------------


def test_fit_passes_exact_samples_and_fails_a_slightly_wrong_distribution() -> None:
    """The statistic itself: N exact draws pass; the same draws against a 2% shift fail."""
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(6, 6, generator=generator) ** 3
    probs[0, :3] = 0  # impossible cells are allowed
    probs /= probs.sum()
    draws = torch.multinomial(probs.flatten(), 200_000, replacement=True, generator=generator)
    counts = torch.bincount(draws, minlength=36).reshape(6, 6)
    assert fit(counts, probs).passes, fit(counts, probs)
    shifted = probs.clone()
    shifted[1, 1] += 0.02
    wrong = fit(counts, shifted / shifted.sum())
    assert wrong.p_value < P_FAIL and wrong.tv > wrong.tv_bound, wrong
    leaked = counts.clone()
    leaked[0, 0] = 1
    assert fit(leaked, probs).impossible == 1 and not fit(leaked, probs).passes


# --- layer 1: verification on Markov chains -------------------------------------------------


@dataclass(frozen=True)
class Simulation:
    counts: torch.Tensor  # [V] * length: how many rows began with each sequence
    bonus_rows: float  # fraction of rows with a bonus token among their first `length`
    recovered_rows: float  # fraction of rows with a recovered token among their first `length`


def simulate(
    verify: Verify,
    p: torch.Tensor,  # [V, V] target
    q: torch.Tensor,  # [V, V] draft model
    *,
    one_hot: bool,
    k: int,
    length: int,
    rows: int,
    seed: int,
) -> Simulation:
    """Speculative generation of `length` tokens in `rows` independent sequences at once.

    Each round every unfinished row drafts k tokens, either sampled from q (probabilistic
    drafter) or q's argmax (one-hot drafter: deterministic, no probabilities passed on),
    then commits the verdict's accepted drafts and its next token.
    """
    generator = torch.Generator().manual_seed(seed)
    out = torch.zeros(rows, length, dtype=torch.long)
    count = torch.zeros(rows, dtype=torch.long)
    last = torch.full((rows,), START)
    bonus = torch.zeros(rows, dtype=torch.bool)
    recovered = torch.zeros(rows, dtype=torch.bool)
    while bool((count < length).any()):
        live = (count < length).nonzero().squeeze(1)  # [m]
        drafts = [last[live]]
        for _ in range(k):
            row = q[drafts[-1]]  # [m, V]
            if one_hot:
                drafts.append(row.argmax(-1))
            else:
                drafts.append(torch.multinomial(row, 1, generator=generator)[:, 0])
        context = torch.stack(drafts, 1)  # [m, k+1]: last committed, then the drafts
        draft_probs = None if one_hot else q[context[:, :k]]  # [m, k, V]
        verdict = verify(context[:, 1:], draft_probs, p[context], generator)
        accepted = verdict.num_accepted  # [m]
        # The committed block: the accepted drafts, then the next token in column `accepted`.
        new = torch.cat([context[:, 1:], verdict.next_tokens[:, None]], 1)  # [m, k+1]
        new.scatter_(1, accepted[:, None], verdict.next_tokens[:, None])
        offsets = torch.arange(k + 1)
        position = count[live, None] + offsets  # [m, k+1]
        keep = (offsets <= accepted[:, None]) & (position < length)
        out[live[:, None].expand(-1, k + 1)[keep], position[keep]] = new[keep]
        next_position = count[live] + accepted  # where the recovered or bonus token lands
        inside = next_position < length
        bonus[live[inside & (accepted == k)]] = True
        recovered[live[inside & (accepted < k)]] = True
        last[live] = verdict.next_tokens
        count[live] += accepted + 1
    index = torch.zeros(rows, dtype=torch.long)
    for t in range(length):
        index = index * V + out[:, t]
    counts = torch.bincount(index, minlength=V**length).reshape([V] * length)
    return Simulation(counts, bonus.double().mean().item(), recovered.double().mean().item())


# --- lossy rules: the same signature as verify_rejection_sampling, each wrong in one place ----


def verify_resample_from_p(
    draft_tokens: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V]
    target_probs: torch.Tensor,  # [B, k+1, V]
    generator: torch.Generator,
) -> Verdict:
    """Lossy: accept with min(1, p/q) as the papers do, but on rejection resample from p
    instead of the residual normalize(max(0, p - q))."""
    k = draft_tokens.shape[1]
    if draft_probs is None:  # one-hot drafts
        draft_probs = torch.nn.functional.one_hot(draft_tokens, target_probs.shape[-1]).float()
    p_x = target_probs[:, :k].gather(-1, draft_tokens[..., None])[..., 0]  # [B, k]
    q_x = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]  # [B, k]
    accept = torch.rand(p_x.shape, generator=generator) * q_x < p_x
    accepted = accept.long().cumprod(-1).sum(-1)  # [B]
    p_next = target_probs[torch.arange(len(accepted)), accepted]  # [B, V]
    return Verdict(accepted, torch.multinomial(p_next, 1, generator=generator)[:, 0])


def verify_shortcut(
    draft_tokens: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V], ignored
    target_probs: torch.Tensor,  # [B, k+1, V]
    generator: torch.Generator,
) -> Verdict:
    """Lossy: accept x with probability p(x), and on rejection resample from all of p (the
    rule above with q one-hot). x can be drawn again after its rejection: emitted too often."""
    return verify_resample_from_p(draft_tokens, None, target_probs, generator)


def verify_bonus_from_last_draft_row(
    draft_tokens: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V]
    target_probs: torch.Tensor,  # [B, k+1, V]
    generator: torch.Generator,
) -> Verdict:
    """Lossy: the real rule, except that the bonus token is drawn from p_k (the row that
    scored x_k) instead of p_{k+1} (the row after x_k): an off-by-one in the bonus."""
    verdict = verify_rejection_sampling(draft_tokens, draft_probs, target_probs, generator)
    k = draft_tokens.shape[1]
    wrong_bonus = torch.multinomial(target_probs[:, k - 1], 1, generator=generator)[:, 0]  # [B]
    all_passed = verdict.num_accepted == k
    return Verdict(verdict.num_accepted, torch.where(all_passed, wrong_bonus, verdict.next_tokens))


def verify_diluted_residual(
    draft_tokens: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V]
    target_probs: torch.Tensor,  # [B, k+1, V]
    generator: torch.Generator,
) -> Verdict:
    """Lossy by a little: the recovered token comes from 0.9 * residual + 0.1 * p, a small
    error in the residual, to show how fine a difference the sample size resolves."""
    verdict = verify_rejection_sampling(draft_tokens, draft_probs, target_probs, generator)
    rows = torch.arange(len(verdict.num_accepted))
    p_next = target_probs[rows, verdict.num_accepted]  # [B, V]
    from_p = torch.multinomial(p_next, 1, generator=generator)[:, 0]
    rejected = verdict.num_accepted < draft_tokens.shape[1]
    diluted = rejected & (torch.rand(rejected.shape, generator=generator) < 0.1)
    return Verdict(verdict.num_accepted, torch.where(diluted, from_p, verdict.next_tokens))


# --- layer 1 tests ---------------------------------------------------------------------------

ROWS = 200_000
SAMPLINGS = {
    "t1.0": SamplingConfig(temperature=1.0),
    "t0.7": SamplingConfig(temperature=0.7),
    "t1.5": SamplingConfig(temperature=1.5),
    "t1.0-topk3": SamplingConfig(temperature=1.0, top_k=3),
    "t1.0-topp0.8": SamplingConfig(temperature=1.0, top_p=0.8),
    "t0.8-topk4-topp0.9": SamplingConfig(temperature=0.8, top_k=4, top_p=0.9),
}
# (sampling, k); the window is k + 1 tokens, so a first round that accepts all k drafts puts
# its bonus token inside it.
LOSSLESS_CASES = [(name, 2) for name in SAMPLINGS] + [("t1.0", 3), ("t1.0-topp0.8", 3)]


@pytest.mark.parametrize("drafter", ["model", "one_hot"])
@pytest.mark.parametrize(("sampling", "k"), LOSSLESS_CASES)
def test_rejection_sampling_emits_the_target_joint(sampling: str, k: int, drafter: str) -> None:
    p, q = markov_chains(SAMPLINGS[sampling])
    sim = simulate(
        verify_rejection_sampling,
        p,
        q,
        one_hot=drafter == "one_hot",
        k=k,
        length=k + 1,
        rows=ROWS,
        seed=1,
    )
    # Both ways a round ends must shape the window: a bonus token and a recovered token.
    assert sim.bonus_rows > 0.1, f"bonus tokens in {sim.bonus_rows:.1%} of rows"
    assert sim.recovered_rows > 0.3, f"recovered tokens in {sim.recovered_rows:.1%} of rows"
    result = fit(sim.counts, markov_joint(p, k + 1))
    assert result.passes, result


LOSSY_CASES = [
    (verify_shortcut, "one_hot", "t1.0"),
    (verify_shortcut, "model", "t1.0"),
    (verify_resample_from_p, "model", "t1.0"),
    (verify_resample_from_p, "model", "t1.0-topp0.8"),
    (verify_bonus_from_last_draft_row, "model", "t1.0"),
    (verify_bonus_from_last_draft_row, "one_hot", "t1.0-topk3"),
    (verify_diluted_residual, "model", "t1.0"),
    (verify_diluted_residual, "one_hot", "t0.7"),
]


@pytest.mark.parametrize(
    ("verify", "drafter", "sampling"), LOSSY_CASES, ids=lambda c: getattr(c, "__name__", c)
)
def test_lossy_rules_fail_the_same_check(verify: Verify, drafter: str, sampling: str) -> None:
    """The check above can fail: each wrong rule is rejected by a wide margin."""
    p, q = markov_chains(SAMPLINGS[sampling])
    sim = simulate(verify, p, q, one_hot=drafter == "one_hot", k=2, length=3, rows=ROWS, seed=1)
    result = fit(sim.counts, markov_joint(p, 3))
    assert result.p_value < P_FAIL, result
    assert result.tv > result.tv_bound, result


# --- layer 2: the decode loop with tiny random models (lossless_models) ---------------------

LOOP_SAMPLES = 3000  # generations per case: about 3 ms each with a draft model, 2 ms n-gram


@pytest.fixture(scope="module")
def tiny_models() -> tuple[PreTrainedModel, PreTrainedModel]:
    return peaked_target_and_draft()


class VerifySpy:
    """Wraps a verification rule inside the decode loop and counts how rounds end."""

    def __init__(self, verify: Verify) -> None:
        self.verify = verify
        self.drafting_rounds = 0  # rounds with at least one draft
        self.bonus_rounds = 0  # all drafts accepted: the next token is a bonus token
        self.rejecting_rounds = 0  # the next token is a recovered token

    def __call__(
        self,
        draft_tokens: torch.Tensor,
        draft_probs: torch.Tensor | None,
        target_probs: torch.Tensor,
        generator: torch.Generator,
    ) -> Verdict:
        verdict = self.verify(draft_tokens, draft_probs, target_probs, generator)
        k = draft_tokens.shape[1]
        if k:
            all_passed = int(verdict.num_accepted[0]) == k
            self.drafting_rounds += 1
            self.bonus_rounds += all_passed
            self.rejecting_rounds += not all_passed
        return verdict


def make_drafter(kind: str, draft: PreTrainedModel) -> Drafter:
    if kind == "ngram":
        return NgramDrafter()
    if kind == "store":  # every pair of tokens is in the store: it drafts whenever the
        # context has no match of its own; (a, b) goes on with (a + b) mod V, then a + 2b
        pairs = [(a, b) for a in range(TINY_V) for b in range(TINY_V)]
        chains = [[a, b, (a + b) % TINY_V, (a + 2 * b) % TINY_V] for a, b in pairs]
        return DatastoreDrafter(Datastore(chains, vocab_digest="tiny"))
    model = DraftModelDrafter(draft, vocab_size=TINY_V)
    # lookup-first: rounds drafted by lookup (one-hot q) and by the model (its q) mix
    return LookupFirstDrafter(model) if kind == "lookup+model" else model


@pytest.mark.parametrize(
    ("drafter", "sampling"),
    [
        ("model", "t1.0"),
        ("ngram", "t1.0"),
        ("lookup+model", "t1.0"),
        ("store", "t1.0"),
        pytest.param("model", "t0.7", marks=pytest.mark.slow),
        pytest.param("model", "t1.0-topk3", marks=pytest.mark.slow),
        pytest.param("model", "t1.0-topp0.8", marks=pytest.mark.slow),
        pytest.param("ngram", "t1.5", marks=pytest.mark.slow),
        pytest.param("ngram", "t0.8-topk4-topp0.9", marks=pytest.mark.slow),
    ],
)
def test_decoder_emits_the_target_joint(
    drafter: str,
    sampling: str,
    tiny_models: tuple[PreTrainedModel, PreTrainedModel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    target, draft = tiny_models
    spy = VerifySpy(verify_rejection_sampling)
    monkeypatch.setattr(decode, "verify_rejection_sampling", spy)
    drafting = make_drafter(drafter, draft)
    counts = decoder_counts(target, drafting, SAMPLINGS[sampling], LOOP_SAMPLES)
    if isinstance(drafting, LookupFirstDrafter):  # both kinds of round ran
        assert drafting.lookup_rounds > 0.1 * spy.drafting_rounds, vars(drafting)
        assert drafting.fallback_rounds > 0.1 * spy.drafting_rounds, vars(drafting)
    assert spy.bonus_rounds > 0.1 * spy.drafting_rounds, vars(spy)
    assert spy.rejecting_rounds > 0.1 * spy.drafting_rounds, vars(spy)
    result = fit(counts, target_joint(target, SAMPLINGS[sampling]))
    assert result.passes, result


# Ends in "3 5": not earlier in the prompt, nor a 3-gram of the store below, and the store
# continues "3 5" two ways: the first round is a tree of two candidates, accepted through
# the first about 12% of the time, the second 11% (300 generations).
TREE_PROMPT = [1, 2, 4, 3, 6, 3, 5]


class TreeSpy:
    """Wraps verify_tree_sampling inside the decode loop and counts how tree rounds end."""

    def __init__(self) -> None:
        self.rounds = 0
        self.second_child = 0  # the accepted path goes through a node's second candidate
        self.rejected = 0  # no draft accepted: the next token is a recovered one

    def __call__(
        self,
        tree: TokenTree,
        node_tokens: torch.Tensor,
        target_probs: torch.Tensor,
        generator: torch.Generator,
    ) -> TreeVerdict:
        verdict = verify_tree_sampling(tree, node_tokens, target_probs, generator)
        path = verdict.accepted_path(0)
        self.rounds += 1
        self.second_child += any(tree.paths[node][-1] > 0 for node in path)
        self.rejected += not path
        return verdict


def test_store_tree_decoding_emits_the_target_joint(
    tiny_models: tuple[PreTrainedModel, PreTrainedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store tree in the decode loop at temperature 1. Every pair of tokens goes on two
    ways in the store, and the prompt ends in a pair it has not seen before, so the first
    round verifies two candidates for the first new token (a tree); whether later rounds
    are trees, chains or copies depends on what was accepted."""
    target, _ = tiny_models
    spy = TreeSpy()
    monkeypatch.setattr(decode, "verify_tree_sampling", spy)
    pairs = [(a, b) for a in range(TINY_V) for b in range(TINY_V)]
    documents = [[a, b, (a + b) % TINY_V, (a + 2 * b) % TINY_V] for a, b in pairs]
    documents += [[a, b, (a * b + 1) % TINY_V, (b + 3) % TINY_V] for a, b in pairs]
    drafter = StoreTreeDrafter(Datastore(documents, vocab_digest="tiny"), nodes=4)
    counts = decoder_counts(target, drafter, SAMPLINGS["t1.0"], LOOP_SAMPLES, prompt=TREE_PROMPT)
    assert spy.rounds >= LOOP_SAMPLES, vars(spy)  # every generation starts with a tree
    # Each way a tree round ends: through the first candidate, the second, or neither.
    first_child = spy.rounds - spy.second_child - spy.rejected
    assert min(first_child, spy.second_child, spy.rejected) > 0.05 * spy.rounds, vars(spy)
    result = fit(counts, target_joint(target, SAMPLINGS["t1.0"], TREE_PROMPT))
    assert result.passes, result


class FixedHeads(NoMemory):
    """Stands in for MTP heads in a merged drafter: after token t, the paths t+1 t+2 and
    t+3 (mod V), whatever the context."""

    name = "fixed"
    needs_target_hidden = False
    max_depth = 2
    nodes = None
    tree = None

    def reset(self) -> None:
        pass

    def observe(self, outcome: Outcome) -> None:
        pass

    def drafted_paths(self, context: torch.Tensor, k: int) -> dict[tuple[int, ...], float]:
        last = int(context[0, -1])
        a, b = (last + 1) % TINY_V, (last + 3) % TINY_V
        return {(a,): -1.0, (a, (a + 1) % TINY_V): -2.0, (b,): -1.5}

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        chain = [p for p in self.drafted_paths(context, k) if len(p) == min(k, 2)][:1]
        return Proposal(torch.tensor(chain, dtype=torch.long).reshape(1, -1), None)


def test_merged_tree_decoding_emits_the_target_joint(
    tiny_models: tuple[PreTrainedModel, PreTrainedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup's copy and the heads' drafts as one tree (`ngram|SPEC`) in the decode loop
    at temperature 1. The prompt ends in "1 2", which occurred before followed by "4 3": the
    first round's tree holds the copy 4 3 beside the heads' 3 4 and 5."""
    target, _ = tiny_models
    spy = TreeSpy()
    monkeypatch.setattr(decode, "verify_tree_sampling", spy)
    drafter = MergedDrafter(FixedHeads(), lookup=NgramDrafter(max_ngram=3, min_ngram=2))  # type: ignore[arg-type]
    counts = decoder_counts(target, drafter, SAMPLINGS["t1.0"], LOOP_SAMPLES)
    assert spy.rounds >= LOOP_SAMPLES, vars(spy)  # every generation starts with a tree
    first_child = spy.rounds - spy.second_child - spy.rejected
    assert min(first_child, spy.second_child, spy.rejected) > 0.05 * spy.rounds, vars(spy)
    result = fit(counts, target_joint(target, SAMPLINGS["t1.0"]))
    assert result.passes, result


@pytest.mark.parametrize(
    ("verify", "drafter"),
    [
        pytest.param(verify_shortcut, "ngram", id="shortcut-ngram"),
        pytest.param(
            verify_resample_from_p, "model", id="resample_from_p-model", marks=pytest.mark.slow
        ),
    ],
)
def test_decoder_with_a_lossy_rule_fails_the_same_check(
    verify: Verify,
    drafter: str,
    tiny_models: tuple[PreTrainedModel, PreTrainedModel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loop-level check can fail too: the decode loop verifying with a lossy rule."""
    target, draft = tiny_models
    monkeypatch.setattr(decode, "verify_rejection_sampling", verify)
    sampling = SAMPLINGS["t1.0"]
    counts = decoder_counts(target, make_drafter(drafter, draft), sampling, LOOP_SAMPLES)
    result = fit(counts, target_joint(target, sampling))
    assert result.p_value < P_FAIL, result
    assert result.tv > result.tv_bound, result
