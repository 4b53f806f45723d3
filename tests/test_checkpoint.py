"""Training checkpoints: exact resume, atomic directories, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specmtp.checkpoint import load_latest_checkpoint, save_checkpoint
from specmtp.errors import SpecMTPError

IDENTITY = {"model": "tiny", "heads": 2}


def model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    model[0].weight.requires_grad_(False)  # frozen weights are not saved
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-2, betas=(0.8, 0.95))


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def test_resume_continues_exactly(tmp_path: Path) -> None:
    straight, opt = model_and_optimizer(0)
    train(straight, opt, range(10))

    first, opt1 = model_and_optimizer(0)
    train(first, opt1, range(6))
    save_checkpoint(tmp_path, step=6, module=first, optimizer=opt1, identity=IDENTITY)
    resumed, opt2 = model_and_optimizer(0)  # a fresh process: same init, empty optimizer
    step = load_latest_checkpoint(tmp_path, module=resumed, optimizer=opt2, identity=IDENTITY)
    assert step == 6
    train(resumed, opt2, range(step, 10))
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_only_whole_recent_checkpoints_remain(tmp_path: Path) -> None:
    model, opt = model_and_optimizer(0)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step=step, module=model, optimizer=opt, identity=IDENTITY)
    (tmp_path / ".staging-killed").mkdir()  # what a kill -9 mid-write leaves
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000002", "step-00000003"]
    assert load_latest_checkpoint(tmp_path, module=model, optimizer=opt, identity=IDENTITY) == 3


def test_no_checkpoint_means_step_zero(tmp_path: Path) -> None:
    model, opt = model_and_optimizer(0)
    assert load_latest_checkpoint(tmp_path / "none", module=model, optimizer=opt, identity={}) == 0


def test_refuses_another_run_and_corrupt_files(tmp_path: Path) -> None:
    model, opt = model_and_optimizer(0)
    path = save_checkpoint(tmp_path, step=1, module=model, optimizer=opt, identity=IDENTITY)
    with pytest.raises(SpecMTPError, match="another run"):
        load_latest_checkpoint(tmp_path, module=model, optimizer=opt, identity={"model": "x"})
    (path / "weights.safetensors").write_bytes(b"garbage")
    with pytest.raises(SpecMTPError, match="corrupt"):
        load_latest_checkpoint(tmp_path, module=model, optimizer=opt, identity=IDENTITY)


def test_refuses_other_shapes(tmp_path: Path) -> None:
    model, opt = model_and_optimizer(0)
    save_checkpoint(tmp_path, step=1, module=model, optimizer=opt, identity=IDENTITY)
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 5))
    other_opt = torch.optim.AdamW(other.parameters())
    with pytest.raises(SpecMTPError):
        load_latest_checkpoint(tmp_path, module=other, optimizer=other_opt, identity=IDENTITY)
