"""Self-distillation data: training prompts, the target's own greedy answers, and a cache.

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

import csv
import hashlib
import itertools
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from specmtp.api import eos_token_ids
from specmtp.errors import SpecMTPError
from specmtp.heads import target_features
from specmtp.models import LoadedModel, vocab_digest

# Default model, 2-core CPU, answer tokens/s: 16 prompts x 64 tokens, short prompts:
# batch 1: 22, 8: 88, 16: 107, 32: 97; 32 train prompts (mean 185 tokens) x 128 tokens:
# 8: 57, 16: 49. Build runs look like the second, so 8.
DEFAULT_BATCH_SIZE = 8
MANIFEST = "manifest.json"
_FORMAT = 1  # bump when the shard layout changes, so old caches are refused, not misread
_PROMPT_SUFFIXES = (".jsonl", ".json", ".csv", ".txt")
_TXT_CHUNK_CHARS = 1500
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
_FINGERPRINT_VALUES = 64  # leading values of each parameter that go into the model fingerprint


@dataclass(frozen=True)
class Sample:
    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]  # the target's greedy answer; ends with eos if it stopped there


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


def load_train_prompts(
    sources: Sequence[Path | str],
    *,
    limit_per_source: int | None = None,
    seed: int = 0,
    max_chars: int | None = 4000,
) -> list[str]:
    """Prompt texts from folders or files (.jsonl, .json, .csv, .txt), shuffled by `seed`.

    Each source is shuffled on its own before `limit_per_source` takes its first prompts, so a
    source's subset does not depend on the others; then the union is shuffled. Prompts longer
    than `max_chars` characters are dropped (a few role prompts run to 144k characters).
    """
    if limit_per_source is not None and limit_per_source < 1:
        raise SpecMTPError(f"limit_per_source must be positive, got {limit_per_source}")
    if not sources:
        raise SpecMTPError("no prompt sources given")
    prompts: list[str] = []
    for source in sources:
        prompts += source_prompts(source, seed=seed, max_chars=max_chars)[:limit_per_source]
    return _shuffled(prompts, seed)


def source_prompts(source: Path | str, *, seed: int = 0, max_chars: int | None = 4000) -> list[str]:
    """One source's distinct prompts in the order `limit_per_source` takes them."""
    texts = list(dict.fromkeys(t.strip() for t in _source_texts(Path(source)) if t.strip()))
    kept = [t for t in texts if max_chars is None or len(t) <= max_chars]
    if not kept:
        dropped = f" ({len(texts)} longer than {max_chars} characters)" if texts else ""
        raise SpecMTPError(f"no prompts found in {source}{dropped}")
    return _shuffled(kept, seed)


def _shuffled(items: list[str], seed: int) -> list[str]:
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed))
    return [items[i] for i in order.tolist()]


def _source_texts(source: Path) -> list[str]:
    if source.is_dir():
        files = sorted(p for p in source.iterdir() if p.suffix.lower() in _PROMPT_SUFFIXES)
        if not files:
            raise SpecMTPError(f"no .jsonl, .json, .csv or .txt files in {source}")
        return [text for path in files for text in _file_texts(path)]
    if not source.exists():
        raise SpecMTPError(f"prompt source not found: {source}")
    if source.suffix.lower() not in _PROMPT_SUFFIXES:
        raise SpecMTPError(f"unsupported prompt file {source}: use .jsonl, .json, .csv or .txt")
    return _file_texts(source)


def _file_texts(path: Path) -> list[str]:
    """The prompts of one file; a .txt file is one document, cut into paragraph chunks."""
    try:
        text = path.read_text(encoding="utf-8")
        suffix = path.suffix.lower()
        if suffix == ".txt":
            return _paragraph_chunks(text)
        if suffix == ".jsonl":
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        elif suffix == ".json":
            records = json.loads(text)
        else:
            # The longest awesome-chatgpt prompt is over csv's default 128 KiB field limit.
            csv.field_size_limit(1 << 24)
            records = list(csv.DictReader(text.splitlines(keepends=True)))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, csv.Error) as exc:
        raise SpecMTPError(f"cannot read prompt file {path}: {exc}") from exc
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise SpecMTPError(f"cannot read prompt file {path}: expected a list of JSON objects")
    texts = [t for t in map(_record_prompt, records) if t]
    if records and not texts:
        raise SpecMTPError(
            f"no prompt field in {path}: expected question, prompt, instruction, problem or text"
        )
    return texts


