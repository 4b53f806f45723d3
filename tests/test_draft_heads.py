"""A draft model with MTP heads trained on it (`MODEL#heads=DIR`): each draft forward
proposes 1 + K tokens, the heads' tokens (parallel) or depths' chain (sequential) are the
ones drafted, and what is accepted does not change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from transformers import AutoModelForCausalLM

from specmtp.api import SpecGenerator, build_drafter
from specmtp.cache import kv_bytes_per_token
from specmtp.config import SamplingConfig
from specmtp.draft_model_drafter import DraftModelDrafter
from specmtp.drafters import Outcome
from specmtp.errors import SpecMTPError
from specmtp.heads import SequentialMTP, build_heads, describe_target
from specmtp.heads_config import HeadsConfig
from specmtp.heads_io import save_heads
from specmtp.models import load_model
from specmtp.sampling import logits_to_probs

NUM_HEADS = 2


def _prompt(seed: int, length: int = 12) -> list[int]:
    return torch.randint(
        100, 5000, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def _save_heads(
    model_dir: Path,
    out: Path,
    *,
    kind: str = "parallel",
    seed: int = 0,
    draft_vocab: tuple[int, ...] | None = tuple(range(0, 6000)),
) -> Path:
    """Heads for the model in `model_dir`, their residual blocks set to random weights so
    that each head predicts something other than the LM head's next token."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = HeadsConfig(
        kind=kind,
        num_heads=NUM_HEADS,
        hidden_size=model.config.hidden_size,
        vocab_size=model.get_output_embeddings().weight.shape[0],
        base_model=describe_target(model),
        draft_vocab=draft_vocab,
    )
    torch.manual_seed(seed)
    heads = build_heads(config, model)
    with torch.no_grad():
        for name, p in heads.named_parameters():
            if name.startswith("heads.") or name.startswith("depths."):
                p.normal_(0, 0.5)
    save_heads(heads, config, out)
    return out


