"""Draft-model token trees (`MODEL#nodes=N`, draft_tree_drafter.py): the tree grown against a
slow reference of fresh forwards, greedy output equal to Hugging Face's, the draft's cache
back at the context after each round, the sampled output the target's, and the specs."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_VOCAB, hf_greedy, tiny_model
from lossless_models import TINY_V, decoder_counts, peaked_target_and_draft, target_joint
from lossless_stats import fit
from test_lossless import LOOP_SAMPLES, SAMPLINGS, TreeSpy
from test_schedule import DRAFT_S, FakeTime, decode_on_fake_clock
from transformers import PreTrainedModel

from specmtp import decode
from specmtp.api import SpecGenerator, build_drafter, eos_token_ids
from specmtp.config import GenerationConfig, SamplingConfig
from specmtp.draft_model import DraftLM, draft_config_for, init_from_target, save_draft
from specmtp.draft_model_drafter import DraftModelDrafter
from specmtp.draft_tree_drafter import DraftTreeDrafter
from specmtp.drafters import LookupFirstDrafter, Outcome, Proposal, TokenPath
from specmtp.errors import SpecMTPError
from specmtp.models import LoadedModel, load_model
from specmtp.mtp_drafter import single_path
from specmtp.tree import TokenTree

PROMPT = [5, 17, 3, 88, 41, 5, 17, 3, 60, 2, 33, 71]
NEW_TOKENS = 40
GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def target() -> PreTrainedModel:
    """A tiny random Llama with peaked next-token distributions: a random draft of it is
    sure enough of its top tokens that trees grow deep (depth 5 among 12 nodes) as well as
    wide."""
    model = tiny_model("llama", seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(32)
    return model


def make_draft(target: PreTrainedModel, *, copy: bool, seed: int = 1) -> DraftLM:
    """A two-layer draft: the target's own layers (it then is the target) or random ones."""
    torch.manual_seed(seed)
    draft = DraftLM(draft_config_for(target, num_layers=2, draft_vocab=None), target=target)
    if copy:
        init_from_target(draft, target, [0, 1])
    return draft.eval()


def reference_scores(
    draft: DraftLM, context: list[int], k: int, nodes: int, beam: int, min_probability: float = 0.0
) -> dict[TokenPath, float]:
    """The slow reference: the tree grown as draft_tree_drafter's docstring says, every
    node's log-probabilities from a fresh forward over the context and its path (no cache,
    no tree mask), growth stopping at the first depth whose likeliest node to expand has
    a probability below `min_probability`. The `nodes` likeliest paths, with their
    log-probabilities."""

    def children(path: TokenPath) -> dict[TokenPath, float]:
        with torch.no_grad():
            logits = draft(torch.tensor([context + list(path)])).logits[0, -1]  # [V]
        top = torch.log_softmax(logits.float(), -1).topk(beam)
        return {
            (*path, t): v for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True)
        }

    def likeliest(scores: dict[TokenPath, float]) -> list[TokenPath]:
        return sorted(scores, key=lambda p: (-scores[p], len(p)))[:nodes]

    scores = children(())
    for depth in range(1, k):
        expand = [p for p in likeliest(scores) if len(p) == depth][:beam]
        if expand and math.exp(scores[expand[0]]) < min_probability:
            break
        for path in expand:
            scores |= {c: v + scores[path] for c, v in children(path).items()}
    return {p: scores[p] for p in likeliest(scores)}