def _record_prompt(record: dict[str, Any]) -> str | None:
    """The prompt of one record in any of the train_prompts layouts (see SOURCES.md)."""
    if record.get("type") == "IMAGE":  # awesome-chatgpt-prompts: image-generation prompts
        return None
    if "problem" in record:  # TAL-SCQ5K: the problem followed by its lettered options
        options = [
            f"{o.get('aoVal', '')}. {str(o.get('content', '')).strip()}"
            for group in record.get("answer_option_list") or []
            for o in group
        ]
        return "\n".join([str(record["problem"]).strip(), *options])
    if "question" in record:  # GSM8K
        return str(record["question"])
    if "text" in record and record.get("test_list"):  # MBPP: one test names the function
        return f"{record['text']}\nYour code should pass this test:\n{record['test_list'][0]}"
    if "instruction" in record:  # self-instruct (instances[0].input) and ruozhiba
        instances = record.get("instances") or [{}]
        extra = str(instances[0].get("input") or "").strip()
        return f"{record['instruction']}\n\n{extra}" if extra else str(record["instruction"])
    for key in ("prompt", "text"):
        if isinstance(record.get(key), str):
            return record[key]
    return None


def _paragraph_chunks(text: str) -> list[str]:
    """Consecutive paragraphs joined up to ~_TXT_CHUNK_CHARS characters per chunk."""
    chunks: list[str] = []
    for paragraph in (p.strip() for p in _PARAGRAPH_BREAK.split(text)):
        if chunks and paragraph and len(chunks[-1]) + len(paragraph) < _TXT_CHUNK_CHARS:
            chunks[-1] += "\n\n" + paragraph
        elif paragraph:
            chunks.append(paragraph)
    return chunks


def encode_prompt(model: LoadedModel, prompt: str, *, chat: bool) -> list[int]:
    """Token ids of a prompt, inside the chat template when `chat`."""
    tokenizer = model.tokenizer
    if not chat:
        return tokenizer(prompt).input_ids
    if tokenizer.chat_template is None:
        raise SpecMTPError(f"{model.spec} has no chat template (use chat=False)")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False).input_ids


def generate_answers(
    model: LoadedModel,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    batch_size: int = DEFAULT_BATCH_SIZE,
    chat: bool = True,
) -> list[Sample]:
    """The target's greedy answer to each prompt, in the prompts' order.

    Prompts are sorted by length and generated in left-padded batches; greedy decoding needs
    no seed, and padding does not change the answers (the tests compare against batch 1).
    """
    if max_new_tokens < 1 or batch_size < 1:
        raise SpecMTPError("max_new_tokens and batch_size must be positive")
    encoded = [encode_prompt(model, p, chat=chat) for p in prompts]
    for i, ids in enumerate(encoded):
        if len(ids) + max_new_tokens > model.context_length:
            raise SpecMTPError(
                f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} "
                f"it exceeds the {model.context_length}-token context of {model.spec}"
            )
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    answers: dict[int, tuple[int, ...]] = {}
    bar = tqdm(total=len(order), desc="target answers", unit="prompt", disable=None)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        batch = _generate_batch(model, [encoded[i] for i in rows], max_new_tokens)
        answers.update(zip(rows, batch, strict=True))
        bar.update(len(rows))
    bar.close()
    return [Sample(tuple(ids), answers[i]) for i, ids in enumerate(encoded)]


def text_samples(model: LoadedModel, texts: Sequence[str]) -> list[Sample]:
    """Texts as samples with no prompt: every token is an answer token, and the labels are
    the target's own distributions over the text (train-mtp --text --objective kl)."""
    samples = [Sample((), tuple(encode_prompt(model, t, chat=False))) for t in texts]
    for i, sample in enumerate(samples):
        if len(sample.answer_ids) > model.context_length:
            raise SpecMTPError(
                f"text {i} has {len(sample.answer_ids)} tokens, over the "
                f"{model.context_length}-token context of {model.spec}"
            )
    return samples


