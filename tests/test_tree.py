"""Tree verification: the tree shape, the tree forward, greedy and sampling rules, the commit.

Three layers:
1. The tree as data and the pure functions, against slow references.
2. Statistical losslessness of `verify_tree_sampling` on Markov chains (the statistic and the
   chains of test_lossless), and two wrong rules that the same check rejects.
3. Tiny random models: tree logits equal chain logits, the committed cache equals a fresh
   one, and greedy tree decoding equals `generate(do_sample=False)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path as FilePath
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_VOCAB, perturbed_copy, tiny_model
from lossless_stats import P_FAIL, START, V, fit, markov_chains, markov_joint
from transformers import PreTrainedModel

from specmtp import tree_verification, verification
from specmtp.cache import CachedModel
from specmtp.config import SamplingConfig
from specmtp.errors import SpecMTPError
from specmtp.tree import (
    Path,
    TokenTree,
    build_tree_tokens,
    check_tree_attention,
    commit_tree_path,
    likeliest_subtree,
    tree_attention_inputs,
    tree_forward,
)
from specmtp.tree_verification import verify_tree_greedy, verify_tree_sampling

# The Medusa-style example: two candidates at depth 1, three nodes below them, one at depth 3.
MEDUSA = TokenTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])


# --- layer 1: the tree as data --------------------------------------------------------------


def test_tree_derives_order_parents_depths_and_ancestors() -> None:
    shuffled = TokenTree([(0, 0, 0), (1, 0), (0,), (0, 1), (1,), (0, 0)])
    assert shuffled == MEDUSA and hash(shuffled) == hash(MEDUSA)
    assert MEDUSA.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert MEDUSA.parents == (0, 0, 1, 1, 2, 3)  # positions: 0 is the root, node i is i + 1
    assert MEDUSA.depths == (1, 1, 2, 2, 2, 3)
    assert MEDUSA.children.tolist() == [
        [0, 1], [2, 3], [4, -1], [5, -1], [-1, -1], [-1, -1], [-1, -1]
    ]  # fmt: skip
    assert MEDUSA.path_table.tolist() == [
        [0, -1, -1], [1, -1, -1], [0, 2, -1], [0, 3, -1], [1, 4, -1], [0, 2, 5]
    ]  # fmt: skip
    expected = torch.zeros(7, 7, dtype=torch.bool)
    ancestors = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 1, 3, 6]]
    for position, row in enumerate(ancestors):
        expected[position, row] = True
    assert torch.equal(MEDUSA.ancestor_mask, expected)
    assert MEDUSA.pruned(2).paths == MEDUSA.paths[:5]


@pytest.mark.parametrize(
    ("paths", "message"),
    [
        ([], "at least one node"),
        ([(0,), (1, 0)], "no parent"),
        ([(0,), (0,)], "twice"),
        ([(0,), ()], "one or more ranks"),
        ([(-1,)], "ints >= 0"),
    ],
)
def test_tree_refuses_what_is_not_a_tree(paths: list[Path], message: str) -> None:
    with pytest.raises(SpecMTPError, match=message):
        TokenTree(paths)


def test_tree_json_round_trip(tmp_path: FilePath) -> None:
    MEDUSA.save(tmp_path / "tree.json")
    assert TokenTree.load(tmp_path / "tree.json") == MEDUSA
    assert TokenTree.from_json("[[1], [0], [0, 0]]").paths == ((0,), (1,), (0, 0))
    for text in ("[[0], [0, 5", '{"a": 1}', "[[0], [0, 0.5]]"):
        with pytest.raises(SpecMTPError):
            TokenTree.from_json(text)


@pytest.mark.parametrize("seed", range(5))
def test_likeliest_subtree_keeps_the_likeliest_nodes(seed: int) -> None:
    """Against the slow reference: sort every drafted path by its log-probability and keep
    the first `budget` (a child is never likelier than its parent, so that is a tree)."""
    generator = torch.Generator().manual_seed(seed)
    wide = TokenTree([(a,) for a in range(4)] + [(a, b) for a in range(4) for b in range(3)]
                     + [(a, b, 0) for a in range(2) for b in range(3)])  # fmt: skip
    step = -torch.rand(wide.num_nodes, generator=generator) * 3  # each node's own log q
    logprob: dict[Path, float] = {}
    for path, own in zip(wide.paths, step.tolist(), strict=True):
        logprob[path] = own + logprob.get(path[:-1], 0.0)
    ranked = sorted(wide.paths, key=lambda p: -logprob[p])
    for budget in (1, 3, 7, wide.num_nodes, wide.num_nodes + 5):
        chosen = likeliest_subtree(logprob, budget)
        assert set(chosen.paths) == set(ranked[:budget])
    with pytest.raises(SpecMTPError, match="budget"):
        likeliest_subtree(logprob, 0)


def test_likeliest_subtree_goes_deep_when_sure_and_wide_when_not() -> None:
    sure = {(0,): -0.01, (1,): -5.0, (0, 0): -0.02, (0, 1): -6.0, (0, 0, 0): -0.05}
    unsure = {(0,): -0.7, (1,): -0.8, (0, 0): -2.0, (0, 1): -2.2, (0, 0, 0): -3.0}
    assert likeliest_subtree(sure, 3).paths == ((0,), (0, 0), (0, 0, 0))
    assert likeliest_subtree(unsure, 3).paths == ((0,), (1,), (0, 0))


def test_build_tree_tokens_per_depth_and_per_path() -> None:
    candidates = [  # per depth, [B=2, K_d]
        torch.tensor([[10, 11], [20, 21]]),
        torch.tensor([[30, 31], [30, 31]]),
        torch.tensor([[40], [40]]),
    ]
    assert build_tree_tokens(MEDUSA, candidates).tolist() == [
        [10, 11, 30, 31, 30, 40],
        [20, 21, 30, 31, 30, 40],
    ]
    by_path = {path: torch.tensor([i, 100 + i]) for i, path in enumerate(MEDUSA.paths)}
    assert build_tree_tokens(MEDUSA, by_path).tolist() == [list(range(6)), list(range(100, 106))]
    with pytest.raises(SpecMTPError, match="needs 2 candidates at depth 2"):
        build_tree_tokens(MEDUSA, [candidates[0], candidates[1][:, :1], candidates[2]])
    with pytest.raises(SpecMTPError, match="3 deep"):
        build_tree_tokens(MEDUSA, candidates[:2])
    with pytest.raises(SpecMTPError, match="no candidate tokens"):
        build_tree_tokens(MEDUSA, {(0,): torch.tensor([1])})


def test_tree_attention_inputs() -> None:
    mask, positions = tree_attention_inputs(MEDUSA, 4, dtype=torch.float32, device="cpu")
    assert mask.shape == (1, 1, 7, 11) and mask.dtype == torch.float32
    allowed = mask[0, 0] == 0
    assert bool(allowed[:, :4].all())  # every position sees the whole past
    assert torch.equal(allowed[:, 4:], MEDUSA.ancestor_mask)
    assert bool((mask[0, 0][~allowed] == torch.finfo(torch.float32).min).all())
    assert positions.tolist() == [[4, 5, 5, 6, 6, 6, 7]]
    with pytest.raises(SpecMTPError, match="float"):
        tree_attention_inputs(MEDUSA, 4, dtype=torch.bool, device="cpu")


def test_attention_without_4d_masks_is_refused() -> None:
    flash = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    with pytest.raises(SpecMTPError, match="flash_attention_2"):
        check_tree_attention(flash)


def reference_greedy(tree_: TokenTree, tokens: list[int], argmax: list[int]) -> list[int]:
    """Slow and obvious: try every node's root-to-node path; keep the first longest that
    matches the target's argmax after each parent. Returns its nodes, then the next token."""
    index = {path: i for i, path in enumerate(tree_.paths)}
    best: list[int] = []
    for path in tree_.paths:
        chain = [index[path[:d]] for d in range(1, len(path) + 1)]
        before = [0] + [node + 1 for node in chain[:-1]]  # the position each token follows
        if all(tokens[n] == argmax[b] for n, b in zip(chain, before, strict=True)):
            best = chain if len(chain) > len(best) else best
    return [*best, argmax[best[-1] + 1 if best else 0]]


