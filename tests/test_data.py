"""Self-distillation data: prompt loading, batched greedy answers, and the shard cache."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file

import specmtp.data_build as data_build
from specmtp.answers import Sample, encode_prompt, generate_answers
from specmtp.data import MANIFEST, DistillCache, is_heldout, iter_batches
from specmtp.data_build import DistillConfig, build_cache, rescore_cache
from specmtp.errors import SpecMTPError
from specmtp.models import LoadedModel, load_model
from specmtp.train_prompts import load_train_prompts, source_prompts

TRAIN_PROMPTS = Path("/work/shared/train_prompts")
SOURCES = [
    "awesome_chatgpt_prompts_en",
    "chatgpt_prompts_zh",
    "gsm8k_train",
    "mbpp",
    "ruozhiba_zh",
    "self_instruct_en",
    "tal_scq5k",
]
PROMPTS = [
    "Hi",
    "What is 2 + 2?",
    "Write a short story about a dragon who learns to bake bread in a small village.",
    "Translate 'good morning' into French.",
    "Name three colours.",
]
CONFIG = DistillConfig(max_new_tokens=6, batch_size=4, shard_size=2, topk=4)


@pytest.fixture(scope="module")
def default() -> LoadedModel:
    return load_model("default")


def tiny_loaded(default: LoadedModel, *, seed: int = 0) -> LoadedModel:
    """A tiny random Llama on the default tokenizer's vocabulary, with its chat template."""
    model = tiny_model("llama", seed=seed, vocab_size=len(default.tokenizer), context=512)
    return LoadedModel(model, default.tokenizer, spec=f"tiny-llama-{seed}", context_length=512)


@pytest.fixture(scope="module")
def tiny(default: LoadedModel) -> LoadedModel:
    return tiny_loaded(default)


@pytest.fixture(scope="module")
def built(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("cache")
    build_cache(tiny, PROMPTS, directory, config=CONFIG, sources=["inline"])
    return directory


# ---------------------------------------------------------------- prompts


@pytest.mark.parametrize("source", SOURCES)
def test_each_train_prompt_source_loads(source: str) -> None:
    prompts = load_train_prompts([TRAIN_PROMPTS / source], seed=3)
    assert len(prompts) > 50
    assert all(isinstance(p, str) and p.strip() == p and p for p in prompts)
    assert len(set(prompts)) == len(prompts)
    assert prompts == load_train_prompts([TRAIN_PROMPTS / source], seed=3)
    assert prompts != load_train_prompts([TRAIN_PROMPTS / source], seed=4)


def test_limit_per_source_and_mixing() -> None:
    sources = [TRAIN_PROMPTS / "gsm8k_train", TRAIN_PROMPTS / "mbpp"]
    prompts = load_train_prompts(sources, limit_per_source=5, seed=0)
    assert len(prompts) == 10
    # A source's subset does not depend on which other sources are loaded with it.
    alone = load_train_prompts(sources[1:], limit_per_source=5, seed=0)
    assert set(alone) < set(prompts)
    assert any("Your code should pass this test:\nassert" in p for p in alone)


def test_source_prompts_is_the_order_limit_per_source_takes() -> None:
    source = TRAIN_PROMPTS / "mbpp"
    ordered = source_prompts(source, seed=0)
    taken = load_train_prompts([source], limit_per_source=7, seed=0)
    assert set(taken) == set(ordered[:7])
    assert taken != ordered[:7]  # the union is shuffled again; the per-source order is not
    assert not set(ordered[7:14]) & set(taken)  # a later slice skips what a run took


def test_txt_document_becomes_paragraph_chunks(tmp_path: Path) -> None:
    paragraphs = [f"Paragraph {i}. " + "word " * 100 for i in range(12)]
    path = tmp_path / "doc.txt"
    path.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    chunks = load_train_prompts([path], seed=0)
    assert 1 < len(chunks) < len(paragraphs)
    assert "".join(chunks).count("Paragraph") == 12


def test_jsonl_strings_may_hold_line_separators(tmp_path: Path) -> None:
    # JSON lets U+2028 and U+2029 stand unescaped in a string; str.splitlines splits there.
    # awesome-chatgpt-prompts has one, and a prompt mix that took it could not be read.
    prompts = ["first\u2028part", "second\u2029part\x85end", "third"]
    path = tmp_path / "mix.jsonl"
    lines = [json.dumps({"prompt": p}, ensure_ascii=False) for p in prompts]
    path.write_text("\r\n".join(lines) + "\n\n", encoding="utf-8")
    assert "\u2028" in path.read_text(encoding="utf-8")
    assert sorted(load_train_prompts([path], seed=0)) == sorted(prompts)


def test_a_bad_jsonl_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n\n{"prompt": "cut\n', encoding="utf-8")
    with pytest.raises(SpecMTPError, match=r"bad\.jsonl: line 3: "):
        load_train_prompts([path], seed=0)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.jsonl", None, "not found"),
        ("empty.txt", "", "no prompts found"),
        ("bad.jsonl", '{"question": "ok"}\n{broken\n', "cannot read prompt file"),
        ("fields.json", '[{"answer": "42"}]', "no prompt field"),
        ("scalar.json", '"just a string"', "expected a list of JSON objects"),
        ("prompts.xml", "<a/>", "unsupported prompt file"),
        ("latin1.txt", b"caf\xe9", "cannot read prompt file"),
    ],
)
def test_bad_prompt_sources(
    tmp_path: Path, name: str, content: str | bytes | None, message: str
) -> None:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(SpecMTPError, match=message):
        load_train_prompts([path], seed=0)


