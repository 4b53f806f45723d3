"""Multi-token-prediction heads: small modules on the target's last hidden state that draft
the tokens after the next one.

Vocabulary. At position t the target reads token x_t and produces h_t, its last hidden
state; its own LM head turns h_t into the distribution of x_{t+1}. A head or depth i
(0-based) predicts x_{t+2+i}.

- `ParallelHeads` (Medusa, Gloeckle et al. 2024): K independent heads, each residual
  blocks on h_t and an output projection. All K drafts come from one h_t.
- `SequentialMTP` (DeepSeek-V3): depth i combines the previous depth's hidden state with
  the embedding of the token it conditions on, runs one transformer block, and predicts
  through the LM head. The depths form a causal chain.

Hidden states. In transformers 5.24, `model(ids, output_hidden_states=True)
.hidden_states[-1]` is taken AFTER the final norm for Llama-style models: the LM head
applied to it gives exactly `logits` (checked in tests/test_heads.py). So heads consume
it as is, and a fresh share_lm_head `ParallelHeads` reproduces the target's logits.

The target's LM head and input embedding are shared as frozen, non-persistent buffers:
never trained, never saved, rebound from the target at load. With `draft_vocab` the
output projection covers only those token ids; `to_full_logits` scatters such logits
into the full vocabulary with -inf elsewhere, so q stays a distribution over all ids.

Saving and loading: `heads_io`; the check of which trunk they were trained on: `trunk`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from specmtp.errors import SpecMTPError
from specmtp.heads_config import HeadsConfig

# Attention of a block's queries, keys and values (each [B, heads, n, d]) -> [B, heads, n, d].
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_NORM_EPS = 1e-6


def describe_target(model: PreTrainedModel) -> str:
    """The `base_model` string heads record: architecture, depth, hidden and vocab size.

    It is built from the config only, so it survives dtype changes and cache paths, but it
    cannot tell apart two checkpoints of the same architecture and size: the trunk sample
    (`trunk.trunk_sample`) does that.
    """
    config = model.config.get_text_config()
    return (
        f"{type(model).__name__} layers={config.num_hidden_layers} "
        f"hidden={config.hidden_size} vocab={target_lm_head(model).shape[0]}"
    )


class VocabProjection(nn.Module):
    """Hidden [.., H] -> logits [.., V'] over the full vocabulary or the draft vocabulary
    `draft_vocab` (V' of the target's V token ids), with the maps between the two."""

    # A drafter's int8 product in place of the float one (int8.use_int8_products)
    int8: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(
        self,
        lm_head_weight: torch.Tensor,  # [V, H]
        *,
        draft_vocab: tuple[int, ...] | None,
        trainable: bool,
    ) -> None:
        super().__init__()
        weight = lm_head_weight.detach()
        ids = None if draft_vocab is None else torch.tensor(draft_vocab)
        if ids is not None:
            weight = weight[ids.to(weight.device)]  # [V', H]
        self.register_buffer("draft_ids", ids, persistent=False)
        # target id -> row of the draft logits, -1 outside draft_vocab; built once, since
        # training maps every label through it
        index = None
        if ids is not None:
            index = torch.full((lm_head_weight.shape[0],), -1, dtype=torch.long)
            index[ids] = torch.arange(len(ids))
        self.register_buffer("draft_index", index, persistent=False)
        self.vocab_size = lm_head_weight.shape[0]
        if trainable:
            self.weight = nn.Parameter(weight.clone())  # own copy, trained and saved
        else:
            self.register_buffer("weight", weight, persistent=False)  # frozen, not saved

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:  # a drafter's cheaper product (int8.use_int8_products)
            return self.int8(hidden)
        return F.linear(hidden, self.weight)

    def to_full_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids in the draft vocabulary (any shape) -> ids in the target's."""
        return ids if self.draft_ids is None else self.draft_ids[ids]

    def to_draft_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids (any shape) -> indices into the draft logits; -1 where the
        token is outside draft_vocab (a label that cannot be predicted)."""
        return ids if self.draft_index is None else self.draft_index[ids]

    def to_full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [..., V'] -> [..., V], -inf outside draft_vocab (softmax stays a
        distribution over the full vocabulary, zero off the draft vocabulary)."""
        if self.draft_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.draft_ids] = logits
        return full


class _HeadsBase(nn.Module):
    """What both kinds share: the config and the map back to full-vocabulary ids."""

    def __init__(self, config: HeadsConfig, lm_head_weight: torch.Tensor) -> None:
        super().__init__()
        if tuple(lm_head_weight.shape) != (config.vocab_size, config.hidden_size):
            raise SpecMTPError(
                f"LM head weight {tuple(lm_head_weight.shape)} does not match the heads' "
                f"vocab_size x hidden_size ({config.vocab_size}, {config.hidden_size})"
            )
        self.config = config
        self.projection = VocabProjection(
            lm_head_weight, draft_vocab=config.draft_vocab, trainable=not config.share_lm_head
        )

    def to_full_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.projection.to_full_ids(ids)

    def to_draft_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.projection.to_draft_ids(ids)

    def to_full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.projection.to_full_logits(logits)


