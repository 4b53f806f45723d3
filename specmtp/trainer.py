"""The training loop that `train-mtp` (MTP heads) and `distill` (draft models) share.

One loop, one set of rules: AdamW on the module's trainable parameters, a learning rate
that is a function of the step (linear warm-up, cosine decay), optional bfloat16 autocast,
data parallelism over several processes (`specmtp.parallel`), a progress bar, one
metrics.jsonl line per step and per evaluation, and atomic checkpoints that a rerun of
the same command resumes from (`specmtp.checkpoint`). What differs between the two
commands (the module, its loss, its held-out report, its data) comes in as an `Objective`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate import Accelerator
from torch import nn

from specmtp.checkpoint import load_latest_checkpoint, save_checkpoint
from specmtp.data import DistillBatch
from specmtp.files import jsonl_lines
from specmtp.parallel import DataParallel
from specmtp.progress import progress

WARMUP_STEPS = 50
LOGGED_DECIMALS = 4

Logged = dict[str, float | list[float]]  # a step's values for metrics.jsonl, by name


class RunSettings(Protocol):
    """The fields of a run's config that the loop reads (`TrainConfig`, `DistillTrainConfig`)."""

    @property
    def out(self) -> Path: ...
    @property
    def steps(self) -> int: ...
    @property
    def lr(self) -> float: ...
    @property
    def seed(self) -> int: ...
    @property
    def checkpoint_every(self) -> int: ...
    @property
    def eval_every(self) -> int: ...
    @property
    def mixed_precision(self) -> str: ...


@dataclass(frozen=True)
class Objective:
    """What the loop trains and how it is scored."""

    module: nn.Module  # its parameters with requires_grad are trained
    # one training step's loss (to backpropagate) and the values logged for it
    losses: Callable[[DistillBatch], tuple[torch.Tensor, Logged]]
    evaluate: Callable[[], dict[str, Any]]  # the held-out report, logged every eval_every
    one_pass: Callable[[int], Iterable[DistillBatch]]  # seed -> one pass over the training split
    identity: dict[str, Any]  # what a checkpoint must match to be resumed
    shown: tuple[str, ...]  # logged values on the progress bar
    # optimizer parameter groups, each with an optional "lr_scale" on the run's learning
    # rate (None: one group of the module's trainable parameters)
    groups: list[dict[str, Any]] | None = None
    # evaluate before the first step too (continued training: where it starts from)
    evaluate_first: bool = False


def run_training(
    objective: Objective,
    config: RunSettings,
    *,
    name: str,
    accelerator: Accelerator,
    parallel: DataParallel,
) -> int:
    """Train from the latest matching checkpoint in out/checkpoints up to `config.steps`;
    return the step reached. Every process runs it; only the main one writes files."""
    module = objective.module
    trainable = [p for p in module.parameters() if p.requires_grad]
    groups = objective.groups or [{"params": trainable}]
    optimizer = torch.optim.AdamW(groups, lr=config.lr, weight_decay=0.0)
    checkpoints = config.out / "checkpoints"
    step = load_latest_checkpoint(
        checkpoints, module=module, optimizer=optimizer, identity=objective.identity
    )
    metrics = MetricsLog(config.out / "metrics.jsonl", resume_after=step, write=parallel.is_main)
    batches = parallel.share(
        endless_batches(objective.one_pass, seed=config.seed, skip=step * parallel.processes)
    )
    if step == 0 and objective.evaluate_first and parallel.is_main:
        metrics.write(step=0, split="heldout", **objective.evaluate())
    bar = progress(total=config.steps, initial=step, desc=name, quiet=not parallel.is_main)
    while step < config.steps:
        batch = next(batches).to(accelerator.device)
        set_lr(optimizer, config, step)
        with bf16_autocast(accelerator, config.mixed_precision):
            loss, logged = objective.losses(batch)
        parallel.update(loss, optimizer, trainable)
        step += 1
        record = _mean_over_processes(logged, parallel)
        bar.update(1)
        bar.set_postfix({key: record[key] for key in objective.shown})
        metrics.write(step=step, **record)
        if parallel.is_main and (step % config.checkpoint_every == 0 or step == config.steps):
            save_checkpoint(
                checkpoints, step=step, module=module, optimizer=optimizer,
                identity=objective.identity,
            )  # fmt: skip
        if parallel.is_main and (step % config.eval_every == 0 or step == config.steps):
            metrics.write(step=step, split="heldout", **objective.evaluate())
    bar.close()
    parallel.check_in_step(trainable)
    return step


def _mean_over_processes(logged: Logged, parallel: DataParallel) -> Logged:
    """The logged values averaged over the processes (in one call), rounded for the log."""
    flat: list[float] = []
    for value in logged.values():
        flat.extend(value if isinstance(value, list) else [value])
    means = iter(parallel.mean(flat))
    record: Logged = {}
    for key, value in logged.items():
        if isinstance(value, list):
            record[key] = [round(next(means), LOGGED_DECIMALS) for _ in value]
        else:
            record[key] = round(next(means), LOGGED_DECIMALS)
    return record


def bf16_autocast(accelerator: Accelerator, mixed_precision: str) -> torch.autocast:
    """bfloat16 autocast on the accelerator's device when asked ("bf16"), else a no-op.
    torch's own autocast, not Accelerator(mixed_precision=...): accelerate keeps that
    setting in a process-wide state that a second run in one process cannot change."""
    device = accelerator.device.type
    return torch.autocast(device, dtype=torch.bfloat16, enabled=mixed_precision == "bf16")


def endless_batches(
    one_pass: Callable[[int], Iterable[DistillBatch]], *, seed: int, skip: int
) -> Iterator[DistillBatch]:
    """Passes `one_pass(seed + e)` for epochs e = 0, 1, ...; the first `skip` batches are
    passed over (resume)."""
    epoch, seen = 0, 0
    while True:
        for batch in one_pass(seed + epoch):
            seen += 1
            if seen > skip:
                yield batch
        epoch += 1


def set_lr(optimizer: torch.optim.Optimizer, config: RunSettings, step: int) -> None:
    """Linear warm-up, then cosine decay to a tenth: a function of the step, so resuming
    needs no scheduler state. A group's "lr_scale" multiplies it."""
    if step < WARMUP_STEPS:
        scale = (step + 1) / WARMUP_STEPS
    else:
        progress = (step - WARMUP_STEPS) / max(1, config.steps - WARMUP_STEPS)
        scale = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    for group in optimizer.param_groups:
        group["lr"] = config.lr * scale * group.get("lr_scale", 1.0)


class MetricsLog:
    """metrics.jsonl, one object per line. On resume the lines past the checkpoint are
    dropped, since those steps run again."""

    def __init__(self, path: Path, *, resume_after: int, write: bool = True) -> None:
        self.path, self.enabled = path, write  # several processes: the main one writes
        if not write:
            return
        kept = []
        if path.exists():
            kept = [
                line for _, line in jsonl_lines(path.read_text())
                if json.loads(line).get("step", 0) <= resume_after
            ]  # fmt: skip
        path.write_text("".join(line + "\n" for line in kept))

    def write(self, **record: Any) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
