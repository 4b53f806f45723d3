"""Building the self-distillation cache (`build_cache`) and rescoring it with another model's
hidden states (`rescore_cache`); the format and the reader are in `specmtp.data`."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from specmtp.answers import DEFAULT_BATCH_SIZE, Sample, generate_answers, text_samples
from specmtp.data import FORMAT, MANIFEST, DistillCache, model_fingerprint, read_manifest, sha256
from specmtp.errors import SpecMTPError
from specmtp.files import write_atomically
from specmtp.heads import target_features
from specmtp.models import LoadedModel
from specmtp.progress import progress
from specmtp.vocab import vocab_digest


@dataclass(frozen=True)
class DistillConfig:
    """How a cache is built; every field but batch_size and forward_tokens shapes its content."""

    max_new_tokens: int = 128
    batch_size: int = DEFAULT_BATCH_SIZE  # prompts per generate call
    chat: bool = True  # wrap each prompt in the tokenizer's chat template
    shard_size: int = 256  # samples per shard: the unit of resumption
    store_hidden: bool = True
    topk: int = 0  # cache the target's top-k log-probabilities; 0 = none
    forward_tokens: int = 2048  # token budget of one forward pass computing hidden/top-k
    # Each source text is itself the answer to score, as plain text (no chat template):
    # the target's hidden states and top-k over it, nothing generated (text_samples).
    text: bool = False
    # Which hidden states to store (heads.target_features): None, the final one alone.
    feature_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "batch_size", "shard_size", "forward_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SpecMTPError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.topk, int) or self.topk < 0:
            raise SpecMTPError(f"topk must be a non-negative integer, got {self.topk!r}")

    def content_settings(self) -> dict[str, Any]:
        settings = asdict(self)
        del settings["batch_size"], settings["forward_tokens"]
        if not self.text:  # caches built before text mode existed keep their identity
            del settings["text"]
        else:  # nothing is generated, and text is scored as plain text
            del settings["max_new_tokens"], settings["chat"]
        if self.feature_layers is None:  # likewise before feature layers
            del settings["feature_layers"]
        else:  # as JSON reads it back
            settings["feature_layers"] = list(self.feature_layers)
        return settings


def build_cache(
    model: LoadedModel,
    prompts: Sequence[str],
    directory: Path,
    *,
    config: DistillConfig = DistillConfig(),
    sources: Sequence[str] = (),
) -> DistillCache:
    """Generate answers (and hidden states / top-k) for `prompts` into `directory`.

    Shards already there and valid are kept, so a killed build resumes; a directory built for
    another model, other settings or other prompts is refused.
    """
    if not prompts:
        raise SpecMTPError("no prompts to build a cache from")
    identity = {
        "format": FORMAT,
        "model": {"spec": model.spec, "fingerprint": model_fingerprint(model)},
        "settings": config.content_settings(),
        "prompts_sha256": _prompts_digest(prompts),
        "num_samples": len(prompts),
    }
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / MANIFEST).exists():
        _check_identity(directory, read_manifest(directory), identity)
    key = sha256(json.dumps(identity, sort_keys=True).encode())
    shards = [
        _ensure_shard(model, prompts[start : start + config.shard_size], config, key=key,
                      path=directory / f"shard-{start // config.shard_size:05d}.safetensors")
        for start in range(0, len(prompts), config.shard_size)
    ]  # fmt: skip
    manifest = {
        **identity,
        "key": key,
        "sources": [str(s) for s in sources],
        "num_tokens": sum(s["tokens"] for s in shards),
        "hidden_size": _stored_width(model, config.feature_layers),
        "vocab_sha256": vocab_digest(model.tokenizer),  # what the token ids mean
        "shards": shards,
    }
    text = json.dumps(manifest, indent=1, ensure_ascii=False)
    write_atomically(directory / MANIFEST, lambda tmp: tmp.write_text(text, "utf-8"))
    return DistillCache.open(directory)


def finished_cache(
    model: LoadedModel, prompts: Sequence[str], directory: Path, *, config: DistillConfig
) -> DistillCache | None:
    """The finished cache in `directory` when it holds `model`'s answers to `prompts` built
    as `config` says but keeps other hidden states beside them: a `train-mtp` cache (other
    feature layers) serves `distill`, which reads tokens and top-k only. None otherwise
    (an exact match included); `build_cache` then builds, resumes or refuses as usual."""
    if not (directory / MANIFEST).is_file():
        return None
    manifest = read_manifest(directory)
    found, wanted = manifest["settings"], config.content_settings()
    loose = ("store_hidden", "feature_layers")
    same_answers = {k: v for k, v in found.items() if k not in loose} == {
        k: v for k, v in wanted.items() if k not in loose
    }
    same_prompts = (manifest.get("num_samples"), manifest.get("prompts_sha256")) == (
        len(prompts),
        _prompts_digest(prompts),
    )
    if found == wanted or not same_answers or not same_prompts:
        return None
    return DistillCache.open(directory, model=model)


def _prompts_digest(prompts: Sequence[str]) -> str:
    return sha256(json.dumps(list(prompts)).encode())


def _ensure_shard(
    model: LoadedModel, prompts: Sequence[str], config: DistillConfig, *, key: str, path: Path
) -> dict[str, Any]:
    """Build the shard at `path` unless a valid one is there; return its manifest entry."""
    if not _reusable_shard(path, key):
        samples = text_samples(model, prompts) if config.text else generate_answers(
            model, prompts, max_new_tokens=config.max_new_tokens,
            batch_size=config.batch_size, chat=config.chat,
        )  # fmt: skip
        tensors = _shard_tensors(model, samples, config)
        metadata = {"key": key, "digest": _tensors_digest(tensors)}
        write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata))
    with safe_open(path, framework="pt") as shard:
        offsets = shard.get_tensor("offsets")
    return {
        "file": path.name,
        "samples": len(offsets) - 1,
        "tokens": int(offsets[-1]),
        "sha256": sha256(path.read_bytes()),
    }


def rescore_cache(
    source: DistillCache,
    model: LoadedModel,
    directory: Path,
    *,
    forward_tokens: int = 2048,
    feature_layers: tuple[int, ...] | None = None,
) -> DistillCache:
    """`source`'s samples, another model's answers, with `model`'s own hidden states: the data
    for MTP heads on a draft model that learn the target's answers from the draft's features.

    The token ids must mean the same to both models. The source's top-k log-probabilities
    (the answering model's distributions) are copied, not recomputed. Shards follow the
    source's, so a killed rescoring resumes as a build does. With `feature_layers` the
    hidden states are those layers' (the same model may rescore its own answers for it).
    """
    check_cache_vocabulary(source, model)
    config = DistillConfig(
        store_hidden=True, topk=0, forward_tokens=forward_tokens, feature_layers=feature_layers
    )
    settings = {**source.manifest["settings"], "store_hidden": True}
    settings.pop("feature_layers", None)
    if feature_layers is not None:
        settings["feature_layers"] = list(feature_layers)
    identity = {
        "format": FORMAT,
        "model": {"spec": model.spec, "fingerprint": model_fingerprint(model)},
        "settings": settings,
        "prompts_sha256": source.manifest["prompts_sha256"],
        "num_samples": source.num_samples,
        "answers_from": {"model": source.manifest["model"], "key": source.manifest["key"]},
    }
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / MANIFEST).exists():
        _check_identity(directory, read_manifest(directory), identity)
    key = sha256(json.dumps(identity, sort_keys=True).encode())
    entries = source.manifest["shards"]
    bar = progress(total=len(entries), desc="rescoring", unit="shard")
    shards = []
    for entry in entries:
        path = directory / entry["file"]
        shards.append(_ensure_rescored_shard(source, entry, model, config, key=key, path=path))
        bar.update(1)
    bar.close()
    manifest = {
        **identity,
        "key": key,
        "sources": source.manifest["sources"],
        "num_tokens": source.manifest["num_tokens"],
        "hidden_size": _stored_width(model, feature_layers),
        "vocab_sha256": source.manifest["vocab_sha256"],
        "shards": shards,
    }
    text = json.dumps(manifest, indent=1, ensure_ascii=False)
    write_atomically(directory / MANIFEST, lambda tmp: tmp.write_text(text, "utf-8"))
    return DistillCache.open(directory)


def _ensure_rescored_shard(
    source: DistillCache,
    entry: dict[str, Any],
    model: LoadedModel,
    config: DistillConfig,
    *,
    key: str,
    path: Path,
) -> dict[str, Any]:
    """Rescore `source`'s shard `entry` into `path` unless a valid one is there; its entry."""
    if not _reusable_shard(path, key):
        tensors = load_file(str(source.directory / entry["file"]))
        offsets = tensors["offsets"].tolist()
        ids = tensors["input_ids"].tolist()
        sequences = [ids[a:b] for a, b in itertools.pairwise(offsets)]
        tensors["hidden"] = _target_outputs(model, sequences, config)["hidden"]
        metadata = {"key": key, "digest": _tensors_digest(tensors)}
        write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata))
    return {**entry, "sha256": sha256(path.read_bytes())}