def test_verify_tree_greedy_matches_the_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    batch, vocab = 4000, 3  # a small vocabulary, so that every path length occurs
    node_tokens = torch.randint(0, vocab, (batch, MEDUSA.num_nodes), generator=generator)
    logits = torch.randn(batch, MEDUSA.num_nodes + 1, vocab, generator=generator)
    verdict = verify_tree_greedy(MEDUSA, node_tokens, logits)
    argmax = logits.argmax(-1)
    for row in range(batch):
        expected = reference_greedy(MEDUSA, node_tokens[row].tolist(), argmax[row].tolist())
        assert [*verdict.accepted_path(row), int(verdict.next_tokens[row])] == expected
    assert set(verdict.num_accepted.tolist()) == {0, 1, 2, 3}


def test_sampling_with_a_one_hot_target_is_greedy() -> None:
    """Temperature 0 as a one-hot p: the sampling rule takes the greedy rule's path. (With
    distinct siblings: among duplicates greedy takes the deepest, sampling the first.)"""
    generator = torch.Generator().manual_seed(0)
    batch, vocab = 2000, 3
    candidates = [  # per depth, two distinct tokens per row
        torch.rand(batch, vocab, generator=generator).argsort(-1)[:, :2] for _ in range(3)
    ]
    node_tokens = build_tree_tokens(MEDUSA, candidates)  # [B, N]
    logits = torch.randn(batch, MEDUSA.num_nodes + 1, vocab, generator=generator)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()
    greedy = verify_tree_greedy(MEDUSA, node_tokens, logits)
    sampled = verify_tree_sampling(MEDUSA, node_tokens, one_hot, generator)
    assert torch.equal(sampled.path_nodes, greedy.path_nodes)
    assert torch.equal(sampled.next_tokens, greedy.next_tokens)
    assert set(greedy.num_accepted.tolist()) == {0, 1, 2, 3}


