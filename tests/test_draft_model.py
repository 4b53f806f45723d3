"""Small draft models (DraftLM): config, equality with the target it copies, cache rollback,
files, and greedy-exact and lossless decoding with it, multi-token drafting included."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, hf_greedy, tiny_model
from lossless_models import TINY_V, decoder_counts, peaked_target_and_draft, target_joint
from lossless_stats import P_FAIL, fit
from safetensors.torch import load_file
from test_lossless import SAMPLINGS, VerifySpy
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from specmtp import decode
from specmtp.api import SpecGenerator, build_drafter, eos_token_ids
from specmtp.cache import CachedModel
from specmtp.config import GenerationConfig, SamplingConfig
from specmtp.draft_model import (
    DRAFT_CONFIG,
    DRAFT_WEIGHTS,
    DraftConfig,
    DraftLM,
    draft_config_for,
    init_from_target,
    is_draft_dir,
    load_draft,
    save_draft,
)
from specmtp.draft_model_drafter import DraftModelDrafter
from specmtp.drafters import Outcome, Proposal
from specmtp.errors import SpecMTPError
from specmtp.models import LoadedModel, load_model
from specmtp.sampling import logits_to_probs
from specmtp.trunk import TRUNK_FILE
from specmtp.verification import verify_rejection_sampling

PROMPT = [5, 17, 3, 88, 41, 5, 17, 3, 60, 2, 33, 71]
NEW_TOKENS = 40
SOME_VOCAB = tuple(range(TINY_VOCAB - 1, 0, -2))  # 48 odd ids, deliberately not sorted


@pytest.fixture(scope="module")
def target() -> PreTrainedModel:
    return tiny_model("llama", seed=0)


def make_draft(
    target: PreTrainedModel,
    *,
    vocab: tuple[int, ...] | None = None,
    heads: int = 0,
    copy: bool = True,
    seed: int = 1,
    head_noise: float = 0.3,
) -> DraftLM:
    """A draft for `target`: its two layers copied (the draft then is the target, on the
    draft vocabulary) or random, with MTP heads moved off their identity start."""
    torch.manual_seed(seed)
    config = draft_config_for(target, num_layers=2, draft_vocab=vocab, mtp_heads=heads)
    draft = DraftLM(config, target=target)
    if copy:
        init_from_target(draft, target, [0, 1])
    if draft.heads is not None:
        with torch.no_grad():
            for param in draft.heads.parameters():
                param.normal_(0, head_noise)
    return draft.eval()


def ids(seed: int, n: int = 14, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, TINY_VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


# --- config ------------------------------------------------------------------------------


def test_config_json_round_trip(target: PreTrainedModel) -> None:
    config = draft_config_for(
        target, num_layers=1, draft_vocab=(9, 2, 40), mtp_heads=2, objective="text",
        init="target:1",
    )  # fmt: skip
    again = DraftConfig.from_json(config.to_json())
    assert again == config and again.draft_vocab == (9, 2, 40)
    assert again.hidden_size == target.config.hidden_size and again.vocab_size == TINY_VOCAB
    assert json.loads(config.to_json())["draft_vocab"] == [9, 2, 40]
    full = draft_config_for(target, num_layers=2, draft_vocab=None)
    assert DraftConfig.from_json(full.to_json()) == full and full.draft_vocab is None


def _edited(target: PreTrainedModel, **fields: object) -> str:
    saved = json.loads(draft_config_for(target, num_layers=2, draft_vocab=(1, 2)).to_json())
    return json.dumps({**saved, **fields})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"mtp_heads": -1}, "mtp_heads"),
        ({"body": {"hidden_size": "32"}}, "hidden_size"),
        ({"draft_vocab": [1, 1]}, "more than once"),
        ({"draft_vocab": [TINY_VOCAB]}, "draft_vocab"),
        ({"draft_vocab": [-1]}, "draft_vocab"),
        ({"draft_vocab": []}, "draft_vocab"),
        ({"kind": "parallel"}, "fields"),
    ],
)
def test_config_refuses_bad_fields(target: PreTrainedModel, fields: dict, message: str) -> None:
    with pytest.raises(SpecMTPError, match=message):
        DraftConfig.from_json(_edited(target, **fields))


@pytest.mark.parametrize(
    ("text", "message"),
    [("{not json", "not valid JSON"), ("[1, 2]", "object"), ("{}", "incomplete")],
)
def test_config_refuses_malformed_json(text: str, message: str) -> None:
    with pytest.raises(SpecMTPError, match=message):
        DraftConfig.from_json(text)


def test_config_refuses_a_bool_layer_count(target: PreTrainedModel) -> None:
    with pytest.raises(SpecMTPError, match="num_layers"):
        DraftConfig.from_json(_edited(target, num_layers=True))


@pytest.mark.parametrize("body", [{"num_hidden_layers": 2}, {"intermediate_size": "64"}])
def test_load_refuses_a_draft_config_with_a_bad_body(
    target: PreTrainedModel, tmp_path: Path, body: dict
) -> None:
    save_draft(make_draft(target), tmp_path)
    config = json.loads((tmp_path / DRAFT_CONFIG).read_text())
    config["body"] |= body
    (tmp_path / DRAFT_CONFIG).write_text(json.dumps(config))
    with pytest.raises(SpecMTPError):
        load_draft(tmp_path, target=target)


# --- the draft that is its target: the obviously-correct reference --------------------------


def test_a_draft_of_all_target_layers_is_the_target(target: PreTrainedModel) -> None:
    draft = make_draft(target)
    x = ids(0)
    with torch.no_grad():
        expected = target(x, output_hidden_states=True)
        got = draft(x, use_cache=False, output_hidden_states=True)
        hidden = draft.hidden(x)
    assert got.logits.shape == (2, 14, TINY_VOCAB)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, expected.hidden_states[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.hidden_states[-1], hidden)
    assert draft.draft_config.init == "random"  # draft_config_for's; distill records it
    with torch.no_grad():
        last = draft(x, use_cache=False, logits_to_keep=1).logits
    torch.testing.assert_close(last, expected.logits[:, -1:], atol=1e-5, rtol=1e-5)


def test_a_draft_vocabulary_keeps_the_target_logits_there_and_minus_inf_elsewhere(
    target: PreTrainedModel,
) -> None:
    draft = make_draft(target, vocab=SOME_VOCAB)
    x = ids(1)
    with torch.no_grad():
        expected = target(x).logits
        got = draft(x, use_cache=False).logits
    inside = torch.zeros(TINY_VOCAB, dtype=torch.bool)
    inside[list(SOME_VOCAB)] = True
    torch.testing.assert_close(got[..., inside], expected[..., inside], atol=1e-5, rtol=1e-5)
    assert torch.isneginf(got[..., ~inside]).all()
    probs = got.softmax(-1)  # still a distribution over the full vocabulary
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 14))


def test_mtp_heads_give_draft_vocabulary_logits_per_head(target: PreTrainedModel) -> None:
    draft = make_draft(target, vocab=SOME_VOCAB, heads=3, head_noise=0.0)  # identity start
    x = ids(2, n=9)
    with torch.no_grad():
        hidden = draft.hidden(x)
        heads = draft.head_logits(hidden)
        next_token = draft.projection(hidden)
    assert heads.shape == (2, 3, 9, len(SOME_VOCAB))
    for i in range(3):  # zero residual blocks: each head starts as the LM head
        torch.testing.assert_close(heads[:, i], next_token)
    with pytest.raises(SpecMTPError, match="no MTP heads"):
        make_draft(target).head_logits(hidden)


def test_init_from_target_copies_the_named_layers_and_refuses_others(
    target: PreTrainedModel,
) -> None:
    config = draft_config_for(target, num_layers=1, draft_vocab=None)
    draft = DraftLM(config, target=target)
    assert init_from_target(draft, target, [1]) == "target:1"
    source = target.get_decoder().layers[1].state_dict()
    for name, value in draft.body.layers[0].state_dict().items():
        assert torch.equal(value, source[name]), name
    for layers in ([2], [0, 1], [-1]):
        with pytest.raises(SpecMTPError, match="target layer indices"):
            init_from_target(draft, target, layers)
    qwen = tiny_model("qwen2", seed=0)
    qwen_draft = DraftLM(draft_config_for(qwen, num_layers=1, draft_vocab=None), target=qwen)
    with pytest.raises(SpecMTPError, match="Llama target"):
        init_from_target(qwen_draft, qwen, [0])


# --- the KV cache --------------------------------------------------------------------------


def test_chunked_cached_forward_with_rollback_equals_one_full_forward(
    target: PreTrainedModel,
) -> None:
    draft = make_draft(target, vocab=SOME_VOCAB, heads=2, copy=False)
    x = ids(3, n=14, batch=1)
    with torch.no_grad():
        full = draft(x, use_cache=False).logits  # [1, 14, V]
        full_hidden = draft.hidden(x)
    runner = CachedModel(draft, vocab_size=TINY_VOCAB, keep_hidden=True)
    chunks = [runner.forward(x[:, a:b]) for a, b in ((0, 5), (5, 9), (9, 14))]
    torch.testing.assert_close(torch.cat(chunks, 1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(runner.last_hidden, full_hidden[:, 9:], atol=1e-5, rtol=1e-5)
    runner.crop(7)
    assert runner.length == 7
    # Refeed a different token first, then the real ones: a stale cache would show.
    runner.forward(torch.tensor([[0]]))
    runner.crop(7)
    again = runner.forward(x[:, 7:], last_only=False)
    torch.testing.assert_close(again, full[:, 7:], atol=1e-5, rtol=1e-5)
    runner.crop(10)
    last = runner.forward(x[:, 10:], last_only=True)
    torch.testing.assert_close(last, full[:, -1:], atol=1e-5, rtol=1e-5)
    assert runner.length == 14 and runner.kv_bytes() > 0


# --- files ---------------------------------------------------------------------------------


def test_save_load_round_trip_keeps_only_trained_tensors(
    target: PreTrainedModel, tmp_path: Path
) -> None:
    draft = make_draft(target, vocab=SOME_VOCAB, heads=2, copy=False)
    save_draft(draft, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [DRAFT_CONFIG, DRAFT_WEIGHTS]
    assert is_draft_dir(tmp_path) and not is_draft_dir(tmp_path / "absent")
    saved = load_file(tmp_path / DRAFT_WEIGHTS)
    assert set(saved) == {name for name, _ in draft.named_parameters()}
    assert not any(
        name.startswith(("embedding", "projection", "heads.projection")) for name in saved
    )
    assert all(TINY_VOCAB not in t.shape and len(SOME_VOCAB) not in t.shape for t in saved.values())

    loaded = load_draft(tmp_path, target=target)
    assert loaded.draft_config == draft.draft_config
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    mine, theirs = draft.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name  # float32: exact
    x = ids(4)
    with torch.no_grad():
        assert torch.equal(loaded(x, use_cache=False).logits, draft(x, use_cache=False).logits)

    save_draft(draft, tmp_path / "half", dtype=torch.float16)
    assert {t.dtype for t in load_file(tmp_path / "half" / DRAFT_WEIGHTS).values()} == {
        torch.float16
    }
    half = load_draft(tmp_path / "half", target=target)
    assert half.dtype == torch.float32
    for name, value in half.state_dict().items():
        assert torch.equal(value, mine[name].half().float()), name


def test_load_refuses_a_draft_made_for_another_target(
    target: PreTrainedModel, tmp_path: Path
) -> None:
    save_draft(make_draft(target), tmp_path)
    wider = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, vocab_size=TINY_VOCAB, pad_token_id=0,
        )
    )  # fmt: skip
    for other in (tiny_model("llama", seed=0, vocab_size=TINY_VOCAB + 8), wider):
        with pytest.raises(SpecMTPError, match="was made for"):
            load_draft(tmp_path, target=other)
    with pytest.raises(SpecMTPError, match="was made for"):
        DraftLM(make_draft(target).draft_config, target=wider)


def test_load_refuses_a_draft_for_another_checkpoint_but_not_another_dtype(
    target: PreTrainedModel, tmp_path: Path
) -> None:
    """A draft shares its target's embedding and LM head and learned its distributions: on
    another checkpoint of the same architecture it is refused, as heads are."""
    save_draft(make_draft(target), tmp_path, dtype=torch.float16, target=target)
    assert (tmp_path / TRUNK_FILE).exists()
    for dtype in (torch.float32, torch.bfloat16):
        load_draft(tmp_path, target=copy.deepcopy(target).to(dtype))
    other = tiny_model("llama", seed=1)  # same architecture and sizes, other weights
    with pytest.raises(SpecMTPError, match="trained on other weights of this architecture"):
        load_draft(tmp_path, target=other)


def test_load_refuses_corrupt_or_mismatched_files(target: PreTrainedModel, tmp_path: Path) -> None:
    save_draft(make_draft(target), tmp_path)
    weights = tmp_path / DRAFT_WEIGHTS
    good = weights.read_bytes()
    for bad in (good[:100], b"\x00" * 64, b"not a safetensors file at all"):
        weights.write_bytes(bad)
        with pytest.raises(SpecMTPError, match="cannot read a draft"):
            load_draft(tmp_path, target=target)
    weights.write_bytes(good)
    config = json.loads((tmp_path / DRAFT_CONFIG).read_text())
    (tmp_path / DRAFT_CONFIG).write_text(json.dumps({**config, "num_layers": 3}))
    with pytest.raises(SpecMTPError, match="does not match its config"):
        load_draft(tmp_path, target=target)
    (tmp_path / DRAFT_CONFIG).write_text(json.dumps({**config, "mtp_heads": 1}))
    with pytest.raises(SpecMTPError, match="does not match its config"):
        load_draft(tmp_path, target=target)
    with pytest.raises(SpecMTPError, match="cannot read a draft"):
        load_draft(tmp_path / "absent", target=target)


# --- greedy decoding: token-identical to the target's own ----------------------------------

KINDS = {
    "self": {},  # the target itself: every draft accepted
    "random": {"copy": False},  # unrelated: few accepted
    "mtp": {"heads": 2},  # multi-token: the LM-head token right, the heads' mostly wrong
    "mtp-vocab": {"heads": 3, "vocab": SOME_VOCAB, "copy": False},
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("gamma", [1, 2, 3, 4, 5])
def test_greedy_decoding_with_a_draft_model_matches_hf(
    target: PreTrainedModel, kind: str, gamma: int
) -> None:
    draft = make_draft(target, **KINDS[kind])
    drafter = DraftModelDrafter(draft, vocab_size=TINY_VOCAB, multi_token=draft.heads is not None)
    decoder = decode.SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
    result = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=gamma))
    assert result.tokens == hf_greedy(target, PROMPT, NEW_TOKENS)
    stats = result.stats
    assert stats.new_tokens == NEW_TOKENS and stats.drafted_tokens > 0
    if kind == "self":
        assert stats.accepted_tokens == stats.drafted_tokens
        assert stats.mean_accepted_tokens > gamma
    if kind == "random":
        assert stats.accepted_tokens < stats.drafted_tokens
    if kind == "mtp" and gamma > 1:  # the LM head's token passes, the heads' rarely
        assert stats.drafted_tokens > stats.accepted_tokens >= stats.rounds - 1


class ForwardSpy:
    """Counts DraftLM forwards and records each proposal's length."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, drafter: DraftModelDrafter) -> None:
        self.forwards = 0
        self.proposed: list[int] = []
        forward, propose = DraftLM.forward, drafter.propose

        def counting_forward(module: DraftLM, *args: object, **kwargs: object) -> object:
            self.forwards += 1
            return forward(module, *args, **kwargs)

        def recording_propose(*args: object) -> Proposal:
            proposal = propose(*args)
            self.proposed.append(proposal.tokens.shape[1])
            return proposal

        monkeypatch.setattr(DraftLM, "forward", counting_forward)
        monkeypatch.setattr(drafter, "propose", recording_propose)


