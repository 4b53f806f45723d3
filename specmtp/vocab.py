"""What token ids mean, and whether a draft's mean the same as its target's.

A draft proposes token ids; the target verifies them. Both must read each id as the same
token (`check_tokenizers_agree`), and p and q are compared over the logits both produce
(`usable_vocab_size`). A data cache records what its ids mean (`vocab_digest`).
"""

import hashlib
import json

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specmtp.errors import SpecMTPError
from specmtp.models import LoadedModel


def check_tokenizers_agree(
    target: PreTrainedTokenizerBase,
    draft: PreTrainedTokenizerBase,
    *,
    target_name: str,
    draft_name: str,
) -> None:
    """Refuse a draft whose token ids mean something else than the target's.

    Only the ids matter: a differing eos token is fine, since the target decides when to stop.
    """
    target_vocab, draft_vocab = _full_vocab(target), _full_vocab(draft)
    if target_vocab == draft_vocab:
        return
    token = _first_difference(target_vocab, draft_vocab)
    detail = (
        f"token {token!r} is {_where(target_vocab, token, 'target')} "
        f"and {_where(draft_vocab, token, 'draft')}"
    )
    if len(target_vocab) != len(draft_vocab):
        detail += f" (the target has {len(target_vocab)} tokens, the draft {len(draft_vocab)})"
    raise SpecMTPError(
        f"vocabulary mismatch between target {target_name!r} and draft {draft_name!r}: {detail}"
    )


def usable_vocab_size(
    target_model: LoadedModel | PreTrainedModel,
    draft_model: LoadedModel | PreTrainedModel,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> int:
    """Number of leading logits both models produce, i.e. where p and q can be compared.

    Drafts often pad their embedding past the real vocabulary; those extra columns are cut
    off. The real vocabulary is len(tokenizer), taken from `tokenizer` or the LoadedModels;
    with two bare models and no tokenizer there is nothing to check it against.
    """
    widths = [(_logits_width(m), _model_name(m)) for m in (target_model, draft_model)]
    usable, narrowest = min(widths)
    tokenizers = (
        [tokenizer]
        if tokenizer is not None
        else [m.tokenizer for m in (target_model, draft_model) if isinstance(m, LoadedModel)]
    )
    real = max((len(t) for t in tokenizers), default=0)
    if usable < real:
        raise SpecMTPError(
            f"model {narrowest!r} produces logits for only {usable} tokens "
            f"but the tokenizer has {real}"
        )
    return usable


def vocab_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """A digest of what every token id means: equal digests, interchangeable token ids."""
    text = json.dumps(sorted(_full_vocab(tokenizer).items()), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _full_vocab(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """Token -> id over the whole tokenizer, including added and special tokens."""
    vocab = dict(tokenizer.get_vocab())
    for token in tokenizer.all_special_tokens:
        vocab.setdefault(token, tokenizer.convert_tokens_to_ids(token))
    return vocab


def _first_difference(target: dict[str, int], draft: dict[str, int]) -> str:
    """The differing token with the smallest id; at a tied id, the target's token."""

    def order(token: str) -> tuple[int, bool]:
        first_id = min(v[token] for v in (target, draft) if token in v)
        return first_id, target.get(token) != first_id

    return min(
        (t for t in target.keys() | draft.keys() if target.get(t) != draft.get(t)), key=order
    )


def _where(vocab: dict[str, int], token: str, side: str) -> str:
    return f"id {vocab[token]} in the {side}" if token in vocab else f"absent from the {side}"


# Set on a model whose LM head was cut to a reduced output vocabulary (output_vocab.py): the
# rows its head had, which its drafter's logits still span (-inf off the kept ids).
LOGITS_WIDTH = "specmtp_logits_width"


def _logits_width(model: LoadedModel | PreTrainedModel) -> int:
    """Rows of the output embedding (what the logits really span), else config.vocab_size."""
    model = model.model if isinstance(model, LoadedModel) else model
    width = getattr(model, LOGITS_WIDTH, None)
    if width is not None:
        return int(width)
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(model.config.get_text_config().vocab_size)


def _model_name(model: LoadedModel | PreTrainedModel) -> str:
    return model.spec if isinstance(model, LoadedModel) else model.name_or_path