def test_tree_sampling_reports_each_depths_acceptance_probability() -> None:
    """With one-hot drafts, accept_probs[d] is the target's mass on the distinct children of
    the node the walk reached at depth d (a duplicate child counted once): the probability
    that one of them is accepted. Checked against the acceptances seen over 20,000 rows
    (within 4 standard errors) at the root and, given the first accepted, one level down."""
    generator = torch.Generator().manual_seed(3)
    batch, vocab = 20_000, 4
    p = torch.rand(MEDUSA.num_nodes + 1, vocab, generator=generator).softmax(-1)
    p = p.expand(batch, -1, -1)  # [B, N+1, V]: the same target rows in every row
    candidates = [torch.randint(vocab, (batch, 2), generator=generator) for _ in range(3)]
    node_tokens = build_tree_tokens(MEDUSA, candidates)  # duplicate siblings in ~1/4 rows
    verdict = verify_tree_sampling(MEDUSA, node_tokens, p, generator)
    first = candidates[0]  # [B, 2]: the root's children
    distinct = torch.nn.functional.one_hot(first, vocab).amax(1).float()  # [B, V]
    assert verdict.accept_probs is not None
    assert torch.allclose(verdict.accept_probs[:, 0], (distinct * p[:, 0]).sum(-1))
    reached_second = verdict.num_accepted >= 1
    walked = verdict.accept_probs[reached_second, 1]
    assert bool((verdict.accept_probs[~reached_second, 1] == 0).all())  # past the walk
    for seen, want in (
        (reached_second.float(), verdict.accept_probs[:, 0]),
        ((verdict.num_accepted[reached_second] >= 2).float(), walked),
    ):
        error = (want.mean() * (1 - want.mean()) / len(seen)) ** 0.5
        assert abs(seen.mean() - want.mean()) < 4 * error
    assert verify_tree_greedy(MEDUSA, node_tokens, p.log()).accept_probs is None


# --- layer 2: statistical losslessness on Markov chains -------------------------------------

BINARY = TokenTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)])  # 2 children, 2 levels
ROWS = 200_000
LENGTH = 3  # the window: a first round reaching a leaf ends it with a bonus token
SAMPLINGS = {
    "t1.0": SamplingConfig(temperature=1.0),
    "t0.7-topk3": SamplingConfig(temperature=0.7, top_k=3),
}


