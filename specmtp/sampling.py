"""Logits processing and sampling: pure functions with an explicit torch.Generator."""

from __future__ import annotations

import torch

from specmtp import native
from specmtp.config import SamplingConfig


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension of logits [..., V]; returns [...] (int64).

    Half-precision logits are compared in float32: the same values, so the same index
    (the first maximum), and on our CPU twice as fast as bfloat16's own argmax (4.5 against
    2.4 ms for 17 rows of 49,152), which a tree round pays on every verify pass."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return logits.argmax(-1)


def top_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k likeliest tokens of each row of logits [P, V], likeliest first: their
    log-softmax values [P, k] (float32) and indices [P, k] (int64). lean.c's specmtp_top_k
    reads each row twice with vector instructions where it is compiled (0.20 against 0.76
    ms for 4 rows of 151,936 through log_softmax and topk, 2 threads: docs/bench-lean-
    layers-2026-12-07/microbench.py); equal values may come out in another order than
    torch's."""
    logits = logits.float().contiguous()
    kernels = native.lean_kernels()
    if kernels is None or logits.dim() != 2 or not 1 <= k <= logits.shape[-1]:
        return torch.log_softmax(logits, -1).topk(k, dim=-1)
    rows, vocab = logits.shape
    values, indices = torch.empty(rows, k), torch.empty(rows, k, dtype=torch.int64)
    lse = torch.empty(rows)
    kernels.top_k(logits.data_ptr(), rows, vocab, k, values.data_ptr(), indices.data_ptr(),
                  lse.data_ptr())  # fmt: skip
    return values - lse[:, None], indices


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Turn logits [..., V] into the sampling distribution [..., V] (float32).

    Greedy (temperature 0) gives the one-hot distribution of the argmax, so that the
    speculative rules stay one formula for every temperature. Top-k and top-p are applied
    after temperature, in that order, as in Hugging Face's sampling.
    """
    logits = logits.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(greedy_tokens(logits), logits.shape[-1]).float()
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first
        # token is always kept.
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= cfg.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row from probs [..., V]; returns [...] (int64)."""
    flat = probs.reshape(-1, probs.shape[-1])
    tokens = torch.multinomial(flat, 1, generator=generator)  # [N, 1]
    return tokens.reshape(probs.shape[:-1])


def choose(
    probs: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None
) -> torch.Tensor:
    """Next token from processed probs [..., V]: argmax when greedy, else a sample."""
    if cfg.greedy:
        return probs.argmax(-1)
    return sample(probs, generator)