class _ResidualBlock(nn.Module):
    """h + SiLU(W h + b), with W and b zero so that it starts as the identity (Medusa
    zeroes W only; zeroing b too makes the start exact, and SiLU'(0) = 1/2 keeps the
    gradient with respect to W nonzero)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + F.silu(self.linear(hidden))


class ParallelHeads(_HeadsBase):
    """K independent heads on h_t; head i predicts x_{t+2+i}."""

    def __init__(self, config: HeadsConfig, *, lm_head_weight: torch.Tensor) -> None:
        if config.kind != "parallel":
            raise SpecMTPError(f"ParallelHeads needs kind 'parallel', got {config.kind!r}")
        super().__init__(config, lm_head_weight)
        self.heads = nn.ModuleList(
            nn.Sequential(*(_ResidualBlock(config.hidden_size) for _ in range(config.num_layers)))
            for _ in range(config.num_heads)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, n, H] -> logits [B, K, n, V']."""
        return torch.stack([self.head(i, hidden) for i in range(len(self.heads))], dim=1)

    def head(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """Head i alone: hidden [..., H] -> logits [..., V'] (training scores few rows)."""
        return self.projection(self.heads[i](hidden))


class _Block(nn.Module):
    """Pre-norm causal self-attention and a SwiGLU MLP (intermediate size 2H).

    No positional encoding (NoPE): the causal mask already orders positions, and h_t
    carries the target's own position information; it keeps the block dependency-free.
    """

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.attn_norm = nn.RMSNorm(hidden_size, eps=_NORM_EPS)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.out = nn.Linear(hidden_size, hidden_size, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden_size, eps=_NORM_EPS)
        self.gate_up = nn.Linear(hidden_size, 4 * hidden_size, bias=False)
        self.down = nn.Linear(2 * hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, attend: Attend | None = None) -> torch.Tensor:
        """x [B, n, H] -> the block's output [B, n, H]. Without `attend`, the n positions
        attend causally to each other alone (training). With it, `attend(q, k, v)` (each
        [B, heads, n, d]) attends them to whatever the caller keeps besides: drafting's
        per-depth cache of earlier positions (mtp_cache.py)."""
        b, n, h = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, n, 3, self.num_heads, h // self.num_heads)
        q, k, v = qkv.transpose(1, 3).unbind(2)  # each [B, heads, n, d]
        if attend is None:
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, heads, n, d]
        else:
            attended = attend(q, k, v)
        x = x + self.out(attended.transpose(1, 2).reshape(b, n, h))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)  # each [B, n, 2H]
        return x + self.down(F.silu(gate) * up)


class _Depth(nn.Module):
    """One DeepSeek-V3 MTP module: norm both inputs, concat, 2H -> H, one block, norm."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.hidden_norm = nn.RMSNorm(hidden_size, eps=_NORM_EPS)
        self.embed_norm = nn.RMSNorm(hidden_size, eps=_NORM_EPS)
        self.combine = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = _Block(hidden_size, num_heads)
        self.final_norm = nn.RMSNorm(hidden_size, eps=_NORM_EPS)

    def forward(
        self, hidden: torch.Tensor, embedded: torch.Tensor, attend: Attend | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden, embedded [B, n, H] -> this depth's hidden state and normed output, each
        [B, n, H]; `attend` as in _Block."""
        joined = torch.cat([self.hidden_norm(hidden), self.embed_norm(embedded)], dim=-1)
        out = self.block(self.combine(joined), attend)
        return out, self.final_norm(out)


class _FeatureFusion(nn.Module):
    """k of the target's hidden states [..., k*H] -> one [..., H]: each RMS-normed (the
    residual stream's scale grows with depth), concatenated, projected (EAGLE-3).

    The projection starts as the identity on the last (highest) layer and zero on the
    others, so fused heads begin exactly where heads on that layer alone are: depth 0
    RMS-norms its input, and a norm of the final state differs from it by a scalar only.
    """

    def __init__(self, hidden_size: int, layers: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.RMSNorm(hidden_size, eps=_NORM_EPS) for _ in range(layers))
        self.project = nn.Linear(layers * hidden_size, hidden_size, bias=False)
        with torch.no_grad():
            self.project.weight.zero_()
            self.project.weight[:, -hidden_size:] = torch.eye(hidden_size)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        parts = features.chunk(len(self.norms), dim=-1)  # k x [..., H]
        return self.project(torch.cat([n(p) for n, p in zip(self.norms, parts, strict=True)], -1))


