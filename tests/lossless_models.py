"""Tiny random models and the decode-loop harness for the loop-level losslessness tests."""

from __future__ import annotations

import torch
from conftest import perturbed_copy, tiny_model
from transformers import PreTrainedModel

from specmtp.config import GenerationConfig, SamplingConfig
from specmtp.decode import SpecDecoder
from specmtp.drafters import Drafter
from specmtp.sampling import logits_to_probs

TINY_V = 8
# "1 2" recurs, so the n-gram drafter proposes "4 3", which the target below accepts about
# half the time; the draft model drafts from the same prompt.
PROMPT = [1, 2, 4, 3, 6, 1, 2]
NEW_TOKENS = 3  # the window; with gamma 2 an all-accepting first round ends in a bonus token
GAMMA = 2


def peaked_target_and_draft() -> tuple[PreTrainedModel, PreTrainedModel]:
    """A tiny Llama over TINY_V tokens with peaked next-token distributions, and a perturbed
    copy of it as a draft that agrees in part."""
    target = tiny_model("llama", seed=0, vocab_size=TINY_V)
    with torch.no_grad():
        target.lm_head.weight.mul_(20)  # logits of a few units, far from uniform
    return target, perturbed_copy(target, scale=0.5, seed=1)


def target_joint(
    target: PreTrainedModel, sampling: SamplingConfig, prompt: list[int] = PROMPT
) -> torch.Tensor:
    """Exact joint [V, V, V] (float64) of the first three new tokens after `prompt`, by
    enumeration: one batched forward over the prompt + every two-token continuation."""
    pairs = torch.cartesian_prod(torch.arange(TINY_V), torch.arange(TINY_V))  # [V^2, 2]: (a, b)
    ids = torch.cat([torch.tensor(prompt).expand(len(pairs), -1), pairs], 1)  # [V^2, n+2]
    with torch.no_grad():
        logits = target(input_ids=ids).logits[:, -3:, :TINY_V]  # [V^2, 3, V]
    probs = logits_to_probs(logits, sampling).double().reshape(TINY_V, TINY_V, 3, TINY_V)
    first = probs[0, 0, 0]  # [V]: p(a)
    second = probs[:, 0, 1]  # [V, V]: p(b | a)
    third = probs[:, :, 2]  # [V, V, V]: p(c | a, b)
    return first[:, None, None] * second[:, :, None] * third


def decoder_counts(
    target: PreTrainedModel,
    drafter: Drafter,
    sampling: SamplingConfig,
    samples: int,
    prompt: list[int] = PROMPT,
) -> torch.Tensor:
    """Counts [V, V, V] of the NEW_TOKENS tokens of `samples` generations, seeds 0..samples-1."""
    decoder = SpecDecoder(target, drafter=drafter, vocab_size=TINY_V, context_length=64)
    counts = torch.zeros([TINY_V] * NEW_TOKENS, dtype=torch.long)
    for seed in range(samples):
        config = GenerationConfig(
            max_new_tokens=NEW_TOKENS, gamma=GAMMA, sampling=sampling, seed=seed, stop_on_eos=False
        )
        counts[tuple(decoder.generate(prompt, config).tokens)] += 1
    return counts
