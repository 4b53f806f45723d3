"""`distill` end to end on a tiny target (both objectives, resume, continued MTP training),
the partition KL it minimises, and the CLI's refusals."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import run_cli
from safetensors.torch import load_file

from specmtp.data import MANIFEST, DistillBatch, DistillCache, is_heldout
from specmtp.data_build import DistillConfig, build_cache
from specmtp.distill import (
    DistillReport,
    DistillTrainConfig,
    _continued_draft,
    _kl_loss,
    train_draft,
)
from specmtp.draft_model import DRAFT_WEIGHTS, load_draft
from specmtp.errors import SpecMTPError
from specmtp.heads import VocabProjection
from specmtp.models import LoadedModel, load_model
from specmtp.text_data import tokenize_chunks
from specmtp.train_prompts import load_train_prompts

PROMPTS = [f"Question {i}: list {i} colours, then count them one by one." for i in range(16)]
TEXT = (
    "The river rose in spring and the village moved its boats to higher ground. "
    "Children counted the days until the water fell, and the baker sold bread from a cart. "
    "In summer the fields turned gold, the swallows came back, and the old mill turned again."
)


@pytest.fixture(scope="module")
def loaded(tiny_target: Path) -> LoadedModel:
    return load_model(str(tiny_target))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("texts")
    for i in range(2):
        (folder / f"doc{i}.txt").write_text("\n\n".join([TEXT] * 4))
    (folder / "notes.md").write_text("not a .txt file: never read")
    return folder


def config(target: Path, prompts: Path, out: Path, steps: int, **fields: Any) -> DistillTrainConfig:
    settings: dict[str, Any] = {
        "sources": (prompts,), "out": out, "target": str(target), "steps": steps,
        "batch_size": 2, "seq_len": 64, "max_new_tokens": 12, "topk": 8, "draft_vocab": 50,
        "lr": 2e-2, "checkpoint_every": 2, "eval_every": 3, "heldout_fraction": 0.25,
    }  # fmt: skip
    return DistillTrainConfig(**(settings | fields))


@pytest.fixture(scope="module")
def distilled(
    tiny_target: Path, prompts: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[DistillTrainConfig, DistillReport]:
    """One 5-step distillation run; its data cache serves the other runs here."""
    run = config(tiny_target, prompts, tmp_path_factory.mktemp("distill"), steps=5)
    return run, train_draft(run)


def metric_lines(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def most_frequent(counts: Counter[int], vocab: tuple[int, ...], size: int) -> None:
    """`vocab` is `size` of the most frequent tokens (ties either way), in id order."""
    assert len(vocab) == min(size, len(counts)) and list(vocab) == sorted(vocab)
    assert set(vocab) <= set(counts)
    left_out = [counts[t] for t in counts if t not in vocab]
    assert not left_out or min(counts[t] for t in vocab) >= max(left_out)


# --- distill: end to end -------------------------------------------------------------------


def test_distillation_writes_a_loadable_draft_metrics_and_a_report(
    distilled: tuple[DistillTrainConfig, DistillReport], loaded: LoadedModel
) -> None:
    run, report = distilled
    assert report.steps == 5 and report.seconds > 0
    draft = load_draft(run.out / "draft", target=loaded.model)
    settings = draft.draft_config
    assert (settings.objective, settings.init, settings.num_layers) == ("distill", "target:0,1", 2)
    assert settings.mtp_heads == 0 and draft.heads is None
    assert {t.dtype for t in load_file(run.out / "draft" / DRAFT_WEIGHTS).values()} == {
        torch.float16
    }
    # Trained: the copied target layers have moved.
    start = loaded.model.get_decoder().layers[0].self_attn.q_proj.weight
    assert not torch.allclose(draft.body.layers[0].self_attn.q_proj.weight, start, atol=1e-3)

    cache = DistillCache.open(run.out / "data")
    counts: Counter[int] = Counter()
    for index in range(cache.num_samples):
        if not is_heldout(index, run.heldout_fraction):
            counts.update(cache.answer_tokens(index).tolist())
    assert settings.draft_vocab is not None
    most_frequent(counts, settings.draft_vocab, run.draft_vocab)

    assert report.tokens == cache.manifest["num_tokens"]
    assert report.draft_parameters == sum(p.numel() for p in draft.parameters())
    assert set(report.heldout) == {"loss", "next_loss", "accuracy"}
    assert report.heldout["loss"] >= 0 and 0 <= report.heldout["accuracy"] <= 1
    assert json.loads((run.out / "report.json").read_text()) == json.loads(
        json.dumps(asdict(report))
    )
    lines = metric_lines(run.out)
    assert [line["step"] for line in lines if "split" not in line] == [1, 2, 3, 4, 5]
    assert [line["step"] for line in lines if line.get("split") == "heldout"] == [3, 5]
    assert all(line["loss"] >= 0 and 0 <= line["accuracy"] <= 1 for line in lines)
    assert lines[-1] == {"step": 5, "split": "heldout", **report.heldout}
    checkpoints = sorted(p.name for p in (run.out / "checkpoints").iterdir())
    assert checkpoints == ["step-00000004", "step-00000005"]


def test_interrupted_distillation_resumes_to_the_same_draft(
    distilled: tuple[DistillTrainConfig, DistillReport],
    tiny_target: Path,
    prompts: Path,
    tmp_path: Path,
) -> None:
    data = distilled[0].data_dir
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_draft(config(tiny_target, prompts, straight, steps=6, cache=data))
    train_draft(config(tiny_target, prompts, resumed, steps=3, cache=data))  # "killed" at 3
    train_draft(config(tiny_target, prompts, resumed, steps=6, cache=data))
    for name in ("checkpoints/step-00000006/weights.safetensors", f"draft/{DRAFT_WEIGHTS}"):
        a, b = load_file(straight / name), load_file(resumed / name)
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (name, key)
    # The resumed steps are not logged twice, and every logged number is the same.
    assert metric_lines(resumed) == metric_lines(straight)
    assert not (resumed / "data").exists()  # the shared cache was used, not rebuilt

    other = config(tiny_target, prompts, resumed, steps=8, cache=data, lr=1e-3)
    with pytest.raises(SpecMTPError, match="another run"):
        train_draft(other)


def test_a_heads_cache_with_other_hidden_states_serves_distillation(
    loaded: LoadedModel, tiny_target: Path, prompts: Path, tmp_path: Path
) -> None:
    """`train-mtp` caches keep hidden states of chosen layers; distillation reads only the
    answers and top-k, so such a cache is used as it is (not rebuilt, not refused). A cache
    whose answers or top-k differ is still refused."""
    data = tmp_path / "heads-data"
    settings = DistillConfig(max_new_tokens=12, topk=8, feature_layers=(1, 2))
    build_cache(loaded, load_train_prompts([prompts]), data, config=settings)
    manifest = (data / MANIFEST).read_text()
    report = train_draft(config(tiny_target, prompts, tmp_path / "run", steps=2, cache=data))
    assert (data / MANIFEST).read_text() == manifest
    assert report.tokens == DistillCache.open(data).manifest["num_tokens"]
    other = config(tiny_target, prompts, tmp_path / "other", steps=2, cache=data, topk=4)
    with pytest.raises(SpecMTPError, match="different settings"):
        train_draft(other)


def test_more_draft_layers_than_the_target_has_cannot_copy_it(
    distilled: tuple[DistillTrainConfig, DistillReport],
    tiny_target: Path,
    prompts: Path,
    tmp_path: Path,
) -> None:
    run = config(tiny_target, prompts, tmp_path, 1, cache=distilled[0].data_dir, num_layers=3)
    with pytest.raises(SpecMTPError, match="target layer indices"):
        train_draft(run)


# --- text, then continued training with MTP heads -----------------------------------------


@pytest.fixture(scope="module")
def text_run(
    tiny_target: Path, texts: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[DistillTrainConfig, DistillReport]:
    run = config(
        tiny_target, texts, tmp_path_factory.mktemp("text"), steps=3, objective="text",
        seq_len=32, draft_vocab=40, init="random",
    )  # fmt: skip
    return run, train_draft(run)


def test_text_objective_trains_on_plain_text(
    text_run: tuple[DistillTrainConfig, DistillReport], loaded: LoadedModel
) -> None:
    run, report = text_run
    draft = load_draft(run.out / "draft", target=loaded.model)
    assert (draft.draft_config.objective, draft.draft_config.init) == ("text", "random")
    documents = [(run.sources[0] / f"doc{i}.txt").read_text().strip() for i in range(2)]
    chunks = tokenize_chunks(documents, loaded.tokenizer, seq_len=32)  # notes.md is not text
    counts: Counter[int] = Counter()
    for index in range(chunks.num_chunks):
        if not is_heldout(index, run.heldout_fraction):
            counts.update(chunks.tokens[index].tolist())
    assert draft.draft_config.draft_vocab is not None
    most_frequent(counts, draft.draft_config.draft_vocab, 40)
    assert report.tokens == chunks.tokens.numel()
    assert report.steps == 3 and 0 <= report.heldout["accuracy"] <= 1
    assert [line["step"] for line in metric_lines(run.out)] == [1, 2, 3, 3]
    assert not (run.out / "data").exists()  # text needs no target answers


def test_continued_training_adds_heads_to_the_draft_it_starts_from(
    text_run: tuple[DistillTrainConfig, DistillReport],
    distilled: tuple[DistillTrainConfig, DistillReport],
    tiny_target: Path,
    prompts: Path,
    loaded: LoadedModel,
    tmp_path: Path,
) -> None:
    old_dir = text_run[0].out / "draft"
    old = load_draft(old_dir, target=loaded.model)
    run = config(
        tiny_target, prompts, tmp_path, steps=2, init_from=old_dir, mtp_heads=2,
        cache=distilled[0].data_dir, draft_vocab=7,  # the old draft's vocabulary is kept
    )  # fmt: skip

    start = _continued_draft(run, loaded)  # the draft train_draft starts from
    body = {k: v for k, v in start.state_dict().items() if not k.startswith("heads.")}
    assert body.keys() == old.state_dict().keys()
    for name, value in old.state_dict().items():
        assert torch.equal(body[name], value), name
    assert start.heads is not None and len(start.heads.heads) == 2
    assert all(not p.any() for p in start.heads.parameters())  # fresh: the identity start
    assert all(p.requires_grad for p in start.parameters())
    settings = start.draft_config
    assert settings.draft_vocab == old.draft_config.draft_vocab
    assert settings.objective == "text+distill" and settings.init.startswith(f"draft:{old_dir}")

    report = train_draft(run)
    trained = load_draft(tmp_path / "draft", target=loaded.model)
    assert trained.heads is not None and trained.draft_config == settings
    assert {"head0_accuracy", "head1_accuracy"} <= set(report.heldout)
    steps = [line for line in metric_lines(tmp_path) if "split" not in line]
    assert len(steps) == 2 and all("head1_accuracy" in line for line in steps)
    heldout = [line for line in metric_lines(tmp_path) if "split" in line]
    assert heldout[0]["step"] == 0  # the draft it starts from, scored before the first step
    assert not (tmp_path / "data").exists()


# --- the partition KL ----------------------------------------------------------------------

V = 12
DRAFT_IDS = (10, 0, 4, 2, 8, 6)  # the even ids, in no particular order
K = 4


def kl_draft() -> SimpleNamespace:
    """What _kl_loss reads from a draft: its projection's maps between vocabularies."""
    return SimpleNamespace(
        projection=VocabProjection(torch.zeros(V, 4), draft_vocab=DRAFT_IDS, trainable=False)
    )


