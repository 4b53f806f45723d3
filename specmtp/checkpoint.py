"""Resumable training checkpoints: safetensors for tensors, JSON for the rest, no pickle.

A checkpoint is a directory `step-NNNNNNNN` holding the trainable weights, the optimizer's
state tensors and a JSON file (step, optimizer hyper-parameters, the run's identity). It
is built under a temporary name and renamed into place, so a killed run leaves either a
whole checkpoint or none; resuming takes the newest whole one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specmtp.errors import SpecMTPError

KEEP = 2  # checkpoints kept on disk; older ones are removed once a newer one is whole
_PREFIX = "step-"


def save_checkpoint(
    directory: Path,
    *,
    step: int,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    identity: dict[str, Any],
) -> Path:
    """Write checkpoint `step` atomically; `identity` must match on resume."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{_PREFIX}{step:08d}"
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=directory))
    try:
        weights = {k: v.detach().contiguous() for k, v in _trainable(module).items()}
        save_file(weights, staging / "weights.safetensors")
        tensors, groups = _optimizer_parts(optimizer)
        save_file(tensors, staging / "optimizer.safetensors")
        state = {"step": step, "param_groups": groups, "identity": identity}
        (staging / "state.json").write_text(json.dumps(state, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for old in sorted(directory.glob(f"{_PREFIX}*"))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_latest_checkpoint(
    directory: Path,
    *,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    identity: dict[str, Any],
) -> int:
    """Restore the newest checkpoint into module and optimizer; return its step (0: none)."""
    found = sorted(directory.glob(f"{_PREFIX}*")) if directory.is_dir() else []
    if not found:
        return 0
    path = found[-1]
    try:
        state = json.loads((path / "state.json").read_text())
        weights = load_file(path / "weights.safetensors")
        tensors = load_file(path / "optimizer.safetensors")
    except (OSError, ValueError, SafetensorError) as exc:
        raise SpecMTPError(f"corrupt checkpoint {path}: {exc}") from exc
    if state.get("identity") != identity:
        raise SpecMTPError(
            f"checkpoint {path} belongs to another run (other model, heads or data settings); "
            "use another output directory or remove it"
        )
    missing, unexpected = _load_trainable(module, weights)
    if missing or unexpected:
        raise SpecMTPError(f"checkpoint {path} does not fit these heads: {missing or unexpected}")
    _restore_optimizer(optimizer, tensors, state["param_groups"])
    return int(state["step"])


def _trainable(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


def _load_trainable(
    module: torch.nn.Module, weights: dict[str, torch.Tensor]
) -> tuple[list[str], list[str]]:
    params = _trainable(module)
    missing = sorted(set(params) - set(weights))
    unexpected = sorted(set(weights) - set(params))
    if not missing and not unexpected:
        with torch.no_grad():
            for name, param in params.items():
                if param.shape != weights[name].shape:
                    return [f"{name} {tuple(param.shape)}"], [f"{tuple(weights[name].shape)}"]
                param.copy_(weights[name])
    return missing, unexpected


def _optimizer_parts(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list]:
    """Split an optimizer state dict into named tensors and JSON-able groups."""
    state = optimizer.state_dict()
    tensors = {}
    for index, values in state["state"].items():
        for key, value in values.items():
            tensor = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"{index}.{key}"] = tensor.detach().contiguous()
    groups = [
        {k: list(v) if isinstance(v, tuple) else v for k, v in g.items()}
        for g in state["param_groups"]
    ]
    return tensors, groups


def _restore_optimizer(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], groups: list
) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = tensor
    restored = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in groups]
    try:
        optimizer.load_state_dict({"state": state, "param_groups": restored})
    except (ValueError, KeyError) as exc:
        raise SpecMTPError(f"checkpoint optimizer state does not fit: {exc}") from exc
