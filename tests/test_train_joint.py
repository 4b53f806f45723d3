"""`train-mtp --joint` on a tiny target: the trained model, its heads, resume, learning rates."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specmtp.api import SpecGenerator
from specmtp.cli import main
from specmtp.data import DistillCache
from specmtp.errors import SpecMTPError
from specmtp.heads_io import load_heads
from specmtp.models import load_model
from specmtp.train import TrainConfig, evaluate, train_mtp
from specmtp.train_joint import JOINT_MODEL_DIR, HeldoutAgreement, JointModule, trainable_trunk

PROMPTS = "\n\n".join(f"Question {i}: name {i} animals, then count them." for i in range(12))


@pytest.fixture(scope="module")
def shared_cache(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data cache with the tiny target's answers, hidden states and top-k."""
    root = tmp_path_factory.mktemp("joint")
    prompts = root / "prompts.txt"
    # One paragraph per prompt: a .txt source is cut at blank lines into chunks.
    prompts.write_text(PROMPTS.replace("\n\n", "\n\n" + "x" * 1400 + "\n\n"))
    train_mtp(replace(base(tiny_target, root / "frozen", steps=1, joint=False), sources=(prompts,)))
    return root / "frozen" / "data"


def base(
    target: Path, out: Path, *, steps: int, joint: bool = True, trunk_lr: float = 1e-3
) -> TrainConfig:
    return TrainConfig(
        sources=(out / "unused.txt",), out=out, target=str(target), kind="sequential",
        num_heads=2, steps=steps, batch_size=2, seq_len=416, max_new_tokens=12, lr=1e-3,
        checkpoint_every=2, eval_every=2, heldout_fraction=0.25, objective="kl", joint=joint,
        trunk_lr=trunk_lr,
    )  # fmt: skip


def run(target: Path, cache: Path, out: Path, steps: int, trunk_lr: float = 1e-3) -> TrainConfig:
    config = replace(base(target, out, steps=steps, trunk_lr=trunk_lr), cache=cache)
    train_mtp(config)
    return config


def layer_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_joint_training_writes_a_model_that_its_heads_draft_for(
    tiny_target: Path, shared_cache: Path, tmp_path: Path
) -> None:
    config = replace(base(tiny_target, tmp_path, steps=4), cache=shared_cache)
    report = train_mtp(config)
    assert report.model == str(tmp_path / JOINT_MODEL_DIR)
    assert report.next_token_agreement is not None and 0 <= report.next_token_agreement <= 1
    original, trained = load_model(str(tiny_target)), load_model(report.model)
    before, after = layer_weights(original.model), layer_weights(trained.model)
    frozen = ("embed_tokens", "lm_head")
    for name in before:
        moved = not torch.equal(before[name], after[name])
        assert moved != any(part in name for part in frozen), name
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert sum('"next_loss"' in line for line in lines) == 4
    assert sum('"next_acc"' in line and "heldout" in line for line in lines) == 2

    load_heads(tmp_path, target_model=trained.model)  # checked against the trained model
    with pytest.raises(SpecMTPError, match="trained on other weights"):
        load_heads(tmp_path, target_model=original.model)
    prompt = [5, 17, 300, 42, 9, 77]
    plain = SpecGenerator(trained).generate(prompt, max_new_tokens=20)
    drafted = SpecGenerator(trained, draft=f"mtp:{tmp_path}").generate(
        prompt, max_new_tokens=20, gamma=2
    )
    assert drafted.tokens == plain.tokens  # greedy: the trained model's own output


def test_an_interrupted_joint_run_resumes_to_the_same_model(
    tiny_target: Path, shared_cache: Path, tmp_path: Path
) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(tiny_target, shared_cache, straight, 4)
    run(tiny_target, shared_cache, resumed, 2)  # "killed" after step 2
    run(tiny_target, shared_cache, resumed, 4)
    for name in ("heads.safetensors", f"{JOINT_MODEL_DIR}/model.safetensors"):
        a, b = load_file(straight / name), load_file(resumed / name)
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key])
    frozen = replace(base(tiny_target, resumed, steps=6, joint=False), cache=shared_cache)
    with pytest.raises(SpecMTPError, match="another run"):
        train_mtp(frozen)  # the frozen mode is another run