def test_empty_folder_and_no_sources(tmp_path: Path) -> None:
    with pytest.raises(SpecMTPError, match=r"no \.jsonl"):
        load_train_prompts([tmp_path], seed=0)
    with pytest.raises(SpecMTPError, match="no prompt sources"):
        load_train_prompts([], seed=0)


# ---------------------------------------------------------------- answers


def test_batched_answers_equal_one_at_a_time(tiny: LoadedModel) -> None:
    one = generate_answers(tiny, PROMPTS, max_new_tokens=12, batch_size=1)
    assert generate_answers(tiny, PROMPTS, max_new_tokens=12, batch_size=4) == one
    assert [s.prompt_ids for s in one] == [
        tuple(encode_prompt(tiny, p, chat=True)) for p in PROMPTS
    ]
    # Make a token from the middle of one answer the eos: batching must still agree, and
    # every answer stops right after its first eos while other rows go on.
    stop = one[2].answer_ids[5]
    tiny.model.generation_config.eos_token_id = stop
    try:
        cut = generate_answers(tiny, PROMPTS, max_new_tokens=12, batch_size=1)
        assert generate_answers(tiny, PROMPTS, max_new_tokens=12, batch_size=4) == cut
    finally:
        tiny.model.generation_config.eos_token_id = None
    assert cut[2].answer_ids == one[2].answer_ids[: one[2].answer_ids.index(stop) + 1]
    assert any(len(s.answer_ids) == 12 and stop not in s.answer_ids for s in cut)


def test_default_model_hidden_states_feed_the_lm_head(default: LoadedModel) -> None:
    ids = torch.tensor([encode_prompt(default, "Name a prime number.", chat=True)])
    with torch.no_grad():
        out = default.model(ids, output_hidden_states=True)
        hidden = out.hidden_states[-1]  # after the final norm in transformers 5.24
        torch.testing.assert_close(hidden, default.model.model(ids).last_hidden_state)
        torch.testing.assert_close(default.model.lm_head(hidden), out.logits)


