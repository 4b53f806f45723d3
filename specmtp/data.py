"""The self-distillation data cache: its format, and reading it (`DistillCache`, `iter_batches`).

`specmtp.data_build` writes it, from the prompts of `specmtp.train_prompts` and the target's
answers to them (`specmtp.answers`).

A cache directory holds `shard-NNNNN.safetensors` files and `manifest.json`. Each shard holds
the samples of `shard_size` prompts, concatenated (all tensors are indexed by token):

    input_ids    int32    [N]     prompt + answer tokens of every sample, back to back
    offsets      int64    [S+1]   sample s is input_ids[offsets[s]:offsets[s+1]]
    loss_mask    bool     [N]     True on answer tokens (where heads learn)
    hidden       float16  [N, H]  optional: the target's final hidden state at each position,
                                  after the final norm, i.e. the LM head's input (predicts t+1);
                                  with `feature_layers`, those states side by side [N, k*H]
    topk_values  float16  [N, k]  optional: the target's k largest log-probabilities at each
    topk_indices int32    [N, k]  position (log-softmax over the full vocabulary) and their ids

Hidden states come from `model(..., output_hidden_states=True).hidden_states[-1]`: in
transformers 5.24 that last entry is taken after the final norm (it equals
`model.model(...).last_hidden_state`, and `lm_head` of it equals the logits exactly; checked on
the default model), so the last decoder layer's pre-norm output is not among the entries.

Shards and the manifest are written to a temporary file and renamed into place, manifest last,
so a killed build leaves only complete shards, which a rerun of `build_cache` keeps.

A rescored cache (`rescore_cache`, `train-mtp --answers-from`) holds another model's answers
(and its top-k) with this model's hidden states: heads on a draft model learn what the target
says from what the draft sees. The manifest records a digest of the tokenizer's vocabulary,
so a rescoring model whose token ids mean other tokens is refused.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from specmtp.errors import SpecMTPError
from specmtp.models import LoadedModel

MANIFEST = "manifest.json"
FORMAT = 1  # bump when the shard layout changes, so old caches are refused, not misread
_FINGERPRINT_VALUES = 64  # leading values of each parameter that go into the model fingerprint


@dataclass(frozen=True)
class DistillBatch:
    """Rows of one batch, right-padded to seq_len; the optional tensors exist if cached."""

    input_ids: torch.Tensor  # [B, T] int64
    attention_mask: torch.Tensor  # [B, T] bool, False on padding
    loss_mask: torch.Tensor  # [B, T] bool, True on answer tokens
    hidden: torch.Tensor | None = None  # [B, T, H] float16
    topk_values: torch.Tensor | None = None  # [B, T, k] float16 log-probabilities
    topk_indices: torch.Tensor | None = None  # [B, T, k] int64

    def to(self, device: torch.device | str) -> DistillBatch:
        tensors = {f.name: getattr(self, f.name) for f in fields(self)}
        return DistillBatch(**{k: None if t is None else t.to(device) for k, t in tensors.items()})


def model_fingerprint(model: LoadedModel) -> str:
    """Config, tokenizer and the leading values of every weight: cheap, but tells apart two
    checkpoints of one architecture."""
    config = {k: v for k, v in model.model.config.to_dict().items() if not k.startswith("_")}
    config.pop("transformers_version", None)
    tokenizer = model.tokenizer
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(f"{len(tokenizer)}:{tokenizer.eos_token_id}:{tokenizer.chat_template}".encode())
    for name, param in model.model.named_parameters():
        values = param.detach().flatten()[:_FINGERPRINT_VALUES].to(torch.float32)
        digest.update(f"{name}{tuple(param.shape)}".encode() + values.numpy().tobytes())
    return digest.hexdigest()[:16]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not path.is_file():
        raise SpecMTPError(f"no distillation cache in {directory}: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecMTPError(f"cannot read {path}: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SpecMTPError(f"{path} is not a format-{FORMAT} distillation cache manifest")
    return manifest


class DistillCache:
    """A checked cache directory; samples are read from memory-mapped shards on demand."""

    def __init__(self, directory: Path, manifest: dict[str, Any]) -> None:
        self.directory = directory
        self.manifest = manifest
        settings = manifest["settings"]
        self.has_hidden: bool = settings["store_hidden"]
        self.topk: int = settings["topk"]
        layers = settings.get("feature_layers")
        self.feature_layers = None if layers is None else tuple(layers)
        self._shards = [_open_shard(directory / s["file"], s, manifest) for s in manifest["shards"]]
        counts = [0] + [s["samples"] for s in manifest["shards"]]
        self._starts = torch.cumsum(torch.tensor(counts), 0)

    @classmethod
    def open(cls, directory: Path, *, model: LoadedModel | None = None) -> DistillCache:
        """Check the manifest and every shard's checksum; with `model`, that it built this."""
        manifest = read_manifest(directory)
        if model is not None and manifest["model"]["fingerprint"] != model_fingerprint(model):
            raise SpecMTPError(
                f"cache {directory} was built by model {manifest['model']['spec']!r} "
                f"(fingerprint {manifest['model']['fingerprint']}), not by {model.spec!r}"
            )
        return cls(directory, manifest)

    @property
    def num_samples(self) -> int:
        return int(self._starts[-1])

    def _locate(self, index: int) -> tuple[Any, dict[str, torch.Tensor], int, int]:
        """A sample's shard, the shard's small tensors, and its token range there."""
        shard_index = int(torch.searchsorted(self._starts, index, right=True)) - 1
        shard, offsets, small = self._shards[shard_index]
        local = index - int(self._starts[shard_index])
        return shard, small, int(offsets[local]), int(offsets[local + 1])

    def sample_length(self, index: int) -> int:
        """Tokens in one sample (prompt and answer), without reading its tensors."""
        _, _, begin, end = self._locate(index)
        return end - begin

    def answer_tokens(self, index: int) -> torch.Tensor:
        """The answer token ids of one sample [m], without reading its large tensors."""
        _, small, begin, end = self._locate(index)
        return small["input_ids"][begin:end][small["loss_mask"][begin:end]].long()

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        """One sample's tensors: input_ids [n], loss_mask [n], hidden [n, H], topk_* [n, k]."""
        shard, small, begin, end = self._locate(index)
        names = set(shard.keys())
        found = {name: tensor[begin:end] for name, tensor in small.items()}
        for name in ("hidden", "topk_values", "topk_indices"):
            if name in names:
                found[name] = shard.get_slice(name)[begin:end]
        return found


