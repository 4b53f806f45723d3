"""Training prompts: reading prompt texts from folders and files, shuffled by a seed.

A source is a folder or a .jsonl, .json, .csv or .txt file in any of the layouts of
`../shared/train_prompts/` (see its SOURCES.md); a .txt file is one document, cut into
paragraph chunks.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specmtp.errors import SpecMTPError
from specmtp.files import jsonl_lines

_PROMPT_SUFFIXES = (".jsonl", ".json", ".csv", ".txt")
_TXT_CHUNK_CHARS = 1500
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


def refuse_evaluation_sets(paths: Sequence[Path | str], what: str) -> None:
    """A SpecMTPError when a path lies under an `eval` folder: `what` (tuning, a datastore)
    must not see the prompts the benchmark reports."""
    for path in paths:
        if "eval" in Path(path).resolve().parts:
            raise SpecMTPError(
                f"{path} is an evaluation set: {what} on training prompts, not on the "
                "prompts the benchmark reports"
            )


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


def _json_line(path: Path, n: int, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise SpecMTPError(f"cannot read prompt file {path}: line {n}: {exc}") from exc


def _file_texts(path: Path) -> list[str]:
    """The prompts of one file; a .txt file is one document, cut into paragraph chunks."""
    try:
        text = path.read_text(encoding="utf-8")
        suffix = path.suffix.lower()
        if suffix == ".txt":
            return _paragraph_chunks(text)
        if suffix == ".jsonl":
            records = [_json_line(path, n, line) for n, line in jsonl_lines(text)]
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
