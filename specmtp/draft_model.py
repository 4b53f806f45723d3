"""Small standalone draft models for a target: a few Llama decoder layers on the target's
own token embedding, and the target's LM head restricted to a draft vocabulary.

Why this shape. On a CPU a draft pays only if one draft step costs about a tenth of a
target step (c = draft step / target step). A full LM head alone (49,152 x 576 for the
default model) costs c ~ 0.2, so the draft projects onto the `draft_vocab` most frequent
tokens of the training data (its other tokens get probability 0; rejection sampling stays
lossless, since q may be zero where p is not). The input embedding and the projection
rows are the target's, frozen and not saved: the shipped files hold only the decoder
layers (and MTP heads), and loading binds them to a target again.

A `DraftLM` behaves like a Hugging Face causal LM towards `CachedModel`: it takes
`input_ids`, `position_ids`, `cache`, `logits_to_keep` and `output_hidden_states`, and
returns logits over the full vocabulary (-inf outside the draft vocabulary).

With `mtp_heads` > 0 it also carries parallel MTP heads (`heads.ParallelHeads`) on its
final hidden state: head i predicts the token 2+i positions ahead, so one draft forward
proposes 1 + mtp_heads tokens.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, LlamaModel, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from specmtp.errors import SpecMTPError
from specmtp.files import write_atomically
from specmtp.heads import ParallelHeads, VocabProjection, describe_target
from specmtp.heads_config import HeadsConfig
from specmtp.trunk import check_trunk, write_trunk

DRAFT_WEIGHTS = "draft.safetensors"
DRAFT_CONFIG = "draft.json"
# Drafts shipped for the default model: spec name -> folder under shipped_drafts_dir().
# `distilled-mtp-ar` is the MTP-trained draft drafting with its next-token head alone.
SHIPPED_DRAFTS = {
    "general": "general",
    "distilled": "distilled",
    "distilled-mtp": "distilled-mtp",
    "distilled-mtp-ar": "distilled-mtp",
}
# Decoder-layer settings copied from the target, so its layers can initialise the draft's.
_BODY_KEYS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters",
)  # fmt: skip


@dataclass(frozen=True)
class DraftConfig:
    """What a draft is and which target it belongs to; saved as draft.json.

    `body` holds the Llama settings of the decoder layers (hidden_size must be the
    target's: the draft reads the target's embeddings). `objective` and `init` record how
    it was made ("distill" / "text"; "target:0,1" = copied from those target layers).
    """

    base_model: str  # heads.describe_target(target)
    vocab_size: int  # the target's V
    body: dict[str, Any]
    num_layers: int = 2
    draft_vocab: tuple[int, ...] | None = None
    mtp_heads: int = 0
    objective: str = "distill"
    init: str = "random"

    def __post_init__(self) -> None:
        for name, least in (("vocab_size", 1), ("num_layers", 1), ("mtp_heads", 0)):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
                raise SpecMTPError(f"draft {name} must be an integer >= {least}, got {value!r}")
        if not isinstance(self.body, dict) or not isinstance(self.body.get("hidden_size"), int):
            raise SpecMTPError("draft body must be an object with an integer hidden_size")
        if unknown := sorted(set(self.body) - set(_BODY_KEYS)):
            raise SpecMTPError(f"draft body has fields {unknown}; allowed: {list(_BODY_KEYS)}")
        try:
            self.llama_config()
        except (TypeError, ValueError, StrictDataclassError) as exc:  # transformers' checks
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise SpecMTPError(f"draft body is not a valid Llama configuration: {first}") from exc
        if self.draft_vocab is not None:
            # HeadsConfig validates a draft vocabulary the same way; reuse it.
            self.heads_config()
            object.__setattr__(self, "draft_vocab", tuple(self.draft_vocab))

    @property
    def hidden_size(self) -> int:
        return self.body["hidden_size"]

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(
            # vocab_size=1: the body's own embedding is never used (the target's is)
            **self.body, num_hidden_layers=self.num_layers, vocab_size=1, pad_token_id=None,
            bos_token_id=None, eos_token_id=None,
            attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        )  # fmt: skip

    def heads_config(self) -> HeadsConfig:
        """The MTP heads' config (also validates draft_vocab, even with no heads)."""
        return HeadsConfig(
            kind="parallel", num_heads=max(1, self.mtp_heads), hidden_size=self.hidden_size,
            vocab_size=self.vocab_size, base_model=self.base_model, draft_vocab=self.draft_vocab,
        )  # fmt: skip

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        if self.draft_vocab is not None:
            fields["draft_vocab"] = list(self.draft_vocab)
        return json.dumps(fields, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DraftConfig:
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecMTPError(f"draft config is not valid JSON: {exc}") from exc
        known = {field.name for field in dataclasses.fields(cls)}
        if not isinstance(fields, dict) or set(fields) - known:
            raise SpecMTPError(f"draft config must be an object of the fields {sorted(known)}")
        try:
            return cls(**fields)
        except TypeError as exc:
            raise SpecMTPError(f"draft config is incomplete: {exc}") from exc


def draft_config_for(
    target: PreTrainedModel,
    *,
    num_layers: int,
    draft_vocab: tuple[int, ...] | None,
    mtp_heads: int = 0,
    objective: str = "distill",
    init: str = "random",
) -> DraftConfig:
    """A draft config whose layers have the target's own dimensions."""
    config = target.config.get_text_config()
    body = {key: getattr(config, key) for key in _BODY_KEYS if getattr(config, key, None)}
    body["hidden_size"] = config.hidden_size
    return DraftConfig(
        base_model=describe_target(target), vocab_size=output_weight(target).shape[0],
        body=json.loads(json.dumps(body)), num_layers=num_layers, draft_vocab=draft_vocab,
        mtp_heads=mtp_heads, objective=objective, init=init,
    )  # fmt: skip


class DraftLM(nn.Module):
    """Decoder layers between the target's frozen embedding and its frozen LM-head rows."""

    def __init__(self, config: DraftConfig, *, target: PreTrainedModel) -> None:
        super().__init__()
        _check_target(config, target, where="this draft")
        self.draft_config = config
        self.body = LlamaModel(config.llama_config())
        self.body.embed_tokens = None  # the target's embedding, passed in as inputs_embeds
        self.config = self.body.config  # what DynamicCache and KV-size accounting read
        self.register_buffer(
            "embedding", target.get_input_embeddings().weight.detach(), persistent=False
        )
        self.projection = VocabProjection(
            output_weight(target), draft_vocab=config.draft_vocab, trainable=False
        )
        self.heads: ParallelHeads | None = None
        if config.mtp_heads:
            self.heads = ParallelHeads(config.heads_config(), lm_head_weight=output_weight(target))
            self.heads.projection = self.projection  # one projection, shared
        self.to(dtype=target.dtype, device=target.device)

    @property
    def device(self) -> torch.device:
        return self.embedding.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.dtype

    def hidden(
        self,
        input_ids: torch.Tensor,  # [B, n]
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
    ) -> torch.Tensor:
        """The final hidden states [B, n, H], after the final norm."""
        out = self.body(
            inputs_embeds=F.embedding(input_ids, self.embedding), attention_mask=attention_mask,
            position_ids=position_ids, cache=cache, use_cache=cache is not None,
        )  # fmt: skip
        return out.last_hidden_state

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, n]
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
        output_hidden_states: bool = False,
    ) -> CausalLMOutputWithPast:
        """The causal-LM call CachedModel makes; logits [B, n', V] over the full vocabulary."""
        hidden = self.hidden(
            input_ids, attention_mask=attention_mask, position_ids=position_ids,
            cache=cache if use_cache else None,
        )  # fmt: skip
        kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        logits = self.projection.to_full_logits(self.projection(kept))
        return CausalLMOutputWithPast(
            logits=logits, hidden_states=(hidden,) if output_hidden_states else None
        )

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """MTP heads on hidden [B, n, H] -> draft-vocabulary logits [B, K, n, V']."""
        if self.heads is None:
            raise SpecMTPError("this draft has no MTP heads")
        return self.heads(hidden)


