"""A reduced output vocabulary for a draft model: `--draft MODEL#vocab=N`.

A small draft with a large vocabulary spends much of each step on its output matrix (the
Qwen2.5 0.5B model: 151,936 x 896 of its weights). Cutting the LM head to the tokens it is
likely to propose makes every draft step cheaper. Only the drafts change, never what is
accepted: greedy verification takes the target's argmax, and under sampling the draft's
distribution q, zero off the kept ids, is the one rejection sampling divides by.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from specmtp.errors import SpecMTPError
from specmtp.kernels import TunedLinear
from specmtp.models import LoadedModel
from specmtp.specs import OUTPUT_VOCAB
from specmtp.vocab import LOGITS_WIDTH

CUT_TO = "specmtp_output_ids"  # the ids a model's LM head was cut to, kept on the model


def output_vocab_ids(
    draft: LoadedModel, size: int, usable: int, *, always: Sequence[int] = ()
) -> torch.Tensor:
    """The token ids a draft with a reduced output vocabulary may propose: the first `size`
    ids, every special or added token and `always` (the end of turn must stay reachable).

    Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, SmolLM) number their tokens in merge
    order, the most frequent pairs of the tokenizer's training text first, so the leading
    ids are the common tokens (FR-Spec, Zhao et al. 2025, ranks by measured frequency
    instead).
    """
    if size >= usable:
        raise SpecMTPError(
            f"{OUTPUT_VOCAB}{size} is not smaller than the draft's vocabulary ({usable} tokens)"
        )
    tokenizer = draft.tokenizer
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    special |= set(always)
    ids = sorted(set(range(size)) | {i for i in special if i < usable})
    return torch.tensor(ids, device=draft.model.device)


def restrict_output_vocab(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """Cut a Hugging Face model's LM head to the rows `ids` [N] (a copy: a head tied to the
    input embedding is untied, the embedding keeps every token). Once: a model already cut
    to these ids is left as it is."""
    if not isinstance(model, PreTrainedModel):
        raise SpecMTPError("a reduced output vocabulary needs a Hugging Face draft model")
    cut_to = getattr(model, CUT_TO, None)
    if cut_to is not None:  # a draft shared by drafters (drafter_specs.sharing_draft_models)
        if not torch.equal(cut_to, ids):
            raise SpecMTPError("this draft's LM head is already cut to other tokens")
        return
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.weight.shape[0] <= int(ids.max()):
        raise SpecMTPError(f"{type(model).__name__} has no LM head to cut to {len(ids)} tokens")
    bias = head.bias is not None
    cut = torch.nn.Linear(head.in_features, len(ids), bias=bias, device="meta")  # no init
    cut.weight = torch.nn.Parameter(head.weight.detach()[ids].clone(), requires_grad=False)
    if head.bias is not None:
        cut.bias = torch.nn.Parameter(head.bias.detach()[ids].clone(), requires_grad=False)
    if isinstance(head, TunedLinear):  # the same kernel plan as the head it replaces
        cut.__class__, cut.kernel_plan, cut.is_head = TunedLinear, head.kernel_plan, True
    model.config.tie_word_embeddings = False
    model.set_output_embeddings(cut)
    setattr(model, CUT_TO, ids)
    setattr(model, LOGITS_WIDTH, head.weight.shape[0])
