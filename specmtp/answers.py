"""The target's answers to prompts: prompt encoding, batched greedy generation, and texts
taken as answers with no prompt (the samples a distillation cache is built from)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specmtp.drafter_specs import eos_token_ids
from specmtp.errors import SpecMTPError
from specmtp.models import LoadedModel
from specmtp.progress import progress

# Default model, 2-core CPU, answer tokens/s: 16 prompts x 64 tokens, short prompts:
# batch 1: 22, 8: 88, 16: 107, 32: 97; 32 train prompts (mean 185 tokens) x 128 tokens:
# 8: 57, 16: 49. Build runs look like the second, so 8.
DEFAULT_BATCH_SIZE = 8


@dataclass(frozen=True)
class Sample:
    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]  # the target's greedy answer; ends with eos if it stopped there


def encode_prompt(model: LoadedModel, prompt: str, *, chat: bool) -> list[int]:
    """Token ids of a prompt, inside the chat template when `chat`."""
    tokenizer = model.tokenizer
    if not chat:
        return tokenizer(prompt).input_ids
    if tokenizer.chat_template is None:
        raise SpecMTPError(f"{model.spec} has no chat template (use chat=False)")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False).input_ids


def generate_answers(
    model: LoadedModel,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    batch_size: int = DEFAULT_BATCH_SIZE,
    chat: bool = True,
) -> list[Sample]:
    """The target's greedy answer to each prompt, in the prompts' order.

    Prompts are sorted by length and generated in left-padded batches; greedy decoding needs
    no seed, and padding does not change the answers (the tests compare against batch 1).
    """
    if max_new_tokens < 1 or batch_size < 1:
        raise SpecMTPError("max_new_tokens and batch_size must be positive")
    encoded = [encode_prompt(model, p, chat=chat) for p in prompts]
    for i, ids in enumerate(encoded):
        if len(ids) + max_new_tokens > model.context_length:
            raise SpecMTPError(
                f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} "
                f"it exceeds the {model.context_length}-token context of {model.spec}"
            )
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    answers: dict[int, tuple[int, ...]] = {}
    bar = progress(total=len(order), desc="target answers", unit="prompt")
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        batch = _generate_batch(model, [encoded[i] for i in rows], max_new_tokens)
        answers.update(zip(rows, batch, strict=True))
        bar.update(len(rows))
    bar.close()
    return [Sample(tuple(ids), answers[i]) for i, ids in enumerate(encoded)]


def text_samples(model: LoadedModel, texts: Sequence[str]) -> list[Sample]:
    """Texts as samples with no prompt: every token is an answer token, and the labels are
    the target's own distributions over the text (train-mtp --text --objective kl)."""
    samples = [Sample((), tuple(encode_prompt(model, t, chat=False))) for t in texts]
    for i, sample in enumerate(samples):
        if len(sample.answer_ids) > model.context_length:
            raise SpecMTPError(
                f"text {i} has {len(sample.answer_ids)} tokens, over the "
                f"{model.context_length}-token context of {model.spec}"
            )
    return samples


@torch.no_grad()
def _generate_batch(
    model: LoadedModel, prompts: list[list[int]], max_new_tokens: int
) -> list[tuple[int, ...]]:
    eos = eos_token_ids(model)
    pad = model.tokenizer.pad_token_id
    pad = eos[0] if pad is None else pad
    width = max(map(len, prompts))
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, T]
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    out = model.model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=eos,
    )
    answers = []
    for new in out[:, width:].tolist():
        ends = [i for i, token in enumerate(new) if token in eos]
        answers.append(tuple(new[: ends[0] + 1] if ends else new))
    return answers