def _open_shard(
    path: Path, entry: dict[str, Any], manifest: dict[str, Any]
) -> tuple[Any, torch.Tensor, dict[str, torch.Tensor]]:
    """The open shard, its offsets and its small per-token tensors, or a SpecMTPError."""
    try:
        if sha256(path.read_bytes()) != entry["sha256"]:
            raise SpecMTPError(f"corrupt cache shard {path}: checksum mismatch")
        shard = safe_open(path, framework="pt")
        if (shard.metadata() or {}).get("key") != manifest["key"]:
            raise SpecMTPError(f"cache shard {path} belongs to another cache")
        offsets = shard.get_tensor("offsets")
        small = {n: shard.get_tensor(n) for n in ("input_ids", "loss_mask")}
    except (OSError, SafetensorError) as exc:
        raise SpecMTPError(f"cannot read cache shard {path}: {exc}") from exc
    tokens = small["input_ids"].shape[0]
    expected = {"offsets": (entry["samples"] + 1,), "loss_mask": (tokens,)}
    if manifest["settings"]["store_hidden"]:
        expected["hidden"] = (tokens, manifest["hidden_size"])
    if manifest["settings"]["topk"]:
        expected["topk_values"] = expected["topk_indices"] = (tokens, manifest["settings"]["topk"])
    names = set(shard.keys())
    for name, shape in expected.items():
        if name not in names or tuple(shard.get_slice(name).get_shape()) != shape:
            raise SpecMTPError(f"corrupt cache shard {path}: {name} missing or not {shape}")
    if tokens != entry["tokens"] or int(offsets[-1]) != tokens:
        raise SpecMTPError(f"corrupt cache shard {path}: offsets disagree with input_ids")
    return shard, offsets, {**small, "input_ids": small["input_ids"].long()}


def is_heldout(index: int, fraction: float) -> bool:
    """Deterministic split by a hash of the sample index: same answer for every reader."""
    digest = hashlib.sha256(f"specmtp-split:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def split_indices(
    cache: DistillCache, split: str, heldout_fraction: float, max_length: int | None = None
) -> list[int]:
    """The samples of a split, in cache order; with `max_length`, those no longer."""
    return [
        i for i in range(cache.num_samples)
        if is_heldout(i, heldout_fraction) == (split == "heldout")
        and (max_length is None or cache.sample_length(i) <= max_length)
    ]  # fmt: skip


def iter_batches(
    cache: DistillCache | Path,
    *,
    batch_size: int,
    seq_len: int,
    seed: int | None = 0,
    split: str = "train",
    heldout_fraction: float = 0.05,
    whole: bool = False,
) -> Iterator[DistillBatch]:
    """Batches of whole samples, right-padded to `seq_len`; one pass, shuffled by `seed`
    (None keeps cache order). A longer sample keeps its last `seq_len` tokens, where its
    answer is; cached hidden states saw the full prompt either way. With `whole`, longer
    samples are skipped instead: for a model that reads the batch itself (train-mtp
    --joint), a window without the prompt's start is another context than the one its
    cached targets were computed in."""
    if split not in ("train", "heldout"):
        raise SpecMTPError(f"split must be 'train' or 'heldout', got {split!r}")
    if batch_size < 1 or seq_len < 1 or not 0 <= heldout_fraction < 1:
        raise SpecMTPError("batch_size and seq_len must be positive, heldout_fraction in [0, 1)")
    cache = cache if isinstance(cache, DistillCache) else DistillCache.open(Path(cache))
    indices = split_indices(cache, split, heldout_fraction, seq_len if whole else None)
    if not indices:
        within = f" within {seq_len} tokens (raise --seq-len)" if whole else ""
        raise SpecMTPError(f"the {split} split of {cache.directory} has no sample{within}")
    if seed is not None:
        order = torch.randperm(len(indices), generator=torch.Generator().manual_seed(seed))
        indices = [indices[i] for i in order.tolist()]
    for start in range(0, len(indices), batch_size):
        rows = [cache.sample(i) for i in indices[start : start + batch_size]]
        yield _collate(rows, seq_len)


def _collate(rows: list[dict[str, torch.Tensor]], seq_len: int) -> DistillBatch:
    padded: dict[str, torch.Tensor] = {}
    for name in rows[0]:
        first = rows[0][name]
        out = torch.zeros((len(rows), seq_len, *first.shape[1:]), dtype=first.dtype)
        for row, sample in enumerate(rows):
            kept = sample[name][-seq_len:]
            out[row, : kept.shape[0]] = kept
        padded[name] = out
    lengths = torch.tensor([min(r["input_ids"].shape[0], seq_len) for r in rows])
    attention_mask = torch.arange(seq_len)[None, :] < lengths[:, None]  # [B, T]
    if "topk_indices" in padded:
        padded["topk_indices"] = padded["topk_indices"].long()
    return DistillBatch(attention_mask=attention_mask, **padded)
