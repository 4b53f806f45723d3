"""`specmtp distill`: train a small draft model (`draft_model.DraftLM`) for a target.

Two objectives, one trainer:
- `distill`: knowledge distillation. The target answers training prompts greedily; the
  data cache (`specmtp.data_build`, shared with `train-mtp`) keeps its top-k log-probabilities
  at every position, and the draft minimises KL(p_target,top-k || q_draft) there (the
  top-k mass is the target's; tokens outside the draft vocabulary drop out).
- `text`: plain next-token cross-entropy on ordinary text (`specmtp.text_data`), never
  seeing the target's outputs: the "general" draft of the same architecture.

With `mtp_heads` > 0 the draft also trains parallel MTP heads on its own final hidden
state (Σ λ_i CE_i on the tokens 2+i ahead, `mtp_loss.mtp_losses`), jointly with its
next-token objective: continued MTP training when `init_from` names a trained draft.

The same training loop as `train-mtp` (`specmtp.trainer`): accelerate, data-parallel
over several processes under `torchrun` or `accelerate launch` (`specmtp.parallel`), a
progress bar with loss and accuracy, metrics.jsonl, atomic checkpoints that a rerun of the
same command resumes.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specmtp.cache import CachedModel
from specmtp.costmodel import measure_verify_costs
from specmtp.data import DistillBatch, is_heldout, iter_batches, model_fingerprint
from specmtp.data_build import DistillConfig, build_cache, finished_cache
from specmtp.draft_model import (
    DraftConfig,
    DraftLM,
    draft_config_for,
    init_from_target,
    load_draft,
    save_draft,
)
from specmtp.errors import SpecMTPError
from specmtp.models import DTYPES, LoadedModel, load_model
from specmtp.mtp_loss import decaying_weights, mtp_losses, topk_kl
from specmtp.parallel import DataParallel, make_accelerator
from specmtp.text_data import TextChunks, iter_text_batches, load_texts, tokenize_chunks
from specmtp.train_prompts import load_train_prompts
from specmtp.train_setup import answer_token_counts
from specmtp.trainer import Logged, Objective, run_training

OBJECTIVES = ("distill", "text")


@dataclass(frozen=True)
class DistillTrainConfig:
    """One run; `out` holds checkpoints, metrics, the final draft (out/draft) and report."""

    sources: tuple[Path, ...]  # prompts (distill) or .txt files and folders (text)
    out: Path
    target: str = "default"
    # The target's dtype while it answers and scores the data: distil the model you will
    # serve (bfloat16 targets answer a little differently from float32 ones). The draft
    # itself trains in float32 (see mixed_precision).
    dtype: str = "float32"
    objective: str = "distill"
    num_layers: int = 2
    init: str = "target"  # "target": copy the target's first layers; "random"
    init_from: Path | None = None  # a saved draft to continue from (its layers and vocab)
    draft_vocab: int = 8192  # the N most frequent tokens of the training data
    mtp_heads: int = 0
    mtp_decay: float = 0.8  # λ_i = decay^i for the heads; the next-token loss weighs 1
    topk: int = 20  # target log-probabilities cached per position (distill)
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 5e-4
    checkpoint_every: int = 100
    eval_every: int = 250
    heldout_fraction: float = 0.05
    limit_per_source: int | None = None
    max_new_tokens: int = 128
    seed: int = 0
    cache: Path | None = None  # the data cache directory (default: out/data)
    # "bf16": autocast matmuls to bfloat16 (weights and optimizer stay float32). On CPUs with
    # AMX or AVX512-BF16 a training step runs several times faster.
    mixed_precision: str = "no"
    data_only: bool = False  # build (or finish) the data cache, then stop: no training

    def __post_init__(self) -> None:
        if not self.sources:
            raise SpecMTPError("give at least one data source (--data)")
        if self.objective not in OBJECTIVES:
            raise SpecMTPError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.init not in ("target", "random"):
            raise SpecMTPError(f"init must be 'target' or 'random', got {self.init!r}")
        positive = ("num_layers", "draft_vocab", "steps", "batch_size", "seq_len", "topk")
        for name in (*positive, "checkpoint_every", "eval_every"):
            if getattr(self, name) < 1:
                raise SpecMTPError(f"{name.replace('_', '-')} must be >= 1")
        if self.mtp_heads < 0 or not 0 < self.mtp_decay <= 1 or self.lr <= 0:
            raise SpecMTPError("need mtp-heads >= 0, mtp-decay in (0, 1] and lr > 0")
        if not 0 < self.heldout_fraction < 1:
            raise SpecMTPError("heldout-fraction must be in (0, 1)")
        if self.dtype not in DTYPES:
            raise SpecMTPError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.mixed_precision not in ("no", "bf16"):
            raise SpecMTPError(
                f"mixed-precision must be 'no' or 'bf16', got {self.mixed_precision!r}"
            )

    @property
    def data_dir(self) -> Path:
        return self.cache or self.out / "data"


@dataclass(frozen=True)
class DistillReport:
    steps: int
    heldout: dict[str, Any]  # agreement with the target (or next-token accuracy), heads
    tokens: int  # tokens in the training data
    draft_parameters: int  # trained parameters (the shared target tensors excluded)
    step_cost_ratio: float  # c: draft one-token step time / target one-token step time
    seconds: float


@dataclass(frozen=True)
class _Data:
    """The run's data, whichever objective: passes over a split, and its size."""

    batches: Callable[[str, int | None], Iterator[DistillBatch]]  # (split, seed) -> one pass
    counts: Counter[int]  # token frequencies of the training split
    tokens: int
    key: str  # identifies the data for checkpoints