def batch_of(p: torch.Tensor, mask: torch.Tensor) -> DistillBatch:
    """Teacher distributions p [B, T, V] as a batch of their top-K log-probabilities."""
    values, indices = p.log().topk(K, dim=-1)
    return DistillBatch(
        input_ids=torch.zeros(mask.shape, dtype=torch.long), attention_mask=mask,
        loss_mask=mask.clone(), topk_values=values, topk_indices=indices,
    )  # fmt: skip


def reference_kl(batch: DistillBatch, log_q: torch.Tensor) -> float:
    """KL(p || q) over {each top-K token in the draft vocabulary, everything else},
    position by position, averaged over the attended positions."""
    terms = []
    for b, t in batch.attention_mask.nonzero().tolist():
        p_rest = q_rest = 1.0
        kl = 0.0
        for value, token in zip(batch.topk_values[b, t], batch.topk_indices[b, t], strict=True):
            if int(token) not in DRAFT_IDS:
                continue  # its mass stays in the rest
            p = math.exp(float(value))
            q = math.exp(float(log_q[b, t, DRAFT_IDS.index(int(token))]))
            kl += p * math.log(p / q)
            p_rest, q_rest = p_rest - p, q_rest - q
        terms.append(kl + (p_rest * math.log(p_rest / q_rest) if p_rest > 1e-12 else 0.0))
    return sum(terms) / len(terms)


