"""Benchmark prompt sets: evaluation files, random token prompts, and long-context versions.

Every evaluation file is JSON Lines, one record a line; the record's shape (its keys) says
which set it comes from, so one loader reads all of them:
- Spec-Bench, MT-bench(-zh): {question_id, category, turns} -> the first turn.
- HumanEval: {task_id, prompt, ...} -> the prompt (code to complete), id = task_id.
- BELLE: {question, class, ...} -> the question, category = class, id = line number.
- GSM8K: {question, answer} -> the question, id = line number.
Line numbers are 1-based lines of the file. A prompt's `suite` is the folder its file lives
in (spec_bench, gsm8k, ...), and results are grouped by `suite/category`.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specmtp.errors import SpecMTPError
from specmtp.files import jsonl_lines

RANDOM_SUITE = "random"
RANDOM_SPEC = re.compile(r"random:(\d+)x(\d+)(?::(\d+))?")
CONTEXT_HEADER = "Read the documents below, then answer the question at the end."
CONTEXT_SLACK = 0.05  # a long-context prompt may run this fraction over the asked length


@dataclass(frozen=True)
class BenchPrompt:
    question_id: Any
    suite: str  # the set: the prompt file's folder name, or "random"
    category: str  # the record's category / class; "" if none
    text: str | None  # the prompt text, before any chat template
    ids: tuple[int, ...] | None = None  # a prompt given as token ids (random prompts)

    def __post_init__(self) -> None:
        if (self.text is None) == (self.ids is None):
            raise SpecMTPError(f"prompt {self.question_id!r}: set exactly one of text and ids")

    @property
    def group(self) -> str:
        """The name results are grouped by."""
        return f"{self.suite}/{self.category}" if self.category else self.suite


@dataclass(frozen=True)
class _Format:
    """A record shape: the keys that identify it and where its fields live."""

    name: str
    keys: tuple[str, ...]
    text_key: str
    id_key: str | None  # None: the line number is the id
    category_key: str | None  # None: no category


_FORMATS = (
    _Format("Spec-Bench/MT-bench", ("turns",), "turns", "question_id", "category"),
    _Format("HumanEval", ("task_id", "prompt"), "prompt", "task_id", None),
    _Format("BELLE", ("question", "class"), "question", None, "class"),
    _Format("GSM8K", ("question", "answer"), "question", None, None),
)
_SHAPES = ", ".join(f"{{{', '.join(f.keys)}}} ({f.name})" for f in _FORMATS)


def _record_text(record: dict[str, Any], fmt: _Format, where: str) -> str:
    text = record[fmt.text_key]
    if fmt.text_key == "turns":
        if not isinstance(text, list) or not text:
            raise SpecMTPError(f"{where}: 'turns' must be a non-empty list of strings")
        text = text[0]
    if not isinstance(text, str) or not text.strip():
        what = "the first turn" if fmt.text_key == "turns" else repr(fmt.text_key)
        raise SpecMTPError(f"{where}: {what} must be a non-empty string")
    return text


def _parse_prompt_line(line: str, line_no: int, suite: str, where: str) -> BenchPrompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise SpecMTPError(f"{where}: bad JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise SpecMTPError(f"{where}: expected a JSON object, one of {_SHAPES}")
    fmt = next((f for f in _FORMATS if all(k in record for k in f.keys)), None)
    if fmt is None:
        raise SpecMTPError(
            f"{where}: unknown record with keys {sorted(record)}; expected {_SHAPES}"
        )
    question_id = record.get(fmt.id_key, line_no) if fmt.id_key else line_no
    category = record.get(fmt.category_key) if fmt.category_key else None
    text = _record_text(record, fmt, where)
    return BenchPrompt(question_id, suite, "" if category is None else str(category), text)


def _check_selection(limit: int | None, per_category: int | None) -> None:
    if limit is not None and limit < 1:
        raise SpecMTPError(f"limit must be >= 1, got {limit}")
    if per_category is not None and per_category < 1:
        raise SpecMTPError(f"per_category must be >= 1, got {per_category}")


def _select(
    prompts: list[BenchPrompt], limit: int | None, per_category: int | None
) -> list[BenchPrompt]:
    """At most the first `per_category` of each group (file order kept), then the first `limit`."""
    if per_category is not None:
        seen: Counter[str] = Counter()
        kept = []
        for prompt in prompts:
            seen[prompt.group] += 1
            if seen[prompt.group] <= per_category:
                kept.append(prompt)
        prompts = kept
    return prompts[:limit]


def load_prompts(
    path: Path, *, limit: int | None = None, per_category: int | None = None
) -> list[BenchPrompt]:
    """The prompts of one evaluation file; see the module docstring for the record shapes."""
    _check_selection(limit, per_category)
    try:
        lines = jsonl_lines(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise SpecMTPError(f"cannot read prompts file {path}: {reason}") from None
    suite = path.absolute().parent.name or path.stem
    prompts = [_parse_prompt_line(line, n, suite, f"{path} line {n}") for n, line in lines]
    if not prompts:
        raise SpecMTPError(f"prompts file {path} holds no prompts")
    return _select(prompts, limit, per_category)


def random_prompts(
    *, vocab_size: int, count: int, length: int, seed: int, exclude: Collection[int] = ()
) -> list[BenchPrompt]:
    """`count` prompts of `length` token ids drawn uniformly from the vocabulary minus `exclude`.

    Unpredictable text: speculation should gain nothing here, and must not lose much either.
    """
    if count < 1 or length < 1:
        raise SpecMTPError(f"random prompts need count and length >= 1, got {count}x{length}")
    allowed = sorted(set(range(vocab_size)) - set(exclude))
    if not allowed:
        raise SpecMTPError(
            f"no token ids left to draw: vocab_size {vocab_size}, {len(set(exclude))} excluded"
        )
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(allowed), (count, length), generator=generator)  # [count, length]
    ids = torch.tensor(allowed)[picks]  # [count, length]
    return [
        BenchPrompt(i, RANDOM_SUITE, "", None, ids=tuple(row))
        for i, row in enumerate(ids.tolist(), 1)
    ]


def load_prompt_spec(
    spec: str,
    *,
    limit: int | None = None,
    per_category: int | None = None,
    vocab_size: int | None = None,
    exclude: Collection[int] = (),
) -> list[BenchPrompt]:
    """A `--prompts` value: a prompts file, or `random:COUNTxLENGTH[:SEED]` (seed 0 by default)."""
    _check_selection(limit, per_category)
    if not spec.startswith(f"{RANDOM_SUITE}:"):
        return load_prompts(Path(spec), limit=limit, per_category=per_category)
    match = RANDOM_SPEC.fullmatch(spec)
    if match is None:
        raise SpecMTPError(
            f"bad prompts spec {spec!r}: expected random:COUNTxLENGTH[:SEED], e.g. random:8x64"
        )
    if vocab_size is None:
        raise SpecMTPError(f"prompts spec {spec!r} needs the target's vocabulary size")
    count, length, seed = (int(g) if g else 0 for g in match.groups())
    prompts = random_prompts(
        vocab_size=vocab_size, count=count, length=length, seed=seed, exclude=exclude
    )
    return _select(prompts, limit, per_category)


def _render(question: str, documents: Sequence[str]) -> str:
    parts = [f"Document {i}:\n{doc}" for i, doc in enumerate(documents, 1)]
    return "\n\n".join([CONTEXT_HEADER, *parts, f"Question: {question}"])


def _fill(
    question: str, sources: Sequence[str], tokens: int, count_tokens: Callable[[str], int]
) -> list[str]:
    """Documents, cycling through `sources`, until the rendered text holds >= `tokens`.

    Sums per-document counts (cheap) and checks the whole text only when the sum gets there,
    since a tokenizer counts a concatenation a little differently from its parts.
    """
    documents: list[str] = []
    estimate = count_tokens(_render(question, documents))
    while True:
        if estimate >= tokens:
            estimate = count_tokens(_render(question, documents))
            if estimate >= tokens:
                return documents
        doc = sources[len(documents) % len(sources)]
        documents.append(doc)
        added = count_tokens(f"Document {len(documents)}:\n{doc}")
        if added < 1:
            raise SpecMTPError("count_tokens counted no tokens in a whole document")
        estimate += added


def _trim(
    question: str, documents: list[str], tokens: int, count_tokens: Callable[[str], int]
) -> str:
    """Drop or cut the last document to the shortest text still holding >= `tokens`."""
    text = _render(question, documents)
    if not documents or count_tokens(text) <= tokens * (1 + CONTEXT_SLACK):
        return text
    head, last = documents[:-1], documents[-1]
    if count_tokens(_render(question, head)) >= tokens:
        return _render(question, head)
    lo, hi = 0, len(last)  # invariant: last[:lo] falls short, last[:hi] reaches `tokens`
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count_tokens(_render(question, [*head, last[:mid]])) >= tokens:
            hi = mid
        else:
            lo = mid
    return _render(question, [*head, last[:hi]])


def context_text(
    prompt: BenchPrompt,
    others: Sequence[BenchPrompt],
    *,
    tokens: int,
    count_tokens: Callable[[str], int],
) -> str:
    """A long-context version of `prompt`: numbered documents from `others`, then the question.

    Documents are the texts of `others` (skipping `prompt` itself and prompts without text),
    cycled as often as needed until `count_tokens` of the whole text reaches `tokens`; the last
    document is then dropped or cut (on a character boundary) so the text runs at most ~5%
    over. The length is approximate: `count_tokens` sees raw text, without a chat template,
    and a question longer than `tokens` on its own is kept whole.
    """
    if prompt.text is None:
        raise SpecMTPError(f"prompt {prompt.question_id!r} has no text to ask about")
    if tokens < 1:
        raise SpecMTPError(f"context tokens must be >= 1, got {tokens}")
    sources = [o.text for o in others if o.text and o != prompt and o.text != prompt.text]
    if not sources:
        raise SpecMTPError("no other prompt holds text to build context documents from")
    documents = _fill(prompt.text, sources, tokens, count_tokens)
    return _trim(prompt.text, documents, tokens, count_tokens)