@pytest.mark.parametrize("multi_token", [True, False])
def test_multi_token_drafting_needs_fewer_draft_forwards(
    target: PreTrainedModel, monkeypatch: pytest.MonkeyPatch, multi_token: bool
) -> None:
    heads = 2
    drafter = DraftModelDrafter(
        make_draft(target, heads=heads, head_noise=0.0), vocab_size=TINY_VOCAB,
        multi_token=multi_token,
    )  # fmt: skip
    spy = ForwardSpy(monkeypatch, drafter)
    decoder = decode.SpecDecoder(target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256)
    result = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=5))
    assert result.tokens == hf_greedy(target, PROMPT, NEW_TOKENS)
    drafted = result.stats.drafted_tokens
    assert sum(spy.proposed) == drafted > 0
    per_forward = 1 + heads if multi_token else 1
    assert spy.forwards == sum(math.ceil(k / per_forward) for k in spy.proposed)
    if multi_token:
        assert spy.forwards < drafted / 2


def reference_rows(draft: DraftLM, context: list[int], drafted: list[int]) -> torch.Tensor:
    """The slow reference for multi-token drafting: the full-vocabulary logits [k, V] each
    drafted token should come from. Every forward is a fresh one over the whole context and
    the tokens of earlier forwards; it yields the LM head's row, then each head's."""
    per_forward = 1 + draft.draft_config.mtp_heads
    rows: list[torch.Tensor] = []
    for start in range(0, len(drafted), per_forward):
        with torch.no_grad():
            hidden = draft.hidden(torch.tensor([context + drafted[:start]]))[:, -1:]  # [1, 1, H]
            step = [draft.projection(hidden[:, 0]), *draft.head_logits(hidden)[:, :, 0].unbind(1)]
        rows += [draft.projection.to_full_logits(row)[0] for row in step]  # each [V]
    return torch.stack(rows[: len(drafted)])


