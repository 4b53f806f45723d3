"""Sequential MTP drafting with per-depth caches equals the training-time computation."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, tiny_model
from test_heads import config_for
from transformers import PreTrainedModel

from specmtp.config import GenerationConfig
from specmtp.decode import SpecDecoder
from specmtp.errors import SpecMTPError
from specmtp.heads import SequentialMTP, build_heads
from specmtp.mtp_cache import GrowingBuffer, SequentialDraftCache
from specmtp.mtp_drafter import MTPDrafter
from specmtp.tree import TokenTree

LENGTH = 40
TREE = TokenTree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (1, 0, 0)])


@pytest.fixture(scope="module")
def target() -> PreTrainedModel:
    return tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def heads(target: PreTrainedModel) -> SequentialMTP:
    """Random sequential depths, 3 deep, over a reduced draft vocabulary."""
    torch.manual_seed(0)
    vocab = tuple(range(1, TINY_VOCAB, 2))
    built = build_heads(config_for(target, "sequential", draft_vocab=vocab), target)
    with torch.no_grad():
        for param in built.depths.parameters():
            param.add_(torch.randn_like(param) * 0.2)
    assert isinstance(built, SequentialMTP)
    return built.eval()


@pytest.fixture(scope="module")
def sequence(target: PreTrainedModel) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [1, LENGTH] and the target's hidden states over them [1, LENGTH, H]."""
    ids = torch.randint(1, TINY_VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[-1]
    return ids, hidden


def reference(
    heads: SequentialMTP, hidden: torch.Tensor, context: torch.Tensor, drafts: torch.Tensor
) -> torch.Tensor:
    """Teacher forcing over context + drafts (slow, obviously the training computation):
    each depth's logits at the last hidden position T-2, [B, k, V']."""
    t = context.shape[1]
    tokens = torch.cat([context, drafts], 1)
    padded = torch.cat(
        [hidden[:, : t - 1], hidden.new_zeros(1, drafts.shape[1] + 1, hidden.shape[2])], 1
    )
    with torch.no_grad():
        every = heads.forward_all(padded, tokens)  # rows past T-2 read zeros: never used here
    return torch.stack([every[i][:, t - 2] for i in range(drafts.shape[1])], dim=1)


def test_rounds_of_drafts_equal_teacher_forcing_on_the_history(
    heads: SequentialMTP, sequence: tuple[torch.Tensor, torch.Tensor]
) -> None:
    ids, hidden = sequence
    cache = SequentialDraftCache(heads)
    t = 6  # the prompt: its hidden states up to the pending last token come from the prefill
    cache.add_hidden(hidden[:, : t - 1])
    rng = torch.Generator().manual_seed(0)
    rounds = 0
    while t + 4 < LENGTH:
        k = int(torch.randint(1, 4, (1,), generator=rng))
        drafts, logits = cache.draft(ids[:, :t], k)  # [1, k], [1, k, V']
        assert drafts.shape == (1, k) and logits.shape[:2] == (1, k)
        assert torch.equal(drafts, heads.to_full_ids(logits.argmax(-1)))
        torch.testing.assert_close(logits, reference(heads, hidden, ids[:, :t], drafts))
        if rounds % 3 == 1:  # the same context again (a re-draft): the same answer
            again, again_logits = cache.draft(ids[:, :t], k)
            assert torch.equal(again, drafts)
            torch.testing.assert_close(again_logits, logits)
        # Commit 1 to 4 tokens of the true sequence (what the target verified).
        step = int(torch.randint(1, 5, (1,), generator=rng))
        cache.add_hidden(hidden[:, t - 1 : t - 1 + step])
        t += step
        rounds += 1
        # The caches hold committed positions only, each depth one further behind.
        assert [cache.cached(i) for i in range(3)][:k] == [t - step - 2 - i for i in range(k)]
    assert rounds >= 8


@pytest.mark.parametrize("t", [2, 3, 7])  # 2, 3: contexts shorter than the tree is deep
def test_tree_children_come_from_the_depth_run_on_their_own_path(
    heads: SequentialMTP, sequence: tuple[torch.Tensor, torch.Tensor], t: int
) -> None:
    ids, hidden = sequence
    trees, chains = SequentialDraftCache(heads), SequentialDraftCache(heads)
    for cache in (trees, chains):
        cache.add_hidden(hidden[:, : t - 1])
    for step in (1, 3, 2, 4, 1):
        drafted = trees.draft_tree(ids[:, :t], TREE)
        tokens = drafted.tokens  # path -> [1]
        chain, _ = chains.draft(ids[:, :t], 3)
        assert set(tokens) == set(drafted.logprob) == set(TREE.paths)
        for path in TREE.paths:
            line = torch.stack([tokens[path[:d]] for d in range(1, len(path) + 1)], 1)  # [1, L]
            logits = reference(heads, hidden, ids[:, :t], line)[:, -1]  # depth L-1 at T-2
            ranked = logits.topk(path[-1] + 1).indices  # draft vocabulary
            assert torch.equal(tokens[path], heads.to_full_ids(ranked)[:, path[-1]]), path
            # The path's log-probability: its parent's plus this depth's for its token.
            chance = logits.log_softmax(-1)[:, ranked[0, path[-1]]]  # [1]
            before = drafted.logprob[path[:-1]] if len(path) > 1 else 0.0
            torch.testing.assert_close(drafted.logprob[path], before + chance)
        # The all-first path is the greedy chain, and both leave the same caches behind.
        assert torch.equal(torch.stack([tokens[(0,) * d] for d in (1, 2, 3)], 1), chain)
        assert [trees.cached(i) for i in range(3)] == [chains.cached(i) for i in range(3)]
        for cache in (trees, chains):
            cache.add_hidden(hidden[:, t - 1 : t - 1 + step])
        t += step


def test_a_batch_of_sequences_drafts_the_trees_each_would_alone(
    heads: SequentialMTP, target: PreTrainedModel, sequence: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """A level's parents run stacked along the batch: with two sequences in the batch,
    every row's tree and cache must still be that sequence's own."""
    ids = torch.cat([sequence[0], sequence[0].flip(1)])  # [2, LENGTH]
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[-1]
    both = SequentialDraftCache(heads)
    alone = [SequentialDraftCache(heads) for _ in range(2)]
    t = 7
    both.add_hidden(hidden[:, : t - 1])
    for row, cache in enumerate(alone):
        cache.add_hidden(hidden[row : row + 1, : t - 1])
    for step in (2, 1, 3):
        tokens = both.draft_tree(ids[:, :t], TREE).tokens
        for row, cache in enumerate(alone):
            own = cache.draft_tree(ids[row : row + 1, :t], TREE).tokens
            assert all(torch.equal(tokens[p][row : row + 1], own[p]) for p in TREE.paths), row
            assert [both.cached(i) for i in range(3)] == [cache.cached(i) for i in range(3)]
            cache.add_hidden(hidden[row : row + 1, t - 1 : t - 1 + step])
        both.add_hidden(hidden[:, t - 1 : t - 1 + step])
        t += step


def test_cache_bytes_grow_with_the_history_and_reset_empties_it(
    heads: SequentialMTP, sequence: tuple[torch.Tensor, torch.Tensor]
) -> None:
    ids, hidden = sequence
    cache = SequentialDraftCache(heads)
    cache.add_hidden(hidden[:, :9])
    cache.draft(ids[:, :10], 3)
    small = cache.nbytes()
    cache.add_hidden(hidden[:, 9:37])
    cache.draft(ids[:, :38], 3)
    assert cache.nbytes() > small > 0  # past the buffers' first capacity
    cache.reset()
    assert cache.nbytes() == 0 and cache.cached(0) == 0


def test_bad_draft_requests_are_refused(
    heads: SequentialMTP, sequence: tuple[torch.Tensor, torch.Tensor]
) -> None:
    ids, hidden = sequence
    cache = SequentialDraftCache(heads)
    with pytest.raises(SpecMTPError, match="holds 0 hidden states"):
        cache.draft(ids[:, :5], 1)
    cache.add_hidden(hidden[:, :4])
    with pytest.raises(SpecMTPError, match="needs 6"):
        cache.draft(ids[:, :7], 1)
    with pytest.raises(SpecMTPError, match="4 tokens with 3"):
        cache.draft(ids[:, :5], 4)
    with pytest.raises(SpecMTPError, match="4 deep"):
        cache.draft_tree(ids[:, :5], TokenTree([(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]))


def test_the_drafter_reports_its_cache(
    heads: SequentialMTP, target: PreTrainedModel, sequence: tuple[torch.Tensor, torch.Tensor]
) -> None:
    drafter = MTPDrafter(heads)
    hidden = target.config.hidden_size
    # float32: h, then k, v, state per depth; twice, for the buffers' spare capacity
    assert drafter.kv_bytes_per_token() == 2 * hidden * (1 + 3 * 3) * 4
    decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
    prompt = sequence[0][0, :8].tolist()
    result = decoder.generate(prompt, GenerationConfig(max_new_tokens=20, gamma=3))
    positions = len(prompt) + len(result.tokens) - 2  # hidden states the drafter has seen
    assert 0 < drafter.kv_bytes() <= positions * drafter.kv_bytes_per_token()
    drafter.reset()
    assert drafter.kv_bytes() == 0


def test_a_growing_buffer_appends_in_place_and_rolls_back_by_length() -> None:
    buffer = GrowingBuffer(1)
    assert buffer.view() is None and buffer.nbytes() == 0
    rows = torch.arange(2 * 40 * 3, dtype=torch.float32).view(2, 40, 3)
    buffer.append(rows[:, :10])
    held = buffer.data
    buffer.append(rows[:, 10:14])  # within capacity: the same storage
    assert buffer.data is held and torch.equal(buffer.view(), rows[:, :14])
    buffer.write(rows[:, 30:33])  # scratch past the length: seen by view(extra) only
    assert torch.equal(buffer.view(3)[:, 14:], rows[:, 30:33]) and buffer.view().shape[1] == 14
    buffer.crop(12)
    buffer.append(rows[:, 12:40])  # grows, keeping what was committed
    assert buffer.data is not held and torch.equal(buffer.view(), rows)
    assert buffer.nbytes() >= rows.numel() * 4
    buffer.crop(50)  # never longer than what it holds
    assert buffer.length == 40


def test_a_window_restarts_the_history_and_drafts_as_teacher_forcing_from_its_base(
    heads: SequentialMTP, sequence: tuple[torch.Tensor, torch.Tensor]
) -> None:
    ids, hidden = sequence
    cache = SequentialDraftCache(heads, window=6)
    t = 20  # a prompt longer than twice the window: the first round already starts later
    cache.add_hidden(hidden[:, : t - 1])
    bases = set()
    for step in (1, 3, 2, 4, 1, 2, 3):
        drafted = cache.draft_tree(ids[:, :t], TREE)
        base = cache.base
        assert t - 2 - 6 * 2 <= base <= t - 2 - 6  # within two windows of the last position
        for path in TREE.paths:
            line = torch.stack([drafted.tokens[path[:d]] for d in range(1, len(path) + 1)], 1)
            logits = reference(heads, hidden[:, base:], ids[:, base:t], line)[:, -1]
            ranked = logits.topk(path[-1] + 1).indices
            assert torch.equal(drafted.tokens[path], heads.to_full_ids(ranked)[:, path[-1]]), path
        assert [cache.cached(i) for i in range(3)] == [t - 2 - i - base for i in range(3)]
        bases.add(base)
        cache.add_hidden(hidden[:, t - 1 : t - 1 + step])
        t += step
    assert len(bases) >= 2  # it moved as the history grew
    fresh = SequentialDraftCache(heads, window=6)
    fresh.add_hidden(hidden[:, :11])
    fresh.draft(ids[:, :12], 3)  # a 12-token prompt: the first round starts one window back
    assert fresh.base == 12 - 2 - 6 and fresh.cached(0) == 6
    with pytest.raises(SpecMTPError, match="window must be >= 3"):
        SequentialDraftCache(heads, window=2)