def proposed_paths(drafter: DraftTreeDrafter, context: list[int], k: int) -> dict[TokenPath, float]:
    """The token paths of one proposal, a chain's or a tree's, with their log-probabilities
    as the drafter scored them."""
    scores: dict[TokenPath, float] = {}
    spy = drafter._likeliest

    def recording(found: dict[TokenPath, float], nodes: int | None) -> list[TokenPath]:
        scores.update(found)
        return spy(found, nodes)

    drafter._likeliest = recording  # type: ignore[method-assign]
    try:
        proposal = drafter.propose(torch.tensor([context]), k, GREEDY, None)
    finally:
        del drafter._likeliest
    tokens = proposal.tokens[0].tolist()
    if proposal.tree is None:
        paths = [tuple(tokens[:d]) for d in range(1, len(tokens) + 1)]
    else:
        token_path: dict[tuple[int, ...], TokenPath] = {(): ()}
        for path, token in zip(proposal.tree.paths, tokens, strict=True):
            token_path[path] = (*token_path[path[:-1]], token)
        paths = [token_path[p] for p in proposal.tree.paths]
    return {path: scores[path] for path in paths}


@pytest.mark.parametrize(("k", "nodes"), [(1, 3), (3, 1), (3, 4), (4, 8), (5, 12)])
def test_the_tree_is_the_slow_references_and_the_cache_keeps_the_accepted_path(
    target: PreTrainedModel, k: int, nodes: int
) -> None:
    draft = make_draft(target, copy=False)
    drafter = DraftTreeDrafter(draft, vocab_size=TINY_VOCAB, nodes=nodes)
    context = PROMPT
    for _ in range(3):  # later rounds read from the cache the rounds before left
        expected = reference_scores(draft, context, k, nodes, drafter.beam)
        proposed = proposed_paths(drafter, context, k)
        assert proposed.keys() == expected.keys()
        for path, score in proposed.items():
            assert score == pytest.approx(expected[path], abs=1e-4), path
        assert len(expected) == min(nodes, len(expected)) and max(map(len, expected)) <= k
        # The context, then the nodes the tree fed (every one but the leaves).
        assert drafter.runner.length == len(context) + len(drafter.tree_fed)
        deepest = max(expected, key=lambda p: (len(p), expected[p]))
        fed = [deepest[:depth] in drafter.tree_fed for depth in range(1, len(deepest) + 1)]
        assert all(fed[:-1])  # every ancestor of a node was fed to draft it
        context = [*context, *deepest, 7]  # as if the target accepted it, then drew 7
        # Next round feeds 7 and, unless fed, the leaf; not the path again. The scores
        # next round (above) read the path's keys and values from the tree's cache.
        assert drafter.catch_up(torch.tensor([context])) == fed.count(False)
        # The decode loop asks after the round's observe, which moved the path in place.
        drafter.observe(
            Outcome(torch.tensor([context]), num_accepted=len(deepest), target_hidden=None)
        )
        assert drafter.catch_up(torch.tensor([context])) == fed.count(False)


def test_a_reduced_output_vocabulary_grows_the_tree_of_its_ids() -> None:
    """With `#vocab=N` the draft's LM head gives logits over N ids; greedy trees rank them
    alone, which is the slow reference's ranking with every other id at probability 0."""
    draft = tiny_model("llama", seed=1)  # a Hugging Face model: its head is cut in place
    with torch.no_grad():
        draft.lm_head.weight.mul_(32)
    ids = torch.arange(1, TINY_VOCAB, 2)  # every other token
    drafter = DraftTreeDrafter(draft, vocab_size=TINY_VOCAB, nodes=8, output_ids=ids)

    def full_logits(tokens: torch.Tensor) -> SimpleNamespace:
        with torch.no_grad():
            logits = draft(tokens).logits  # [1, n, N]: the drafter cut the head
        assert logits.shape[-1] == len(ids)
        full = logits.new_full((*logits.shape[:-1], TINY_VOCAB), float("-inf"))
        full[..., ids] = logits
        return SimpleNamespace(logits=full)

    context = PROMPT
    for _ in range(2):
        expected = reference_scores(full_logits, context, 4, 8, drafter.beam)  # type: ignore[arg-type]
        proposed = proposed_paths(drafter, context, 4)
        assert proposed.keys() == expected.keys()
        for path, score in proposed.items():
            assert score == pytest.approx(expected[path], abs=1e-4), path
            assert set(path) <= set(ids.tolist())
        deepest = max(expected, key=lambda p: (len(p), expected[p]))
        context = [*context, *deepest, 7]
        drafter.observe(
            Outcome(torch.tensor([context]), num_accepted=len(deepest), target_hidden=None)
        )


