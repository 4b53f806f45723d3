"""Data parallelism for `train-mtp` and `distill` over several processes.

Launched with `torchrun --nproc_per_node N` (CPU: gloo) or `accelerate launch
--num_processes N` (GPUs), the same command trains with N processes; launched plainly it
is one process and nothing here does anything. Every process holds the whole module being
trained (MTP heads or a small draft: tens of MB; with `train-mtp --joint`, the target's
trunk and its heads) and the frozen target, and takes its own share of the batch stream:
process r of N takes batches r, r + N, r + 2N, ... So one step sees N batches, and a
step's gradient is their mean. After each backward the gradients are averaged across
processes in one all-reduce, so every process applies the same update and the copies stay
identical (checked at the end of a run).

Not wrapped in DDP: the losses call the module's own methods (`forward_all`, the draft's
heads), not its `forward`, which DDP's gradient hooks rely on. Not sharded (FSDP): the
trained modules are small, and the frozen target is only read; a joint run holds the whole
target in every process, fine for small targets, not for one that does not fit a device.

Only the main process writes files: the data cache (the others wait for it, then read
it), checkpoints, metrics and the final artifacts.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

import torch
from accelerate import Accelerator

from specmtp.errors import SpecMTPError

T = TypeVar("T")


def make_accelerator() -> Accelerator:
    """The run's Accelerator. Without a GPU it is told so: only then does accelerate join
    the processes torchrun started (over gloo) rather than run each one alone."""
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise SpecMTPError(
            f"launched as {launched} processes, but accelerate joined "
            f"{accelerator.num_processes} ({accelerator.distributed_type})"
        )
    return accelerator


class DataParallel:
    """The run's processes, as `train-mtp` and `distill` use them."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    @property
    def processes(self) -> int:
        return self.accelerator.num_processes

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def main_first(self) -> contextlib.AbstractContextManager[None]:
        """The main process runs the block first (building a data cache); the others run
        it after, and find the cache complete."""
        return self.accelerator.main_process_first()

    def share(self, batches: Iterable[T]) -> Iterator[T]:
        """This process's batches of the common stream: r, r + N, r + 2N, ..."""
        rank = self.accelerator.process_index
        return itertools.islice(batches, rank, None, self.processes)

    def update(
        self,
        loss: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        params: Sequence[torch.nn.Parameter],
    ) -> None:
        """One optimiser step: backward, gradients averaged over the processes, their norm
        clipped to 1."""
        optimizer.zero_grad()
        self.accelerator.backward(loss)
        self.average_gradients(params)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    def average_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Replace each gradient by its mean over the processes (a missing one counts as
        zero), in one all-reduce of one flat buffer."""
        if self.processes == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = self.accelerator.reduce(torch.cat([g.flatten() for g in grads]), reduction="mean")
        for param, part in zip(params, flat.split([g.numel() for g in grads]), strict=True):
            param.grad = part.view_as(param).clone()

    def mean(self, values: Sequence[float]) -> list[float]:
        """Values (a step's loss, accuracies) averaged over the processes, for the log."""
        if self.processes == 1:
            return list(values)
        device = self.accelerator.device
        tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
        return self.accelerator.reduce(tensor, reduction="mean").tolist()

    def check_in_step(self, params: Iterable[torch.Tensor]) -> None:
        """Raise if the processes' copies of the trained module differ."""
        if self.processes == 1:
            return
        sums = [torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
                for p in params]  # fmt: skip
        mine = torch.cat(sums).to(self.accelerator.device)
        every = self.accelerator.gather(mine[None])  # [N, 2 * params]
        if not bool((every == every[0]).all()):
            raise SpecMTPError(
                f"the {self.processes} training processes ended with different weights"
            )