def test_multi_token_proposals_match_the_slow_reference(target: PreTrainedModel) -> None:
    draft = make_draft(target, vocab=SOME_VOCAB, heads=2, copy=False)
    drafter = DraftModelDrafter(draft, vocab_size=TINY_VOCAB, multi_token=True)
    drafter.reset()
    greedy, sampled = SamplingConfig(), SamplingConfig(temperature=1.0)
    context = PROMPT[:8]
    proposal = drafter.propose(torch.tensor([context]), 5, greedy, None)
    drafted = proposal.tokens[0].tolist()
    assert len(drafted) == 5 and proposal.probs is None
    assert drafted == reference_rows(draft, context, drafted).argmax(-1).tolist()
    # The target keeps two drafts and corrects the third: the drafter rolls back to that.
    context = [*context, *drafted[:2], (drafted[2] + 1) % TINY_VOCAB]
    drafter.observe(Outcome(torch.tensor([context]), num_accepted=2, target_hidden=None))
    generator = torch.Generator().manual_seed(0)
    for k in (4, 1, 6):
        proposal = drafter.propose(torch.tensor([context]), k, sampled, generator)
        drafted = proposal.tokens[0].tolist()
        assert proposal.probs is not None and proposal.probs.shape == (1, k, TINY_VOCAB)
        expected = logits_to_probs(reference_rows(draft, context, drafted), sampled)
        torch.testing.assert_close(proposal.probs[0], expected, atol=1e-5, rtol=1e-4)
        assert (proposal.probs[0].gather(-1, proposal.tokens[0, :, None]) > 0).all()
        context = [*context, *drafted[:1], 0]  # one kept, then a correction
        drafter.observe(Outcome(torch.tensor([context]), num_accepted=1, target_hidden=None))


