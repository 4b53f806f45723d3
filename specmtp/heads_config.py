"""What a set of MTP heads is (`HeadsConfig`): kind, sizes, draft vocabulary, the target
layers it reads, and the target it was trained for; stored as `heads.json` (heads_io)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass

from specmtp.errors import SpecMTPError

_KINDS = ("parallel", "sequential")


@dataclass(frozen=True)
class HeadsConfig:
    """What a set of heads is and which target it was trained for.

    `num_layers` is the number of residual blocks per parallel head (a sequential depth is
    always one transformer block). `attention_heads` splits the sequential block's
    attention and must divide hidden_size; parallel heads ignore it.
    """

    kind: str
    num_heads: int
    hidden_size: int
    vocab_size: int
    base_model: str
    num_layers: int = 1
    draft_vocab: tuple[int, ...] | None = None
    share_lm_head: bool = True
    attention_heads: int = 4
    # Which of the target's hidden states the heads read (EAGLE-3's feature fusion): indices
    # into `output_hidden_states` (0: the embeddings; the last layer's index: the final,
    # normed state), ascending. None: the final state alone. See `target_features`.
    feature_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise SpecMTPError(f"heads kind must be one of {_KINDS}, got {self.kind!r}")
        for name in ("num_heads", "hidden_size", "vocab_size", "num_layers", "attention_heads"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise SpecMTPError(f"heads {name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.base_model, str) or not isinstance(self.share_lm_head, bool):
            raise SpecMTPError("heads base_model must be a string and share_lm_head a bool")
        if self.kind == "sequential" and self.hidden_size % self.attention_heads:
            raise SpecMTPError(
                f"heads attention_heads ({self.attention_heads}) must divide "
                f"hidden_size ({self.hidden_size})"
            )
        if self.draft_vocab is not None:
            ids = tuple(self.draft_vocab)
            if not ids or not all(isinstance(i, int) and 0 <= i < self.vocab_size for i in ids):
                raise SpecMTPError(
                    f"draft_vocab must be a non-empty list of token ids in [0, {self.vocab_size})"
                )
            if len(set(ids)) != len(ids):
                raise SpecMTPError("draft_vocab lists a token id more than once")
            object.__setattr__(self, "draft_vocab", ids)  # a list given in: store hashable
        if self.feature_layers is not None:  # a list given in: store hashable
            object.__setattr__(
                self, "feature_layers", check_feature_layers(self.feature_layers, self.kind)
            )

    @property
    def output_size(self) -> int:
        """V': the width of the logits the heads produce."""
        return self.vocab_size if self.draft_vocab is None else len(self.draft_vocab)

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        if self.draft_vocab is not None:
            fields["draft_vocab"] = list(self.draft_vocab)
        if self.feature_layers is None:  # heads saved before the field existed read the same
            del fields["feature_layers"]
        else:
            fields["feature_layers"] = list(self.feature_layers)
        return json.dumps(fields, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> HeadsConfig:
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecMTPError(f"heads config is not valid JSON: {exc}") from exc
        if not isinstance(fields, dict):
            raise SpecMTPError("heads config must be a JSON object")
        known = {field.name for field in dataclasses.fields(cls)}
        if unknown := sorted(set(fields) - known):
            raise SpecMTPError(f"heads config has unknown fields {unknown}")
        try:
            return cls(**fields)
        except TypeError as exc:  # a required field is missing
            raise SpecMTPError(f"heads config is incomplete: {exc}") from exc


def check_feature_layers(layers: Sequence[int], kind: str) -> tuple[int, ...]:
    """`layers` as a tuple if sequential heads may read them (see HeadsConfig), else a
    SpecMTPError naming the flag (train-mtp checks its settings with it before any data)."""
    layers = tuple(layers)
    if kind != "sequential":
        raise SpecMTPError("feature layers (--feature-layers) need sequential heads")
    if not layers or not all(isinstance(i, int) and i >= 0 for i in layers):
        raise SpecMTPError(f"feature layers must be layer indices >= 0, at least one; got {layers}")
    if list(layers) != sorted(set(layers)):
        raise SpecMTPError(f"feature layers must be ascending and distinct, got {layers}")
    return layers
