"""Plain-text training data for a general draft model: documents, token chunks, batches.

A general draft learns plain next-token prediction on ordinary text, not a target's answers.
Documents (.txt files) are tokenised, joined into one token stream with the tokenizer's EOS
after each, and cut into non-overlapping chunks of `seq_len` tokens. Chunks are full, so
their batches are the trainer's `DistillBatch` with every position attended and learned.

A chunk file is one safetensors file:

    tokens  int32  [N, seq_len]   chunk i is tokens[i]

with metadata `format`, `seq_len`, `sources` (a JSON list) and `sha256` (of the token bytes).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerBase

from specmtp.data import DistillBatch, is_heldout
from specmtp.errors import SpecMTPError

_FORMAT = "1"  # bump when the chunk file layout changes, so old files are refused
# Documents are tokenised in pieces of about this many characters, cut where a paragraph
# break begins, so a whole novel is never one tokenizer call.
_PIECE_CHARS = 100_000
_PARAGRAPH_BREAK = re.compile(r"\s*\n\s*\n")


@dataclass(frozen=True)
class TextChunks:
    """Non-overlapping windows of one token stream, in stream order."""

    tokens: torch.Tensor  # [N, seq_len] int64
    seq_len: int
    sources: tuple[str, ...]  # what the texts were read from, for the record

    @property
    def num_chunks(self) -> int:
        return self.tokens.shape[0]


def load_texts(sources: Sequence[Path | str]) -> list[str]:
    """The documents of .txt files and folders (searched recursively, in sorted order), each
    with its surrounding whitespace stripped; an empty or non-UTF-8 file is refused."""
    if not sources:
        raise SpecMTPError("no text sources given")
    texts: list[str] = []
    for source in map(Path, sources):
        if source.is_dir():
            files = sorted(p for p in source.rglob("*.txt") if p.is_file())
            if not files:
                raise SpecMTPError(f"no .txt files in {source}")
        elif source.is_file():
            if source.suffix.lower() != ".txt":
                raise SpecMTPError(f"unsupported text file {source}: use .txt")
            files = [source]
        else:
            raise SpecMTPError(f"text source not found: {source}")
        texts += [_read_text(path) for path in files]
    return texts


def _read_text(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecMTPError(f"cannot read text file {path}: {exc}") from exc
    if not text:
        raise SpecMTPError(f"text file {path} is empty")
    return text


def _pieces(text: str, size: int) -> list[str]:
    """`text` cut into pieces of at least `size` characters, each cut just before the
    whitespace of a paragraph break. GPT-2-style byte-level pre-tokenizers split there anyway,
    so with them the pieces' tokens are the whole text's. A text without breaks stays whole."""
    pieces: list[str] = []
    start = 0
    for found in _PARAGRAPH_BREAK.finditer(text):
        if found.start() - start >= size:
            pieces.append(text[start : found.start()])
            start = found.start()
    return [*pieces, text[start:]]


def tokenize_chunks(
    texts: Sequence[str],
    tokenizer: PreTrainedTokenizerBase,
    *,
    seq_len: int,
    sources: Sequence[str] = (),
) -> TextChunks:
    """All `texts` as one token stream (no special tokens; the tokenizer's EOS, if it has one,
    after each document) cut into chunks of `seq_len` tokens; the last partial chunk is
    dropped. `sources` is recorded with the chunks."""
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise SpecMTPError(f"seq_len must be a positive integer, got {seq_len!r}")
    if not texts:
        raise SpecMTPError("no texts to tokenise")
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for text in texts:
        for piece in _pieces(text, _PIECE_CHARS):
            # verbose=False: the over-max-length warning is meant for model inputs, not this.
            stream += tokenizer(piece, add_special_tokens=False, verbose=False).input_ids
        if eos is not None:
            stream.append(eos)
    count = len(stream) // seq_len
    if count == 0:
        raise SpecMTPError(f"{len(stream)} tokens of text do not fill one {seq_len}-token chunk")
    tokens = torch.tensor(stream[: count * seq_len], dtype=torch.int64).view(count, seq_len)
    return TextChunks(tokens=tokens, seq_len=seq_len, sources=tuple(map(str, sources)))


def save_chunks(chunks: TextChunks, path: Path | str) -> None:
    """Write `chunks` to one safetensors file, through a temporary file and a rename."""
    path = Path(path)
    if chunks.tokens.dtype != torch.int64 or chunks.tokens.shape[1:] != (chunks.seq_len,):
        raise SpecMTPError(f"tokens must be int64 [N, {chunks.seq_len}]")
    if chunks.tokens.numel() and int(chunks.tokens.max()) >= 2**31:
        raise SpecMTPError("token ids do not fit the file's int32")
    tokens = chunks.tokens.to(torch.int32).contiguous()  # [N, seq_len]
    metadata = {
        "format": _FORMAT,
        "seq_len": str(chunks.seq_len),
        "sources": json.dumps(list(chunks.sources)),
        "sha256": hashlib.sha256(tokens.numpy().tobytes()).hexdigest(),
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"tokens": tokens}, str(tmp), metadata)
        os.replace(tmp, path)
    except OSError as exc:
        raise SpecMTPError(f"cannot write {path}: {exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)


def load_chunks(path: Path | str) -> TextChunks:
    """Chunks written by `save_chunks`, checked against their checksum."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
            tokens = file.get_tensor("tokens") if "tokens" in file.keys() else None  # noqa: SIM118
    except (OSError, SafetensorError) as exc:
        raise SpecMTPError(f"cannot read text chunks {path}: {exc}") from exc
    if metadata.get("format") != _FORMAT or tokens is None:
        raise SpecMTPError(f"{path} is not a format-{_FORMAT} text chunk file")
    try:
        seq_len = int(metadata["seq_len"])
        sources = json.loads(metadata["sources"])
    except (KeyError, ValueError) as exc:
        raise SpecMTPError(f"corrupt text chunks {path}: bad metadata ({exc})") from exc
    if not isinstance(sources, list):
        raise SpecMTPError(f"corrupt text chunks {path}: sources is not a list")
    if tokens.dtype != torch.int32 or tokens.dim() != 2 or tokens.shape[1] != seq_len:
        raise SpecMTPError(f"corrupt text chunks {path}: tokens are not int32 [N, {seq_len}]")
    if hashlib.sha256(tokens.numpy().tobytes()).hexdigest() != metadata.get("sha256"):
        raise SpecMTPError(f"corrupt text chunks {path}: checksum mismatch")
    return TextChunks(tokens=tokens.long(), seq_len=seq_len, sources=tuple(map(str, sources)))