def test_multi_token_drafting_needs_heads(target: PreTrainedModel) -> None:
    with pytest.raises(ValueError, match="MTP heads"):
        DraftModelDrafter(make_draft(target), vocab_size=TINY_VOCAB, multi_token=True)


# --- through the API: saved drafts by spec ------------------------------------------------


@pytest.fixture(scope="module")
def loaded_target(tiny_target: Path) -> LoadedModel:
    return load_model(str(tiny_target))


@pytest.fixture(scope="module")
def saved_drafts(loaded_target: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two drafts for loaded_target: `same` (its own layers, no heads) and `mtp` (its own
    layers and two MTP heads)."""
    root = tmp_path_factory.mktemp("drafts")
    save_draft(make_draft(loaded_target.model), root / "same")
    save_draft(make_draft(loaded_target.model, heads=2), root / "mtp")
    return root


@pytest.mark.parametrize(
    ("spec", "multi_token"), [("draft:same", False), ("draft:mtp", True), ("draft-ar:mtp", False)]
)
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_generator_with_a_saved_draft_matches_hf(
    loaded_target: LoadedModel, saved_drafts: Path, spec: str, multi_token: bool, gamma: int
) -> None:
    method, _, name = spec.partition(":")
    generator = SpecGenerator(loaded_target, draft=f"{method}:{saved_drafts / name}")
    drafter = generator.decoder.drafter
    assert isinstance(drafter, DraftModelDrafter) and drafter.multi_token == multi_token
    prompt = loaded_target.tokenizer("The colours of the rainbow are").input_ids
    completion = generator.generate(prompt, max_new_tokens=24, gamma=gamma)
    expected = hf_greedy(loaded_target.model, prompt, 24, eos=eos_token_ids(loaded_target))
    assert completion.tokens == expected
    stats = completion.stats
    if name == "same":
        assert stats.accepted_tokens == stats.drafted_tokens > 0


def test_generator_takes_a_drafter_object(loaded_target: LoadedModel) -> None:
    draft = make_draft(loaded_target.model, heads=2, copy=False)
    vocab = len(loaded_target.tokenizer)
    drafter = DraftModelDrafter(draft, vocab_size=vocab, multi_token=True)
    assert build_drafter(drafter, loaded_target)[0] is drafter
    generator = SpecGenerator(loaded_target, draft=drafter)
    prompt = loaded_target.tokenizer("Count to ten:").input_ids
    completion = generator.generate(prompt, max_new_tokens=20, gamma=4)
    assert completion.tokens == hf_greedy(
        loaded_target.model, prompt, 20, eos=eos_token_ids(loaded_target)
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("draft:", "bad draft spec"),
        ("draft:{missing}", "no draft in"),
        ("draft-ar:{missing}", "no draft in"),
    ],
)
def test_bad_draft_specs_are_refused(
    loaded_target: LoadedModel, tmp_path: Path, spec: str, message: str
) -> None:
    with pytest.raises(SpecMTPError, match=message):
        build_drafter(spec.format(missing=tmp_path / "missing"), loaded_target)


# --- sampling: lossless with a multi-token draft model -------------------------------------


EXCLUDED = 4  # the target's likeliest first token; the draft can never propose it


@pytest.fixture(scope="module")
def peaked() -> tuple[PreTrainedModel, DraftLM]:
    """lossless_models' peaked target, and a draft of it with the perturbed copy's layers,
    a draft vocabulary without EXCLUDED, and two MTP heads well off their identity start."""
    target, perturbed = peaked_target_and_draft()
    vocab = tuple(i for i in range(TINY_V) if i != EXCLUDED)
    config = draft_config_for(target, num_layers=2, draft_vocab=vocab, mtp_heads=2)
    torch.manual_seed(0)
    draft = DraftLM(config, target=target)
    init_from_target(draft, perturbed, [0, 1])
    with torch.no_grad():
        for param in draft.heads.parameters():
            param.normal_(0, 0.3)
    return target, draft.eval()


class WrongHeadQ(DraftModelDrafter):
    """Lossy: the first head's token is drawn from that head's q but reported with the LM
    head's q of the same forward, as if one distribution served every token of a forward."""

    def propose(
        self,
        context: torch.Tensor,
        k: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        proposal = super().propose(context, k, sampling, generator)
        if proposal.probs is None or proposal.tokens.shape[1] < 2:
            return proposal
        probs = proposal.probs.clone()  # [B, k, V]
        probs[:, 1] = probs[:, 0]
        return Proposal(proposal.tokens, probs)


LOOP_SAMPLES = 3000  # generations per case, about 3 ms each


@pytest.mark.parametrize(
    "sampling", ["t1.0", pytest.param("t0.8-topk4-topp0.9", marks=pytest.mark.slow)]
)
def test_multi_token_draft_model_emits_the_target_joint(
    peaked: tuple[PreTrainedModel, DraftLM], monkeypatch: pytest.MonkeyPatch, sampling: str
) -> None:
    target, draft = peaked
    spy = VerifySpy(verify_rejection_sampling)
    monkeypatch.setattr(decode, "verify_rejection_sampling", spy)
    drafter = DraftModelDrafter(draft, vocab_size=TINY_V, multi_token=True)
    counts = decoder_counts(target, drafter, SAMPLINGS[sampling], LOOP_SAMPLES)
    assert spy.bonus_rounds > 0.1 * spy.drafting_rounds, vars(spy)
    assert spy.rejecting_rounds > 0.1 * spy.drafting_rounds, vars(spy)
    # q is 0 on EXCLUDED; it still comes first about as often as p says, from the residual
    assert counts[EXCLUDED].sum() > 0.3 * LOOP_SAMPLES
    result = fit(counts, target_joint(target, SAMPLINGS[sampling]))
    assert result.passes, result


@pytest.mark.slow
def test_a_multi_token_drafter_reporting_the_wrong_q_fails_the_same_check(
    peaked: tuple[PreTrainedModel, DraftLM],
) -> None:
    target, draft = peaked
    sampling = SAMPLINGS["t1.0"]
    drafter = WrongHeadQ(draft, vocab_size=TINY_V, multi_token=True)
    counts = decoder_counts(target, drafter, sampling, LOOP_SAMPLES)
    result = fit(counts, target_joint(target, sampling))
    assert result.p_value < P_FAIL and not result.passes, result