def test_the_trunk_learns_at_its_own_rate(
    tiny_target: Path, shared_cache: Path, tmp_path: Path
) -> None:
    original = layer_weights(load_model(str(tiny_target)).model)

    def change(trunk_lr: float) -> float:
        out = tmp_path / str(trunk_lr)
        run(tiny_target, shared_cache, out, 2, trunk_lr=trunk_lr)
        trained = layer_weights(load_model(str(out / JOINT_MODEL_DIR)).model)
        return sum(float((trained[n] - original[n]).abs().sum()) for n in original)

    slow, fast = change(1e-6), change(1e-3)
    assert 0 < slow < fast / 100
    with pytest.raises(SpecMTPError, match="trunk-lr"):
        base(tiny_target, tmp_path, steps=1, trunk_lr=0.0)


def test_the_command_says_where_the_model_is_and_how_to_draft_for_it(
    tiny_target: Path, shared_cache: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code = main([
        "train-mtp", "--joint", "--trunk-lr", "1e-4", "--data", str(tmp_path / "unused.txt"),
        "--cache", str(shared_cache), "--target", str(tiny_target), "--out", str(tmp_path),
        "--kind", "sequential", "--num-heads", "2", "--objective", "kl", "--steps", "1",
        "--batch-size", "2", "--seq-len", "416", "--heldout-fraction", "0.25", "--threads", "1",
    ])  # fmt: skip
    out, err = capfd.readouterr()
    assert code == 0, err
    model = tmp_path / JOINT_MODEL_DIR
    assert f"--target {model} --draft mtp:{tmp_path}" in out
    assert json.loads(out.strip().splitlines()[-1])["model"] == str(model)


def test_heldout_agreement_counts_the_trunks_own_greedy_tokens(
    tiny_target: Path, shared_cache: Path
) -> None:
    """The untrained trunk teacher-forced on its own greedy answers agrees with them (up to
    float ties between a cached step and a whole-sequence pass) when its windows hold the
    whole samples; noise in its layers makes it agree less; and the same pass hands the
    heads the trunk's features."""
    config = replace(base(tiny_target, shared_cache.parent, steps=1), seq_len=500)
    trunk = trainable_trunk(str(tiny_target))
    cache = DistillCache.open(shared_cache, model=trunk)
    heads, _ = load_heads(shared_cache.parent, target_model=trunk.model)
    joint = JointModule(trunk.model, heads.float(), None)

    def agreement() -> float:
        counter = HeldoutAgreement(joint, lambda batch: None)
        accuracy = evaluate(joint.heads, cache, config, features=counter)
        assert accuracy == evaluate(joint.heads, cache, config, features=lambda b: joint(b)[1])
        assert counter.total > 0
        return counter.rate

    assert agreement() >= 0.95
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in trunk.model.model.layers:
            for param in layer.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * param.std())
    assert agreement() < 0.9


def test_a_joint_run_trains_on_the_samples_within_its_window(
    tiny_target: Path, shared_cache: Path, tmp_path: Path
) -> None:
    """Windows keep a long sample's last tokens; the trunk would then read another context
    than the one its cached targets were computed in, so a joint run skips such samples,
    says how many it kept, and refuses before training when a split keeps none."""
    cache = DistillCache.open(shared_cache)
    lengths = [cache.sample_length(i) for i in range(cache.num_samples)]
    config = replace(base(tiny_target, tmp_path / "run", steps=1), cache=shared_cache)
    report = train_mtp(config)
    assert report.joint_samples == sum(n <= config.seq_len for n in lengths)
    assert 0 < report.joint_samples < len(lengths)
    short = replace(config, out=tmp_path / "short", seq_len=min(lengths) - 1)
    with pytest.raises(SpecMTPError, match=f"fits --seq-len {short.seq_len}"):
        train_mtp(short)
    assert not (short.out / "checkpoints").exists()


def test_a_joint_checkpoint_from_before_whole_samples_does_not_resume(
    tiny_target: Path, shared_cache: Path, tmp_path: Path
) -> None:
    """Joint runs took windows cut to --seq-len before they took whole samples; such a
    checkpoint was trained on other batches, so it is another run."""
    config = run(tiny_target, shared_cache, tmp_path, 2)
    for state_file in (tmp_path / "checkpoints").glob("*/state.json"):
        state = json.loads(state_file.read_text())
        del state["identity"]["settings"]["joint_samples"]
        state_file.write_text(json.dumps(state))
    with pytest.raises(SpecMTPError, match="another run"):
        train_mtp(replace(config, steps=4))
