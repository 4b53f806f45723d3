"""Heads reading several of the target's hidden states (EAGLE-3's feature fusion): the
widened heads start where the final-state heads were, draft over the history as trained,
decode losslessly, and train end to end from cached features."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, tiny_model
from test_heads import config_for
from test_train import config, prompts  # noqa: F401 (a fixture)
from transformers import PreTrainedModel

from specmtp.config import GenerationConfig
from specmtp.data import DistillCache
from specmtp.decode import SpecDecoder
from specmtp.errors import SpecMTPError
from specmtp.heads import SequentialMTP, build_heads, target_features, widen_heads
from specmtp.heads_config import HeadsConfig
from specmtp.heads_io import load_heads
from specmtp.models import load_model
from specmtp.mtp_cache import SequentialDraftCache
from specmtp.mtp_drafter import MTPDrafter
from specmtp.train import train_mtp

LAYERS = (0, 1, 2)  # the tiny target has 2 layers: embeddings, layer 1, the final state


@pytest.fixture(scope="module")
def target() -> PreTrainedModel:
    return tiny_model("llama", seed=0)


def random_heads(target: PreTrainedModel, layers: tuple[int, ...] | None) -> SequentialMTP:
    torch.manual_seed(1)
    heads = build_heads(config_for(target, "sequential", feature_layers=layers), target)
    with torch.no_grad():
        for param in heads.parameters():
            param.add_(torch.randn_like(param) * 0.2)
    assert isinstance(heads, SequentialMTP)
    return heads.eval()


def features(target: PreTrainedModel, ids: torch.Tensor, layers: tuple[int, ...] | None):
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    return target_features(out.hidden_states, layers)


def test_widened_heads_start_where_the_final_state_heads_are(target: PreTrainedModel) -> None:
    narrow = random_heads(target, None)
    wide = widen_heads(narrow, LAYERS, target).eval()
    assert wide.config.feature_layers == LAYERS and narrow.fusion is None
    ids = torch.randint(1, TINY_VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    wide_in = features(target, ids, LAYERS)  # [2, 12, 3H]
    assert wide_in.shape[-1] == 3 * target.config.hidden_size
    with torch.no_grad():
        before = narrow.forward_all(features(target, ids, None), ids)
        after = wide.forward_all(wide_in, ids)
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    with pytest.raises(SpecMTPError, match="final hidden state"):
        widen_heads(narrow, (0, 1), target)


def test_fused_heads_draft_over_the_history_as_in_training(target: PreTrainedModel) -> None:
    heads = random_heads(target, LAYERS)
    ids = torch.randint(1, TINY_VOCAB, (1, 30), generator=torch.Generator().manual_seed(3))
    hidden = features(target, ids, LAYERS)  # [1, 30, 3H]
    cache = SequentialDraftCache(heads)
    t = 5
    cache.add_hidden(hidden[:, : t - 1])
    while t + 4 < ids.shape[1]:
        drafts, logits = cache.draft(ids[:, :t], 3)  # [1, 3], [1, 3, V']
        # Teacher forcing over context + drafts, the training computation (rows past T-2
        # read zero features and are not compared).
        padded = torch.cat([hidden[:, : t - 1], hidden.new_zeros(1, 4, hidden.shape[2])], 1)
        with torch.no_grad():
            every = heads.forward_all(padded, torch.cat([ids[:, :t], drafts], 1))
        expected = torch.stack([every[i][:, t - 2] for i in range(3)], dim=1)
        torch.testing.assert_close(logits, expected)
        cache.add_hidden(hidden[:, t - 1 : t + 1])  # two tokens verified
        t += 2


def test_positions_added_between_drafts_are_fused_once_when_drafting(
    target: PreTrainedModel,
) -> None:
    """Plain rounds add one position each; fusing each there cost 0.7 ms of a 55 ms step.
    They wait for the next draft, which fuses them in one call and drafts as trained."""
    heads = random_heads(target, LAYERS)
    ids = torch.randint(1, TINY_VOCAB, (1, 16), generator=torch.Generator().manual_seed(6))
    hidden = features(target, ids, LAYERS)  # [1, 16, 3H]
    assert heads.fusion is not None
    calls: list[int] = []
    heads.fusion.register_forward_hook(lambda module, args, out: calls.append(1))
    cache = SequentialDraftCache(heads)
    t = 5
    cache.add_hidden(hidden[:, : t - 1])
    cache.draft(ids[:, :t], 2)
    assert len(calls) == 1  # the prompt's features
    before = cache.nbytes()
    for _ in range(4):  # four plain rounds: one position each
        cache.add_hidden(hidden[:, t - 1 : t])
        t += 1
    assert len(calls) == 1
    # Counted as held, unfused: the target's three states per position (float32).
    assert cache.nbytes() - before == 4 * hidden.shape[-1] * 4
    # At most: three states, then each depth's key, value, state; twice, for spare capacity.
    assert cache.bytes_per_position() == 2 * target.config.hidden_size * (3 + 3 * 3) * 4
    drafts, logits = cache.draft(ids[:, :t], 3)  # [1, 3], [1, 3, V']
    assert len(calls) == 2
    with torch.no_grad():  # teacher forcing over all the features: the training computation
        padded = torch.cat([hidden[:, : t - 1], hidden.new_zeros(1, 4, hidden.shape[2])], 1)
        every = heads.forward_all(padded, torch.cat([ids[:, :t], drafts], 1))
    torch.testing.assert_close(logits, torch.stack([every[i][:, t - 2] for i in range(3)], 1))


def test_greedy_decoding_with_fused_heads_equals_plain_decoding(target: PreTrainedModel) -> None:
    heads = random_heads(target, LAYERS)
    prompt = torch.randint(1, TINY_VOCAB, (9,), generator=torch.Generator().manual_seed(5))
    settings = GenerationConfig(max_new_tokens=24, gamma=3)
    plain = SpecDecoder(target, vocab_size=TINY_VOCAB, context_length=256)
    expected = plain.generate(prompt.tolist(), settings).tokens  # no drafter: plain
    drafter = MTPDrafter(heads)
    decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
    assert decoder.generate(prompt.tolist(), settings).tokens == expected
    assert decoder.target.last_hidden.shape[-1] == 3 * target.config.hidden_size


def test_feature_layers_are_checked() -> None:
    base = {"kind": "sequential", "num_heads": 2, "hidden_size": 32, "vocab_size": TINY_VOCAB,
            "base_model": "x"}  # fmt: skip
    for layers, message in (
        ((2, 1), "ascending"),
        ((1, 1), "ascending"),
        ((), "at least one"),
        ((-1, 2), ">= 0"),
    ):
        with pytest.raises(SpecMTPError, match=message):
            HeadsConfig(**base, feature_layers=layers)
    with pytest.raises(SpecMTPError, match="sequential"):
        HeadsConfig(**{**base, "kind": "parallel"}, feature_layers=(1, 2))
    config = HeadsConfig(**base, feature_layers=[0, 2])
    assert HeadsConfig.from_json(config.to_json()) == config
    plain = HeadsConfig(**base)
    assert "feature_layers" not in json.loads(plain.to_json())  # old heads read the same
    with pytest.raises(SpecMTPError, match="has 2 layers"):
        build_heads(
            replace(config, hidden_size=32, feature_layers=(0, 3)), tiny_model("llama", seed=0)
        )


def test_training_widens_heads_on_cached_features_of_those_layers(
    tiny_target: Path,
    prompts: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    first = replace(config(tiny_target, prompts, tmp_path / "first", steps=2), kind="sequential")
    train_mtp(first)
    wide = replace(
        first, out=tmp_path / "wide", steps=1, init_from=first.out, lr=1e-12,
        answers_from=first.out / "data", feature_layers=LAYERS,
    )  # fmt: skip
    train_mtp(wide)
    model = load_model(str(tiny_target)).model
    cache = DistillCache.open(wide.out / "data")
    assert cache.feature_layers == LAYERS
    sample = cache.sample(0)
    ids = sample["input_ids"][None]
    torch.testing.assert_close(
        sample["hidden"].float(), features(model, ids, LAYERS)[0], rtol=2e-3, atol=2e-3
    )
    narrow, _ = load_heads(first.out, target_model=model)
    heads, found = load_heads(wide.out, target_model=model)
    assert found.feature_layers == LAYERS and found.draft_vocab == narrow.config.draft_vocab
    with torch.no_grad():  # one almost-zero step: where the narrow heads were
        before = narrow.forward_all(features(model, ids, None), ids)
        after = heads.forward_all(features(model, ids, LAYERS), ids)
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)
    with pytest.raises(SpecMTPError, match="holds hidden states the final one alone"):
        train_mtp(replace(wide, out=tmp_path / "x", answers_from=None, cache=first.out / "data"))
    with pytest.raises(SpecMTPError, match="read hidden states 0,1,2"):
        train_mtp(replace(wide, out=tmp_path / "y", init_from=wide.out, feature_layers=(1, 2)))
    with pytest.raises(SpecMTPError, match="need sequential heads"):
        replace(wide, kind="parallel")