def test_default_model_cache_matches_fresh_forward(default: LoadedModel, tmp_path: Path) -> None:
    prompts = PROMPTS[:2]
    config = DistillConfig(max_new_tokens=8, batch_size=2, topk=0)
    cache = build_cache(default, prompts, tmp_path, config=config)
    expected = generate_answers(default, prompts, max_new_tokens=8, batch_size=1)
    for index, sample in enumerate(expected):
        found = cache.sample(index)
        ids = sample.prompt_ids + sample.answer_ids
        assert found["input_ids"].tolist() == list(ids)
        with torch.no_grad():
            fresh = default.model(torch.tensor([ids]), output_hidden_states=True)
        torch.testing.assert_close(
            found["hidden"].float(), fresh.hidden_states[-1][0], atol=0.05, rtol=1e-2
        )


# ---------------------------------------------------------------- cache


def test_cache_round_trip(tiny: LoadedModel, built: Path) -> None:
    cache = DistillCache.open(built, model=tiny)
    manifest = json.loads((built / MANIFEST).read_text())
    assert cache.num_samples == manifest["num_samples"] == len(PROMPTS)
    assert len(manifest["shards"]) == 3 and manifest["sources"] == ["inline"]
    expected = generate_answers(tiny, PROMPTS, max_new_tokens=6, batch_size=1)
    for index, sample in enumerate(expected):
        found = cache.sample(index)
        ids = list(sample.prompt_ids + sample.answer_ids)
        assert found["input_ids"].tolist() == ids
        assert found["loss_mask"].tolist() == [i >= len(sample.prompt_ids) for i in range(len(ids))]
        with torch.no_grad():
            fresh = tiny.model(torch.tensor([ids]), output_hidden_states=True)
        torch.testing.assert_close(
            found["hidden"].float(), fresh.hidden_states[-1][0], atol=2e-3, rtol=1e-2
        )
        values, indices = torch.log_softmax(fresh.logits[0], dim=-1).topk(4, dim=-1)
        assert torch.equal(found["topk_indices"][:, 0].long(), indices[:, 0])
        torch.testing.assert_close(found["topk_values"].float(), values, atol=2e-2, rtol=1e-2)


def test_iter_batches_shapes_and_heldout_split(built: Path) -> None:
    cache = DistillCache.open(built)
    train = list(iter_batches(cache, batch_size=2, seq_len=40, seed=1, heldout_fraction=0.4))
    heldout = list(iter_batches(cache, batch_size=2, seq_len=40, seed=None, split="heldout",
                                heldout_fraction=0.4))  # fmt: skip
    rows = {split: [tuple(r.tolist()) for b in batches for r in b.input_ids]
            for split, batches in (("train", train), ("heldout", heldout))}  # fmt: skip
    assert len(rows["train"]) + len(rows["heldout"]) == len(PROMPTS)
    assert rows["heldout"] and not set(rows["train"]) & set(rows["heldout"])
    batch = train[0]
    assert batch.input_ids.shape == batch.loss_mask.shape == batch.attention_mask.shape
    assert batch.hidden is not None and batch.hidden.shape == (*batch.input_ids.shape, 32)
    assert batch.topk_indices is not None and batch.topk_indices.shape[-1] == 4
    assert not (batch.loss_mask & ~batch.attention_mask).any()
    again = next(iter_batches(built, batch_size=2, seq_len=40, seed=1, heldout_fraction=0.4))
    assert torch.equal(again.input_ids, batch.input_ids)
    short = next(iter_batches(cache, batch_size=5, seq_len=3, seed=None, heldout_fraction=0))
    assert short.attention_mask.all() and short.loss_mask[:, -1].all()  # answers kept
    assert sum(is_heldout(i, 0.25) for i in range(4000)) in range(900, 1100)