class SequentialMTP(_HeadsBase):
    """DeepSeek-V3 multi-token prediction: K chained depths, depth i predicts x_{t+2+i}.

    Depth i at position t reads h^{i-1}_t (h^{-1} = the target's h_t) and the embedding
    of x_{t+1+i}. The embedding is the target's, RMS-normed before use, so a constant
    embedding scale (as in Gemma) does not matter and the plain weight suffices.
    """

    def __init__(
        self, config: HeadsConfig, *, lm_head_weight: torch.Tensor, embed_weight: torch.Tensor
    ) -> None:
        if config.kind != "sequential":
            raise SpecMTPError(f"SequentialMTP needs kind 'sequential', got {config.kind!r}")
        if embed_weight.shape[1] != config.hidden_size:
            raise SpecMTPError(
                f"embedding width {embed_weight.shape[1]} != hidden_size {config.hidden_size}"
            )
        super().__init__(config, lm_head_weight)
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.depths = nn.ModuleList(
            _Depth(config.hidden_size, config.attention_heads) for _ in range(config.num_heads)
        )
        layers = config.feature_layers
        self.fusion = None if layers is None else _FeatureFusion(config.hidden_size, len(layers))

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [..., F] (see `target_features`) -> depth 0's input [..., H]."""
        return features if self.fusion is None else self.fusion(features)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embed_weight)  # [B, n] -> [B, n, H]

    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """Depth 0 only: hidden [B, n, F], next_tokens [B, n] (x_{t+1}) -> logits [B, n, V']."""
        _, normed = self.depths[0](self.fuse(hidden), self.embed(next_tokens))
        return self.projection(normed)

    def forward_all(self, hidden: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        """All depths with teacher forcing, for training.

        hidden [B, n, F] is the target's features over tokens [B, n] (the same input ids).
        Returns logits_i [B, n-1-i, V'] for each depth i < min(K, n-1); row t predicts
        x_{t+2+i}, so rows with t + 2 + i < n have a target inside the sequence.
        """
        n, logits, state = tokens.shape[1], [], self.fuse(hidden)
        for i, depth in enumerate(self.depths[: max(0, n - 1)]):
            state, normed = depth(state[:, : n - 1 - i], self.embed(tokens[:, 1 + i :]))
            logits.append(self.projection(normed))  # [B, n-1-i, V']
        return logits


Heads = ParallelHeads | SequentialMTP


def build_heads(config: HeadsConfig, target_model: PreTrainedModel) -> Heads:
    """Fresh heads for `target_model`, sharing its LM head (and embedding), on its device
    and in its dtype. The one place that turns `kind` into a class."""
    layers = target_model.config.get_text_config().num_hidden_layers
    if config.feature_layers is not None and config.feature_layers[-1] > layers:
        raise SpecMTPError(
            f"heads read hidden state {config.feature_layers[-1]}, but the model has "
            f"{layers} layers (hidden states 0..{layers})"
        )
    lm_head = target_lm_head(target_model)
    heads: Heads
    if config.kind == "parallel":
        heads = ParallelHeads(config, lm_head_weight=lm_head)
    else:
        embed = target_model.get_input_embeddings().weight
        heads = SequentialMTP(config, lm_head_weight=lm_head, embed_weight=embed)
    return heads.to(device=lm_head.device, dtype=lm_head.dtype)


def target_features(
    hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...] | None
) -> torch.Tensor:
    """What heads read from a forward with `output_hidden_states`: the final (normed)
    state [..., H], or with `layers` those states side by side [..., len(layers) * H]."""
    if layers is None:
        return hidden_states[-1]
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


def widen_heads(heads: Heads, layers: tuple[int, ...], target_model: PreTrainedModel) -> Heads:
    """Sequential heads trained on the final state alone, reading `layers` instead: the
    same weights and a fresh fusion, which starts as the identity on the last layer (so
    they draft as before until trained)."""
    if not isinstance(heads, SequentialMTP) or heads.fusion is not None:
        raise SpecMTPError("only sequential heads without feature layers can be widened")
    final = target_model.config.get_text_config().num_hidden_layers
    if layers[-1] != final:
        raise SpecMTPError(
            f"widened heads must read the final hidden state ({final}) last, got {list(layers)}"
        )
    wider = build_heads(dataclasses.replace(heads.config, feature_layers=layers), target_model)
    missing, unexpected = wider.load_state_dict(heads.state_dict(), strict=False)
    assert not unexpected and all(name.startswith("fusion.") for name in missing)
    return wider.to(dtype=next(heads.parameters()).dtype)


def target_lm_head(model: PreTrainedModel) -> torch.Tensor:
    """The target's LM head weight [V, H], which heads project through (and share)."""
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise SpecMTPError(f"{type(model).__name__}: MTP heads need a bias-free linear LM head")
    return head.weight  # [V, H]