def draft_tree(
    q: torch.Tensor, last: torch.Tensor, *, draw: str, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft Markov chain q [V, V] grows BINARY under each row's last token [m]. The two
    children of a node are q's top-2 after it ("top2"), two independent draws from it
    ("iid"), or two draws without replacement ("distinct").
    Returns node tokens [m, N] and the q each node's token came from [m, N, V]."""
    tokens: dict[Path, torch.Tensor] = {}
    for path in BINARY.paths:
        parent = last if len(path) == 1 else tokens[path[:-1]]
        row = q[parent]  # [m, V]
        if draw == "top2":
            tokens[path] = row.topk(2).indices[:, path[-1]]
        elif draw == "iid":
            tokens[path] = torch.multinomial(row, 1, generator=generator)[:, 0]
        elif path[-1] == 0:  # distinct: draw both siblings at once
            pair = torch.multinomial(row, 2, replacement=False, generator=generator)
            tokens[path], tokens[(*path[:-1], 1)] = pair[:, 0], pair[:, 1]
    node_tokens = build_tree_tokens(BINARY, tokens)  # [m, N]
    positions = torch.cat([last[:, None], node_tokens], 1)  # [m, N+1]
    return node_tokens, q[positions[:, list(BINARY.parents)]]


@dataclass(frozen=True)
class TreeSimulation:
    counts: torch.Tensor  # [V] * LENGTH
    second_child_rounds: float  # rounds whose path went through a rank-2 child
    leaf_rounds: float  # rounds that reached a leaf (bonus token)
    rejected_rounds: float  # rounds that accepted nothing


SECOND_CHILDREN = [i for i, path in enumerate(BINARY.paths) if path[-1] == 1]


def verify_likeliest_subtrees(
    node_tokens: torch.Tensor,  # [m, N] BINARY's nodes
    draft_probs: torch.Tensor,  # [m, N, V]
    target_probs: torch.Tensor,  # [m, N+1, V]
    budget: int,
    generator: torch.Generator,
) -> tree_verification.TreeVerdict:
    """A dynamic tree per row: the `budget` nodes of BINARY with the largest draft
    log-probability (as `likeliest_subtree` picks them), verified in groups of rows with the
    same shape. Returns the verdict with BINARY's node indices."""
    chance = draft_probs.gather(2, node_tokens[..., None])[..., 0].log()  # [m, N]
    for i, parent in enumerate(BINARY.parents):
        if parent:
            chance[:, i] += chance[:, parent - 1]  # parents come first in node order
    keep = torch.zeros_like(chance, dtype=torch.bool).scatter(1, chance.topk(budget).indices, True)
    key = (keep.long() << torch.arange(BINARY.num_nodes)).sum(1)  # [m]: the shape's bits
    rows = node_tokens.shape[0]
    path_nodes = torch.full((rows, BINARY.max_depth), -1)
    next_tokens = torch.zeros(rows, dtype=torch.long)
    for shape in key.unique().tolist():
        group = (key == shape).nonzero().squeeze(1)  # [g]
        nodes = [i for i in range(BINARY.num_nodes) if shape >> i & 1]
        subtree = TokenTree(tuple(BINARY.paths[i] for i in nodes))  # ancestor-closed: q < 1
        verdict = verify_tree_sampling(
            subtree,
            node_tokens[group][:, nodes],
            target_probs[group][:, [0, *(i + 1 for i in nodes)]],
            generator,
        )
        found = verdict.path_nodes  # [g, D'] subtree indices
        back = torch.tensor(nodes)[found.clamp_min(0)].masked_fill(found < 0, -1)
        path_nodes[group, : back.shape[1]] = back
        next_tokens[group] = verdict.next_tokens
    return tree_verification.TreeVerdict(path_nodes, (path_nodes >= 0).sum(-1), next_tokens)


def simulate_tree(
    p: torch.Tensor,
    q: torch.Tensor,
    *,
    draw: str,
    pass_q: bool,
    seed: int,
    budget: int | None = None,
) -> TreeSimulation:
    """Tree speculative generation of LENGTH tokens in ROWS independent rows at once; the
    verifier gets the draft distributions when pass_q, else treats the drafts as one-hot.
    With a budget, each row verifies its own likeliest `budget` nodes (a dynamic tree)."""
    generator = torch.Generator().manual_seed(seed)
    depth = BINARY.max_depth
    out = torch.zeros(ROWS, LENGTH, dtype=torch.long)
    count = torch.zeros(ROWS, dtype=torch.long)
    last = torch.full((ROWS,), START)
    rounds = second = leaf = rejected = 0
    while bool((count < LENGTH).any()):
        live = (count < LENGTH).nonzero().squeeze(1)  # [m]
        node_tokens, draft_probs = draft_tree(q, last[live], draw=draw, generator=generator)
        positions = torch.cat([last[live, None], node_tokens], 1)  # [m, N+1]
        if budget is None:
            verdict = tree_verification.verify_tree_sampling(
                BINARY, node_tokens, p[positions], generator, draft_probs if pass_q else None
            )
        else:  # the shape depends on the drafts alone: one-hot q stays exact
            verdict = verify_likeliest_subtrees(
                node_tokens, draft_probs, p[positions], budget, generator
            )
        rounds += len(live)
        second += int(torch.isin(verdict.path_nodes, torch.tensor(SECOND_CHILDREN)).any(-1).sum())
        leaf += int((verdict.num_accepted == depth).sum())
        rejected += int((verdict.num_accepted == 0).sum())
        accepted, next_tokens = verdict.num_accepted, verdict.next_tokens  # [m]
        new = node_tokens.gather(1, verdict.path_nodes.clamp_min(0))  # [m, D]
        new = torch.cat([new, next_tokens[:, None]], 1)  # [m, D+1]
        new.scatter_(1, accepted[:, None], next_tokens[:, None])
        offsets = torch.arange(depth + 1)
        position = count[live, None] + offsets  # [m, D+1]
        keep = (offsets <= accepted[:, None]) & (position < LENGTH)
        out[live[:, None].expand(-1, depth + 1)[keep], position[keep]] = new[keep]
        last[live] = next_tokens
        count[live] += accepted + 1
    index = (out * V ** torch.arange(LENGTH - 1, -1, -1)).sum(1)
    counts = torch.bincount(index, minlength=V**LENGTH).reshape([V] * LENGTH)
    return TreeSimulation(counts, second / rounds, leaf / rounds, rejected / rounds)


# (how siblings are drawn, whether the verifier gets q)
LOSSLESS_DRAFTS = {
    "top2": ("top2", False),  # deterministic candidates, Medusa-style
    "iid-with-q": ("iid", True),  # SpecInfer's independent draws with their q
    "iid-one-hot": ("iid", False),  # one-hot q is exact for any tokens fixed in advance
}


@pytest.mark.parametrize("drafts", list(LOSSLESS_DRAFTS))
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_tree_sampling_emits_the_target_joint(sampling: str, drafts: str) -> None:
    p, q = markov_chains(SAMPLINGS[sampling])
    draw, pass_q = LOSSLESS_DRAFTS[drafts]
    sim = simulate_tree(p, q, draw=draw, pass_q=pass_q, seed=1)
    # Every way a round can end shapes the window, the second child's residual included.
    assert sim.second_child_rounds > 0.05, sim
    assert sim.leaf_rounds > 0.05, sim
    assert sim.rejected_rounds > 0.05, sim
    result = fit(sim.counts, markov_joint(p, LENGTH))
    assert result.passes, result


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_dynamic_tree_sampling_emits_the_target_joint(sampling: str) -> None:
    """Each round verifies the 3 likeliest of BINARY's top-2 nodes, so the shape changes
    with the drafts (deeper where the draft is sure, wider where it is not)."""
    p, q = markov_chains(SAMPLINGS[sampling])
    sim = simulate_tree(p, q, draw="top2", pass_q=False, seed=2, budget=3)
    assert sim.second_child_rounds > 0.02, sim  # rarer: a sure draft verifies a chain
    assert sim.leaf_rounds > 0.05, sim
    assert sim.rejected_rounds > 0.05, sim
    assert fit(sim.counts, markov_joint(p, LENGTH)).passes


MultiCandidate = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Generator | None],
    tuple[torch.Tensor, torch.Tensor],
]
REAL_RULE: MultiCandidate = tree_verification.multi_candidate_rejection


