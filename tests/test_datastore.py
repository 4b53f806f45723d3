"""Retrieval drafting (`store:FILE`): the datastore's suffix index against a brute-force
reference, its continuations, its file, the drafter, greedy output and the CLI."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    SHIPPED_NEW_TOKENS,
    SHIPPED_PROMPT,
    TINY_VOCAB,
    hf_greedy,
    run_cli,
    tiny_model,
)

from specmtp.answers import generate_answers
from specmtp.api import SpecGenerator, build_drafter
from specmtp.config import GenerationConfig, SamplingConfig
from specmtp.data_build import DistillConfig, build_cache
from specmtp.datastore import (
    BEFORE_FALLBACK_MIN_PROBABILITY,
    Datastore,
    DatastoreDrafter,
    StoreTreeDrafter,
    shipped_store_file,
)
from specmtp.datastore_build import LEAD_TOKENS
from specmtp.decode import SpecDecoder
from specmtp.drafters import LOOKUP_ARM, MODEL_ARM, LookupFirstDrafter
from specmtp.errors import SpecMTPError
from specmtp.models import LoadedModel, load_model
from specmtp.vocab import vocab_digest

GREEDY = SamplingConfig()
DIGEST = "0123456789abcdef"


def random_documents(seed: int, count: int = 12, vocab: int = 6) -> list[list[int]]:
    """Short documents over a small vocabulary: many repeated n-grams."""
    generator = np.random.default_rng(seed)
    return [generator.integers(0, vocab, generator.integers(1, 30)).tolist() for _ in range(count)]


def reference_occurrences(documents: list[list[int]], ngram: list[int]) -> list[tuple[int, int]]:
    """(document, index after the n-gram) of every occurrence, by scanning."""
    n = len(ngram)
    return [
        (d, i + n)
        for d, doc in enumerate(documents)
        for i in range(len(doc) - n + 1)
        if doc[i : i + n] == ngram
    ]


def reference_path(
    documents: list[list[int]], ngram: list[int], depth: int, min_probability: float = 0.0
) -> list[int]:
    """The greedy most frequent continuation, by scanning (ties: the smallest id)."""
    hits = reference_occurrences(documents, ngram)
    path: list[int] = []
    probability = 1.0
    for _ in range(depth):
        following = [documents[d][i] for d, i in hits if i < len(documents[d])]
        if not following:
            break
        counts = Counter(following)
        token = min(counts, key=lambda t: (-counts[t], t))
        probability *= counts[token] / (len(following) + 1)
        if probability < min_probability:
            break
        path.append(token)
        hits = [(d, i + 1) for d, i in hits if i < len(documents[d]) and documents[d][i] == token]
    return path


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_occurrences_and_continuations_match_a_scan(seed: int) -> None:
    documents = random_documents(seed)
    store = Datastore(documents, vocab_digest=DIGEST, max_ngram=4)
    starts = np.cumsum([0] + [len(doc) + 1 for doc in documents])  # each ends in a separator
    assert len(store.tokens) == starts[-1]
    generator = np.random.default_rng(seed + 10)
    for _ in range(200):
        n = int(generator.integers(1, 5))
        ngram = generator.integers(0, 7, n).tolist()  # 6 never occurs: some n-grams miss
        found = sorted(store.occurrences(ngram).tolist())
        expected = sorted(int(starts[d]) + i for d, i in reference_occurrences(documents, ngram))
        assert found == expected
        for min_probability in (0.0, 0.2):
            path = store.continuation(ngram, 5, min_ngram=n, min_probability=min_probability)
            assert path == reference_path(documents, ngram, 5, min_probability), ngram


def reference_prefixes(
    documents: list[list[int]], ngram: list[int], depth: int
) -> dict[tuple[int, ...], float]:
    """Every continuation prefix of `ngram`'s occurrences up to `depth` tokens, with its
    probability: the product of count / (hits continuing the parent + 1), by scanning."""
    found: dict[tuple[int, ...], float] = {}

    def grow(hits: list[tuple[int, int]], path: tuple[int, ...], probability: float) -> None:
        following = [documents[d][i] for d, i in hits if i < len(documents[d])]
        if len(path) == depth or not following:
            return
        for token, count in Counter(following).items():
            chance = probability * count / (len(following) + 1)
            found[(*path, token)] = chance
            kept = [
                (d, i + 1) for d, i in hits if i < len(documents[d]) and documents[d][i] == token
            ]
            grow(kept, (*path, token), chance)

    grow(reference_occurrences(documents, ngram), (), 1.0)
    return found


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_likeliest_continuations_are_the_top_nodes_of_the_scanned_trie(seed: int) -> None:
    documents = random_documents(seed, count=20, vocab=4)
    store = Datastore(documents, vocab_digest=DIGEST, max_ngram=4)
    generator = np.random.default_rng(seed + 20)
    for _ in range(100):
        n = int(generator.integers(1, 5))
        ngram = generator.integers(0, 4, n).tolist()
        nodes, floor = int(generator.integers(1, 12)), float(generator.choice([0.0, 0.1]))
        found = store.likeliest_continuations(ngram, 4, nodes, min_ngram=n, min_probability=floor)
        reference = {
            path: chance
            for path, chance in reference_prefixes(documents, ngram, 4).items()
            if chance >= floor
        }
        best = sorted(reference.values(), reverse=True)[:nodes]
        # The same probabilities as the nodes a scan ranks first (ties may pick either).
        assert sorted(found.values(), reverse=True) == pytest.approx(best), ngram
        for path, chance in found.items():
            assert chance == pytest.approx(reference[path])
            assert len(path) == 1 or path[:-1] in found  # a tree: every prefix is in it


def test_a_store_tree_holds_the_copied_path_then_the_likeliest_continuations() -> None:
    store = Datastore([[10, 11, 12, 13], [10, 11, 12, 13], [10, 11, 14]], vocab_digest=DIGEST)
    # After "10 11": 12 (2/4), then 12 13 (2/4 * 2/3), then 14 (1/4).
    tree = StoreTreeDrafter(store, nodes=3)
    proposal = tree.propose(torch.tensor([[5, 6, 10, 11]]), 3, GREEDY, None)
    assert proposal.tree is not None and proposal.tree.paths == ((0,), (1,), (0, 0))
    assert proposal.tokens.tolist() == [[12, 14, 13]]
    # Two nodes: 12 13, one path: a chain, verified without a tree mask.
    chain = StoreTreeDrafter(store, nodes=2).propose(torch.tensor([[10, 11]]), 3, GREEDY, None)
    assert chain.tree is None and chain.tokens.tolist() == [[12, 13]]
    # "10 11" occurred earlier in the context, followed by 9 10 11: that path comes first,
    # the store's fill the rest of the budget, which is k nodes (k + 1 rows, as a chain's).
    context = torch.tensor([[10, 11, 9, 10, 11]])
    wide = StoreTreeDrafter(store, nodes=6)
    proposal = wide.propose(context, 4, GREEDY, None)
    assert proposal.tree is not None
    assert proposal.tree.paths == ((0,), (1,), (0, 0), (0, 0, 0))
    assert proposal.tokens.tolist() == [[9, 12, 10, 11]]
    assert wide.propose(context, 5, GREEDY, None).tokens.tolist() == [[9, 12, 10, 13, 11]]
    assert wide.propose(context, 2, GREEDY, None).tokens.tolist() == [[9, 10]]  # a chain
    # Nothing in the context or the store: the last token's earlier continuation, as `store`.
    lone = StoreTreeDrafter(store, nodes=4, last_token_lookup=True)
    assert lone.propose(torch.tensor([[6, 9, 4, 6]]), 2, GREEDY, None).tokens.tolist() == [[9, 4]]
    assert tree.propose(torch.tensor([[6, 9, 4, 6]]), 2, GREEDY, None).tokens.shape == (1, 0)
    assert tree.propose(torch.tensor([[10, 11]]), 0, GREEDY, None).tokens.shape == (1, 0)
    with pytest.raises(SpecMTPError, match="nodes >= 1"):
        StoreTreeDrafter(store, nodes=0)


def test_the_longest_suffix_wins_and_paths_stop_at_document_ends() -> None:
    documents = [[1, 2, 3, 4, 5], [9, 2, 3, 7], [8, 2, 3, 7]]
    store = Datastore(documents, vocab_digest=DIGEST, max_ngram=3)
    # "2 3" continues with 7 twice and 4 once; "1 2 3" only with 4 5, then the document ends.
    assert store.continuation([2, 3], 4) == [7]
    assert store.continuation([1, 2, 3], 4) == [4, 5]
    assert store.continuation([6, 2, 3], 4) == [7]  # "6 2 3" is absent: the 2-gram answers
    # min_ngram 2: a lone "3" is not enough, and a 2-gram never seen finds nothing.
    assert store.continuation([5, 3], 4) == []
    # Each token's probability is count / (hits + 1): 7 after "2 3" is 2/4 = 0.5.
    assert store.continuation([2, 3], 4, min_probability=0.5) == [7]
    assert store.continuation([2, 3], 4, min_probability=0.51) == []


def test_bad_documents_and_an_empty_store() -> None:
    with pytest.raises(SpecMTPError, match="token id < 0"):
        Datastore([[1, -1, 2]], vocab_digest=DIGEST)  # -1 would read as a document's end
    with pytest.raises(SpecMTPError, match="beyond int32"):
        Datastore([[2**31]], vocab_digest=DIGEST)
    assert Datastore([], vocab_digest=DIGEST).continuation([1, 2], 3) == []


def test_save_and_load(tmp_path: Path) -> None:
    documents = random_documents(3)
    store = Datastore(documents, vocab_digest=DIGEST, max_ngram=3)
    path = tmp_path / "store.safetensors"
    store.save(path)
    loaded = Datastore.load(path, vocab_digest=DIGEST)
    assert loaded.tokens.tolist() == store.tokens.tolist()
    assert (loaded.max_ngram, loaded.documents) == (3, len(documents))
    for ngram in ([0, 1], [2, 2, 2], [5, 4]):
        assert loaded.continuation(ngram, 6) == store.continuation(ngram, 6)
    with pytest.raises(SpecMTPError, match="another tokenizer"):
        Datastore.load(path, vocab_digest="fedcba9876543210")
    with pytest.raises(SpecMTPError, match="no datastore file"):
        Datastore.load(tmp_path / "missing.safetensors")
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(path.read_bytes()[:40])
    with pytest.raises(SpecMTPError, match="cannot be read"):
        Datastore.load(corrupt)


def test_the_drafter_looks_in_the_context_then_in_the_store() -> None:
    store = Datastore([[10, 11, 12, 13], [10, 11, 12, 13]], vocab_digest=DIGEST)
    drafter = DatastoreDrafter(store)
    # The context repeats "2 3" (then 7 8): prompt lookup drafts, the store is not asked.
    own = drafter.propose(torch.tensor([[2, 3, 7, 8, 10, 11, 2, 3]]), 2, GREEDY, None)
    assert own.tokens.tolist() == [[7, 8]]
    # No repeat in the context, but the store saw "10 11": 12 13 follow there.
    stored = drafter.propose(torch.tensor([[5, 6, 10, 11]]), 3, GREEDY, None)
    assert stored.tokens.tolist() == [[12, 13]]
    assert drafter.propose(torch.tensor([[5, 6, 1, 2]]), 3, GREEDY, None).tokens.shape == (1, 0)
    # Only the last token (6) occurred before, and the store has nothing: with
    # last_token_lookup the drafter proposes what followed it, as `ngram` would.
    context = torch.tensor([[6, 9, 4, 5, 6]])
    assert drafter.propose(context, 2, GREEDY, None).tokens.shape == (1, 0)
    unigrams = DatastoreDrafter(store, last_token_lookup=True)
    assert unigrams.propose(context, 2, GREEDY, None).tokens.tolist() == [[9, 4]]
    # The store still comes before a one-token match.
    assert unigrams.propose(torch.tensor([[11, 3, 10, 11]]), 2, GREEDY, None).tokens.tolist() == [
        [12, 13]
    ]
    assert drafter.propose(torch.tensor([[5, 6, 10, 11]]), 0, GREEDY, None).tokens.shape == (1, 0)


def test_lookup_first_with_a_store_asks_the_fallback_when_neither_matches() -> None:
    store = Datastore([[10, 11, 12, 13]], vocab_digest=DIGEST)
    fallback = DatastoreDrafter(Datastore([[1, 2, 99]], vocab_digest=DIGEST), name="other")
    drafter = LookupFirstDrafter(fallback, lookup=DatastoreDrafter(store, name="store"))
    assert drafter.name == "store+other"
    context = torch.tensor([[5, 10, 11]])
    assert drafter.next_arm(context) == LOOKUP_ARM
    assert drafter.propose(context, 2, GREEDY, None).tokens.tolist() == [[12, 13]]
    context = torch.tensor([[5, 1, 2]])
    assert drafter.next_arm(context) == MODEL_ARM
    assert drafter.propose(context, 2, GREEDY, None).tokens.tolist() == [[99]]
    assert (drafter.lookup_rounds, drafter.fallback_rounds) == (1, 1)


def test_greedy_output_is_the_targets_own() -> None:
    target = tiny_model("llama", seed=0)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, TINY_VOCAB, (8,), generator=generator).tolist() for _ in range(6)]
    answers = [hf_greedy(target, prompt, 40) for prompt in prompts]
    # The store holds the target's answers to the first prompts (each with the prompt's
    # last tokens, as `specmtp datastore` keeps them), not to the last one.
    store = Datastore(
        [p[-3:] + a for p, a in zip(prompts[:5], answers[:5], strict=True)], vocab_digest=DIGEST
    )
    for drafter in (DatastoreDrafter(store), StoreTreeDrafter(store, nodes=6)):
        accepted = []
        for prompt, answer in ((prompts[0], answers[0]), (prompts[5], answers[5])):
            decoder = SpecDecoder(
                target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256
            )
            result = decoder.generate(prompt, GenerationConfig(max_new_tokens=40, gamma=4))
            assert result.tokens == answer
            accepted.append(result.stats.accepted_tokens)
        # An answer the store holds is drafted from it nearly whole; an unseen one is not.
        assert accepted[0] >= 30 > accepted[1], accepted


def test_specs_and_cli(
    tmp_path: Path, default_model: LoadedModel, capfd: pytest.CaptureFixture[str]
) -> None:
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("The cat sat on the mat. The cat sat on the hat.\n")
    (texts / "b.txt").write_text("A dog sat on the mat.\n")
    out = tmp_path / "store.safetensors"
    code, stdout, err = run_cli(capfd, "datastore", "--text", str(texts), "--out", str(out))
    assert code == 0, err
    assert '"documents": 2' in stdout.splitlines()[-1]
    store = Datastore.load(out, vocab_digest=vocab_digest(default_model.tokenizer))
    tokenizer = default_model.tokenizer
    # " bird sat on" is nowhere; " sat on" is, three times: " the", then " mat" twice.
    after = tokenizer(" A bird sat on", add_special_tokens=False).input_ids
    assert tokenizer.decode(store.continuation(after, 2)) == " the mat"

    drafter, _ = build_drafter(f"store:{out}", default_model)
    assert isinstance(drafter, DatastoreDrafter) and drafter.name == f"store:{out}"
    paired, _ = build_drafter(f"store:{out}+mtp", default_model)
    assert isinstance(paired, LookupFirstDrafter) and isinstance(paired.lookup, DatastoreDrafter)
    assert paired.name == f"store:{out}+mtp"
    assert paired.lookup.min_probability == BEFORE_FALLBACK_MIN_PROBABILITY
    assert drafter.min_probability == 0.0  # alone: any match beats drafting nothing
    assert drafter.last_token is not None and paired.lookup.last_token is None
    careful, _ = build_drafter(f"store:{out}#min-p=0.5+mtp", default_model)
    assert isinstance(careful, LookupFirstDrafter) and careful.lookup.min_probability == 0.5
    tree, _ = build_drafter(f"store:{out}#min-p=0.1#nodes=5", default_model)
    assert isinstance(tree, StoreTreeDrafter) and (tree.nodes, tree.min_probability) == (5, 0.1)
    assert tree.last_token is not None and tree.tree.num_nodes == 5  # T(n) is timed on it
    for bad, message in (
        (f"store:{out}+ngram", "name a model drafter"),
        (f"store:{out}+", "name a model drafter"),
        ("store:", "use store, store:FILE"),
        (f"store:{out}#min-p=1.5", "0 <= P < 1"),
        (f"store:{out}#min-p=x+mtp", "0 <= P < 1"),
        (f"store:{out}#nodes=0", "#nodes=N with N >= 1"),
        (f"store:{out}#nodes=4#min-p=0.1", "#nodes=N with N >= 1"),
        (f"store:{out}#nodes=4+mtp", "drafts alone"),
        (f"store:{tmp_path / 'none.safetensors'}", "no datastore file"),
    ):
        with pytest.raises(SpecMTPError, match=message):
            build_drafter(bad, default_model)
    code, _, err = run_cli(capfd, "datastore", "--out", str(out))
    assert code != 0 and "needs --data, --cache or --text" in err
    code, _, err = run_cli(
        capfd, "datastore", "--data", "../shared/prompts/eval/gsm8k", "--out", str(out)
    )
    assert code != 0 and "evaluation set" in err


def test_built_from_answers_and_caches(
    tiny_target: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """`--data`: the target answers here; `--cache`: the answers a data cache holds. Either
    way a document is an answer with the LEAD_TOKENS prompt tokens before it."""
    tiny = load_model(str(tiny_target))
    prompts = ["Name three colours.", "What is 2 + 2?", "Write a haiku."]
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in prompts)
    )
    expected = {
        tuple(s.prompt_ids[-LEAD_TOKENS:] + s.answer_ids)
        for s in generate_answers(tiny, prompts, max_new_tokens=6)
    }
    cache = tmp_path / "cache"
    build_cache(tiny, prompts, cache, config=DistillConfig(max_new_tokens=6), sources=["inline"])
    for flag, source in (("--data", tmp_path / "prompts.jsonl"), ("--cache", cache)):
        out = tmp_path / f"{flag[2:]}.safetensors"
        code, _, err = run_cli(
            capfd, "datastore", "--target", str(tiny_target), flag, str(source),
            "--max-new-tokens", "6", "--out", str(out),
        )  # fmt: skip
        assert code == 0, err
        store = Datastore.load(out, vocab_digest=vocab_digest(tiny.tokenizer))
        documents = np.split(store.tokens, np.flatnonzero(store.tokens == -1) + 1)[:-1]
        assert {tuple(doc[:-1].tolist()) for doc in documents} == expected, flag


@pytest.mark.parametrize("spec", ["store", "store+mtp", "store#nodes=8"])
def test_the_shipped_store_drafts_and_stays_greedy_exact(
    default_model: LoadedModel, shipped_greedy: list[int], spec: str
) -> None:
    assert shipped_store_file().is_file(), f"{shipped_store_file()} is missing"
    generator = SpecGenerator(default_model, draft=spec)
    ids = generator.encode(SHIPPED_PROMPT, chat=True)
    result = generator.decoder.generate(ids, GenerationConfig(max_new_tokens=SHIPPED_NEW_TOKENS))
    assert result.tokens == shipped_greedy
    # The target's own phrasing is in the store: its drafts get accepted.
    assert result.stats.accepted_tokens > 0.1 * len(shipped_greedy)
    with pytest.raises(SpecMTPError, match="another tokenizer"):
        Datastore.load(shipped_store_file(), vocab_digest="fedcba9876543210")
    shipped, _ = build_drafter("store#min-p=0.5", default_model)
    assert isinstance(shipped, DatastoreDrafter) and shipped.min_probability == 0.5
