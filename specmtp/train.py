"""`specmtp train-mtp`: train MTP heads on a frozen target by self-distillation.

The target answers training prompts (greedily, cached with its final hidden states by
`specmtp.data_build`); heads learn to predict the answer tokens 2, 3, ... positions ahead
from those hidden states, with loss Σ_i λ_i CE_i. The trunk never changes, so the target's
own outputs stay exactly the same. The training loop is `specmtp.trainer`'s, shared with
`distill`: accelerate, data-parallel processes, atomic checkpoints that a rerun resumes.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from specmtp.data import DistillBatch, DistillCache, is_heldout, iter_batches, model_fingerprint
from specmtp.data_build import DistillConfig, build_cache, rescore_cache
from specmtp.errors import SpecMTPError
from specmtp.heads import Heads, build_heads, describe_target, widen_heads
from specmtp.heads_config import HeadsConfig, check_feature_layers
from specmtp.heads_io import HEADS_WEIGHTS, load_heads, save_heads
from specmtp.models import DTYPES, LoadedModel, load_model
from specmtp.mtp_loss import RANKS, decaying_weights, mtp_losses
from specmtp.parallel import DataParallel, make_accelerator
from specmtp.train_prompts import load_train_prompts
from specmtp.trainer import Logged, Objective, run_training
from specmtp.tree import TREE_FILE, best_tree

HEAD_OBJECTIVES = ("tokens", "kl")
KL_TOPK = 20  # target log-probabilities cached per position when --objective kl builds data
# Nodes of the token tree written beside the heads: on a CPU, verifying 16 tokens costs
# about 1.8x a one-token step for the default model, so wider trees stop paying.
TREE_BUDGET = 16


@dataclass(frozen=True)
class TrainConfig:
    """One training run; `out` holds data cache, checkpoints, metrics and the final heads."""

    sources: tuple[Path, ...]
    out: Path
    target: str = "default"
    kind: str = "parallel"
    num_heads: int = 4
    num_layers: int = 1
    draft_vocab: int = 0  # 0: the full vocabulary; N: the N most frequent answer tokens
    decay: float = 0.8  # λ_i = decay^i
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 384
    lr: float = 1e-3
    checkpoint_every: int = 100
    eval_every: int = 250
    heldout_fraction: float = 0.05
    limit_per_source: int | None = None
    max_new_tokens: int = 128
    seed: int = 0
    data: DistillConfig = field(default_factory=DistillConfig)
    dtype: str = "float32"  # the target's dtype while it builds (and must match) the data
    cache: Path | None = None  # an existing data cache with hidden states (else out/data)
    # another model's cache (its answers): out/data gets them with this target's hidden
    # states, so heads on a draft model learn the answers of the model it drafts for
    answers_from: Path | None = None
    mixed_precision: str = "no"  # "bf16": autocast matmuls; heads stay float32
    # "tokens": cross-entropy on the target's answer tokens; "kl": KL to the target's own
    # distribution of each future token (its cached top-k, so the data needs topk > 0)
    objective: str = "tokens"
    # the sources are training text, scored by the target, not prompts to answer (needs kl:
    # the text's own tokens are not the target's)
    text: bool = False
    init_from: Path | None = None  # trained heads to continue from (their architecture)
    # Sequential heads reading these hidden states of the target (EAGLE-3's feature fusion;
    # heads.target_features), e.g. (3, 15, 30); None: the final state alone. With
    # init_from heads on the final state alone, they are widened (heads.widen_heads).
    feature_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.sources:
            raise SpecMTPError("give at least one prompt source (--data)")
        positive = ("num_heads", "num_layers", "steps", "batch_size", "seq_len")
        for name in (*positive, "checkpoint_every", "eval_every"):
            if getattr(self, name) < 1:
                raise SpecMTPError(f"{name.replace('_', '-')} must be >= 1")
        if self.draft_vocab < 0 or not 0 < self.decay <= 1 or self.lr <= 0:
            raise SpecMTPError("need draft-vocab >= 0, decay in (0, 1] and lr > 0")
        if self.objective not in HEAD_OBJECTIVES:
            raise SpecMTPError(
                f"objective must be one of {list(HEAD_OBJECTIVES)}, got {self.objective!r}"
            )
        if self.cache is not None and self.answers_from is not None:
            raise SpecMTPError("give --cache or --answers-from, not both")
        if self.text and self.objective != "kl":
            raise SpecMTPError(
                "--text needs --objective kl: the text's own tokens are not the target's"
            )
        if self.text and self.answers_from is not None:
            raise SpecMTPError("give --text or --answers-from, not both")
        if self.feature_layers is not None:
            check_feature_layers(self.feature_layers, self.kind)
        if self.dtype not in DTYPES or self.mixed_precision not in ("no", "bf16"):
            raise SpecMTPError(
                f"dtype must be one of {list(DTYPES)} and mixed-precision 'no' or 'bf16'"
            )


@dataclass(frozen=True)
class TrainReport:
    steps: int
    heldout_accuracy: list[float]  # per head, top-1 on held-out answers
    heldout_rank_probabilities: list[list[float]]  # [head][r]: label is the rank-r candidate
    tokens: int  # answer + prompt tokens in the data cache
    seconds: float


def train_mtp(config: TrainConfig) -> TrainReport | None:
    """Train the heads; their report, or None in a process other than the main one of a
    data-parallel run (`specmtp.parallel`)."""
    start_time = time.perf_counter()
    config.out.mkdir(parents=True, exist_ok=True)
    accelerator = make_accelerator()
    parallel = DataParallel(accelerator)
    target = load_model(config.target, dtype=DTYPES[config.dtype])
    with parallel.main_first():
        cache = _data_cache(config, target)
    torch.manual_seed(config.seed)  # the same start in every process
    if config.init_from is not None:
        heads, heads_config = initial_heads(config, target)
    else:
        heads_config = make_heads_config(config, target, cache)
        heads = build_heads(heads_config, target.model)
    heads = heads.float()  # float32 master weights
    heads.to(accelerator.device)
    identity = run_identity(config, target, cache, heads_config, processes=parallel.processes)
    objective = Objective(
        module=heads,
        losses=lambda batch: _step_losses(heads, batch, config),
        evaluate=lambda: {"acc": evaluate(heads, cache, config)},
        one_pass=lambda seed: iter_batches(
            cache, batch_size=config.batch_size, seq_len=config.seq_len, seed=seed,
            heldout_fraction=config.heldout_fraction,
        ),
        identity=identity,
        shown=("loss", "acc"),
    )  # fmt: skip
    step = run_training(
        objective, config, name="train-mtp", accelerator=accelerator, parallel=parallel
    )
    if not parallel.is_main:
        accelerator.wait_for_everyone()
        return None
    rank_probs = _write_heads(config, heads, heads_config, target, cache)
    report = TrainReport(
        step, [row[0] for row in rank_probs], rank_probs, int(cache.manifest["num_tokens"]),
        time.perf_counter() - start_time,
    )  # fmt: skip
    (config.out / "report.json").write_text(json.dumps(asdict(report), indent=1))
    accelerator.wait_for_everyone()
    return report


def _write_heads(
    config: TrainConfig,
    heads: Heads,
    heads_config: HeadsConfig,
    target: LoadedModel,
    cache: DistillCache,
) -> list[list[float]]:
    """Save the heads and their token tree; return the held-out rank statistics."""
    rank_probs = rank_probabilities(heads, cache, config)
    # float16, as distill saves drafts: half the size, and loading casts to the target's dtype.
    save_heads(heads, heads_config, config.out, dtype=torch.float16, trunk=target.model)
    best_tree(rank_probs, TREE_BUDGET).save(config.out / TREE_FILE)
    return rank_probs


def _step_losses(
    heads: Heads, batch: DistillBatch, config: TrainConfig
) -> tuple[torch.Tensor, Logged]:
    """One step's loss Σ λ_i CE_i (or KL), and its per-head CE and top-1 accuracy."""
    weights = decaying_weights(config.num_heads, config.decay)
    losses = mtp_losses(
        heads, batch.input_ids, batch.hidden.float(), batch.loss_mask, weights,
        target_topk=target_topk(batch, config), label_ids=label_ids(batch, config),
    )  # fmt: skip
    logged: Logged = {
        "loss": losses.loss.item(),
        "ce": list(losses.per_head_ce),
        "acc": list(losses.per_head_accuracy),
    }
    return losses.loss, logged