def iter_text_batches(
    chunks: TextChunks,
    *,
    batch_size: int,
    seed: int | None = 0,
    split: str = "train",
    heldout_fraction: float = 0.05,
) -> Iterator[DistillBatch]:
    """One pass over the chunks of `split`, `batch_size` chunks a batch (the last may be
    smaller), shuffled by `seed` (None keeps stream order). The split is `is_heldout` of the
    chunk index, as `data.iter_batches` splits samples."""
    if split not in ("train", "heldout"):
        raise SpecMTPError(f"split must be 'train' or 'heldout', got {split!r}")
    if batch_size < 1 or not 0 <= heldout_fraction < 1:
        raise SpecMTPError("batch_size must be positive, heldout_fraction in [0, 1)")
    indices = [
        i for i in range(chunks.num_chunks)
        if is_heldout(i, heldout_fraction) == (split == "heldout")
    ]  # fmt: skip
    if not indices:
        raise SpecMTPError(f"the {split} split of {chunks.num_chunks} text chunks is empty")
    order = torch.tensor(indices)
    if seed is not None:
        order = order[torch.randperm(len(indices), generator=torch.Generator().manual_seed(seed))]
    for start in range(0, len(order), batch_size):
        input_ids = chunks.tokens[order[start : start + batch_size]]  # [B, T]
        full = torch.ones_like(input_ids, dtype=torch.bool)  # [B, T]
        yield DistillBatch(input_ids=input_ids, attention_mask=full, loss_mask=full.clone())