def test_kl_is_zero_when_the_draft_matches_the_teacher_on_the_partition() -> None:
    generator = torch.Generator().manual_seed(0)
    p = (3 * torch.randn(2, 5, V, generator=generator)).softmax(-1)
    batch = batch_of(p, torch.ones(2, 5, dtype=torch.bool))
    # q agrees with p on each top-K token it can emit and spreads the rest evenly over its
    # other tokens: different from p token by token, equal on the partition.
    q = torch.zeros(2, 5, len(DRAFT_IDS))
    for b in range(2):
        for t in range(5):
            top = batch.topk_indices[b, t].tolist()
            inside = [i for i, token in enumerate(DRAFT_IDS) if token in top]
            others = [i for i in range(len(DRAFT_IDS)) if i not in inside]
            q[b, t, inside] = p[b, t, [DRAFT_IDS[i] for i in inside]]
            q[b, t, others] = (1 - q[b, t, inside].sum()) / len(others)
    loss, _ = _kl_loss(kl_draft(), batch, q.log())
    assert abs(float(loss)) < 1e-6
    assert float(_kl_loss(kl_draft(), batch, q.roll(1, -1).log())[0]) > 1e-3


def test_tokens_outside_the_draft_vocabulary_fall_into_the_rest() -> None:
    # One position: the teacher's top tokens are 3 (outside, 0.6), 2 (inside, 0.3), then
    # tokens 5, 7 (outside, 0.05 each); the rest bucket holds 1 - 0.3 = 0.7 of p.
    values = torch.tensor([[[0.6, 0.3, 0.05, 0.05]]]).log()
    indices = torch.tensor([[[3, 2, 5, 7]]])
    mask = torch.ones(1, 1, dtype=torch.bool)
    batch = DistillBatch(torch.zeros(1, 1, dtype=torch.long), mask, mask, None, values, indices)

    def loss(q_of_2: float) -> float:
        q = torch.full((1, 1, len(DRAFT_IDS)), (1 - q_of_2) / (len(DRAFT_IDS) - 1))
        q[..., DRAFT_IDS.index(2)] = q_of_2
        return float(_kl_loss(kl_draft(), batch, q.log())[0])

    assert abs(loss(0.3)) < 1e-6
    expected = 0.3 * math.log(0.3 / 0.9) + 0.7 * math.log(0.7 / 0.1)
    assert loss(0.9) == pytest.approx(expected, rel=1e-5)


