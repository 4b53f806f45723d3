"""Frozen, validated settings. Defaults are defined here and nowhere else."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specmtp.errors import SpecMTPError


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become a distribution. The same processing builds p (target) and q (draft).

    temperature 0 means greedy (argmax); top_k 0 means no top-k cut; top_p 1.0 means no
    nucleus cut.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SpecMTPError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SpecMTPError(f"top-k must be >= 0, got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise SpecMTPError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


SCHEDULES = ("fixed", "heuristic", "adaptive", "guarded")
MEASURED_SCHEDULES = ("adaptive", "guarded")  # those that need a cost model (T(n) timed)


@dataclass(frozen=True)
class GenerationConfig:
    """One generation request: budget, draft length, stops, sampling and seed.

    `gamma` is the draft length of a fixed schedule, the starting length of the heuristic
    one (Hugging Face's +2 / -1), the largest length the adaptive one may choose, and the
    length the guarded one drafts whenever it drafts (adaptive_schedule.py).
    `model_gamma`, for drafters with a lookup arm and a model arm (`ngram+SPEC`), is the
    fixed or starting γ of the model's rounds, `gamma` then being the lookup's (None: the
    same). `max_memory_bytes` bounds the weights plus KV caches of target and drafter (None: no
    bound); see SpecDecoder.
    """

    max_new_tokens: int = 128
    gamma: int = 4
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_strings: tuple[str, ...] = ()
    stop_on_eos: bool = True
    seed: int = 0
    schedule: str = "fixed"
    model_gamma: int | None = None
    max_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise SpecMTPError(
                f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}"
            )
        if self.max_memory_bytes is not None and self.max_memory_bytes < 1:
            raise SpecMTPError(f"max-memory must be positive, got {self.max_memory_bytes}")
        if self.max_new_tokens < 1:
            raise SpecMTPError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.gamma < 1:
            raise SpecMTPError(f"gamma must be >= 1, got {self.gamma}")
        if self.model_gamma is not None and self.model_gamma < 1:
            raise SpecMTPError(f"the model rounds' gamma must be >= 1, got {self.model_gamma}")
        if any(not s for s in self.stop_strings):
            raise SpecMTPError("stop strings must not be empty")