def test_whole_batches_skip_the_samples_a_window_would_cut(built: Path) -> None:
    cache = DistillCache.open(built)
    lengths = [cache.sample(i)["input_ids"].shape[0] for i in range(cache.num_samples)]
    assert [cache.sample_length(i) for i in range(cache.num_samples)] == lengths
    limit = sorted(lengths)[len(lengths) // 2]  # about half the samples fit
    whole = [
        row[mask].tolist()
        for batch in iter_batches(
            cache, batch_size=3, seq_len=limit, seed=None, heldout_fraction=0, whole=True
        )
        for row, mask in zip(batch.input_ids, batch.attention_mask, strict=True)
    ]
    fitting = [i for i, n in enumerate(lengths) if n <= limit]
    assert 0 < len(fitting) < len(lengths)
    assert whole == [cache.sample(i)["input_ids"].tolist() for i in fitting]  # uncut
    with pytest.raises(SpecMTPError, match=f"no sample within {min(lengths) - 1} tokens"):
        next(iter_batches(cache, batch_size=2, seq_len=min(lengths) - 1, whole=True))


def assert_same_cache(directory: Path, reference: Path) -> None:
    """Same manifest and tokens as `reference`. A rebuilt shard's float16 hidden states may
    differ in the last bit (CPU kernels are not bitwise reproducible from run to run), so
    shard digests are left out and hidden states compared with a tolerance."""
    rebuilt = json.loads((directory / MANIFEST).read_text())
    original = json.loads((reference / MANIFEST).read_text())
    for entry in (*rebuilt["shards"], *original["shards"]):
        entry.pop("sha256")
    assert rebuilt == original
    for entry in original["shards"]:
        fresh, kept = load_file(directory / entry["file"]), load_file(reference / entry["file"])
        assert torch.equal(fresh["input_ids"], kept["input_ids"])
        torch.testing.assert_close(
            fresh["hidden"].float(), kept["hidden"].float(), atol=2e-2, rtol=1e-2
        )


def test_resume_rebuilds_only_missing_shards(
    tiny: LoadedModel, built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "copy"
    directory.mkdir()
    for path in built.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    calls: list[int] = []
    real = data_build.generate_answers

    def counting(*args: object, **kwargs: object) -> list[Sample]:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(data_build, "generate_answers", counting)
    (directory / "shard-00002.safetensors").unlink()
    build_cache(tiny, PROMPTS, directory, config=CONFIG, sources=["inline"])
    assert len(calls) == 1
    assert_same_cache(directory, built)
    (directory / MANIFEST).unlink()  # killed before the manifest was written
    build_cache(tiny, PROMPTS, directory, config=CONFIG, sources=["inline"])
    assert len(calls) == 1
    assert_same_cache(directory, built)
    # With no manifest, a shard whose data was damaged fails its own digest and is rebuilt.
    (directory / MANIFEST).unlink()
    shard = directory / "shard-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-10] ^= 0xFF
    shard.write_bytes(bytes(raw))
    build_cache(tiny, PROMPTS, directory, config=CONFIG, sources=["inline"])
    assert len(calls) == 2
    assert_same_cache(directory, built)


def test_mismatched_cache_is_refused(default: LoadedModel, tiny: LoadedModel, built: Path) -> None:
    other = tiny_loaded(default, seed=1)
    with pytest.raises(SpecMTPError, match="different model"):
        build_cache(other, PROMPTS, built, config=CONFIG)
    with pytest.raises(SpecMTPError, match="different settings"):
        build_cache(tiny, PROMPTS, built, config=replace(CONFIG, max_new_tokens=7))
    with pytest.raises(SpecMTPError, match="different prompt list"):
        build_cache(tiny, PROMPTS[::-1], built, config=CONFIG)
    with pytest.raises(SpecMTPError, match="not by 'tiny-llama-1'"):
        DistillCache.open(built, model=other)


def test_foreign_shard_without_manifest_is_refused(
    tiny: LoadedModel, built: Path, tmp_path: Path
) -> None:
    (tmp_path / "shard-00000.safetensors").write_bytes(
        (built / "shard-00000.safetensors").read_bytes()
    )
    with pytest.raises(SpecMTPError, match=r"shard-00000\.safetensors belongs to a cache"):
        build_cache(tiny, PROMPTS, tmp_path, config=replace(CONFIG, topk=2))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_shard_is_named(built: Path, tmp_path: Path, damage: str) -> None:
    for path in built.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    shard = tmp_path / "shard-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    if damage == "flip":
        raw[-10] ^= 0xFF
    else:
        raw = raw[: len(raw) // 2]
    shard.write_bytes(bytes(raw))
    with pytest.raises(SpecMTPError, match=r"shard-00001\.safetensors"):
        DistillCache.open(tmp_path)
    with pytest.raises(SpecMTPError, match="missing"):
        DistillCache.open(tmp_path / "nowhere")


def test_config_is_validated() -> None:
    with pytest.raises(SpecMTPError, match="shard_size"):
        DistillConfig(shard_size=0)
    with pytest.raises(SpecMTPError, match="topk"):
        DistillConfig(topk=-1)


# ---------------------------------------------------------------- another model's answers


def test_a_rescored_cache_keeps_the_answers_and_takes_the_other_models_hidden_states(
    default: LoadedModel, tiny: LoadedModel, built: Path, tmp_path: Path
) -> None:
    draft_model = tiny_model("qwen2", seed=3, vocab_size=len(default.tokenizer), context=512)
    draft = LoadedModel(draft_model, default.tokenizer, spec="tiny-qwen2", context_length=512)
    source = DistillCache.open(built, model=tiny)
    rescored = rescore_cache(source, draft, tmp_path / "r")
    assert rescored.num_samples == source.num_samples
    for index in range(source.num_samples):
        theirs, ours = source.sample(index), rescored.sample(index)
        for name in ("input_ids", "loss_mask", "topk_values", "topk_indices"):
            assert torch.equal(ours[name], theirs[name])  # the answering model's
        with torch.no_grad():
            fresh = draft_model(ours["input_ids"][None], output_hidden_states=True)
        torch.testing.assert_close(
            ours["hidden"].float(), fresh.hidden_states[-1][0], atol=2e-3, rtol=1e-2
        )
        assert not torch.allclose(ours["hidden"], theirs["hidden"], atol=1e-2)
    manifest = json.loads((tmp_path / "r" / MANIFEST).read_text())
    assert manifest["answers_from"]["key"] == source.manifest["key"]
    DistillCache.open(tmp_path / "r", model=draft)
    with pytest.raises(SpecMTPError, match="was built by model 'tiny-qwen2'"):
        DistillCache.open(tmp_path / "r", model=tiny)
    # Rerun: every shard kept. Another answering cache in the same directory: refused.
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "r").iterdir()}
    rescore_cache(source, draft, tmp_path / "r")
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "r").iterdir()}
    assert {n: t for n, t in after.items() if n != MANIFEST} == {
        n: t for n, t in before.items() if n != MANIFEST
    }
    other = build_cache(tiny_loaded(default, seed=2), PROMPTS, tmp_path / "o", config=CONFIG)
    with pytest.raises(SpecMTPError, match="different answering cache"):
        rescore_cache(other, draft, tmp_path / "r")
    # A plain build into a rescored directory is refused with the same one line.
    with pytest.raises(SpecMTPError, match="different answering cache"):
        build_cache(draft, PROMPTS, tmp_path / "r", config=CONFIG)


def test_rescoring_needs_the_same_token_ids(
    default: LoadedModel, tiny: LoadedModel, built: Path, tmp_path: Path
) -> None:
    source = DistillCache.open(built)
    tokenizer = load_model("default").tokenizer
    tokenizer.add_tokens(["<specmtp-extra>"])
    extended = LoadedModel(tiny.model, tokenizer, spec="extended", context_length=512)
    with pytest.raises(SpecMTPError, match=r"vocabulary mismatch: cache .* 'extended'"):
        rescore_cache(source, extended, tmp_path / "r")
    old = tmp_path / "old"  # a cache from before manifests recorded the vocabulary
    old.mkdir()
    for path in built.iterdir():
        (old / path.name).write_bytes(path.read_bytes())
    manifest = json.loads((old / MANIFEST).read_text())
    del manifest["vocab_sha256"]
    (old / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(SpecMTPError, match="records no tokenizer vocabulary"):
        rescore_cache(DistillCache.open(old), tiny, tmp_path / "r2")
