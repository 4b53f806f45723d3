"""Data-parallel training (`specmtp.parallel`): `train-mtp` under torchrun with two
processes trains the heads that one process gets by averaging, each step, the gradients of
the two batches the processes took."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from test_train import prompts  # noqa: F401  (a fixture)

from specmtp.checkpoint import _PREFIX
from specmtp.data import DistillCache, iter_batches
from specmtp.heads import build_heads
from specmtp.heads_config import HeadsConfig
from specmtp.heads_io import HEADS_CONFIG
from specmtp.models import load_model
from specmtp.mtp_loss import decaying_weights, mtp_losses
from specmtp.parallel import DataParallel
from specmtp.train import TrainConfig, target_topk
from specmtp.train_joint import JOINT_MODEL_DIR
from specmtp.trainer import endless_batches, set_lr

STEPS, PROCESSES = 3, 2


def test_each_process_takes_its_own_share_of_the_batches() -> None:
    shares = [
        list(DataParallel(SimpleNamespace(process_index=r, num_processes=3)).share(range(10)))
        for r in range(3)
    ]
    assert shares == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(command: list[str]) -> subprocess.CompletedProcess[str]:
    """`specmtp COMMAND` in PROCESSES processes under torchrun, one thread each."""
    argv = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={PROCESSES}",
        f"--master_port={_free_port()}", "-m", "specmtp", *command, "--threads", "1",
    ]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def _training_steps_logged(out: Path) -> list[int]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if "split" not in r]


def _last_identity(out: Path, steps: int) -> dict:
    state = out / "checkpoints" / f"{_PREFIX}{steps:08d}" / "state.json"
    return json.loads(state.read_text())["identity"]


def _reference_heads(config: TrainConfig) -> dict[str, torch.Tensor]:
    """One process: each step, the mean of the gradients of the next PROCESSES batches of
    the common stream, then the run's clipping and optimiser step."""
    target = load_model(config.target)
    cache = DistillCache.open(config.out / "data", model=target)
    heads_config = HeadsConfig.from_json((config.out / HEADS_CONFIG).read_text())
    torch.manual_seed(config.seed)
    heads = build_heads(heads_config, target.model).float()
    trainable = [p for p in heads.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=0.0)
    stream = endless_batches(
        lambda seed: iter_batches(
            cache, batch_size=config.batch_size, seq_len=config.seq_len, seed=seed,
            heldout_fraction=config.heldout_fraction,
        ),
        seed=config.seed, skip=0,
    )  # fmt: skip
    weights = decaying_weights(config.num_heads, config.decay)
    for step in range(config.steps):
        set_lr(optimizer, config, step)
        grads = []
        for _ in range(PROCESSES):
            batch = next(stream)
            loss = mtp_losses(
                heads, batch.input_ids, batch.hidden.float(), batch.loss_mask, weights,
                target_topk=target_topk(batch, config),
            ).loss  # fmt: skip
            grads.append(torch.autograd.grad(loss, trainable))
        for param, *each in zip(trainable, *grads, strict=True):
            param.grad = sum(each) / PROCESSES
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
    return {name: p.detach() for name, p in heads.named_parameters() if p.requires_grad}


@pytest.mark.slow
def test_two_processes_train_the_heads_of_one_averaging_two_batches(
    tiny_target: Path,
    prompts: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    config = TrainConfig(
        sources=(prompts,), out=tmp_path, target=str(tiny_target), num_heads=2,
        steps=STEPS, batch_size=2, seq_len=64, max_new_tokens=12, checkpoint_every=2,
        eval_every=STEPS, heldout_fraction=0.25, draft_vocab=300,
    )  # fmt: skip
    run = _launch([
        "train-mtp", "--target", config.target, "--data", str(prompts), "--out", str(tmp_path),
        "--num-heads", "2", "--steps", str(STEPS), "--batch-size", "2", "--seq-len", "64",
        "--max-new-tokens", "12", "--checkpoint-every", "2", "--eval-every", str(STEPS),
        "--heldout-fraction", "0.25", "--draft-vocab", "300",
    ])  # fmt: skip
    # One report and one metrics line per step: only the main process writes.
    assert run.stdout.count("heads written to") == 1
    assert _training_steps_logged(tmp_path) == list(range(1, STEPS + 1))
    assert _last_identity(tmp_path, STEPS)["processes"] == PROCESSES
    # The run's float32 weights (its last checkpoint) equal the one-process reference.
    final = tmp_path / "checkpoints" / f"{_PREFIX}{STEPS:08d}"
    trained = load_file(final / "weights.safetensors")
    reference = _reference_heads(config)
    assert trained.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_distill_runs_data_parallel(
    tiny_target: Path,
    prompts: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The same machinery in `distill`: the processes end in step (checked by the run
    itself: it fails if their weights differ) and only the main one writes and reports."""
    run = _launch([
        "distill", "--target", str(tiny_target), "--data", str(prompts), "--out", str(tmp_path),
        "--steps", str(STEPS), "--batch-size", "2", "--seq-len", "64", "--max-new-tokens", "12",
        "--topk", "8", "--draft-vocab", "50", "--checkpoint-every", "2",
        "--eval-every", str(STEPS), "--heldout-fraction", "0.25",
    ])  # fmt: skip
    assert run.stdout.count("draft written to") == 1
    assert (tmp_path / "draft").is_dir() and (tmp_path / "report.json").exists()
    assert _training_steps_logged(tmp_path) == list(range(1, STEPS + 1))
    assert _last_identity(tmp_path, STEPS)["processes"] == PROCESSES


@pytest.mark.slow
def test_joint_training_runs_data_parallel(
    tiny_target: Path,
    prompts: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """`train-mtp --joint` under two processes: the trunk trains with the heads, the
    processes end in step (the run checks it, trunk included), and only the main process
    writes the model and the heads."""
    run = _launch([
        "train-mtp", "--joint", "--target", str(tiny_target), "--data", str(prompts),
        "--out", str(tmp_path), "--kind", "sequential", "--num-heads", "2", "--objective",
        "kl", "--steps", str(STEPS), "--batch-size", "2", "--seq-len", "512",
        "--max-new-tokens", "12", "--checkpoint-every", "2", "--eval-every", str(STEPS),
        "--heldout-fraction", "0.25",
    ])  # fmt: skip
    assert run.stdout.count("heads written to") == 1
    assert _training_steps_logged(tmp_path) == list(range(1, STEPS + 1))
    assert _last_identity(tmp_path, STEPS)["processes"] == PROCESSES
    original = load_model(str(tiny_target)).model.state_dict()
    trained = load_model(str(tmp_path / JOINT_MODEL_DIR)).model.state_dict()
    moved = [name for name in original if not torch.equal(original[name], trained[name])]
    assert moved and all("embed_tokens" not in n and "lm_head" not in n for n in moved)
