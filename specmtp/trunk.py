"""Which trunk heads and drafts were trained on.

`base_model` (architecture, depth, sizes) cannot tell two checkpoints of one architecture
apart, so a heads' or draft's directory also keeps a sample of the trunk's weights they were
trained on (`TRUNK_FILE`), and loading refuses a trunk whose weights differ from it by more
than dtype rounding: heads learn one checkpoint's hidden states, and on another they would
draft, losslessly still, but at a fraction of their acceptance.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from specmtp.errors import SpecMTPError
from specmtp.files import first_line, write_atomically

TRUNK_FILE = "trunk.safetensors"  # one tensor, "sample": see trunk_sample
_TRUNK_VALUES = 16  # evenly spaced values per trunk tensor
# The same weights in float32, bfloat16 or float16 differ by at most half a bfloat16 ulp
# (2^-8 relative; float16's double rounding and subnormals stay within the absolute term).
_TRUNK_RELATIVE = 2.0**-7
_TRUNK_ABSOLUTE = 1e-6


def trunk_sample(model: PreTrainedModel) -> torch.Tensor:
    """Evenly spaced values of every weight of `model`, in float32 [N]."""
    values = []
    for param in model.parameters():
        flat = param.detach().flatten()
        step = max(1, flat.numel() // _TRUNK_VALUES)
        values.append(flat[::step][:_TRUNK_VALUES].to("cpu", torch.float32))
    return torch.cat(values)


def write_trunk(directory: Path, model: PreTrainedModel) -> None:
    """Record, beside heads or a draft in `directory`, the weights they were trained on."""
    sample = {"sample": trunk_sample(model)}
    write_atomically(directory / TRUNK_FILE, lambda path: save_file(sample, str(path)))


def check_trunk(directory: Path, model: PreTrainedModel, *, what: str) -> None:
    """Refuse `model` if `directory` records other weights (nothing recorded: accepted, as
    for heads and drafts saved before it was)."""
    path = directory / TRUNK_FILE
    if not path.exists():
        return
    try:
        sample = load_file(str(path))["sample"]
    except (OSError, SafetensorError, KeyError) as exc:
        raise SpecMTPError(f"cannot read {what} from {directory}: {first_line(exc)}") from exc
    ours = trunk_sample(model)
    if ours.shape != sample.shape:
        far = torch.ones_like(sample, dtype=torch.bool)
    else:
        far = (ours - sample).abs() > _TRUNK_RELATIVE * sample.abs() + _TRUNK_ABSOLUTE
    if far.any():
        raise SpecMTPError(
            f"the {what} in {directory}: trained on other weights of this architecture "
            f"({int(far.sum())} of {far.numel()} sampled weights differ); "
            f"train {what} for this checkpoint"
        )