@pytest.fixture(scope="module")
def heads_dir(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_heads(tiny_target, tmp_path_factory.mktemp("draft-heads"))


@pytest.fixture(scope="module")
def sequential_dir(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_heads(tiny_target, tmp_path_factory.mktemp("draft-seq"), kind="sequential")


def _build(tiny_target: Path, heads: Path) -> DraftModelDrafter:
    """The tiny model drafting for itself with the heads in `heads`, reset."""
    drafter, _ = build_drafter(f"{tiny_target}#heads={heads}", load_model(str(tiny_target)))
    assert isinstance(drafter, DraftModelDrafter) and drafter.multi_token
    assert drafter.name == f"{tiny_target}#heads={heads}"
    drafter.reset()
    return drafter


def _count_forwards(drafter: DraftModelDrafter) -> list[int]:
    """A one-element list that counts the draft model's forwards from now on."""
    forwards = [0]
    forward = drafter.runner.forward

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        forwards[0] += 1
        return forward(*args, **kwargs)  # type: ignore[arg-type]

    drafter.runner.forward = counting  # type: ignore[method-assign]
    return forwards


def _reference_rows(drafter: DraftModelDrafter, context: list[int], k: int) -> torch.Tensor:
    """Logits [k, V] of what the drafter should draft, by whole forwards over the context
    plus the drafts so far: the LM head's next token and then each head's, from the hidden
    state of the last token fed."""
    model, heads = drafter.runner.model, drafter.heads
    assert heads is not None
    rows: list[torch.Tensor] = []
    drafted: list[int] = []
    with torch.inference_mode():
        while len(rows) < k:
            out = model(torch.tensor([context + drafted]), output_hidden_states=True)
            hidden = out.hidden_states[-1][:, -1:]  # [1, 1, H]
            step = [out.logits[0, -1], *heads.to_full_logits(heads(hidden)[0, :, -1]).unbind(0)]
            step = step[: k - len(rows)]
            rows += step
            drafted += [int(row.argmax()) for row in step]
    return torch.stack(rows)


def test_each_forward_drafts_the_next_token_and_the_heads_tokens(
    tiny_target: Path, heads_dir: Path
) -> None:
    drafter = _build(tiny_target, heads_dir)
    forwards = _count_forwards(drafter)
    context = _prompt(1)
    greedy = SamplingConfig()
    proposal = drafter.propose(torch.tensor([context]), 5, greedy, None)
    assert forwards == [2]  # 1 + K = 3 tokens a forward
    drafted = proposal.tokens[0].tolist()
    expected = _reference_rows(drafter, context, 5)
    assert drafted == expected.argmax(-1).tolist()
    with torch.inference_mode():  # the model's own greedy continuation: not what was drafted
        plain = drafter.runner.model.generate(
            torch.tensor([context]), max_new_tokens=5, min_new_tokens=5, do_sample=False
        )[0, len(context) :].tolist()
    assert drafted[0] == plain[0] and drafted != plain
    # Two kept, the third corrected: the next proposal starts from the corrected context.
    context = [*context, *drafted[:2], (drafted[2] + 1) % 5000]
    drafter.observe(Outcome(torch.tensor([context]), num_accepted=2, target_hidden=None))
    sampled = SamplingConfig(temperature=1.0)
    proposal = drafter.propose(torch.tensor([context]), 3, sampled, torch.Generator())
    assert proposal.probs is not None and proposal.probs.shape[:2] == (1, 3)
    got = proposal.tokens[0].tolist()
    with torch.inference_mode():  # one forward: the rows do not depend on the sampled tokens
        out = drafter.runner.model(torch.tensor([context]), output_hidden_states=True)
        hidden = out.hidden_states[-1][:, -1:]
        heads = drafter.heads
        assert heads is not None
        rows = [out.logits[0, -1], *heads.to_full_logits(heads(hidden)[0, :, -1]).unbind(0)]
    expected_q = logits_to_probs(torch.stack(rows), sampled)
    torch.testing.assert_close(proposal.probs[0], expected_q, atol=1e-5, rtol=1e-4)
    assert (proposal.probs[0].gather(-1, torch.tensor(got)[:, None]) > 0).all()
    # The heads' draft vocabulary: q is zero off it.
    assert torch.all(proposal.probs[0, 1:, 6000:] == 0)


@torch.inference_mode()
def _depth_chain(drafter: DraftModelDrafter, base: list[int], first: int, m: int) -> list[int]:
    """Depths 0..m-1's greedy chain after `base` and its next token `first`, by whole
    forwards, teacher-forced (`forward_all`, the training computation): depth i's top-1 at
    the last position of `base`."""
    model, heads = drafter.runner.model, drafter.heads
    assert isinstance(heads, SequentialMTP)
    sequence = [*base, first]
    for i in range(m):
        ids = torch.tensor([sequence])
        hidden = model(ids, output_hidden_states=True).hidden_states[-1]
        logits = heads.forward_all(hidden, ids)[i][0, len(base) - 1]  # [V']
        sequence.append(int(heads.to_full_ids(logits.argmax())))
    return sequence[len(base) + 1 :]


@torch.inference_mode()
def _sequential_reference(drafter: DraftModelDrafter, context: list[int], k: int) -> list[int]:
    """The greedy drafts: per draft forward, the LM head's next token after the context
    and the drafts so far, then the depths' chain after it."""
    depths = drafter.heads.config.num_heads if drafter.heads is not None else 0
    drafted: list[int] = []
    while len(drafted) < k:
        base = context + drafted
        first = int(drafter.runner.model(torch.tensor([base])).logits[0, -1].argmax())
        drafted += [first, *_depth_chain(drafter, base, first, min(depths, k - len(drafted) - 1))]
    return drafted


def test_sequential_depths_draft_over_the_history_across_rounds(
    tiny_target: Path, sequential_dir: Path
) -> None:
    drafter = _build(tiny_target, sequential_dir)
    assert drafter.history is not None
    forwards = _count_forwards(drafter)
    context, greedy = _prompt(2), SamplingConfig()
    chance = torch.Generator().manual_seed(0)
    for _ in range(6):  # rounds of random acceptance; the caches keep only committed tokens
        forwards[0] = 0
        drafted = drafter.propose(torch.tensor([context]), 5, greedy, None).tokens[0].tolist()
        assert forwards == [2]  # 1 + K = 3 tokens, then 2 more
        assert drafted == _sequential_reference(drafter, context, 5)
        kept = int(torch.randint(0, 6, (1,), generator=chance))
        context = [*context, *drafted[:kept], int(torch.randint(100, 5000, (1,), generator=chance))]
        drafter.observe(Outcome(torch.tensor([context]), num_accepted=kept, target_hidden=None))
        assert drafter.history.hidden is not None
        assert drafter.history.hidden.shape[1] == drafter.fed.shape[1] <= len(context)
    assert drafter.kv_bytes() > drafter.runner.kv_bytes()
    assert drafter.kv_bytes_per_token() > kv_bytes_per_token(drafter.runner.model)
    # A random depth disagrees with the model's own continuation: the heads do draft.
    with torch.inference_mode():
        plain = drafter.runner.model.generate(
            torch.tensor([context]), max_new_tokens=3, min_new_tokens=3, do_sample=False
        )[0, len(context) :].tolist()
    assert _sequential_reference(drafter, context, 3) != plain


def test_sequential_depth_drafts_are_fixed_choices_when_sampling(
    tiny_target: Path, sequential_dir: Path
) -> None:
    drafter = _build(tiny_target, sequential_dir)
    context, sampled = _prompt(3), SamplingConfig(temperature=1.0)
    proposal = drafter.propose(torch.tensor([context]), 3, sampled, torch.Generator())
    assert proposal.probs is not None and proposal.probs.shape[:2] == (1, 3)
    got = proposal.tokens[0].tolist()
    with torch.inference_mode():
        logits = drafter.runner.model(torch.tensor([context])).logits[0, -1]
    torch.testing.assert_close(proposal.probs[0, 0], logits_to_probs(logits, sampled))
    # After the sampled first token, the depths' greedy chain, with one-hot q.
    assert got[1:] == _depth_chain(drafter, context, got[0], 2)
    assert torch.equal(proposal.probs[0, 1:].argmax(-1), torch.tensor(got[1:]))
    assert torch.equal(proposal.probs[0, 1:].sum(-1), torch.ones(2))


def test_greedy_output_is_plain_decodings(
    tiny_target: Path, heads_dir: Path, sequential_dir: Path
) -> None:
    plain = SpecGenerator(str(tiny_target))
    headed = SpecGenerator(str(tiny_target), draft=f"{tiny_target}#heads={heads_dir}")
    cut = SpecGenerator(str(tiny_target), draft=f"{tiny_target}#vocab=3000#heads={heads_dir}")
    chained = SpecGenerator(str(tiny_target), draft=f"{tiny_target}#heads={sequential_dir}")
    for seed in range(3):
        prompt = _prompt(seed)
        expected = plain.generate(prompt, max_new_tokens=30).tokens
        done = headed.generate(prompt, max_new_tokens=30, gamma=4)
        assert done.tokens == expected
        # The LM head (the target itself) is right every round, the random heads rarely.
        assert done.stats.rounds <= done.stats.accepted_tokens < done.stats.drafted_tokens
        assert cut.generate(prompt, max_new_tokens=30, gamma=4).tokens == expected
        done = chained.generate(prompt, max_new_tokens=30, gamma=5)
        assert done.tokens == expected
        assert done.stats.rounds <= done.stats.accepted_tokens < done.stats.drafted_tokens


def test_bad_head_specs_are_refused(
    tiny_target: Path, heads_dir: Path, tmp_path: Path, specmtp_cache: Path
) -> None:
    target = load_model(str(tiny_target))
    # A draft whose output matrix is wider than the target's vocabulary (padded rows):
    # sequential heads over all of it could draft ids the target does not have.
    padded = tmp_path / "padded"
    wide = tiny_model("llama", seed=1, vocab_size=target.model.config.vocab_size + 64)
    wide.save_pretrained(padded)
    target.tokenizer.save_pretrained(padded)
    sequential = _save_heads(padded, tmp_path / "seq", kind="sequential", draft_vocab=None)
    for spec, message in [
        (f"{tiny_target}#heads=", "use MODEL#heads=DIR"),
        (f"#heads={heads_dir}", "use MODEL#heads=DIR"),
        (f"mtp#heads={heads_dir}", "applies to a draft model given by name or path"),
        (f"distilled#heads={heads_dir}", "applies to a draft model given by name or path"),
        (f"{padded}#heads={sequential}", "can draft token id"),
        (f"{tiny_target}#heads={tmp_path / 'none'}", "cannot read heads"),
        (f"default#heads={heads_dir}", "were trained for"),  # another model's heads
    ]:
        with pytest.raises(SpecMTPError, match=message):
            build_drafter(spec, target)