def test_a_tree_ranks_siblings_and_depths_by_the_drafts_probabilities(
    target: PreTrainedModel,
) -> None:
    """Sibling order follows the draft's probabilities; a wide budget gives a real tree
    (some node with two children), as the tiny random draft is unsure."""
    draft = make_draft(target, copy=False)
    drafter = DraftTreeDrafter(draft, vocab_size=TINY_VOCAB, nodes=8)
    proposal = drafter.propose(torch.tensor([PROMPT]), 3, GREEDY, None)
    assert proposal.tree is not None
    tree: TokenTree = proposal.tree
    assert any(path[-1] > 0 for path in tree.paths)
    with torch.no_grad():
        first = draft(torch.tensor([PROMPT])).logits[0, -1].argsort(descending=True)
    depth_one = [
        t for path, t in zip(tree.paths, proposal.tokens[0].tolist(), strict=True) if len(path) == 1
    ]
    assert depth_one == first[: len(depth_one)].tolist()


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=1.0)])
def test_a_check_drafts_the_trees_top_path_alone(
    target: PreTrainedModel, k: int, sampling: SamplingConfig
) -> None:
    """Under `single_path` (a round that only checks whether drafting pays) the tree
    drafter proposes a chain: the slow reference's path of k nodes, one child each, which
    is the draft's greedy chain, as fixed choices (no q, also when sampling: the top token
    of the distribution the tree is ranked by). Inside a lookup-first drafter too; after
    it, trees again."""
    draft = make_draft(target, copy=False)
    drafter = DraftTreeDrafter(draft, vocab_size=TINY_VOCAB, nodes=8)
    chain = DraftModelDrafter(draft, vocab_size=TINY_VOCAB)
    context = torch.tensor([PROMPT])
    greedy_chain = chain.propose(context, k, GREEDY, None).tokens[0].tolist()
    reference = reference_scores(draft, PROMPT, k, nodes=k, beam=1)
    assert list(reference) == [tuple(greedy_chain[:d]) for d in range(1, k + 1)]
    for wrapped in (drafter, LookupFirstDrafter(drafter)):
        with single_path(wrapped):
            proposal = wrapped.propose(context, k, sampling, None)
        assert proposal.tree is None and proposal.probs is None
        assert proposal.tokens[0].tolist() == greedy_chain
        assert len(drafter.tree_fed) == k - 1 and not drafter.single_path  # all but the leaf
        assert drafter.runner.length == len(PROMPT) + k - 1
    assert drafter.propose(context, k, sampling, None).tree is not None


def test_each_round_feeds_the_draft_only_what_its_tree_had_not(target: PreTrainedModel) -> None:
    """The draft is the target, so the tree's top path is always right: each round's first
    draft forward (the one without a tree mask) reads the target's new token and the
    accepted leaf, at most 2 rows, where it read the whole accepted path again before."""
    drafter = DraftTreeDrafter(make_draft(target, copy=True), vocab_size=TINY_VOCAB, nodes=4)
    rows: list[tuple[int, bool]] = []  # per draft forward: rows, whether a tree step
    forward = drafter.runner.forward

    def counting(tokens: torch.Tensor, **kwargs: object) -> torch.Tensor:
        rows.append((tokens.shape[1], "attention_mask" in kwargs))
        return forward(tokens, **kwargs)  # type: ignore[arg-type]

    drafter.runner.forward = counting  # type: ignore[method-assign]
    decoder = decode.SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
    result = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=4))
    assert result.tokens == hf_greedy(target, PROMPT, NEW_TOKENS)
    firsts = [n for n, tree_step in rows if not tree_step]
    assert firsts[0] == len(PROMPT) and len(firsts) <= result.stats.rounds
    assert max(firsts[1:]) <= 2
    assert result.stats.accepted_tokens > result.stats.rounds  # paths of 2 and more accepted


