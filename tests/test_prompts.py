"""Benchmark prompt sets: every evaluation file, selection, random prompts, long contexts."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from specmtp.errors import SpecMTPError
from specmtp.prompts import (
    CONTEXT_HEADER,
    BenchPrompt,
    context_text,
    load_prompt_spec,
    load_prompts,
    random_prompts,
)

EVAL = Path("/work/shared/prompts/eval")
MT_BENCH_CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem"]
MT_BENCH = {c: 10 for c in [*MT_BENCH_CATEGORIES, "humanities"]}
SPEC_BENCH = MT_BENCH | {
    c: 80 for c in ["translation", "summarization", "qa", "math_reasoning", "rag"]
}
BELLE = {
    "open qa": 285,
    "brainstorming": 179,
    "rewrite": 131,
    "generation": 98,
    "math": 75,
    "classification": 65,
    "closed\xa0qa": 52,  # the file's class string holds a no-break space
    "summarization": 40,
    "code": 38,
    "extract": 37,
}
# file, categories with their counts, first prompt's (question_id, category, start of text)
EVAL_SETS = [
    ("spec_bench/question.jsonl", SPEC_BENCH, (81, "writing", "Compose an engaging travel")),
    ("mt_bench_zh/question.jsonl", MT_BENCH, (81, "writing", "编写一篇关于最近去夏威夷")),
    ("humaneval/HumanEval.jsonl", {"": 164}, ("HumanEval/0", "", "from typing import List\n")),
    ("gsm8k/test.jsonl", {"": 1319}, (1, "", "Janet\u2019s ducks lay 16 eggs")),
    ("belle_eval_zh/eval_set.jsonl", BELLE, (1, "code", "请你写出一个可以生成五个不同随机数")),
]
needs_eval = pytest.mark.skipif(not EVAL.is_dir(), reason=f"{EVAL} is missing")


def write_lines(path: Path, records: list[object]) -> Path:
    path.write_text("".join(f"{json.dumps(r)}\n" for r in records), encoding="utf-8")
    return path


def words(text: str) -> int:
    return len(text.split())


@needs_eval
@pytest.mark.parametrize(("name", "categories", "first"), EVAL_SETS)
def test_every_eval_file_loads(
    name: str, categories: dict[str, int], first: tuple[object, str, str]
) -> None:
    prompts = load_prompts(EVAL / name)
    suite = name.split("/")[0]
    assert len(prompts) == sum(categories.values())
    assert Counter(p.category for p in prompts) == categories
    assert {p.suite for p in prompts} == {suite}
    assert all(p.text and p.text.strip() and p.ids is None for p in prompts)
    assert len({p.question_id for p in prompts}) == len(prompts)
    question_id, category, start = first
    assert (prompts[0].question_id, prompts[0].category) == (question_id, category)
    assert prompts[0].text is not None and prompts[0].text.startswith(start)
    assert prompts[0].group == (f"{suite}/{category}" if category else suite)


@needs_eval
def test_gsm8k_ids_are_line_numbers_and_per_category_keeps_file_order() -> None:
    gsm8k = load_prompts(EVAL / "gsm8k/test.jsonl", limit=5)
    assert [p.question_id for p in gsm8k] == [1, 2, 3, 4, 5]
    every = load_prompts(EVAL / "spec_bench/question.jsonl")
    picked = load_prompts(EVAL / "spec_bench/question.jsonl", per_category=3)
    before = [sum(q.category == p.category for q in every[:i]) for i, p in enumerate(every)]
    expected = [p for p, n in zip(every, before, strict=True) if n < 3]
    assert picked == expected
    assert Counter(p.category for p in picked) == {c: 3 for c in SPEC_BENCH}


def test_per_category_then_limit(tmp_path: Path) -> None:
    cats = ["a", "b", "a", "c", "a", "b", "b", "c"]
    records = [{"question_id": i, "category": c, "turns": [f"q{i}"]} for i, c in enumerate(cats)]
    path = write_lines(tmp_path / "q.jsonl", records)
    assert [p.question_id for p in load_prompts(path, per_category=2)] == [0, 1, 2, 3, 5, 7]
    assert [p.question_id for p in load_prompts(path, per_category=1)] == [0, 1, 3]
    assert [p.question_id for p in load_prompts(path, limit=3)] == [0, 1, 2]
    assert [p.question_id for p in load_prompts(path, per_category=2, limit=4)] == [0, 1, 2, 3]
    assert [p.question_id for p in load_prompts(path, limit=100)] == list(range(8))
    for bad in ({"limit": 0}, {"per_category": 0}):
        with pytest.raises(SpecMTPError, match="must be >= 1"):
            load_prompts(path, **bad)


def test_record_shapes_are_detected_per_line(tmp_path: Path) -> None:
    folder = tmp_path / "my_set"
    folder.mkdir()
    path = write_lines(
        folder / "mixed.jsonl",
        [
            {"question_id": "x", "category": "writing", "turns": ["first", "second"]},
            {"task_id": "T/1", "prompt": "def f():\n", "test": "..."},
            {"question": "2+2?", "answer": "#### 4"},
            {"question": "你好", "std_answer": "", "class": "open qa"},
        ],
    )
    prompts = load_prompts(path)
    assert [(p.question_id, p.category, p.text) for p in prompts] == [
        ("x", "writing", "first"),
        ("T/1", "", "def f():\n"),
        (3, "", "2+2?"),
        (4, "open qa", "你好"),
    ]
    assert {p.suite for p in prompts} == {"my_set"}
    assert [p.group for p in prompts] == ["my_set/writing", "my_set", "my_set", "my_set/open qa"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "bad JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"title": "x", "body": "y"}', "unknown record with keys ['body', 'title']"),
        ('{"question": "q"}', "unknown record"),
        ('{"turns": []}', "'turns' must be a non-empty list"),
        ('{"turns": [" "]}', "the first turn must be a non-empty string"),
        ('{"task_id": 1, "prompt": 5}', "'prompt' must be a non-empty string"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text(f'{{"question": "ok", "answer": "a"}}\n\n{line}\n', encoding="utf-8")
    with pytest.raises(SpecMTPError, match=r"q\.jsonl line 3: ") as error:
        load_prompts(path)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_line_separators_inside_strings_stay_in_the_prompt(tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    records = [{"question": "a\u2028b", "answer": "x"}, {"question": "c\u2029d", "answer": "y"}]
    lines = [json.dumps(r, ensure_ascii=False) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert [(p.question_id, p.text) for p in load_prompts(path)] == [
        (1, "a\u2028b"),
        (2, "c\u2029d"),
    ]


def test_empty_and_unreadable_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(SpecMTPError, match=r"prompts file .*empty\.jsonl holds no prompts"):
        load_prompts(empty)
    with pytest.raises(SpecMTPError, match=r"cannot read .*missing\.jsonl: No such file"):
        load_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(SpecMTPError, match=r"cannot read .*: Is a directory"):
        load_prompts(tmp_path)


def test_random_prompts_are_seeded_in_range_and_avoid_exclude() -> None:
    exclude = {0, 1, 2, 7}
    first = random_prompts(vocab_size=10, count=4, length=50, seed=3, exclude=exclude)
    again = random_prompts(vocab_size=10, count=4, length=50, seed=3, exclude=exclude)
    other = random_prompts(vocab_size=10, count=4, length=50, seed=4, exclude=exclude)
    assert first == again
    assert [p.ids for p in first] != [p.ids for p in other]
    assert len(first) == 4 and all(p.ids is not None and len(p.ids) == 50 for p in first)
    drawn = Counter(t for p in first for t in p.ids or ())
    assert set(drawn) == set(range(10)) - exclude  # 200 draws from 6 ids: every one shows up
    assert all(p.suite == "random" and p.category == "" and p.text is None for p in first)
    assert [p.question_id for p in first] == [1, 2, 3, 4]
    assert first[0].group == "random"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab_size": 10, "count": 0, "length": 5}, "count and length >= 1"),
        ({"vocab_size": 10, "count": 2, "length": 0}, "count and length >= 1"),
        ({"vocab_size": 3, "count": 2, "length": 5, "exclude": (0, 1, 2)}, "no token ids left"),
    ],
)
def test_random_prompts_validate(kwargs: dict, message: str) -> None:
    with pytest.raises(SpecMTPError, match=message):
        random_prompts(seed=0, **kwargs)


def test_prompt_holds_exactly_one_of_text_and_ids() -> None:
    with pytest.raises(SpecMTPError, match="exactly one of text and ids"):
        BenchPrompt(1, "s", "", None)
    with pytest.raises(SpecMTPError, match="exactly one of text and ids"):
        BenchPrompt(1, "s", "", "text", ids=(1, 2))


def make_prompts(texts: list[str | None]) -> list[BenchPrompt]:
    return [
        BenchPrompt(i, "s", "", t) if t is not None else BenchPrompt(i, "s", "", None, ids=(1,))
        for i, t in enumerate(texts)
    ]


@pytest.mark.parametrize("tokens", [30, 200, 1000, 5000])
def test_context_text_reaches_the_length_and_asks_last(tokens: int) -> None:
    doc_words = [" ".join(f"w{i}x{j}" for j in range(n)) for i, n in enumerate([40, 7, 90, 3])]
    prompts = make_prompts(["what is the question here?", *doc_words, None])
    text = context_text(prompts[0], prompts, tokens=tokens, count_tokens=words)
    assert tokens <= words(text) <= tokens * 1.05
    assert text.startswith(CONTEXT_HEADER)
    assert text.endswith("\n\nQuestion: what is the question here?")
    assert text.count("what is the question here?") == 1  # the prompt is no document
    assert "Document 1:\nw0x0 " in text  # documents follow `others` order, prompt skipped


def test_context_text_cuts_the_last_document() -> None:
    prompts = make_prompts(["q?", " ".join(["a"] * 1000), " ".join(["b"] * 1000)])
    text = context_text(prompts[0], prompts, tokens=300, count_tokens=words)
    assert 300 <= words(text) <= 315
    assert "Document 2" not in text and "b" not in text.split()
    text = context_text(prompts[0], prompts, tokens=1500, count_tokens=words)
    assert 1500 <= words(text) <= 1575 and "Document 2:\nb b" in text


def test_context_text_counts_characters_too() -> None:
    prompts = make_prompts(["问题是什么", "中文文档的内容" * 30, "另一份文档" * 10])
    text = context_text(prompts[0], prompts, tokens=1000, count_tokens=len)
    assert 1000 <= len(text) <= 1050 and text.endswith("Question: 问题是什么")
    assert "Document 3:" in text  # cycled through the two documents


def test_context_text_needs_other_texts() -> None:
    prompts = make_prompts(["q?", None, "q?"])
    with pytest.raises(SpecMTPError, match="no other prompt holds text"):
        context_text(prompts[0], prompts, tokens=100, count_tokens=words)
    with pytest.raises(SpecMTPError, match="no text"):
        context_text(prompts[1], prompts, tokens=100, count_tokens=words)


def test_load_prompt_spec(tmp_path: Path) -> None:
    spec = load_prompt_spec("random:4x16", vocab_size=50)
    assert spec == random_prompts(vocab_size=50, count=4, length=16, seed=0)
    seeded = load_prompt_spec("random:4x16:7", vocab_size=50, exclude=[0], limit=3)
    assert seeded == random_prompts(vocab_size=50, count=4, length=16, seed=7, exclude=[0])[:3]
    path = write_lines(tmp_path / "q.jsonl", [{"question": "a", "answer": "b"}] * 3)
    assert len(load_prompt_spec(str(path), vocab_size=None, limit=2)) == 2


@pytest.mark.parametrize(
    ("spec", "vocab_size", "message"),
    [
        ("random:x", 50, "bad prompts spec 'random:x'"),
        ("random:4x", 50, "bad prompts spec"),
        ("random:4x16:", 50, "bad prompts spec"),
        ("random:-1x16", 50, "bad prompts spec"),
        ("random:0x5", 50, "count and length >= 1"),
        ("random:4x16", None, "needs the target's vocabulary size"),
    ],
)
def test_load_prompt_spec_rejects(spec: str, vocab_size: int | None, message: str) -> None:
    with pytest.raises(SpecMTPError, match=message) as error:
        load_prompt_spec(spec, vocab_size=vocab_size)
    assert "\n" not in str(error.value)
