"""`train-mtp` end to end on a tiny target: outputs, exact resume, refusals."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file

from specmtp.cli import main
from specmtp.data import DistillCache, iter_batches
from specmtp.errors import SpecMTPError
from specmtp.heads_io import load_heads
from specmtp.models import load_model
from specmtp.train import TrainConfig, label_ids, train_mtp
from specmtp.train_prompts import load_train_prompts
from specmtp.tree import TREE_FILE, TokenTree

PROMPTS = "\n\n".join(
    f"Question {i}: list {i} colours, then count them one by one." for i in range(12)
)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    # One paragraph per prompt: a .txt source is cut at blank lines into chunks.
    path.write_text(PROMPTS.replace("\n\n", "\n\n" + "x" * 1400 + "\n\n"))
    return path


def config(target: Path, prompts: Path, out: Path, steps: int) -> TrainConfig:
    return TrainConfig(
        sources=(prompts,), out=out, target=str(target), num_heads=3, steps=steps,
        batch_size=2, seq_len=64, max_new_tokens=12, checkpoint_every=2, eval_every=3,
        heldout_fraction=0.25, draft_vocab=300,
    )  # fmt: skip


def test_training_writes_loadable_heads_and_a_tree(
    tiny_target: Path, prompts: Path, tmp_path: Path
) -> None:
    report = train_mtp(config(tiny_target, prompts, tmp_path, steps=5))
    assert report.steps == 5 and len(report.heldout_accuracy) == 3
    rows = report.heldout_rank_probabilities
    assert all(round(value, 4) == value for row in rows for value in row)  # 4 decimals, exactly
    _, heads_config = load_heads(tmp_path, target_model=load_model(str(tiny_target)).model)
    assert heads_config.num_heads == 3 and len(heads_config.draft_vocab) <= 300
    tree = TokenTree.load(tmp_path / TREE_FILE)
    assert 1 <= tree.max_depth <= 3
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert sum('"loss"' in line for line in lines) == 5


def test_interrupted_training_resumes_to_the_same_heads(
    tiny_target: Path, prompts: Path, tmp_path: Path
) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_mtp(config(tiny_target, prompts, straight, steps=6))
    train_mtp(config(tiny_target, prompts, resumed, steps=3))  # "killed" after step 3
    train_mtp(config(tiny_target, prompts, resumed, steps=6))
    a = load_file(straight / "heads.safetensors")
    b = load_file(resumed / "heads.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name])
    steps = [
        line for line in (resumed / "metrics.jsonl").read_text().splitlines() if "loss" in line
    ]
    assert len(steps) == 6  # the resumed steps are not logged twice


def test_a_run_directory_of_other_settings_is_refused(
    tiny_target: Path, prompts: Path, tmp_path: Path
) -> None:
    train_mtp(config(tiny_target, prompts, tmp_path, steps=2))
    other = TrainConfig(**{**config(tiny_target, prompts, tmp_path, 4).__dict__, "lr": 5e-3})
    with pytest.raises(SpecMTPError, match="another run"):
        train_mtp(other)


def test_cli_bad_training_input(capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(["train-mtp", "--data", str(tmp_path / "missing"), "--out", str(tmp_path)])
    err = capfd.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    code = main(["train-mtp", "--data", str(tmp_path), "--out", str(tmp_path), "--steps", "0"])
    assert code == 2


def test_an_existing_cache_is_used_as_is_and_checked(
    tiny_target: Path, prompts: Path, tmp_path: Path
) -> None:
    first = tmp_path / "first"
    train_mtp(config(tiny_target, prompts, first, steps=2))
    manifest = (first / "data" / "manifest.json").read_text()
    reused = replace(
        config(tiny_target, tmp_path / "missing.txt", tmp_path / "second", steps=2),
        cache=first / "data", kind="sequential", mixed_precision="bf16",
    )  # fmt: skip
    report = train_mtp(reused)  # the prompt source does not exist: nothing is rebuilt
    assert report.steps == 2 and not (tmp_path / "second" / "data").exists()
    assert (first / "data" / "manifest.json").read_text() == manifest
    other = tmp_path / "other-target"
    shutil.copytree(tiny_target, other)
    model = load_model(str(other)).model
    with torch.no_grad():
        model.get_input_embeddings().weight[0] += 1.0
    model.save_pretrained(other)
    with pytest.raises(SpecMTPError, match="was built by model"):
        train_mtp(replace(reused, target=str(other), out=tmp_path / "third"))


def test_kl_objective_caches_the_targets_top_k_and_needs_it(
    tiny_target: Path, prompts: Path, tmp_path: Path
) -> None:
    kl = replace(config(tiny_target, prompts, tmp_path / "kl", steps=3), objective="kl")
    report = train_mtp(kl)
    assert report.steps == 3 and len(report.heldout_accuracy) == 3
    assert '"topk": 20' in (tmp_path / "kl" / "data" / "manifest.json").read_text()
    # The same run directory with the other objective is another run.
    with pytest.raises(SpecMTPError, match="another run"):
        train_mtp(replace(kl, objective="tokens", steps=4, cache=tmp_path / "kl" / "data"))
    tokens_only = config(tiny_target, prompts, tmp_path / "tokens", steps=1)
    train_mtp(tokens_only)  # its data cache has hidden states and no top-k
    reuse = replace(kl, out=tmp_path / "third", cache=tmp_path / "tokens" / "data")
    with pytest.raises(SpecMTPError, match="no top-k"):
        train_mtp(reuse)
    with pytest.raises(SpecMTPError, match="objective must be"):
        replace(kl, objective="mse")


def test_heads_for_a_draft_learn_the_targets_answers_from_the_drafts_features(
    tiny_target: Path, prompts: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """--answers-from: the target's cache, rescored by the draft; the heads load on the
    draft (`MODEL#heads=DIR`) and are refused by the target."""
    teacher = tmp_path / "teacher"
    train_mtp(config(tiny_target, prompts, teacher, steps=1))
    draft_dir = tmp_path / "draft"  # another architecture on the same tokenizer
    tokenizer = load_model(str(tiny_target)).tokenizer
    tiny_model("qwen2", seed=3, vocab_size=len(tokenizer), context=512).save_pretrained(draft_dir)
    tokenizer.save_pretrained(draft_dir)
    out = tmp_path / "heads"
    code = main([
        "train-mtp", "--target", str(draft_dir), "--data", str(prompts), "--out", str(out),
        "--answers-from", str(teacher / "data"), "--steps", "2", "--num-heads", "2",
        "--batch-size", "2", "--seq-len", "64", "--draft-vocab", "300",
        "--heldout-fraction", "0.25",
    ])  # fmt: skip
    assert code == 0, capfd.readouterr().err
    data = json.loads((out / "data" / "manifest.json").read_text())
    teacher_data = json.loads((teacher / "data" / "manifest.json").read_text())
    assert data["answers_from"]["key"] == teacher_data["key"]
    assert (
        data["model"]["spec"] == str(draft_dir) and data["num_tokens"] == teacher_data["num_tokens"]
    )
    load_heads(out, target_model=load_model(str(draft_dir)).model)
    with pytest.raises(SpecMTPError, match="were trained for base model"):
        load_heads(out, target_model=load_model(str(tiny_target)).model)
    with pytest.raises(SpecMTPError, match="not both"):
        replace(config(draft_dir, prompts, out, 2), cache=out / "data", answers_from=out / "data")


def test_text_mode_trains_on_the_targets_distributions_over_the_text_itself(
    tiny_target: Path, prompts: Path, tmp_path: Path
) -> None:
    text = replace(config(tiny_target, prompts, tmp_path, steps=2), objective="kl", text=True)
    assert train_mtp(text).steps == 2
    cache = DistillCache.open(tmp_path / "data")
    settings = cache.manifest["settings"]
    assert settings["text"] is True and "chat" not in settings and "max_new_tokens" not in settings
    target = load_model(str(tiny_target))
    chunks = load_train_prompts([prompts], seed=0)
    assert cache.num_samples == len(chunks)
    for index in (0, 5):
        sample = cache.sample(index)
        ids = target.tokenizer(chunks[index]).input_ids  # plain text, nothing generated
        assert sample["input_ids"].tolist() == ids and bool(sample["loss_mask"].all())
        with torch.no_grad():
            logits = target.model(torch.tensor([ids])).logits[0].float()
        expected = torch.log_softmax(logits, -1).topk(20, -1)
        assert torch.equal(sample["topk_indices"][:, :5].long(), expected.indices[:, :5])
        torch.testing.assert_close(
            sample["topk_values"].float(), expected.values, atol=2e-2, rtol=1e-2
        )
    # The draft vocabulary is made of the target's top-1 tokens, not of the text's tokens.
    _, heads_config = load_heads(tmp_path, target_model=target.model)
    top1 = {
        t for i in range(cache.num_samples) for t in cache.sample(i)["topk_indices"][:, 0].tolist()
    }
    text_tokens = {
        t for i in range(cache.num_samples) for t in cache.sample(i)["input_ids"].tolist()
    }
    assert set(heads_config.draft_vocab) <= top1 and text_tokens - top1
    # Positions are scored against the target's top-1 after the text before them.
    batch = next(iter_batches(cache, batch_size=2, seq_len=64, seed=None))
    labels = label_ids(batch, text)
    assert torch.equal(labels[:, 1:], batch.topk_indices[:, :-1, 0])
    assert label_ids(batch, replace(text, text=False)) is None
    with pytest.raises(SpecMTPError, match="--text needs --objective kl"):
        replace(text, objective="tokens")


def test_init_from_continues_the_given_heads_and_checks_them(
    tiny_target: Path, prompts: Path, tmp_path: Path
) -> None:
    first = tmp_path / "first"
    train_mtp(config(tiny_target, prompts, first, steps=3))
    before = load_file(first / "heads.safetensors")
    still = replace(
        config(tiny_target, prompts, tmp_path / "still", steps=1),
        cache=first / "data", init_from=first, lr=1e-12,
    )  # fmt: skip
    train_mtp(still)
    heldout = [json.loads(line) for line in (tmp_path / "still" / "metrics.jsonl").open()]
    heldout = [record for record in heldout if record.get("split") == "heldout"]
    assert [record["step"] for record in heldout] == [0, 1]  # where continued training starts
    assert heldout[0]["acc"] == heldout[1]["acc"]  # an almost-zero step
    after = load_file(tmp_path / "still" / "heads.safetensors")
    for name in before:  # an almost-zero step from the given heads, not a fresh start
        torch.testing.assert_close(after[name], before[name])
    fresh = replace(still, out=tmp_path / "fresh", init_from=None)
    train_mtp(fresh)
    assert '"step": 0' not in (tmp_path / "fresh" / "metrics.jsonl").read_text()
    fresh_weights = load_file(tmp_path / "fresh" / "heads.safetensors")
    assert any(not torch.equal(fresh_weights[n], before[n]) for n in before)
    with pytest.raises(SpecMTPError, match="have --num-heads 3, this run asks for 2"):
        train_mtp(replace(still, out=tmp_path / "other", num_heads=2))
    with pytest.raises(SpecMTPError, match="--draft-vocab"):
        train_mtp(replace(still, out=tmp_path / "other", draft_vocab=0))