def train_draft(config: DistillTrainConfig) -> DistillReport | None:
    """Train the draft; its report, or None in a process other than the main one of a
    data-parallel run (`specmtp.parallel`)."""
    start_time = time.perf_counter()
    config.out.mkdir(parents=True, exist_ok=True)
    accelerator = make_accelerator()
    parallel = DataParallel(accelerator)
    target = load_model(config.target, dtype=DTYPES[config.dtype])
    with parallel.main_first():
        data = _prepare_data(config, target)
    if config.data_only:
        seconds = time.perf_counter() - start_time
        return DistillReport(0, {}, data.tokens, 0, 0.0, seconds) if parallel.is_main else None
    draft = _build_draft(config, target, data).float()  # float32 master weights
    draft.to(accelerator.device)
    weights = decaying_weights(config.mtp_heads, config.mtp_decay) if config.mtp_heads else []
    objective = Objective(
        module=draft,
        losses=lambda batch: _step_losses(draft, batch, config.objective, weights),
        evaluate=lambda: evaluate(draft, data, config, weights),
        one_pass=lambda seed: data.batches("train", seed),
        identity=_run_identity(config, target, draft, data, processes=parallel.processes),
        shown=("loss", "accuracy"),
        evaluate_first=config.init_from is not None,
    )
    draft.train()
    step = run_training(
        objective, config, name="distill", accelerator=accelerator, parallel=parallel
    )
    draft.eval()
    if not parallel.is_main:
        accelerator.wait_for_everyone()
        return None
    save_draft(draft, config.out / "draft", dtype=torch.float16, target=target.model)
    saved = load_draft(config.out / "draft", target=target.model)  # as it will draft
    report = DistillReport(
        step, evaluate(draft, data, config, weights), data.tokens,
        sum(p.numel() for p in draft.parameters() if p.requires_grad),
        step_cost_ratio(saved, target),
        time.perf_counter() - start_time,
    )  # fmt: skip
    (config.out / "report.json").write_text(json.dumps(asdict(report), indent=1))
    accelerator.wait_for_everyone()
    return report


def step_cost_ratio(draft: DraftLM, target: LoadedModel, *, rounds: int = 5) -> float:
    """c = draft step / target step: one-token forwards after a 64-token prefill, medians
    of interleaved rounds (both on this machine, in this process)."""
    vocab = target.model.get_output_embeddings().weight.shape[0]
    runners = [CachedModel(m, vocab_size=vocab) for m in (draft, target.model)]
    ids = [2 + i % 64 for i in range(65)]  # content does not change the cost
    times: list[list[float]] = [[], []]
    for _ in range(rounds):
        for runner, found in zip(runners, times, strict=True):
            found.append(measure_verify_costs(runner, ids, max_tokens=1, repeats=5)[0])
    return round(statistics.median(times[0]) / statistics.median(times[1]), 4)