def _data_cache(config: TrainConfig, target: LoadedModel) -> DistillCache:
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


def run_identity(
    config: TrainConfig,
    target: LoadedModel,
    cache: DistillCache,
    heads: HeadsConfig,
    *,
    processes: int = 1,
) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: model, data, heads, optimisation, and
    the number of processes (each step's batches and their order depend on it)."""
    settings = {
        k: v
        for k, v in asdict(config).items()
        if k not in ("out", "sources", "data", "steps", "cache", "answers_from", "init_from")
    }
    if config.objective == "tokens":  # the only one before there was a choice: old runs resume
        del settings["objective"]
    if not config.text:  # as before text mode existed: old runs resume
        del settings["text"]
    if config.feature_layers is None:  # likewise before feature layers
        del settings["feature_layers"]
    identity = {
        "model": model_fingerprint(target),
        "data": cache.manifest["key"],
        "heads": json.loads(heads.to_json()),
        "settings": json.loads(json.dumps(settings, default=str)),
    }
    if config.init_from is not None:  # the starting weights, not where they were
        weights = (config.init_from / HEADS_WEIGHTS).read_bytes()
        identity["init_from"] = hashlib.sha256(weights).hexdigest()
    if processes > 1:  # one process: as before there was a choice, so old runs resume
        identity["processes"] = processes
    return identity


def target_topk(
    batch: DistillBatch, config: TrainConfig
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The target's top-k (values, ids) [B, T, k] for the KL objective, else None."""
    if config.objective != "kl":
        return None
    assert batch.topk_values is not None and batch.topk_indices is not None  # _data_cache
    return batch.topk_values, batch.topk_indices


def label_ids(batch: DistillBatch, config: TrainConfig) -> torch.Tensor | None:
    """On text (--text), what each position is scored against: the target's top-1 given
    the text before it (its cached top-k at the position before), since drafts must match
    the target, not the text; None (the tokens themselves) on the target's own answers."""
    if not config.text:
        return None
    assert batch.topk_indices is not None  # text mode needs kl, which caches the top-k
    top1 = batch.topk_indices[:, :-1, 0]  # [B, T-1]: the target's choice of tokens 1..T-1
    return torch.cat([batch.input_ids[:, :1], top1], dim=1)  # [B, T]; token 0 is no label


@torch.no_grad()
def rank_probabilities(heads: Heads, cache: DistillCache, config: TrainConfig) -> list[list[float]]:
    """[head][r]: how often the held-out label is the head's rank-r candidate. Rank 0 is
    top-1 accuracy; the table chooses the token tree."""
    ranks = torch.zeros(config.num_heads, RANKS)
    counts = torch.zeros(config.num_heads)
    weights = decaying_weights(config.num_heads, config.decay)
    device = next(heads.parameters()).device
    for batch in iter_batches(
        cache, batch_size=config.batch_size, seq_len=config.seq_len, seed=None,
        split="heldout", heldout_fraction=config.heldout_fraction,
    ):  # fmt: skip
        batch = batch.to(device)
        result = mtp_losses(
            heads, batch.input_ids, batch.hidden.float(), batch.loss_mask, weights,
            label_ids=label_ids(batch, config),
        )  # fmt: skip
        for i, (hist, n) in enumerate(
            zip(result.per_head_rank_counts, result.per_head_count, strict=True)
        ):
            ranks[i] += torch.tensor(hist, dtype=torch.float)
            counts[i] += n
    return (ranks / counts.clamp_min(1)[:, None]).round(decimals=4).tolist()


def evaluate(heads: Heads, cache: DistillCache, config: TrainConfig) -> list[float]:
    """Per-head top-1 accuracy on the held-out answers."""
    return [row[0] for row in rank_probabilities(heads, cache, config)]