def check_cache_vocabulary(source: DistillCache, model: LoadedModel) -> None:
    """Refuse a model (rescoring, or reading the answers) whose token ids mean other tokens
    than the cache's."""
    theirs, answered_by = source.manifest.get("vocab_sha256"), source.manifest["model"]["spec"]
    if theirs is None:
        raise SpecMTPError(
            f"cache {source.directory} records no tokenizer vocabulary (built by an older "
            "specmtp); build it again"
        )
    if theirs != vocab_digest(model.tokenizer):
        raise SpecMTPError(
            f"vocabulary mismatch: cache {source.directory} was answered by {answered_by!r}, "
            f"whose token ids mean other tokens than {model.spec!r}'s"
        )


def _check_identity(directory: Path, found: dict[str, Any], wanted: dict[str, Any]) -> None:
    """Refuse, naming the first difference, a cache built from something else."""
    labels = {"model": "model", "settings": "settings", "prompts_sha256": "prompt list",
              "num_samples": "number of prompts", "answers_from": "answering cache"}  # fmt: skip
    for name, label in labels.items():
        if found.get(name) != wanted.get(name):
            raise SpecMTPError(
                f"cache {directory} was built with a different {label} "
                f"({found.get(name)} != {wanted.get(name)}); use a new directory"
            )


