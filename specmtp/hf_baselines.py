"""Hugging Face's own decoding, timed beside ours: `generate()` plain, with an assistant model
(assisted generation) and with prompt lookup, on the same models, prompts and settings.

Each run returns the new tokens, cut as our decoder cuts them, and its latency, time to
first new token (TTFT) and time per output token (TPOT).

What transformers 5.x does (checked against 5.24), and what this module does about it:

- `generate()` fills every config field left None from `model.generation_config`, and some
  logits processors (`suppress_tokens`, `min_p`, `bad_words_ids`, `forced_eos_token_id`, ...)
  switch on whenever their field is not None, so no explicit value keeps a model's defaults
  (sampling, repetition penalty, max_length) out. For the call, the target and the assistant
  get a fresh `GenerationConfig` as `generation_config`; the models' own are restored after.
- The assisted settings `num_assistant_tokens`, `num_assistant_tokens_schedule` and
  `assistant_confidence_threshold` are read from `assistant.generation_config` only; passed
  to `generate()` they are ignored. They go into the assistant's swapped-in config.
- An unset confidence threshold becomes 0.4 (HF's global default): drafting then stops at the
  first draft token whose probability is below it. `assistant_confidence_threshold=0.0`
  turns that off (the ConfidenceCriteria is added only for a threshold > 0, and the
  scikit-learn ROC re-tuning of the threshold, when sklearn is installed, only for a
  non-zero one).
- The "heuristic" schedule writes its final draft length back into
  `assistant.generation_config`, so it would carry over into the next call; the swap drops
  it, and every call starts from `num_tokens`.
- Streamers work with all three: the first `put()` is the whole prompt, then plain decoding
  puts one token per step and assisted decoding one block per verify round.
- `generate()` has no generator argument: sampling draws from torch's global RNG, which is
  seeded right before the call. Assisted sampling uses speculative sampling; prompt lookup
  has no draft probabilities, so HF samples every verified position from the target and keeps
  the drafts equal to those samples. Both are lossless.
- Prompt lookup filters its candidates by running the logits processors on uniform fake
  logits. Top-k keeps all ties, but top-p < 1 drops part of the vocabulary among them, so
  candidates are thrown away arbitrarily: outputs stay correct, acceptance drops.
- The assistant's inner `generate()` gets a config and loose arguments together, so HF
  warns that this is deprecated, on the first assisted call of a process. Only that
  message, only during our calls, is filtered out.
- HF's assisted decoding handles batch size 1 only, as does this module; an assistant with
  another vocabulary needs HF's universal assisted decoding (tokenizers), not supported here.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from specmtp.config import SamplingConfig
from specmtp.errors import SpecMTPError

METHODS = ("assisted", "prompt-lookup", "plain")
SCHEDULES = ("constant", "heuristic")
# How HF 5.24 words the warning that its assisted decoding triggers by itself.
ASSISTANT_CALL_WARNING = "Passing `generation_config` together with generation-related arguments"


@dataclass(frozen=True)
class HFSettings:
    """How HF's generate is called.

    num_tokens: drafts per round (assisted: num_assistant_tokens; prompt lookup:
    prompt_lookup_num_tokens; unused by plain). confidence_threshold None keeps HF's early
    stop of drafting off; max_matching_ngram_size None is HF's default (2).
    """

    method: str
    num_tokens: int = 4
    schedule: str = "constant"
    confidence_threshold: float | None = None
    max_matching_ngram_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpecMTPError(f"unknown HF method {self.method!r}; use one of {METHODS}")
        if self.num_tokens < 1:
            raise SpecMTPError(f"num_tokens must be >= 1, got {self.num_tokens}")
        if self.schedule not in SCHEDULES:
            raise SpecMTPError(f"unknown schedule {self.schedule!r}; use one of {SCHEDULES}")
        threshold = self.confidence_threshold
        if threshold is not None and not 0 < threshold <= 1:
            raise SpecMTPError(f"confidence_threshold must be in (0, 1], got {threshold}")
        ngram = self.max_matching_ngram_size
        if ngram is not None and ngram < 1:
            raise SpecMTPError(f"max_matching_ngram_size must be >= 1, got {ngram}")
        # Refuse settings the chosen method would silently ignore.
        if self.method != "assisted" and (threshold is not None or self.schedule != "constant"):
            raise SpecMTPError("schedule and confidence_threshold are for assisted generation")
        if self.method != "prompt-lookup" and ngram is not None:
            raise SpecMTPError("max_matching_ngram_size applies to prompt lookup only")


def hf_default_assisted() -> HFSettings:
    """Assisted generation as transformers runs it when nothing is set: its own defaults for
    draft length, schedule and confidence threshold (20, constant, 0.4 in 5.24)."""
    defaults = GenerationConfig._get_default_generation_params()
    return HFSettings(
        "assisted",
        num_tokens=defaults["num_assistant_tokens"],
        schedule=defaults["num_assistant_tokens_schedule"],
        confidence_threshold=defaults["assistant_confidence_threshold"],
    )


@dataclass(frozen=True)
class HFRun:
    """One generation: the new tokens only, and its timings in seconds."""

    tokens: list[int]
    latency_s: float  # the whole generate call, prefill included
    ttft_s: float  # from the call to the first new token

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first."""
        if len(self.tokens) <= 1:
            return 0.0
        return (self.latency_s - self.ttft_s) / (len(self.tokens) - 1)