def init_from_target(draft: DraftLM, target: PreTrainedModel, layers: list[int]) -> str:
    """Copy target decoder layers `layers` (and the final norm) into the draft; return the
    `init` string to record. Needs a Llama target with the draft's layer dimensions."""
    if target.config.model_type != "llama":
        raise SpecMTPError(
            f"initialising from target layers needs a Llama target, got "
            f"{target.config.model_type!r} (use random initialisation)"
        )
    source = target.get_decoder()
    count = len(source.layers)
    if len(layers) != len(draft.body.layers) or not all(0 <= i < count for i in layers):
        raise SpecMTPError(
            f"need {len(draft.body.layers)} target layer indices in [0, {len(source.layers)}), "
            f"got {layers}"
        )
    for mine, index in zip(draft.body.layers, layers, strict=True):
        mine.load_state_dict(source.layers[index].state_dict())
    draft.body.norm.load_state_dict(source.norm.state_dict())
    return "target:" + ",".join(map(str, layers))


def trainable_state(draft: DraftLM) -> dict[str, torch.Tensor]:
    """What a draft saves: every parameter (the shared target tensors are buffers)."""
    return {name: p.detach().contiguous() for name, p in draft.named_parameters()}


def save_draft(
    draft: DraftLM,
    directory: str | Path,
    *,
    dtype: torch.dtype | None = None,
    target: PreTrainedModel | None = None,
) -> None:
    """Write draft.safetensors and draft.json atomically (weights in `dtype` if given) and,
    given the target it was trained for, a sample of its weights (trunk.TRUNK_FILE)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype or v.dtype) for k, v in trainable_state(draft).items()}
    write_atomically(directory / DRAFT_WEIGHTS, lambda path: save_file(tensors, str(path)))
    text = draft.draft_config.to_json()
    write_atomically(directory / DRAFT_CONFIG, lambda path: path.write_text(text))
    if target is not None:
        write_trunk(directory, target)


def shipped_drafts_dir() -> Path:
    """The drafts that ship with the package, trained for the default model."""
    return Path(__file__).parent / "assets" / "smollm2-135m-drafts"


def is_draft_dir(path: str | Path) -> bool:
    return (Path(path) / DRAFT_CONFIG).is_file()


def load_draft(directory: str | Path, *, target: PreTrainedModel) -> DraftLM:
    """A draft saved by save_draft, checked against and bound to `target`."""
    directory = Path(directory)
    try:
        config = DraftConfig.from_json((directory / DRAFT_CONFIG).read_text())
        tensors = load_file(str(directory / DRAFT_WEIGHTS))
    except (OSError, UnicodeDecodeError, SafetensorError) as exc:
        raise SpecMTPError(f"cannot read a draft from {directory}: {exc}") from exc
    _check_target(config, target, where=f"the draft in {directory}")
    check_trunk(directory, target, what="draft")
    draft = DraftLM(config, target=target)
    try:
        draft.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise SpecMTPError(f"the draft in {directory} does not match its config: {first}") from exc
    return draft.eval().requires_grad_(False)


def _check_target(config: DraftConfig, target: PreTrainedModel, *, where: str) -> None:
    hidden = target.config.get_text_config().hidden_size
    for what, theirs, ours in (
        ("base model", config.base_model, describe_target(target)),
        ("vocab size", config.vocab_size, output_weight(target).shape[0]),
        ("hidden size", config.hidden_size, hidden),
    ):
        if theirs != ours:
            raise SpecMTPError(f"{where} was made for {what} {theirs!r}, the target has {ours!r}")


def output_weight(target: PreTrainedModel) -> torch.Tensor:
    head = target.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise SpecMTPError(f"{type(target).__name__}: a draft needs a bias-free linear LM head")
    return head.weight  # [V, H]
