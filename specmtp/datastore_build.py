"""`specmtp datastore`: build a retrieval datastore for a target from its own greedy answers
to training prompts, from the answers already in train-mtp / distill data caches, and from
plain text."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specmtp.answers import generate_answers
from specmtp.data import DistillCache
from specmtp.data_build import check_cache_vocabulary
from specmtp.datastore import Datastore
from specmtp.errors import SpecMTPError
from specmtp.models import DTYPES, LoadedModel, load_model
from specmtp.text_data import load_texts
from specmtp.train_prompts import load_train_prompts, refuse_evaluation_sets
from specmtp.vocab import vocab_digest

# Prompt tokens kept before each answer: the chat template's "assistant" turn opening, so
# the store knows how answers start.
LEAD_TOKENS = 3


@dataclass(frozen=True)
class DatastoreConfig:
    out: Path
    target: str = "default"
    data: tuple[Path, ...] = ()  # training prompts: the target answers them here
    caches: tuple[Path, ...] = ()  # train-mtp / distill data caches of the target's answers
    texts: tuple[Path, ...] = ()  # .txt files or folders, one document per file
    max_new_tokens: int = 128
    limit_per_source: int | None = None
    max_ngram: int = 4
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not (self.data or self.caches or self.texts):
            raise SpecMTPError("datastore needs --data, --cache or --text")
        refuse_evaluation_sets(self.data, "build the store")
        if not 1 <= self.max_ngram <= 8:
            raise SpecMTPError(f"max-ngram must be in 1..8, got {self.max_ngram}")
        if self.max_new_tokens < 1:
            raise SpecMTPError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.dtype not in DTYPES:
            raise SpecMTPError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")


@dataclass(frozen=True)
class DatastoreReport:
    documents: int
    tokens: int
    out: str


def build_datastore(config: DatastoreConfig) -> DatastoreReport:
    """Collect the documents, index them and write the store to `config.out`."""
    target = load_model(config.target, dtype=DTYPES[config.dtype])
    documents: list[list[int]] = []
    for directory in config.caches:
        cache = DistillCache.open(directory)  # any model's answers, in the target's ids
        check_cache_vocabulary(cache, target)
        documents += cached_answers(cache)
    if config.data:
        prompts = load_train_prompts(config.data, limit_per_source=config.limit_per_source)
        answers = generate_answers(target, prompts, max_new_tokens=config.max_new_tokens)
        documents += [list(s.prompt_ids[-LEAD_TOKENS:]) + list(s.answer_ids) for s in answers]
    if config.texts:
        documents += [text_ids(target, text) for text in load_texts(config.texts)]
    store = Datastore(
        documents, vocab_digest=vocab_digest(target.tokenizer), max_ngram=config.max_ngram
    )
    config.out.parent.mkdir(parents=True, exist_ok=True)
    store.save(config.out)
    return DatastoreReport(store.documents, store.num_tokens, str(config.out))


def cached_answers(cache: DistillCache) -> list[list[int]]:
    """Each cached sample's answer with the LEAD_TOKENS prompt tokens before it (a text
    sample, all answer, whole)."""
    documents = []
    for index in range(cache.num_samples):
        sample = cache.sample(index)
        answer = sample["loss_mask"].nonzero().flatten()
        if not len(answer):
            continue
        start = max(0, int(answer[0]) - LEAD_TOKENS)
        documents.append(sample["input_ids"][start:].long().tolist())
    return documents


def text_ids(target: LoadedModel, text: str) -> list[int]:
    """A plain text's token ids, with no special tokens (any length: it is not run)."""
    return target.tokenizer(text, add_special_tokens=False).input_ids