class FirstTokenTimer(BaseStreamer):
    """Notes when generate hands over its first new token: the first put() is the prompt."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass  # nothing buffered; BaseStreamer.end only raises


def cut_at_stops(tokens: Sequence[int], eos_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Our decoder's stops: up to and including the first EOS, at most max_new_tokens."""
    eos = set(eos_ids)
    kept = list(tokens[:max_new_tokens])
    for i, token in enumerate(kept):
        if token in eos:
            return kept[: i + 1]
    return kept


@contextmanager
def fresh_generation_configs(
    models: Sequence[PreTrainedModel], defaults: GenerationConfig
) -> Iterator[None]:
    """Give each model a copy of `defaults` as its generation_config, then restore its own."""
    unique = list({id(m): m for m in models}.values())  # the target may be its own assistant
    saved = [m.generation_config for m in unique]
    try:
        for model in unique:
            model.generation_config = copy.deepcopy(defaults)
        yield
    finally:
        for model, config in zip(unique, saved, strict=True):
            model.generation_config = config


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


@contextmanager
def quiet_assistant_warning() -> Iterator[None]:
    """Hide HF's deprecation warning about its own assistant call (nothing a caller can fix)."""
    logger = logging.getLogger("transformers.generation.utils")
    drop = _DropMessage(ASSISTANT_CALL_WARNING)
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


class HFGenerator:
    """A target (and, for assisted generation, an assistant) decoded by HF's `generate()`."""

    def __init__(
        self,
        target: PreTrainedModel,
        *,
        settings: HFSettings,
        assistant: PreTrainedModel | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        if settings.method == "assisted" and assistant is None:
            raise SpecMTPError("assisted generation needs an assistant model")
        if settings.method != "assisted" and assistant is not None:
            raise SpecMTPError(f"{settings.method} takes no assistant model")
        if settings.method != "plain" and getattr(target, "_is_stateful", False):
            raise SpecMTPError(f"HF cannot speculate with stateful {type(target).__name__}")
        if assistant is not None and _vocab_size(assistant) != _vocab_size(target):
            raise SpecMTPError(
                f"the assistant's vocabulary ({_vocab_size(assistant)}) differs from the "
                f"target's ({_vocab_size(target)})"
            )
        self.target = target
        self.settings = settings
        self.assistant = assistant
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = _pad_token_id(target, self.eos_token_ids)

    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> HFRun:
        if len(prompt_ids) == 0:
            raise SpecMTPError("the prompt is empty")
        if max_new_tokens < 1:
            raise SpecMTPError(f"max-new-tokens must be >= 1, got {max_new_tokens}")
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.target.device)
        models = [self.target] if self.assistant is None else [self.target, self.assistant]
        with fresh_generation_configs(models, self._model_defaults()), quiet_assistant_warning():
            return self._timed(ids, self._call_config(max_new_tokens, sampling), seed)

    def _timed(self, ids: torch.Tensor, config: GenerationConfig, seed: int) -> HFRun:
        """One timed generate() call on ids [1, n]."""
        timer = FirstTokenTimer()
        # No generator argument in HF: sampling draws from the global RNG.
        torch.manual_seed(seed)
        start = time.perf_counter()
        out = self.target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            generation_config=config,
            assistant_model=self.assistant,
            streamer=timer,
        )  # [1, n + new]
        latency = time.perf_counter() - start
        new = out[0, ids.shape[1] :].tolist()
        tokens = cut_at_stops(new, self.eos_token_ids, config.max_new_tokens)
        first = timer.first_token_at
        return HFRun(tokens, latency, latency if first is None else first - start)

    def _model_defaults(self) -> GenerationConfig:
        """What stands in for the models' own generation_config during a call."""
        if self.settings.method != "assisted":
            return GenerationConfig()
        threshold = self.settings.confidence_threshold
        return GenerationConfig(
            num_assistant_tokens=self.settings.num_tokens,
            num_assistant_tokens_schedule=self.settings.schedule,
            # 0.0, not None: None would become HF's default of 0.4.
            assistant_confidence_threshold=0.0 if threshold is None else threshold,
        )

    def _call_config(self, max_new_tokens: int, sampling: SamplingConfig) -> GenerationConfig:
        """The config passed to generate(): stops, budget, sampling and the drafting method."""
        fields: dict[str, object] = {
            "max_new_tokens": max_new_tokens,
            "eos_token_id": list(self.eos_token_ids) or None,  # None: stop on length only
            "pad_token_id": self.pad_token_id,
            "use_cache": True,
            "do_sample": not sampling.greedy,
        }
        if not sampling.greedy:
            # top_k 0 and top_p 1.0 add no warper in HF either.
            fields |= {
                "temperature": sampling.temperature,
                "top_k": sampling.top_k,
                "top_p": sampling.top_p,
            }
        if self.settings.method == "prompt-lookup":
            fields["prompt_lookup_num_tokens"] = self.settings.num_tokens
            fields["max_matching_ngram_size"] = self.settings.max_matching_ngram_size
        return GenerationConfig(**fields)


def _vocab_size(model: PreTrainedModel) -> int:
    return model.config.get_text_config().vocab_size


def _pad_token_id(model: PreTrainedModel, eos_token_ids: Sequence[int]) -> int | None:
    """The model's pad id, else an EOS id; HF pads only finished rows of a batch, so batch
    size 1 never shows it, but HF refuses EOS stopping without one."""
    for pad in (model.generation_config.pad_token_id, model.config.get_text_config().pad_token_id):
        if isinstance(pad, int):
            return pad
    return eos_token_ids[0] if eos_token_ids else None