def test_kl_matches_the_reference_and_is_never_negative() -> None:
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        p = (3 * torch.randn(3, 6, V, generator=generator)).softmax(-1)
        mask = torch.rand(3, 6, generator=generator) < 0.7
        mask[0, 0] = True
        batch = batch_of(p, mask)
        log_q = (2 * torch.randn(3, 6, len(DRAFT_IDS), generator=generator)).log_softmax(-1)
        loss, accuracy = _kl_loss(kl_draft(), batch, log_q)
        assert float(loss) >= 0
        assert float(loss) == pytest.approx(reference_kl(batch, log_q), rel=1e-4, abs=1e-6)
        # Padding changes nothing.
        padded = DistillBatch(
            batch.input_ids, mask, mask, None,
            torch.where(mask[..., None], batch.topk_values, 0.0),
            torch.where(mask[..., None], batch.topk_indices, 1),
        )  # fmt: skip
        assert torch.equal(_kl_loss(kl_draft(), padded, log_q)[0], loss)
        best = torch.tensor(DRAFT_IDS)[log_q.argmax(-1)]  # [B, T] full ids
        predicts_answer = torch.zeros_like(mask)  # position t predicts x_{t+1}
        predicts_answer[:, :-1] = mask[:, 1:]
        right = (best == batch.topk_indices[..., 0])[mask & predicts_answer]
        assert float(accuracy) == pytest.approx(float(right.float().mean()))


def test_accuracy_scores_the_positions_that_predict_answer_tokens() -> None:
    # Prompt x0 x1 x2, answer x3 x4: positions 2 and 3 predict the answer; 4 predicts past it.
    top = torch.tensor(DRAFT_IDS[:5])  # the teacher's top-1 at positions 0..4
    p = torch.full((1, 5, V), 0.5 / (V - 1))
    p[0, torch.arange(5), top] = 0.5
    batch = batch_of(p, torch.ones(1, 5, dtype=torch.bool))
    batch = DistillBatch(
        batch.input_ids, batch.attention_mask, torch.tensor([[False, False, False, True, True]]),
        None, batch.topk_values, batch.topk_indices,
    )  # fmt: skip
    guess = torch.tensor([5, 5, 2, 3, 5])  # draft ids: right (= top) at positions 2 and 3 only
    log_q = torch.nn.functional.one_hot(guess, len(DRAFT_IDS)).float()[None].log_softmax(-1)
    assert (torch.tensor(DRAFT_IDS)[guess] == top).tolist() == [False, False, True, True, False]
    assert float(_kl_loss(kl_draft(), batch, log_q)[1]) == 1.0


