"""`specmtp train-mtp`: train MTP heads on a frozen target by self-distillation.

The target answers training prompts (greedily, cached with its final hidden states by
`specmtp.data_build`); heads learn to predict the answer tokens 2, 3, ... positions ahead
from those hidden states, with loss Σ_i λ_i CE_i. The trunk never changes, so the target's
own outputs stay exactly the same; `--joint` trains the target with them instead
(`specmtp.train_joint`). The training loop is `specmtp.trainer`'s, shared with `distill`:
accelerate, data-parallel processes, atomic checkpoints that a rerun resumes.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from specmtp.data import DistillBatch, DistillCache, iter_batches, model_fingerprint, split_indices
from specmtp.data_build import DistillConfig
from specmtp.errors import SpecMTPError
from specmtp.heads import Heads, build_heads
from specmtp.heads_config import HeadsConfig, check_feature_layers
from specmtp.heads_io import HEADS_WEIGHTS, save_heads
from specmtp.models import DTYPES, LoadedModel, load_model
from specmtp.mtp_loss import RANKS, decaying_weights, mtp_losses
from specmtp.parallel import DataParallel, make_accelerator
from specmtp.train_joint import (
    JOINT_MODEL_DIR,
    HeldoutAgreement,
    JointModule,
    joint_losses,
    save_trunk,
    trainable_trunk,
)
from specmtp.train_setup import data_cache, initial_heads, make_heads_config
from specmtp.trainer import Logged, Objective, run_training
from specmtp.tree import TREE_FILE, best_tree

HEAD_OBJECTIVES = ("tokens", "kl")
Features = Callable[[DistillBatch], torch.Tensor]  # a batch -> what the heads read [B, T, F]
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
    # Continued MTP training (train_joint.py): the target's layers are trained with the
    # heads, keeping its next-token loss, at their own learning rate; OUT/model is the result.
    joint: bool = False
    trunk_lr: float = 2e-5

    def __post_init__(self) -> None:
        if not self.sources:
            raise SpecMTPError("give at least one prompt source (--data)")
        positive = ("num_heads", "num_layers", "steps", "batch_size", "seq_len")
        for name in (*positive, "checkpoint_every", "eval_every"):
            if getattr(self, name) < 1:
                raise SpecMTPError(f"{name.replace('_', '-')} must be >= 1")
        if self.draft_vocab < 0 or not 0 < self.decay <= 1 or self.lr <= 0 or self.trunk_lr <= 0:
            raise SpecMTPError("need draft-vocab >= 0, decay in (0, 1], lr > 0 and trunk-lr > 0")
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
    # --joint: the trained model's directory, and how often its greedy token at held-out
    # answer positions is the original target's
    model: str | None = None
    next_token_agreement: float | None = None
    # --joint: the samples it trains and scores on (train and held-out): those within
    # --seq-len, since a window without its prompt's start is another context
    joint_samples: int | None = None


def train_mtp(config: TrainConfig) -> TrainReport | None:
    """Train the heads; their report, or None in a process other than the main one of a
    data-parallel run (`specmtp.parallel`)."""
    start_time = time.perf_counter()
    config.out.mkdir(parents=True, exist_ok=True)
    accelerator = make_accelerator()
    parallel = DataParallel(accelerator)
    target = load_model(config.target, dtype=DTYPES[config.dtype])
    with parallel.main_first():
        cache = data_cache(config, target)
    torch.manual_seed(config.seed)  # the same start in every process
    if config.init_from is not None:
        heads, heads_config = initial_heads(config, target)
    else:
        heads_config = make_heads_config(config, target, cache)
        heads = build_heads(heads_config, target.model)
    heads = heads.float()  # float32 master weights
    heads.to(accelerator.device)
    identity = run_identity(config, target, cache, heads_config, processes=parallel.processes)
    if config.joint:
        joint_samples = _joint_samples(cache, config)
        trunk = trainable_trunk(config.target)
        joint = JointModule(trunk.model, heads, config.feature_layers).to(accelerator.device)
        objective = _joint_objective(joint, cache, config, identity)
    else:
        objective = Objective(
            module=heads,
            losses=lambda batch: _step_losses(heads, batch, config),
            evaluate=lambda: {"acc": evaluate(heads, cache, config)},
            one_pass=lambda seed: _one_pass(cache, config, seed),
            identity=identity,
            shown=("loss", "acc"),
            evaluate_first=config.init_from is not None,
        )
    step = run_training(
        objective, config, name="train-mtp", accelerator=accelerator, parallel=parallel
    )
    if not parallel.is_main:
        accelerator.wait_for_everyone()
        return None
    if config.joint:
        report = _finish_joint(config, joint, trunk, heads_config, cache, step)
        report = replace(report, joint_samples=joint_samples)
    else:
        rank_probs = _write_heads(config, heads, heads_config, target.model, cache)
        report = TrainReport(
            step, [row[0] for row in rank_probs], rank_probs, int(cache.manifest["num_tokens"]),
            0.0,
        )  # fmt: skip
    report = replace(report, seconds=time.perf_counter() - start_time)
    (config.out / "report.json").write_text(json.dumps(asdict(report), indent=1))
    accelerator.wait_for_everyone()
    return report


def _one_pass(cache: DistillCache, config: TrainConfig, seed: int) -> Iterator[DistillBatch]:
    return iter_batches(
        cache, batch_size=config.batch_size, seq_len=config.seq_len, seed=seed,
        heldout_fraction=config.heldout_fraction, whole=config.joint,
    )  # fmt: skip


def _joint_samples(cache: DistillCache, config: TrainConfig) -> int:
    """How many samples a joint run trains and scores on (those within --seq-len); an error
    before training when a split has none."""
    total = 0
    for split in ("train", "heldout"):
        fitting = len(split_indices(cache, split, config.heldout_fraction, config.seq_len))
        if fitting == 0:
            shortest = min(cache.sample_length(i) for i in range(cache.num_samples))
            raise SpecMTPError(
                f"--joint trains on whole samples, and no {split} sample of {cache.directory} "
                f"fits --seq-len {config.seq_len} (the shortest has {shortest} tokens)"
            )
        total += fitting
    return total


def _joint_objective(
    joint: JointModule, cache: DistillCache, config: TrainConfig, identity: dict[str, Any]
) -> Objective:
    """--joint: the trunk and heads trained together (train_joint.py)."""
    weights = decaying_weights(config.num_heads, config.decay)

    def losses(batch: DistillBatch) -> tuple[torch.Tensor, Logged]:
        return joint_losses(
            joint, batch, weights=weights, kl=config.objective == "kl",
            target_topk=target_topk(batch, config), labels=label_ids(batch, config),
        )  # fmt: skip

    def held_out() -> dict[str, Any]:
        agreement = _heldout_agreement(joint, config)
        accuracy = evaluate(joint.heads, cache, config, features=agreement)
        return {"acc": accuracy, "next_acc": agreement.rate}

    return Objective(
        module=joint,
        losses=losses,
        evaluate=held_out,
        one_pass=lambda seed: _one_pass(cache, config, seed),
        identity=identity,
        shown=("loss", "next_acc", "acc"),
        groups=joint.optimizer_groups(config.trunk_lr / config.lr),
        evaluate_first=config.init_from is not None,
    )


def _heldout_agreement(joint: JointModule, config: TrainConfig) -> HeldoutAgreement:
    return HeldoutAgreement(joint, lambda batch: label_ids(batch, config))


def _finish_joint(
    config: TrainConfig,
    joint: JointModule,
    trunk: LoadedModel,
    heads_config: HeadsConfig,
    cache: DistillCache,
    step: int,
) -> TrainReport:
    """Write the trained model to OUT/model and the heads (checked against it) to OUT."""
    model_dir = config.out / JOINT_MODEL_DIR
    save_trunk(trunk, model_dir)
    agreement = _heldout_agreement(joint, config)
    with torch.no_grad():
        rank_probs = _write_heads(
            config, joint.heads, heads_config, trunk.model, cache, features=agreement
        )
    return TrainReport(
        step, [row[0] for row in rank_probs], rank_probs, int(cache.manifest["num_tokens"]),
        0.0, model=str(model_dir), next_token_agreement=agreement.rate,
    )  # fmt: skip


def _write_heads(
    config: TrainConfig,
    heads: Heads,
    heads_config: HeadsConfig,
    trunk: PreTrainedModel,
    cache: DistillCache,
    *,
    features: Features | None = None,
) -> list[list[float]]:
    """Save the heads and their token tree; return the held-out rank statistics."""
    rank_probs = rank_probabilities(heads, cache, config, features=features)
    # float16, as distill saves drafts: half the size, and loading casts to the target's dtype.
    save_heads(heads, heads_config, config.out, dtype=torch.float16, trunk=trunk)
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
    if not config.joint:  # likewise before the joint mode
        del settings["joint"], settings["trunk_lr"]
    else:  # whole samples only: a joint run from before that took other batches
        settings["joint_samples"] = "whole"
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
    assert (
        batch.topk_values is not None and batch.topk_indices is not None
    )  # train_setup.data_cache
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
def rank_probabilities(
    heads: Heads, cache: DistillCache, config: TrainConfig, *, features: Features | None = None
) -> list[list[float]]:
    """[head][r]: how often the held-out label is the head's rank-r candidate. Rank 0 is
    top-1 accuracy; the table chooses the token tree. The heads read the cached hidden
    states, or what `features` computes from a batch (--joint: the trained trunk's)."""
    ranks = torch.zeros(config.num_heads, RANKS)
    counts = torch.zeros(config.num_heads)
    weights = decaying_weights(config.num_heads, config.decay)
    device = next(heads.parameters()).device
    for batch in iter_batches(
        cache, batch_size=config.batch_size, seq_len=config.seq_len, seed=None,
        split="heldout", heldout_fraction=config.heldout_fraction, whole=config.joint,
    ):  # fmt: skip
        batch = batch.to(device)
        hidden = batch.hidden.float() if features is None else features(batch)
        result = mtp_losses(
            heads, batch.input_ids, hidden, batch.loss_mask, weights,
            label_ids=label_ids(batch, config),
        )  # fmt: skip
        for i, (hist, n) in enumerate(
            zip(result.per_head_rank_counts, result.per_head_count, strict=True)
        ):
            ranks[i] += torch.tensor(hist, dtype=torch.float)
            counts[i] += n
    # float64 before rounding: a rounded float32 prints as 0.7006000280380249 in report.json
    return (ranks.double() / counts.clamp_min(1).double()[:, None]).round(decimals=4).tolist()


def evaluate(
    heads: Heads, cache: DistillCache, config: TrainConfig, *, features: Features | None = None
) -> list[float]:
    """Per-head top-1 accuracy on the held-out answers."""
    return [row[0] for row in rank_probabilities(heads, cache, config, features=features)]
