"""Plain-text training data: documents, token chunks, the chunk file, and batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

import specmtp.text_data as text_data
from specmtp.data import DistillBatch, is_heldout
from specmtp.errors import SpecMTPError
from specmtp.models import load_model
from specmtp.text_data import (
    TextChunks,
    iter_text_batches,
    load_chunks,
    load_texts,
    save_chunks,
    tokenize_chunks,
)

WORDS = [f"w{i}" for i in range(50)]
UNK, EOS = 0, 1
TOO_LONG_WARNING = "sequence-length-is-longer-than-the-specified-maximum"


def word_tokenizer(*, eos: bool = True, max_length: int = 8) -> PreTrainedTokenizerBase:
    """One token per whitespace-separated word: w<i> is id i + 2, </s> is 1, <unk> 0."""
    vocab = {"<unk>": UNK, "</s>": EOS} | {w: i + 2 for i, w in enumerate(WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        eos_token="</s>" if eos else None,
        model_max_length=max_length,
    )


def ids(text: str) -> list[int]:
    return [int(word[1:]) + 2 for word in text.split()]


def indexed_chunks(count: int, seq_len: int = 4) -> TextChunks:
    """Chunk i holds i * seq_len, ...: a batch row names the chunk it came from."""
    tokens = torch.arange(count * seq_len, dtype=torch.int64).view(count, seq_len)
    return TextChunks(tokens=tokens, seq_len=seq_len, sources=("inline",))


def batch_chunk_indices(batches: list[DistillBatch], seq_len: int = 4) -> list[int]:
    return [int(row[0]) // seq_len for batch in batches for row in batch.input_ids]


@pytest.fixture(scope="module")
def default_tokenizer() -> PreTrainedTokenizerBase:
    return load_model("default").tokenizer


# ---------------------------------------------------------------- texts


def test_load_texts_reads_folders_recursively_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "inner.txt").write_text("third", encoding="utf-8")
    (tmp_path / "a.txt").write_text("  first\n\n", encoding="utf-8")
    (tmp_path / "a2.txt").write_text("second ünïcode", encoding="utf-8")
    (tmp_path / "notes.md").write_text("not a text source", encoding="utf-8")
    single = tmp_path / "b" / "inner.txt"
    assert load_texts([tmp_path, single]) == ["first", "second ünïcode", "third", "third"]
    assert load_texts([str(single)]) == ["third"]


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"", "is empty"), (b" \n\n\t", "is empty"), (b"caf\xe9", "cannot read text file")],
)
def test_load_texts_refuses_empty_or_undecodable_files(
    tmp_path: Path, content: bytes, message: str
) -> None:
    (tmp_path / "bad.txt").write_bytes(content)
    with pytest.raises(SpecMTPError, match=message):
        load_texts([tmp_path])


def test_load_texts_refuses_missing_sources(tmp_path: Path) -> None:
    (tmp_path / "notes.md").write_text("x", encoding="utf-8")
    with pytest.raises(SpecMTPError, match="no text sources"):
        load_texts([])
    with pytest.raises(SpecMTPError, match=r"no \.txt files"):
        load_texts([tmp_path])
    with pytest.raises(SpecMTPError, match=r"use \.txt"):
        load_texts([tmp_path / "notes.md"])
    with pytest.raises(SpecMTPError, match="not found"):
        load_texts([tmp_path / "absent.txt"])


# ---------------------------------------------------------------- chunks


def test_chunks_cut_one_stream_with_eos_after_each_document() -> None:
    texts = ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9"]
    stream = [*ids(texts[0]), EOS, *ids(texts[1]), EOS, *ids(texts[2]), EOS]  # 12 tokens
    chunks = tokenize_chunks(texts, word_tokenizer(), seq_len=3, sources=["a", "b"])
    assert chunks.tokens.dtype == torch.int64
    assert chunks.tokens.shape == (4, 3) and chunks.num_chunks == 4
    assert chunks.tokens.flatten().tolist() == stream
    assert chunks.seq_len == 3 and chunks.sources == ("a", "b")
    # The partial chunk at the end is dropped: 12 tokens make two 5-token chunks.
    five = tokenize_chunks(texts, word_tokenizer(), seq_len=5)
    assert five.tokens.tolist() == [stream[:5], stream[5:10]]


def test_tokenizer_without_eos_joins_documents_directly() -> None:
    chunks = tokenize_chunks(["w1 w2", "w3 w4"], word_tokenizer(eos=False), seq_len=2)
    assert chunks.tokens.tolist() == [ids("w1 w2"), ids("w3 w4")]


def test_chunks_cover_the_stream_without_overlap_when_tokenised_in_pieces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    generator = torch.Generator().manual_seed(0)
    words = [WORDS[i] for i in torch.randint(len(WORDS), (600,), generator=generator).tolist()]
    paragraphs = [" ".join(words[i : i + 30]) for i in range(0, 600, 30)]
    texts = ["\n\n".join(paragraphs[:12]), "\n \n\n".join(paragraphs[12:])]
    stream = [*ids(texts[0]), EOS, *ids(texts[1]), EOS]
    tokenizer = word_tokenizer(max_length=8)
    pieces: list[int] = []
    cut = text_data._pieces
    monkeypatch.setattr(text_data, "_PIECE_CHARS", 200)  # ~3 paragraphs a piece
    monkeypatch.setattr(text_data, "_pieces", lambda *a: pieces.append(len(cut(*a))) or cut(*a))
    chunks = tokenize_chunks(texts, tokenizer, seq_len=7)
    assert pieces[0] > 2 and pieces[1] > 2
    assert chunks.num_chunks == len(stream) // 7
    assert chunks.tokens.flatten().tolist() == stream[: chunks.num_chunks * 7]
    # Every piece is longer than the tokenizer's 8-token limit; that is no model input.
    assert TOO_LONG_WARNING not in tokenizer.deprecation_warnings


def test_pieces_cut_before_paragraph_whitespace() -> None:
    text = "one two.\n\nthree  \n \n four\n\n\nfive"
    pieces = text_data._pieces(text, 3)
    assert "".join(pieces) == text
    assert pieces == ["one two.", "\n\nthree", "  \n \n four", "\n\n\nfive"]
    assert text_data._pieces(text, 1000) == [text]
    assert text_data._pieces("no breaks at all", 1) == ["no breaks at all"]


def test_pieces_tokenise_like_the_whole_text_with_the_default_tokenizer(
    default_tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = (
        'CHAPTER I\n\n\n"Well," said she,  \n\n  "it is 1811."\n\nEnd.\r\n\r\n'
        "Ünïcode — dashes -- and tabs\t\n\n\tindented.\n\n12345 67890"
    )
    whole = default_tokenizer(text, add_special_tokens=False).input_ids
    eos = default_tokenizer.eos_token_id
    assert eos is not None
    monkeypatch.setattr(text_data, "_PIECE_CHARS", 1)  # a piece per paragraph
    assert len(text_data._pieces(text, 1)) == 7
    chunks = tokenize_chunks([text], default_tokenizer, seq_len=len(whole) + 1)
    assert chunks.tokens.tolist() == [[*whole, eos]]


def test_tokenize_chunks_refuses_bad_arguments() -> None:
    tokenizer = word_tokenizer()
    for seq_len in (0, -3, 2.0, True):
        with pytest.raises(SpecMTPError, match="seq_len must be a positive integer"):
            tokenize_chunks(["w1"], tokenizer, seq_len=seq_len)  # type: ignore[arg-type]
    with pytest.raises(SpecMTPError, match="no texts"):
        tokenize_chunks([], tokenizer, seq_len=2)
    with pytest.raises(SpecMTPError, match="3 tokens of text do not fill one 4-token chunk"):
        tokenize_chunks(["w1 w2"], tokenizer, seq_len=4)


# ---------------------------------------------------------------- chunk file


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    chunks = tokenize_chunks(["w1 w2 w3 w4 w5", "w6"], word_tokenizer(), seq_len=2,
                             sources=["runs/corpora/austen", "ünï.txt"])  # fmt: skip
    path = tmp_path / "sub" / "chunks.safetensors"
    save_chunks(chunks, path)
    assert [p.name for p in path.parent.iterdir()] == ["chunks.safetensors"]  # no temp left
    loaded = load_chunks(path)
    assert loaded.tokens.dtype == torch.int64
    assert torch.equal(loaded.tokens, chunks.tokens)
    assert (loaded.seq_len, loaded.sources) == (2, chunks.sources)
    save_chunks(indexed_chunks(3), path)  # overwriting replaces the file whole
    assert torch.equal(load_chunks(path).tokens, indexed_chunks(3).tokens)


def test_load_refuses_corrupt_or_foreign_files(tmp_path: Path) -> None:
    path = tmp_path / "chunks.safetensors"
    save_chunks(indexed_chunks(5), path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # a token inside the tensor data
    flipped = tmp_path / "flipped.safetensors"
    flipped.write_bytes(bytes(data))
    with pytest.raises(SpecMTPError, match="checksum mismatch"):
        load_chunks(flipped)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:-10])
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file at all")
    for bad in (truncated, garbage, tmp_path / "absent.safetensors"):
        with pytest.raises(SpecMTPError, match="cannot read text chunks"):
            load_chunks(bad)
    foreign = tmp_path / "foreign.safetensors"
    save_file({"input_ids": torch.zeros(4, dtype=torch.int32)}, str(foreign))
    with pytest.raises(SpecMTPError, match="not a format-1 text chunk file"):
        load_chunks(foreign)


def test_load_refuses_tokens_that_disagree_with_the_metadata(tmp_path: Path) -> None:
    path = tmp_path / "chunks.safetensors"
    metadata = {"format": "1", "seq_len": "3", "sources": "[]", "sha256": "0"}
    save_file({"tokens": torch.zeros((2, 4), dtype=torch.int32)}, str(path), metadata)
    with pytest.raises(SpecMTPError, match=r"not int32 \[N, 3\]"):
        load_chunks(path)


# ---------------------------------------------------------------- batches


def test_batches_are_full_distill_batches_in_stream_order_without_seed() -> None:
    chunks = indexed_chunks(10)
    batches = list(iter_text_batches(chunks, batch_size=4, seed=None, heldout_fraction=0.0))
    assert [b.input_ids.shape for b in batches] == [(4, 4), (4, 4), (2, 4)]
    assert batch_chunk_indices(batches) == list(range(10))
    for batch in batches:
        assert isinstance(batch, DistillBatch)
        assert batch.input_ids.dtype == torch.int64
        assert batch.attention_mask.dtype == batch.loss_mask.dtype == torch.bool
        assert batch.attention_mask.all() and batch.loss_mask.all()
        assert batch.hidden is batch.topk_values is batch.topk_indices is None
    assert torch.equal(torch.cat([b.input_ids for b in batches]), chunks.tokens)


def test_splits_are_disjoint_and_follow_is_heldout() -> None:
    chunks = indexed_chunks(60)
    train = batch_chunk_indices(list(iter_text_batches(chunks, batch_size=7, heldout_fraction=0.3)))
    heldout = batch_chunk_indices(
        list(iter_text_batches(chunks, batch_size=7, split="heldout", heldout_fraction=0.3))
    )
    assert sorted(heldout) == [i for i in range(60) if is_heldout(i, 0.3)]
    assert not set(train) & set(heldout)
    assert sorted(train + heldout) == list(range(60))
    assert 5 < len(heldout) < 30  # the fraction is honoured roughly


def test_shuffle_is_determined_by_the_seed() -> None:
    chunks = indexed_chunks(40)

    def order(seed: int | None) -> list[int]:
        return batch_chunk_indices(list(iter_text_batches(chunks, batch_size=3, seed=seed)))

    assert order(1) == order(1)
    assert order(1) != order(2)
    assert sorted(order(1)) == order(None) == [i for i in range(40) if not is_heldout(i, 0.05)]


def test_iter_text_batches_refuses_bad_arguments() -> None:
    chunks = indexed_chunks(3)
    for kwargs in (
        {"batch_size": 0},
        {"batch_size": 2, "heldout_fraction": 1.0},
        {"batch_size": 2, "heldout_fraction": -0.1},
    ):
        with pytest.raises(SpecMTPError, match="batch_size must be positive"):
            next(iter_text_batches(chunks, **kwargs))  # type: ignore[arg-type]
    with pytest.raises(SpecMTPError, match="split must be"):
        next(iter_text_batches(chunks, batch_size=2, split="test"))
    with pytest.raises(SpecMTPError, match="heldout split of 3 text chunks is empty"):
        next(iter_text_batches(chunks, batch_size=2, split="heldout", heldout_fraction=0.0))