KINDS = {"self": True, "random": False}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(("gamma", "nodes"), [(1, 1), (2, 4), (4, 4), (5, 8)])
def test_greedy_decoding_with_a_draft_tree_matches_hf(
    target: PreTrainedModel, kind: str, gamma: int, nodes: int
) -> None:
    drafter = DraftTreeDrafter(
        make_draft(target, copy=KINDS[kind]), vocab_size=TINY_VOCAB, nodes=nodes
    )
    decoder = decode.SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
    result = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=gamma))
    assert result.tokens == hf_greedy(target, PROMPT, NEW_TOKENS)
    stats = result.stats
    assert stats.new_tokens == NEW_TOKENS and stats.drafted_tokens > 0
    if kind == "self":  # the draft's top path is the target's: every round takes a path
        assert stats.accepted_tokens >= stats.rounds - 1
    else:
        assert stats.mean_accepted_tokens < min(gamma, nodes) + 1


def test_a_tree_accepts_more_than_the_chain_of_its_depth(target: PreTrainedModel) -> None:
    """The same random draft, γ = 3: the 8-node tree keeps the chain's path among its nodes
    when it can, and second candidates besides, so it accepts at least as many tokens in
    the same number of rounds or fewer."""
    draft = make_draft(target, copy=False)
    results = {}
    for name, drafter in {
        "chain": DraftModelDrafter(draft, vocab_size=TINY_VOCAB),
        "tree": DraftTreeDrafter(draft, vocab_size=TINY_VOCAB, nodes=8),
    }.items():
        decoder = decode.SpecDecoder(
            target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256
        )
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3)
        results[name] = decoder.generate(PROMPT, config)
    assert results["tree"].tokens == results["chain"].tokens
    assert results["tree"].stats.rounds < results["chain"].stats.rounds


class CheckRecorder(DraftTreeDrafter):
    """A draft tree on test_schedule's fake clock (`per_token` seconds a drafted depth),
    recording whether each round drafted under `single_path` and what it proposed."""

    def __init__(self, model: PreTrainedModel, clock: FakeTime, per_token: float) -> None:
        super().__init__(model, vocab_size=TINY_VOCAB, nodes=4)
        self.clock, self.per_token = clock, per_token
        self.rounds: list[tuple[bool, Proposal]] = []

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        proposal = super().propose(context, k, sampling, generator)
        self.clock.now += self.per_token * proposal.depth
        self.rounds.append((self.single_path, proposal))
        return proposal


def test_the_adaptive_schedules_probes_verify_the_trees_top_path(
    monkeypatch: pytest.MonkeyPatch, target: PreTrainedModel
) -> None:
    """A draft that misses (an unrelated model) under the adaptive schedule: it falls back
    to plain decoding, and its probes draft one token, the top path alone, not the tree;
    rounds predicted to pay draft trees. Greedy output stays Hugging Face's."""
    clock = FakeTime()
    drafter = CheckRecorder(tiny_model("llama", seed=99), clock, DRAFT_S)
    decoder = decode_on_fake_clock(monkeypatch, target, drafter, clock)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=4, schedule="adaptive")
    result = decoder.generate(PROMPT, config)
    assert result.tokens == hf_greedy(target, PROMPT, NEW_TOKENS)
    checks = [proposal for checking, proposal in drafter.rounds if checking]
    trees = [proposal for checking, proposal in drafter.rounds if not checking]
    assert len(checks) >= 2 and all(p.tree is None and p.depth == 1 for p in checks)
    assert trees and all(p.tree is not None for p in trees)
    assert result.stats.requested_gammas[0] > result.stats.rounds / 2  # mostly plain