def _reusable_shard(path: Path, key: str) -> bool:
    """A shard from this very build (kept), none or a corrupt one (rebuilt); else refuse."""
    try:
        with safe_open(path, framework="pt") as shard:
            metadata = shard.metadata() or {}
            tensors = {name: shard.get_tensor(name) for name in shard.keys()}  # noqa: SIM118
    except (OSError, SafetensorError):
        return False
    if metadata.get("key") != key:
        raise SpecMTPError(f"{path} belongs to a cache with other settings; use a new directory")
    # Shards carry a digest of their own tensors, so a damaged one is caught with no manifest.
    return metadata.get("digest") == _tensors_digest(tensors)


@torch.no_grad()
def _shard_tensors(
    model: LoadedModel, samples: list[Sample], config: DistillConfig
) -> dict[str, torch.Tensor]:
    sequences = [list(s.prompt_ids + s.answer_ids) for s in samples]
    lengths = torch.tensor([0] + [len(s) for s in sequences])
    tensors = {
        "input_ids": torch.tensor([t for s in sequences for t in s], dtype=torch.int32),
        "offsets": torch.cumsum(lengths, 0),
        "loss_mask": torch.tensor(
            [
                i >= len(s.prompt_ids)
                for s, seq in zip(samples, sequences, strict=True)
                for i in range(len(seq))
            ],
            dtype=torch.bool,
        ),
    }
    if config.store_hidden or config.topk:
        tensors |= _target_outputs(model, sequences, config)
    return tensors


@torch.no_grad()
def _target_outputs(
    model: LoadedModel, sequences: list[list[int]], config: DistillConfig
) -> dict[str, torch.Tensor]:
    """Final hidden states and top-k log-probabilities at every position of every sequence.

    Sequences are right-padded (causal attention keeps padding out of earlier positions) in
    forward passes of about `forward_tokens` tokens, longest first.
    """
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    per_sequence: dict[int, dict[str, torch.Tensor]] = {}
    while order:
        width = len(sequences[order[0]])
        count = max(1, config.forward_tokens // width)
        rows, order = order[:count], order[count:]
        input_ids = torch.zeros((len(rows), width), dtype=torch.long)  # [B, T]
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # [B, T]
        for row, i in enumerate(rows):
            input_ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
            attention_mask[row, : len(sequences[i])] = 1
        # Without top-k only the hidden states are needed: skip the LM head's logits.
        out = model.model(input_ids, attention_mask=attention_mask, output_hidden_states=True,
                          logits_to_keep=0 if config.topk else 1)  # fmt: skip
        features = target_features(out.hidden_states, config.feature_layers)  # [B, T, F]
        for row, i in enumerate(rows):
            n, found = len(sequences[i]), {}
            if config.store_hidden:
                found["hidden"] = features[row, :n].to(torch.float16)  # [n, F]
            if config.topk:
                logprobs = torch.log_softmax(out.logits[row, :n].float(), dim=-1)  # [n, V]
                values, indices = logprobs.topk(config.topk, dim=-1)  # [n, k]
                found["topk_values"] = values.to(torch.float16)
                found["topk_indices"] = indices.to(torch.int32)
            per_sequence[i] = found
    names = per_sequence[0].keys()
    return {
        name: torch.cat([per_sequence[i][name] for i in range(len(sequences))]).contiguous()
        for name in names
    }


def _stored_width(model: LoadedModel, feature_layers: tuple[int, ...] | None) -> int:
    """The width of the cached hidden states: H, or k*H for k feature layers."""
    hidden = model.model.config.get_text_config().hidden_size
    return hidden * (1 if feature_layers is None else len(feature_layers))


def _tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode() + tensors[name].contiguous().numpy().tobytes())
    return digest.hexdigest()