def _prepare_data(config: DistillTrainConfig, target: LoadedModel) -> _Data:
    if config.objective == "text":
        return _text_data(config, target)
    prompts = load_train_prompts(
        config.sources, limit_per_source=config.limit_per_source, seed=config.seed
    )
    settings = DistillConfig(max_new_tokens=config.max_new_tokens, topk=config.topk)
    cache = finished_cache(target, prompts, config.data_dir, config=settings) or build_cache(
        target, prompts, config.data_dir, config=settings, sources=[str(s) for s in config.sources]
    )
    counts = answer_token_counts(cache, config.heldout_fraction)

    def batches(split: str, seed: int | None) -> Iterator[DistillBatch]:
        return iter_batches(
            cache, batch_size=config.batch_size, seq_len=config.seq_len, seed=seed,
            split=split, heldout_fraction=config.heldout_fraction,
        )  # fmt: skip

    return _Data(batches, counts, int(cache.manifest["num_tokens"]), cache.manifest["key"])


def _text_data(config: DistillTrainConfig, target: LoadedModel) -> _Data:
    texts = load_texts(config.sources)
    chunks: TextChunks = tokenize_chunks(texts, target.tokenizer, seq_len=config.seq_len)
    counts: Counter[int] = Counter()
    for index in range(chunks.num_chunks):
        if not is_heldout(index, config.heldout_fraction):
            counts.update(chunks.tokens[index].tolist())

    def batches(split: str, seed: int | None) -> Iterator[DistillBatch]:
        return iter_text_batches(
            chunks, batch_size=config.batch_size, seed=seed, split=split,
            heldout_fraction=config.heldout_fraction,
        )  # fmt: skip

    key = hashlib.sha256(chunks.tokens.to(torch.int32).numpy().tobytes()).hexdigest()[:16]
    return _Data(batches, counts, int(chunks.tokens.numel()), key)


def _build_draft(config: DistillTrainConfig, target: LoadedModel, data: _Data) -> DraftLM:
    torch.manual_seed(config.seed)
    if config.init_from is not None:
        return _continued_draft(config, target)
    vocab = tuple(sorted(token for token, _ in data.counts.most_common(config.draft_vocab)))
    draft_config = draft_config_for(
        target.model, num_layers=config.num_layers, draft_vocab=vocab,
        mtp_heads=config.mtp_heads, objective=config.objective,
    )  # fmt: skip
    draft = DraftLM(draft_config, target=target.model)
    if config.init == "target":
        init = init_from_target(draft, target.model, list(range(config.num_layers)))
        draft.draft_config = DraftConfig(**{**asdict(draft_config), "init": init})
    return draft


def _continued_draft(config: DistillTrainConfig, target: LoadedModel) -> DraftLM:
    """The draft at `init_from`, with `mtp_heads` fresh heads added (continued training)."""
    start = load_draft(config.init_from, target=target.model)
    old = start.draft_config
    init = f"draft:{config.init_from}" + (f" ({old.init})" if old.init else "")
    new_config = DraftConfig(
        **{**asdict(old), "mtp_heads": config.mtp_heads, "init": init,
           "objective": f"{old.objective}+{config.objective}"}
    )  # fmt: skip
    draft = DraftLM(new_config, target=target.model)
    body = {k: v for k, v in start.state_dict().items() if not k.startswith("heads.")}
    draft.load_state_dict(body, strict=False)
    return draft.requires_grad_(True)


def _step_losses(
    draft: DraftLM, batch: DistillBatch, objective: str, weights: list[float]
) -> tuple[torch.Tensor, Logged]:
    """One step's loss, and every value of `draft_losses` for the log."""
    losses = draft_losses(draft, batch, objective, weights)
    return losses["loss"], {key: float(value.detach()) for key, value in losses.items()}


