"""What a `train-mtp` run starts from: its data cache (built, given, or another model's
answers rescored) and its heads (new, sized from the data, or continued from a directory)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, replace
from typing import TYPE_CHECKING

from specmtp.data import DistillCache, is_heldout
from specmtp.data_build import DistillConfig, build_cache, rescore_cache
from specmtp.errors import SpecMTPError
from specmtp.heads import Heads, describe_target, widen_heads
from specmtp.heads_config import HeadsConfig
from specmtp.heads_io import load_heads
from specmtp.models import LoadedModel
from specmtp.train_prompts import load_train_prompts

if TYPE_CHECKING:
    from specmtp.train import TrainConfig

KL_TOPK = 20  # target log-probabilities cached per position when --objective kl builds data


def data_cache(config: TrainConfig, target: LoadedModel) -> DistillCache:
    """The given cache (checked: built by this target, with hidden states), another model's
    answers rescored by this target, or one built from the prompt sources, in out/data."""
    if config.answers_from is not None:
        source = DistillCache.open(config.answers_from)
        if config.objective == "kl" and not source.topk:
            raise SpecMTPError(
                f"cache {config.answers_from} holds no top-k log-probabilities; "
                "--objective kl needs them"
            )
        return rescore_cache(
            source, target, config.out / "data", feature_layers=config.feature_layers
        )
    if config.cache is not None:
        cache = DistillCache.open(config.cache, model=target)
        if not cache.has_hidden:
            raise SpecMTPError(f"cache {config.cache} holds no hidden states; heads need them")
        if cache.feature_layers != config.feature_layers:
            raise SpecMTPError(
                f"cache {config.cache} holds hidden states {_layers(cache.feature_layers)}, "
                f"this run reads {_layers(config.feature_layers)}"
            )
        if config.objective == "kl" and not cache.topk:
            raise SpecMTPError(
                f"cache {config.cache} holds no top-k log-probabilities; --objective kl needs them"
            )
        return cache
    prompts = load_train_prompts(
        config.sources, limit_per_source=config.limit_per_source, seed=config.seed
    )
    data_config = DistillConfig(
        **{**asdict(config.data), "max_new_tokens": config.max_new_tokens, "text": config.text,
           "feature_layers": config.feature_layers}
    )  # fmt: skip
    if config.objective == "kl" and not data_config.topk:
        data_config = replace(data_config, topk=KL_TOPK)
    return build_cache(
        target, prompts, config.out / "data", config=data_config,
        sources=[str(s) for s in config.sources],
    )  # fmt: skip


def make_heads_config(config: TrainConfig, target: LoadedModel, cache: DistillCache) -> HeadsConfig:
    text_config = target.model.config.get_text_config()
    return HeadsConfig(
        kind=config.kind,
        num_heads=config.num_heads,
        hidden_size=text_config.hidden_size,
        vocab_size=target.model.get_output_embeddings().weight.shape[0],
        base_model=describe_target(target.model),
        num_layers=config.num_layers,
        draft_vocab=frequent_tokens(cache, config) if config.draft_vocab else None,
        feature_layers=config.feature_layers,
    )


def initial_heads(config: TrainConfig, target: LoadedModel) -> tuple[Heads, HeadsConfig]:
    """The heads at `init_from` (continued training), checked against the run's settings:
    their architecture and draft vocabulary are kept, so the flags must describe them."""
    assert config.init_from is not None
    heads, found = load_heads(config.init_from, target_model=target.model)
    vocab = len(found.draft_vocab) if found.draft_vocab else 0
    for flag, ours, theirs, same in (
        ("--kind", config.kind, found.kind, config.kind == found.kind),
        ("--num-heads", config.num_heads, found.num_heads, config.num_heads == found.num_heads),
        ("--num-layers", config.num_layers, found.num_layers,
         config.num_layers == found.num_layers),
        # --draft-vocab N asks for at most N tokens (fewer when the data has fewer)
        ("--draft-vocab", config.draft_vocab, vocab,
         (vocab == 0) == (config.draft_vocab == 0) and vocab <= config.draft_vocab),
    ):  # fmt: skip
        if not same:
            raise SpecMTPError(
                f"heads in {config.init_from} have {flag} {theirs}, this run asks for {ours}"
            )
    if found.feature_layers == config.feature_layers:
        return heads, found
    if found.feature_layers is not None:
        raise SpecMTPError(
            f"heads in {config.init_from} read hidden states {_layers(found.feature_layers)}, "
            f"this run asks for {_layers(config.feature_layers)}"
        )
    assert config.feature_layers is not None
    wider = widen_heads(heads, config.feature_layers, target.model)
    return wider, wider.config


def _layers(layers: tuple[int, ...] | None) -> str:
    return "the final one alone" if layers is None else ",".join(map(str, layers))


def frequent_tokens(cache: DistillCache, config: TrainConfig) -> tuple[int, ...]:
    """The `draft_vocab` most frequent answer tokens of the training split, sorted by id; on
    text (--text), the target's most frequent top-1 tokens, the labels heads are scored on."""
    if config.text:
        counts: Counter[int] = Counter()
        for index in range(cache.num_samples):
            if not is_heldout(index, config.heldout_fraction):
                counts.update(cache.sample(index)["topk_indices"][:, 0].tolist())
    else:
        counts = answer_token_counts(cache, config.heldout_fraction)
    return tuple(sorted(token for token, _ in counts.most_common(config.draft_vocab)))


def answer_token_counts(cache: DistillCache, heldout_fraction: float) -> Counter[int]:
    """How often each token occurs in the answers of the training split."""
    counts: Counter[int] = Counter()
    for index in range(cache.num_samples):
        if not is_heldout(index, heldout_fraction):
            counts.update(cache.answer_tokens(index).tolist())
    return counts
