"""A causal LM together with its KV cache. Appending is a forward; rolling back is a crop."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from specmtp.errors import SpecMTPError
from specmtp.heads import target_features

if TYPE_CHECKING:  # lean.py imports invariant.py, which imports this module
    from specmtp.lean import LeanForward


class CachedModel:
    """Runs a Hugging Face causal LM one chunk at a time over a growing KV cache.

    `length` is the number of positions held in the cache. `forward(tokens)` appends the
    tokens at positions `length..length+n-1` and returns their logits; `crop(n)` rolls the
    cache back to its first n positions. Only plain full-attention layers are accepted:
    their rollback is exact. Sliding-window and recurrent layers keep no full history, so
    they are refused rather than rolled back approximately.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        vocab_size: int,
        name: str = "model",
        keep_hidden: bool = False,
        hidden_layers: tuple[int, ...] | None = None,
    ) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.name = name
        # With keep_hidden, `last_hidden` [B, n, H] holds the final hidden states (the LM
        # head's input) of the tokens of the latest forward: MTP heads draft from them.
        # With hidden_layers, those layers' states side by side (heads.target_features).
        self.keep_hidden = keep_hidden
        self.hidden_layers = hidden_layers
        self.last_hidden: torch.Tensor | None = None
        # A cheaper forward for decode steps (lean.py), where the drafter set one
        self.lean: LeanForward | None = None
        self.cache = self._new_cache()
        self.length = 0

    def _new_cache(self) -> DynamicCache:
        cache = DynamicCache(config=self.model.config)
        for layer in cache.layers:
            if type(layer) is not DynamicLayer:
                raise SpecMTPError(
                    f"{self.name}: its cache layers ({type(layer).__name__}) cannot be rolled back "
                    "exactly, so speculative decoding is refused for this model"
                )
        return cache

    @property
    def device(self) -> torch.device:
        return self.model.device

    def reset(self) -> None:
        self.cache = self._new_cache()
        self.length = 0

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        *,
        last_only: bool = False,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append tokens [B, n]; return logits [B, n, V] (or [B, 1, V] with last_only).

        Without a mask the tokens form a chain at positions length..length+n-1; a tree
        passes its own 4-D mask [B, 1, n, length+n] and position ids [B, n].
        """
        n = tokens.shape[1]
        if position_ids is None:
            position_ids = torch.arange(self.length, self.length + n, device=tokens.device)[None]
        if (
            self.lean is not None
            and not self.keep_hidden
            and self.lean.takes(tokens, attention_mask)
        ):
            logits = self.lean(
                tokens, self.cache, position_ids=position_ids, attention_mask=attention_mask,
                last_only=last_only,
            )  # fmt: skip
            self.length += n
            return logits[..., : self.vocab_size]
        out = self.model(
            input_ids=tokens,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
            output_hidden_states=self.keep_hidden,
        )
        if self.keep_hidden:
            # hidden_states[-1] is taken after the final norm, in transformers 5
            self.last_hidden = target_features(out.hidden_states, self.hidden_layers)
        self.length += n
        return out.logits[..., : self.vocab_size]

    def crop(self, length: int) -> None:
        """Keep the first `length` cached positions and drop the rest."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        if length < self.length:
            self.cache.crop(length - self.length)  # transformers 5: a negative count removes
            self.length = length

    @torch.inference_mode()
    def keep(self, start: int, kept: torch.Tensor) -> None:
        """Keep positions 0..start-1, then the positions `kept` [m] (ascending, >= start),
        moved down to start..start+m-1: how a tree round keeps its accepted path."""
        if len(kept) and (kept[0] < start or kept[-1] >= self.length or (kept.diff() <= 0).any()):
            raise ValueError(f"cannot keep positions {kept.tolist()} of {self.length} from {start}")
        end = start + len(kept)
        for layer in self.cache.layers:
            if layer.is_initialized:
                for name in ("keys", "values"):
                    states = getattr(layer, name)  # [B, H, S, d]
                    states[..., start:end, :] = states.index_select(-2, kept.to(states.device))
                    setattr(layer, name, states[..., :end, :])
        self.length = end

    def kv_bytes(self) -> int:
        """Bytes held by the cached keys and values (the lean forward's buffers, where it
        keeps them: the cache's tensors are views of those)."""
        held = None if self.lean is None else self.lean.held_bytes(self.cache)
        if held is not None:
            return held
        return sum(
            layer.keys.numel() * layer.keys.element_size() * 2
            for layer in self.cache.layers
            if layer.is_initialized
        )


def kv_bytes_per_token(model: PreTrainedModel) -> int:
    """Bytes of keys and values one position adds to the cache, from the model's config.

    Read before any allocation, so a memory budget can be checked before it is exceeded.
    """
    config = model.config.get_text_config()
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    element = torch.empty((), dtype=model.dtype).element_size()
    return 2 * layers * kv_heads * head_dim * element


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of distinct storages: tied or shared weights counted once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())
