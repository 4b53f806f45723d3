"""Heads on disk: saving, loading (checked against and bound to a target), and where the
shipped heads live.

A heads directory holds `HEADS_WEIGHTS` (the trainable parameters only: the target's LM
head and embedding are rebound at load), `HEADS_CONFIG` and, when known, the trunk sample
(`trunk.TRUNK_FILE`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from specmtp.errors import SpecMTPError
from specmtp.files import first_line, write_atomically
from specmtp.heads import Heads, build_heads, describe_target, target_lm_head
from specmtp.heads_config import HeadsConfig
from specmtp.trunk import check_trunk, write_trunk

HEADS_WEIGHTS = "heads.safetensors"
HEADS_CONFIG = "heads.json"


def shipped_heads_dir() -> Path:
    """The heads that ship with the package, trained for the default model."""
    return Path(__file__).parent / "assets" / "smollm2-135m-mtp"


def save_heads(
    module: Heads,
    config: HeadsConfig,
    directory: str | Path,
    *,
    dtype: torch.dtype | None = None,
    trunk: PreTrainedModel | None = None,
) -> None:
    """Write heads.safetensors (trainable parameters only, in `dtype` if given), heads.json
    and, given the `trunk` they were trained on, its weights' sample, each atomically."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: p.detach().to(dtype or p.dtype).contiguous() for name, p in module.named_parameters()
    }
    write_atomically(directory / HEADS_WEIGHTS, lambda path: save_file(tensors, str(path)))
    write_atomically(directory / HEADS_CONFIG, lambda path: path.write_text(config.to_json()))
    if trunk is not None:
        write_trunk(directory, trunk)


def load_heads(
    directory: str | Path, *, target_model: PreTrainedModel
) -> tuple[Heads, HeadsConfig]:
    """Heads saved by save_heads, checked against and bound to `target_model`."""
    directory = Path(directory)
    try:
        config = HeadsConfig.from_json((directory / HEADS_CONFIG).read_text())
        tensors = load_file(str(directory / HEADS_WEIGHTS))
    except (OSError, UnicodeDecodeError, SafetensorError) as exc:
        raise SpecMTPError(f"cannot read heads from {directory}: {first_line(exc)}") from exc
    expected = describe_target(target_model)
    hidden = target_model.config.get_text_config().hidden_size
    vocab = target_lm_head(target_model).shape[0]
    for what, theirs, ours in (
        ("hidden size", config.hidden_size, hidden),
        ("vocab size", config.vocab_size, vocab),
        ("base model", config.base_model, expected),
    ):
        if theirs != ours:
            raise SpecMTPError(
                f"heads in {directory} were trained for {what} {theirs!r}, the target has {ours!r}"
            )
    check_trunk(directory, target_model, what="heads")
    heads = build_heads(config, target_model)
    try:
        heads.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:  # missing, unexpected or misshapen tensors
        raise SpecMTPError(
            f"heads in {directory} do not match their config: {first_line(exc)}"
        ) from exc
    return heads, config