# --- the CLI -------------------------------------------------------------------------------


def one_line_error(code: int, err: str) -> None:
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err


def test_cli_distill_refuses_bad_input(
    capfd: pytest.CaptureFixture[str], tiny_target: Path, prompts: Path, tmp_path: Path
) -> None:
    base = ["distill", "--out", str(tmp_path / "out"), "--target", str(tiny_target)]
    code, _, err = run_cli(capfd, *base, "--data", str(prompts), "--steps", "0")
    one_line_error(code, err)
    assert "steps must be >= 1" in err
    code, _, err = run_cli(capfd, *base, "--data", str(tmp_path / "missing"))
    one_line_error(code, err)
    assert "not found" in err
    code, _, err = run_cli(capfd, *base, "--data", str(prompts), "--objective", "text")
    one_line_error(code, err)
    assert "unsupported text file" in err


def test_cli_distill_runs_and_refuses_a_missing_init_draft(
    capfd: pytest.CaptureFixture[str],
    distilled: tuple[DistillTrainConfig, DistillReport],
    tiny_target: Path,
    prompts: Path,
    tmp_path: Path,
) -> None:
    run = distilled[0]
    flags = [
        "distill", "--data", str(prompts), "--target", str(tiny_target), "--cache",
        str(run.data_dir), "--max-new-tokens", "12", "--topk", "8", "--seq-len", "64",
        "--batch-size", "2", "--heldout-fraction", "0.25", "--draft-vocab", "30",
    ]  # fmt: skip
    code, out, _ = run_cli(capfd, *flags, "--out", str(tmp_path / "ok"), "--steps", "2")
    assert code == 0
    report = json.loads(out.splitlines()[-1])
    assert report["steps"] == 2
    vocab = json.loads((tmp_path / "ok" / "draft" / "draft.json").read_text())["draft_vocab"]
    assert len(vocab) == 30
    code, _, err = run_cli(
        capfd, *flags, "--out", str(tmp_path / "bad"), "--init-from", str(tmp_path / "nothing")
    )
    one_line_error(code, err)
    assert "cannot read a draft" in err


def test_data_only_builds_the_cache_and_trains_nothing(
    capfd: pytest.CaptureFixture[str],
    distilled: tuple[DistillTrainConfig, DistillReport],
    tiny_target: Path,
    prompts: Path,
    tmp_path: Path,
) -> None:
    run, out = distilled[0], tmp_path / "data-only"
    code, stdout, err = run_cli(
        capfd, "distill", "--data", str(prompts), "--target", str(tiny_target), "--out",
        str(out), "--max-new-tokens", "12", "--topk", "8", "--data-only",
    )  # fmt: skip
    assert code == 0, err
    assert stdout.splitlines()[0].startswith(f"data cache {out / 'data'}: ")
    assert sorted(p.name for p in out.iterdir()) == ["data"]  # no draft, no checkpoints
    built, reference = DistillCache.open(out / "data"), DistillCache.open(run.data_dir)
    assert built.manifest["key"] == reference.manifest["key"]  # the same content
    assert json.loads(stdout.splitlines()[-1])["tokens"] == reference.manifest["num_tokens"]


def test_cli_generate_refuses_a_missing_or_foreign_draft(
    capfd: pytest.CaptureFixture[str],
    distilled: tuple[DistillTrainConfig, DistillReport],
    tiny_target: Path,
    tmp_path: Path,
) -> None:
    code, _, err = run_cli(
        capfd, "generate", "hi", "--target", str(tiny_target), "--draft", "draft:/nonexistent"
    )
    one_line_error(code, err)
    assert "no draft in /nonexistent" in err
    draft = distilled[0].out / "draft"  # made for the tiny target, not the default model
    code, _, err = run_cli(capfd, "generate", "hi", "--draft", f"draft:{draft}")
    one_line_error(code, err)
    assert "was made for" in err