@torch.no_grad()
def _generate_batch(
    model: LoadedModel, prompts: list[list[int]], max_new_tokens: int
) -> list[tuple[int, ...]]:
    eos = eos_token_ids(model)
    pad = model.tokenizer.pad_token_id
    pad = eos[0] if pad is None else pad
    width = max(map(len, prompts))
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, T]
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    out = model.model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=eos,
    )
    answers = []
    for new in out[:, width:].tolist():
        ends = [i for i, token in enumerate(new) if token in eos]
        answers.append(tuple(new[: ends[0] + 1] if ends else new))
    return answers


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
        "format": _FORMAT,
        "model": {"spec": model.spec, "fingerprint": model_fingerprint(model)},
        "settings": config.content_settings(),
        "prompts_sha256": _sha256(json.dumps(list(prompts)).encode()),
        "num_samples": len(prompts),
    }
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / MANIFEST).exists():
        _check_identity(directory, _read_manifest(directory), identity)
    key = _sha256(json.dumps(identity, sort_keys=True).encode())
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
    _write_atomically(directory / MANIFEST, lambda tmp: Path(tmp).write_text(text, "utf-8"))
    return DistillCache.open(directory)


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
        _write_atomically(path, lambda tmp: save_file(tensors, tmp, metadata))
    with safe_open(path, framework="pt") as shard:
        offsets = shard.get_tensor("offsets")
    return {
        "file": path.name,
        "samples": len(offsets) - 1,
        "tokens": int(offsets[-1]),
        "sha256": _sha256(path.read_bytes()),
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
    config = DistillConfig(
        store_hidden=True, topk=0, forward_tokens=forward_tokens, feature_layers=feature_layers
    )
    settings = {**source.manifest["settings"], "store_hidden": True}
    settings.pop("feature_layers", None)
    if feature_layers is not None:
        settings["feature_layers"] = list(feature_layers)
    identity = {
        "format": _FORMAT,
        "model": {"spec": model.spec, "fingerprint": model_fingerprint(model)},
        "settings": settings,
        "prompts_sha256": source.manifest["prompts_sha256"],
        "num_samples": source.num_samples,
        "answers_from": {"model": source.manifest["model"], "key": source.manifest["key"]},
    }
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / MANIFEST).exists():
        _check_identity(directory, _read_manifest(directory), identity)
    key = _sha256(json.dumps(identity, sort_keys=True).encode())
    shards = []
    for entry in tqdm(source.manifest["shards"], desc="rescoring", unit="shard", disable=None):
        path = directory / entry["file"]
        if not _reusable_shard(path, key):
            tensors = load_file(str(source.directory / entry["file"]))
            offsets = tensors["offsets"].tolist()
            ids = tensors["input_ids"].tolist()
            sequences = [ids[a:b] for a, b in itertools.pairwise(offsets)]
            tensors["hidden"] = _target_outputs(model, sequences, config)["hidden"]
            metadata = {"key": key, "digest": _tensors_digest(tensors)}
            _write_atomically(path, lambda tmp, t=tensors, m=metadata: save_file(t, tmp, m))
        shards.append({**entry, "sha256": _sha256(path.read_bytes())})
    manifest = {
        **identity,
        "key": key,
        "sources": source.manifest["sources"],
        "num_tokens": source.manifest["num_tokens"],
        "hidden_size": _stored_width(model, feature_layers),
        "vocab_sha256": theirs,
        "shards": shards,
    }
    text = json.dumps(manifest, indent=1, ensure_ascii=False)
    _write_atomically(directory / MANIFEST, lambda tmp: Path(tmp).write_text(text, "utf-8"))
    return DistillCache.open(directory)


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


def _write_atomically(path: Path, write: Any) -> None:
    """Write through a temporary file beside `path`, then rename: never a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(str(tmp))
        os.replace(tmp, path)
    except OSError as exc:
        raise SpecMTPError(f"cannot write {path}: {exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode() + tensors[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def _read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not path.is_file():
        raise SpecMTPError(f"no distillation cache in {directory}: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecMTPError(f"cannot read {path}: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise SpecMTPError(f"{path} is not a format-{_FORMAT} distillation cache manifest")
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
        manifest = _read_manifest(directory)
        if model is not None and manifest["model"]["fingerprint"] != model_fingerprint(model):
            raise SpecMTPError(
                f"cache {directory} was built by model {manifest['model']['spec']!r} "
                f"(fingerprint {manifest['model']['fingerprint']}), not by {model.spec!r}"
            )
        return cls(directory, manifest)

    @property
    def num_samples(self) -> int:
        return int(self._starts[-1])

    def answer_tokens(self, index: int) -> torch.Tensor:
        """The answer token ids of one sample [m], without reading its large tensors."""
        shard_index = int(torch.searchsorted(self._starts, index, right=True)) - 1
        _, offsets, small = self._shards[shard_index]
        local = index - int(self._starts[shard_index])
        begin, end = int(offsets[local]), int(offsets[local + 1])
        return small["input_ids"][begin:end][small["loss_mask"][begin:end]].long()

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        """One sample's tensors: input_ids [n], loss_mask [n], hidden [n, H], topk_* [n, k]."""
        shard_index = int(torch.searchsorted(self._starts, index, right=True)) - 1
        shard, offsets, small = self._shards[shard_index]
        names = set(shard.keys())
        local = index - int(self._starts[shard_index])
        begin, end = int(offsets[local]), int(offsets[local + 1])
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
        if _sha256(path.read_bytes()) != entry["sha256"]:
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


def iter_batches(
    cache: DistillCache | Path,
    *,
    batch_size: int,
    seq_len: int,
    seed: int | None = 0,
    split: str = "train",
    heldout_fraction: float = 0.05,
) -> Iterator[DistillBatch]:
    """Batches of whole samples, right-padded to `seq_len`; one pass, shuffled by `seed`
    (None keeps cache order). A longer sample keeps its last `seq_len` tokens, where its
    answer is; cached hidden states saw the full prompt either way."""
    if split not in ("train", "heldout"):
        raise SpecMTPError(f"split must be 'train' or 'heldout', got {split!r}")
    if batch_size < 1 or seq_len < 1 or not 0 <= heldout_fraction < 1:
        raise SpecMTPError("batch_size and seq_len must be positive, heldout_fraction in [0, 1)")
    cache = cache if isinstance(cache, DistillCache) else DistillCache.open(Path(cache))
    indices = [
        i for i in range(cache.num_samples)
        if is_heldout(i, heldout_fraction) == (split == "heldout")
    ]  # fmt: skip
    if not indices:
        raise SpecMTPError(f"the {split} split of {cache.directory} is empty")
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