def draft_losses(
    draft: DraftLM, batch: DistillBatch, objective: str, weights: list[float]
) -> dict[str, torch.Tensor]:
    """The next-token loss (KL to the target's top-k, or CE on the text), plus the MTP
    heads' Σ λ_i CE_i; also top-1 accuracy against the target's argmax (or the text)."""
    hidden = draft.hidden(batch.input_ids, attention_mask=batch.attention_mask)  # [B, T, H]
    logits = draft.projection(hidden)  # [B, T, V']
    log_q = torch.log_softmax(logits.float(), dim=-1)
    if objective == "distill":
        loss, accuracy = _kl_loss(draft, batch, log_q)
    else:
        loss, accuracy = _text_loss(draft, batch, log_q)
    result = {"loss": loss, "next_loss": loss.detach(), "accuracy": accuracy}
    if weights:
        heads = mtp_losses(draft.heads, batch.input_ids, hidden, batch.loss_mask, weights)
        result["loss"] = loss + heads.loss
        for i, acc in enumerate(heads.per_head_accuracy):
            result[f"head{i}_accuracy"] = torch.tensor(acc)
    return result


def _kl_loss(
    draft: DraftLM, batch: DistillBatch, log_q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(p || q) to the target's cached top-k at every position (mtp_loss.topk_kl)."""
    assert batch.topk_values is not None and batch.topk_indices is not None
    rows = batch.attention_mask  # [B, T]: every real position, prompt and answer
    ids = draft.projection.to_draft_ids(batch.topk_indices[rows])  # [M, k], -1 outside
    loss = topk_kl(log_q[rows], batch.topk_values[rows], ids)
    # Position t predicts x_{t+1}: score the positions whose next token is an answer token.
    predicts_answer = torch.zeros_like(batch.loss_mask)
    predicts_answer[:, :-1] = batch.loss_mask[:, 1:]
    answer = predicts_answer[rows]  # [M]
    best = draft.projection.to_full_ids(log_q[rows][answer].argmax(-1))
    accuracy = (best == batch.topk_indices[rows][answer][:, 0]).float().mean()
    return loss, accuracy.detach()


def _text_loss(
    draft: DraftLM, batch: DistillBatch, log_q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    labels = draft.projection.to_draft_ids(batch.input_ids[:, 1:])  # [B, T-1], -1 outside
    rows = batch.attention_mask[:, 1:] & (labels >= 0)
    loss = F.nll_loss(log_q[:, :-1][rows], labels[rows])
    full = batch.input_ids[:, 1:][batch.attention_mask[:, 1:]]
    best = draft.projection.to_full_ids(log_q[:, :-1][batch.attention_mask[:, 1:]].argmax(-1))
    return loss, (best == full).float().mean().detach()


@torch.no_grad()
def evaluate(
    draft: DraftLM, data: _Data, config: DistillTrainConfig, weights: list[float]
) -> dict[str, float]:
    """Held-out means of the per-batch metrics, weighted by batch."""
    was_training = draft.training
    draft.eval()
    sums: Counter[str] = Counter()
    batches = 0
    device = next(draft.parameters()).device
    for batch in data.batches("heldout", None):
        batch = batch.to(device)
        for name, value in draft_losses(draft, batch, config.objective, weights).items():
            sums[name] += float(value)
        batches += 1
    draft.train(was_training)
    return {name: round(total / max(1, batches), 4) for name, total in sums.items()}


def _run_identity(
    config: DistillTrainConfig,
    target: LoadedModel,
    draft: DraftLM,
    data: _Data,
    *,
    processes: int = 1,
) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: model, data, draft, optimisation, and
    the number of processes (each step's batches and their order depend on it)."""
    skip = ("out", "sources", "steps", "cache", "eval_every", "checkpoint_every")
    settings = {k: v for k, v in asdict(config).items() if k not in skip}
    identity = {
        "model": model_fingerprint(target),
        "data": data.key,
        "draft": json.loads(draft.draft_config.to_json()),
        "settings": json.loads(json.dumps(settings, default=str)),
    }
    if processes > 1:  # one process: as before there was a choice, so old runs resume
        identity["processes"] = processes
    return identity