def rejection_against_original_p(
    p: torch.Tensor,  # [B, V]
    tokens: torch.Tensor,  # [B, C]
    draft_probs: torch.Tensor | None,  # [B, C, V]
    valid: torch.Tensor,  # [B, C]
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossy: a later child is tested against the node's ORIGINAL p, not the residual its
    rejected elder siblings left; the fallback residual is right."""
    choice = torch.full((tokens.shape[0],), -1)
    residual = p
    for c in range(tokens.shape[1]):
        x = tokens[:, c : c + 1]
        if draft_probs is None:
            q = torch.nn.functional.one_hot(x[:, 0], V).float()  # [B, V]
        else:
            q = draft_probs[:, c]  # [B, V]
        r = torch.rand(tokens.shape[0], generator=generator)
        trying = valid[:, c] & (choice < 0)
        accept = trying & (r * q.gather(1, x)[:, 0] < p.gather(1, x)[:, 0])
        choice = torch.where(accept, c, choice)
        residual = torch.where(
            (trying & ~accept)[:, None], verification.residual(residual, q), residual
        )
    return choice, residual


def rejection_fallback_from_p(
    p: torch.Tensor,
    tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    valid: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossy: the real rule, but when every child is rejected the recovered token is drawn
    from the full p instead of the residual."""
    choice, _ = REAL_RULE(p, tokens, draft_probs, valid, generator)
    return choice, p


@pytest.mark.parametrize("drafts", ["top2", "iid-with-q"])
@pytest.mark.parametrize("rule", [rejection_against_original_p, rejection_fallback_from_p])
def test_wrong_tree_rules_fail_the_same_check(
    rule: MultiCandidate, drafts: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tree_verification, "multi_candidate_rejection", rule)
    p, q = markov_chains(SAMPLINGS["t1.0"])
    draw, pass_q = LOSSLESS_DRAFTS[drafts]
    result = fit(simulate_tree(p, q, draw=draw, pass_q=pass_q, seed=1).counts, markov_joint(p, 3))
    assert result.p_value < P_FAIL, result
    assert result.tv > result.tv_bound, result


def test_q_of_siblings_drawn_without_replacement_fails_the_same_check() -> None:
    """The rule with q assumes independent siblings: the second of two distinct draws came
    from q with the first removed, not from q. Passing q anyway is lossy (pass None)."""
    p, q = markov_chains(SAMPLINGS["t1.0"])
    sim = simulate_tree(p, q, draw="distinct", pass_q=True, seed=1)
    result = fit(sim.counts, markov_joint(p, LENGTH))
    assert result.p_value < P_FAIL, result
    assert result.tv > result.tv_bound, result
    one_hot = simulate_tree(p, q, draw="distinct", pass_q=False, seed=1)
    assert fit(one_hot.counts, markov_joint(p, LENGTH)).passes


# --- layer 3: tiny random models -------------------------------------------------------------

ARCHS = ["llama", "qwen2", "gpt2"]
PROMPT = torch.tensor([[5, 17, 3, 42, 8, 23, 61, 7, 12]])

Draft = Callable[[torch.Tensor], list[torch.Tensor]]


def chain_candidates(model: PreTrainedModel, *, width: int = 2, sign: float = 1.0) -> Draft:
    """Medusa-like per-depth candidates from a model: its top-`width` tokens at each of the
    next MEDUSA.max_depth positions along its own greedy chain (sign -1: the bottom ones,
    which the target never accepts)."""

    @torch.no_grad()
    def draft(context: torch.Tensor) -> list[torch.Tensor]:
        candidates = []
        for _ in range(MEDUSA.max_depth):
            logits = sign * last_logits(model, context)  # [B, V]
            candidates.append(logits.topk(width, -1).indices)  # [B, width]
            context = torch.cat([context, candidates[-1][:, :1]], 1)
        return candidates

    return draft


@torch.no_grad()
def last_logits(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    return out.logits[:, -1, :TINY_VOCAB]  # [B, V]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tree_logits_equal_chain_logits(arch: str, attention: str) -> None:
    """Every node's logits equal those of its root-to-node path run as a plain chain; two
    rows with different tokens share the tree mask."""
    model = tiny_model(arch, seed=0)
    model.set_attn_implementation(attention)
    prompts = torch.cat([PROMPT, PROMPT.flip(1)])  # [2, n]
    target = CachedModel(model, vocab_size=TINY_VOCAB)
    target.forward(prompts[:, :-1])
    draft = chain_candidates(perturbed_copy(model, scale=1.0, seed=1))
    node_tokens = build_tree_tokens(MEDUSA, draft(prompts))  # [2, N]
    logits = tree_forward(target, MEDUSA, prompts[:, -1:], node_tokens)  # [2, N+1, V]
    assert target.length == prompts.shape[1] + MEDUSA.num_nodes
    torch.testing.assert_close(logits[:, 0], last_logits(model, prompts), atol=1e-5, rtol=1e-4)
    for node, row in enumerate(MEDUSA.path_table.tolist()):
        chain = [n for n in row if n >= 0]
        expected = last_logits(model, torch.cat([prompts, node_tokens[:, chain]], 1))  # [2, V]
        torch.testing.assert_close(logits[:, node + 1], expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_committed_cache_equals_a_fresh_one(arch: str) -> None:
    """Commit every node's path in turn (the greedy verdict's among them) and compare the
    cache with a fresh forward over the same tokens."""
    model = tiny_model(arch, seed=0)
    node_tokens = build_tree_tokens(MEDUSA, chain_candidates(model)(PROMPT))
    paths = [[n for n in row if n >= 0] for row in MEDUSA.path_table.tolist()]
    for path in [[], *paths]:
        target = CachedModel(model, vocab_size=TINY_VOCAB)
        target.forward(PROMPT[:, :-1])
        past = target.length
        logits = tree_forward(target, MEDUSA, PROMPT[:, -1:], node_tokens)
        if path == paths[-1]:  # the model drafting for itself: its greedy chain passes
            assert verify_tree_greedy(MEDUSA, node_tokens, logits).accepted_path() == path
        commit_tree_path(target, past, path)
        fresh = CachedModel(model, vocab_size=TINY_VOCAB)
        fresh.forward(torch.cat([PROMPT, node_tokens[:, path]], 1))
        assert target.length == fresh.length == PROMPT.shape[1] + len(path)
        for ours, theirs in zip(target.cache.layers, fresh.cache.layers, strict=True):
            torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(ours.values, theirs.values, atol=1e-5, rtol=1e-4)


def test_commit_refuses_a_path_outside_the_tree_forward() -> None:
    target = CachedModel(tiny_model("llama", seed=0), vocab_size=TINY_VOCAB)
    target.forward(PROMPT)
    with pytest.raises(SpecMTPError, match="not a tree path"):
        commit_tree_path(target, 3, [2, 1])
    with pytest.raises(SpecMTPError, match="not a tree path"):
        commit_tree_path(target, 3, [10])


def tree_generate_greedy(
    model: PreTrainedModel, draft: Draft, new_tokens: int
) -> tuple[list[int], list[list[int]]]:
    """A minimal greedy tree decode loop: the new tokens, and each round's accepted path."""
    target = CachedModel(model, vocab_size=TINY_VOCAB)
    context = PROMPT
    target.forward(context[:, :-1])  # the last prompt token is pending: the first root
    paths = []
    while context.shape[1] < PROMPT.shape[1] + new_tokens:
        past = target.length
        node_tokens = build_tree_tokens(MEDUSA, draft(context))  # [1, N]
        logits = tree_forward(target, MEDUSA, context[:, -1:], node_tokens)  # [1, N+1, V]
        verdict = verify_tree_greedy(MEDUSA, node_tokens, logits)
        path = verdict.accepted_path(0)
        commit_tree_path(target, past, path)
        context = torch.cat([context, node_tokens[:, path], verdict.next_tokens[:, None]], 1)
        paths.append(path)
    return context[0, PROMPT.shape[1] : PROMPT.shape[1] + new_tokens].tolist(), paths


# Noise on a copy of the target that accepts partly; random GPT-2 is far more predictable.
PARTLY = {"llama": 0.3, "qwen2": 0.3, "gpt2": 2.0}
SECOND_RANKED = {i for i, path in enumerate(MEDUSA.paths) if 1 in path}


@pytest.mark.parametrize(
    ("arch", "drafter"),
    [
        ("llama", "self"),
        ("llama", "partly"),
        ("llama", "bottom"),
        ("qwen2", "partly"),
        ("gpt2", "partly"),
    ],
)
def test_greedy_tree_decoding_equals_generate(arch: str, drafter: str) -> None:
    new_tokens = 48
    model = tiny_model(arch, seed=0)
    drafts = {
        "self": lambda: chain_candidates(model),  # all-accepting
        "partly": lambda: chain_candidates(perturbed_copy(model, scale=PARTLY[arch], seed=1)),
        "bottom": lambda: chain_candidates(model, sign=-1.0),  # never accepting
    }
    tokens, paths = tree_generate_greedy(model, drafts[drafter](), new_tokens)
    with torch.no_grad():
        expected = model.generate(
            PROMPT,
            attention_mask=torch.ones_like(PROMPT),
            max_new_tokens=new_tokens,
            do_sample=False,
        )[0, PROMPT.shape[1] :].tolist()
    assert tokens == expected
    lengths = [len(path) for path in paths]
    if drafter == "self":
        assert set(lengths) == {MEDUSA.max_depth}, paths
    elif drafter == "bottom":
        assert set(lengths) == {0}, paths
    else:  # rejections, long paths, and paths through second-ranked candidates
        assert min(lengths) == 0 and max(lengths) >= 2, paths
        assert any(SECOND_RANKED & set(path) for path in paths), paths