def test_sampled_draft_tree_decoding_emits_the_target_joint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A draft tree in the decode loop at temperature 1 (lossless_models' peaked target and
    its perturbed copy as the draft): trees whose accepted path runs through a second
    candidate, and rounds that accept nothing, both occur; the output is the target's."""
    target, draft = peaked_target_and_draft()
    spy = TreeSpy()
    monkeypatch.setattr(decode, "verify_tree_sampling", spy)
    drafter = DraftTreeDrafter(draft, vocab_size=TINY_V, nodes=4)
    counts = decoder_counts(target, drafter, SAMPLINGS["t1.0"], LOOP_SAMPLES)
    first_child = spy.rounds - spy.second_child - spy.rejected
    assert spy.rounds >= LOOP_SAMPLES, vars(spy)
    assert min(first_child, spy.second_child, spy.rejected) > 0.05 * spy.rounds, vars(spy)
    result = fit(counts, target_joint(target, SAMPLINGS["t1.0"]))
    assert result.passes, result


# --- specs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded_target(tiny_target: Path) -> LoadedModel:
    return load_model(str(tiny_target))


@pytest.fixture(scope="module")
def saved_drafts(loaded_target: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`same` (the target's layers, no heads) and `mtp` (the same with two MTP heads)."""
    root = tmp_path_factory.mktemp("drafts")
    save_draft(make_draft(loaded_target.model, copy=True), root / "same")
    torch.manual_seed(2)
    config = draft_config_for(loaded_target.model, num_layers=2, draft_vocab=None, mtp_heads=2)
    save_draft(DraftLM(config, target=loaded_target.model).eval(), root / "mtp")
    return root


@pytest.mark.parametrize(
    "spec",
    ["draft:{root}/same#nodes=4", "draft-ar:{root}/mtp#nodes=3", "ngram+draft:{root}/same#nodes=5"],
)
def test_tree_specs_generate_what_hf_does(
    loaded_target: LoadedModel, saved_drafts: Path, spec: str
) -> None:
    generator = SpecGenerator(loaded_target, draft=spec.format(root=saved_drafts))
    drafter = generator.decoder.drafter
    if isinstance(drafter, LookupFirstDrafter):
        drafter = drafter.fallback
    assert isinstance(drafter, DraftTreeDrafter)
    assert drafter.name.endswith(f"#nodes={drafter.nodes}")
    prompt = loaded_target.tokenizer("The colours of the rainbow are").input_ids
    completion = generator.generate(prompt, max_new_tokens=24, gamma=3)
    expected = hf_greedy(loaded_target.model, prompt, 24, eos=eos_token_ids(loaded_target))
    assert completion.tokens == expected


def test_a_model_given_by_path_drafts_a_tree(loaded_target: LoadedModel, tiny_target: Path) -> None:
    drafter, vocab = build_drafter(f"{tiny_target}#nodes=6", loaded_target)
    assert isinstance(drafter, DraftTreeDrafter) and drafter.nodes == 6
    assert vocab == len(loaded_target.tokenizer)
    assert drafter.timing_tree.num_nodes == 6  # what bench and tune time T(n) with


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("draft:{root}/mtp#nodes=4", "LM head alone"),
        ("ngram#nodes=auto", "#nodes=auto applies to mtp-tree and draft models"),
        ("ngram#nodes=4", "applies to mtp-tree and draft models"),
        ("mtp#nodes=4", "applies to mtp-tree and draft models"),
        ("draft:{root}/same#nodes=0", "N >= 1"),
        ("{target}#nodes=4#heads={root}/h", "not with heads"),
    ],
)
def test_bad_tree_specs_are_refused(
    loaded_target: LoadedModel, saved_drafts: Path, tiny_target: Path, spec: str, message: str
) -> None:
    with pytest.raises(SpecMTPError, match=message):
        build_drafter(spec.format(root=saved_drafts, target=tiny_target), loaded_target)


def test_a_tree_drafts_one_sequence_at_a_time(target: PreTrainedModel) -> None:
    drafter = DraftTreeDrafter(make_draft(target, copy=True), vocab_size=TINY_VOCAB, nodes=4)
    with pytest.raises(SpecMTPError, match="batch size 1"):
        drafter.propose(torch.tensor([PROMPT, PROMPT]), 3, GREEDY, None)
