"""A lean decode-step forward for `#int8` and `#int4` draft models of the Llama and Qwen2
families.

A draft step of the Qwen2.5 0.5B draft (1 row, bfloat16, int8 products, 2 threads, this
Intel Xeon) took 41.5 ms through transformers' forward, of which its int8 products were
26.4 ms: the rest was the modeling code's small tensor operations, about fifteen for the
rotary embedding of a layer, seven for each norm (4.0 ms for the 49 norms), each a few
microseconds of dispatch on one row (scripts/lean_profile.py). The draft's cost per forward
is what speculative decoding pays for every proposed token, so this module runs the same
computation in a dozen calls a layer: q, k and v in one product (their matrices stacked),
gate and up in another, one C call (lean.c) to rotate and lay out q and k, one for each
residual add and the RMS norm after it, the row-wise attention of attention.c, silu(gate) *
up in one more, the residual stream in float32, the products writing outputs kept from step
to step. 32.6 ms a step (-21%); with `#int4` layers 23.4-24.1 ms. Those calls from Python
cost about 6 ms of it, so by default every layer runs in one C call (lean_layers.py: the
same kernels in the same order, the same bits; `layer_step` stays as the reference):
17.7 ms for one row, 23.5 for four (30.2 before).

Style point 6 says: never fork modeling files. This is not a fork but a second
implementation of one decode step for drafters only, kept honest two ways: it is used only
where every part of the model is one it knows (`unsupported` names what is not), and at
load its logits are compared with transformers' own on a probe (`agrees`); a model that
differs keeps transformers' forward. Its numbers differ from transformers' by rounding
(float32 where transformers rounds to bfloat16 between operations, amplified by the int8
products' 8-bit inputs), which can only move which tokens the draft proposes: the target
verifies them, so outputs do not change.

Prompts (more than MAX_LOOP_ROWS tokens) and forwards that must return hidden states go
through transformers; both fill the same DynamicCache, so the two mix freely.
SPECMTP_LEAN=0 turns it off (for A/B runs).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import torch
from transformers import DynamicCache, PreTrainedModel

from specmtp import native
from specmtp.int4 import Int4Linear, Int4Product
from specmtp.int8 import BLOCK, Int8Linear, Int8Product
from specmtp.invariant import MAX_LOOP_ROWS, _kernel_rows, _native_attention, kernel_takes
from specmtp.lean_layers import CStep, KVBuffers

ENABLE = "SPECMTP_LEAN"
FAMILIES = ("llama", "qwen2")
# The least correlation of a probe row's logits with transformers' that passes. Rounding
# differs (float32 here), and each int8 or int4 product rounds its input row to 8 bits, so a
# small change can move an input by a step. Least row of 3 on a random-token probe: the
# Qwen2.5 0.5B draft 0.9945 (int8) and 0.9945 (int4), SmolLM2-135M 0.989-0.990 (int8 and
# int4, float32 and bfloat16), all correct; with an attention scale 1.5 times too large the
# Qwen draft gave 0.972 (int8) and 0.967 (int4), with one layer's norm weights reversed
# 0.73 and 0.70. Compared layer by layer instead (each fed transformers' input), the same
# bugs were harder to tell from rounding: a layer's change of the states differed by up to
# 19% with no bug (rows whose range one large value sets round coarsely).
CORRELATION = 0.98


Product = Int8Product | Int4Product
_FLOAT32 = torch.empty(0)  # the rotary embedding reads its input's dtype and device only


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [hidden] float32
    qkv: Product  # q, k and v stacked: [(heads + 2 kv_heads) * d, hidden]
    o: Product
    post_norm: torch.Tensor  # [hidden] float32
    gate_up: Product  # gate and up stacked: [2 * intermediate, hidden]
    down: Product


@dataclass
class _Outputs:
    """A step's product outputs [n, features] float32, and the MLP's activation."""

    qkv: torch.Tensor
    q: torch.Tensor  # [n, heads, d], rotated (lean.c's step)
    attended: torch.Tensor  # [n, heads * d], attention's output (lean.c's step)
    o: torch.Tensor
    gate_up: torch.Tensor
    activation: torch.Tensor
    down: torch.Tensor


class LeanForward:
    """One decode step (at most MAX_LOOP_ROWS rows) of a supported model over its cache."""

    def __init__(self, model: PreTrainedModel) -> None:
        config, body = model.config, model.model
        self.eps = config.rms_norm_eps
        self.embed = body.embed_tokens
        self.rotary = body.rotary_emb
        self.final_norm = body.norm.weight.float()
        self.lm_head = model.lm_head.product
        attention = body.layers[0].self_attn
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.scale = attention.head_dim, attention.scaling
        self.intermediate = config.intermediate_size
        self.layers = [_lean_layer(layer) for layer in body.layers]
        self.kernels = native.lean_kernels()
        self.attend = native.attention_kernel()
        self._attend_address = ctypes.cast(self.attend, ctypes.c_void_p)  # for lean.c
        # Every layer in one C call (lean_layers.py), with each cache's keys and values in
        # buffers it writes into; False: layer_step from Python, the reference it matches
        self.in_c = True
        self._buffers: WeakKeyDictionary[DynamicCache, KVBuffers] = WeakKeyDictionary()
        # The products' outputs for a step of n rows, kept from step to step (a fresh
        # tensor a product cost about 15 us more than one written before: 1.5 ms a step)
        self._outputs: dict[int, _Outputs] = {}

    def takes(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
        """Whether this forward serves the call: one batch row, a decode step's few rows,
        causal or a 4-D mask."""
        batch, n = tokens.shape
        return (
            batch == 1
            and n <= MAX_LOOP_ROWS
            and (attention_mask is None or attention_mask.dim() == 4)
        )

    @torch.inference_mode()
    def __call__(
        self,
        tokens: torch.Tensor,
        cache: DynamicCache,
        *,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """tokens [1, n] at position_ids [1, n], appended to `cache`; logits [1, n, V]
        float32 ([1, 1, V] with last_only). The mask as CachedModel.forward takes it."""
        x = self.embed(tokens[0]).float()  # [n, hidden], the residual stream
        h = torch.empty_like(x)  # [n, hidden], the normed stream the products read
        rotary = self.rotary_tables(position_ids)
        if self.in_c:
            self._layers_in_c(x, h, rotary, cache, attention_mask)
        else:
            delta = None  # the MLP's output, added to x by the next norm
            for index in range(len(self.layers)):
                delta = self.layer_step(index, x, delta, h, rotary, cache, attention_mask)
            self._add_norm(x, delta, self.final_norm, h)
        return self.lm_head(h[-1:] if last_only else h)[None]

    def held_bytes(self, cache: DynamicCache) -> int | None:
        """Bytes of the buffers holding `cache`'s keys and values, None if it has none."""
        buffers = self._buffers.get(cache)
        return None if buffers is None else buffers.nbytes()

    def _layers_in_c(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        cache: DynamicCache,
        attention_mask: torch.Tensor | None,
    ) -> None:
        """Every layer_step and the final norm, in lean.c: x [n, hidden] updated in place,
        h [n, hidden] the final norm's output; the keys and values appended to `cache`."""
        n, hidden = x.shape
        past = cache.get_seq_length()
        kv_dtype = self.embed.weight.dtype
        if cache not in self._buffers:
            self._buffers[cache] = KVBuffers(self.layers, self.kv_heads, self.head_dim, kv_dtype)
        buffers = self._buffers[cache]
        buffers.hold(cache, past, past + n)
        prefix, extra_start, extras = _kernel_rows(attention_mask, 0, n, past + n)
        outputs, (cos, sin) = self._outputs_for(n, self.layers[0]), rotary
        step = CStep(
            n, hidden, self.intermediate, buffers.capacity, past, self.heads, self.kv_heads,
            self.head_dim, int(kv_dtype == torch.bfloat16), torch.get_num_threads(),
            cos.data_ptr(), sin.data_ptr(), prefix.data_ptr(), extra_start.data_ptr(),
            extras.data_ptr(), self.final_norm.data_ptr(), outputs.qkv.data_ptr(),
            outputs.q.data_ptr(), outputs.attended.data_ptr(), outputs.o.data_ptr(),
            outputs.gate_up.data_ptr(), outputs.activation.data_ptr(), outputs.down.data_ptr(),
            self.eps, self.scale,
        )  # fmt: skip
        layers = ctypes.byref(buffers.layers)
        if self.kernels.layers(layers, len(self.layers), self._attend_address,
                               ctypes.byref(step), x.data_ptr(), h.data_ptr()):  # fmt: skip
            raise MemoryError(f"lean step of {n} rows: a kernel ran out of memory")
        buffers.publish(cache, past + n)

    def rotary_tables(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [n, d] float32 at position_ids [1, n], from the model's own rotary
        embedding (its scaling included)."""
        cos, sin = self.rotary(_FLOAT32, position_ids)  # [1, n, d]
        return cos[0].contiguous(), sin[0].contiguous()

    def layer_step(
        self,
        index: int,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        h: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        cache: DynamicCache,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Decoder layer `index` on the residual stream x [n, hidden] (float32, updated in
        place), the previous layer's MLP output `delta` added first; h [n, hidden] scratch.
        Returns this layer's MLP output [n, hidden] (not yet added to x), in a tensor the
        next layer's step writes again: read it before then."""
        layer, n = self.layers[index], x.shape[0]
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        kv_dtype = self.embed.weight.dtype
        outputs = self._outputs_for(n, layer)
        self._add_norm(x, delta, layer.input_norm, h)
        layer.qkv.into(h, outputs.qkv)  # [n, (H + 2 Hkv) d]
        q = torch.empty(n, heads, d)  # [n, H, d]
        k = torch.empty(1, kv_heads, n, d, dtype=kv_dtype)  # [1, Hkv, n, d]
        v = torch.empty_like(k)
        cos, sin = rotary
        self.kernels.rotary(
            outputs.qkv.data_ptr(), n, heads, kv_heads, d, cos.data_ptr(), sin.data_ptr(),
            q.data_ptr(), k.data_ptr(), v.data_ptr(), int(kv_dtype == torch.bfloat16),
        )  # fmt: skip
        keys, values = cache.update(k, v, index)  # [1, Hkv, S, d]
        query = q.transpose(0, 1)[None]  # [1, H, n, d]
        out = _native_attention(self.attend, query, keys, values, attention_mask, self.scale)
        layer.o.into(out.view(n, heads * d), outputs.o)
        self._add_norm(x, outputs.o, layer.post_norm, h)
        layer.gate_up.into(h, outputs.gate_up)  # [n, 2 I]
        self.kernels.silu_mul(
            outputs.gate_up.data_ptr(), n, self.intermediate, outputs.activation.data_ptr()
        )
        layer.down.into(outputs.activation, outputs.down)
        return outputs.down

    def _outputs_for(self, n: int, layer: _Layer) -> _Outputs:
        """The kept outputs of a step of n rows (every layer has the same shapes). The
        MLP's output is read by the next layer's norm before that layer writes it."""
        if n not in self._outputs:
            hidden = layer.o.out_features
            self._outputs[n] = _Outputs(
                qkv=torch.empty(n, layer.qkv.out_features),
                q=torch.empty(n, self.heads, self.head_dim),
                attended=torch.empty(n, self.heads * self.head_dim),
                o=torch.empty(n, hidden),
                gate_up=torch.empty(n, 2 * self.intermediate),
                activation=torch.empty(n, self.intermediate),
                down=torch.empty(n, hidden),
            )
        return self._outputs[n]

    def _add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor
    ) -> None:
        """x += delta (in place, where given); out = RMS norm of x times weight (lean.c)."""
        n, hidden = x.shape
        delta_pointer = None if delta is None else delta.data_ptr()
        self.kernels.norm(
            x.data_ptr(), delta_pointer, n, hidden, weight.data_ptr(), self.eps, out.data_ptr()
        )


def lean_forward(model: PreTrainedModel) -> LeanForward | None:
    """The lean forward of an `#int8` draft model (int8.use_int8_products done), or None
    where it does not serve: turned off, kernels missing, a model part it does not know, or
    logits that differ from transformers' on the probe. Built once per model: drafters
    sharing a draft model (drafter_specs.shared_drafts) share it too."""
    if os.environ.get(ENABLE, "1") == "0":
        return None
    if model not in _built:
        lean = None if unsupported(model) is not None else LeanForward(model)
        _built[model] = lean if lean is not None and agrees(model, lean) else None
    return _built[model]


_built: WeakKeyDictionary[PreTrainedModel, LeanForward | None] = WeakKeyDictionary()


def unsupported(model: PreTrainedModel) -> str | None:
    """What of `model` the lean forward does not implement, or None if nothing."""
    config = model.config
    if config.model_type not in FAMILIES:
        return f"model type {config.model_type!r}"
    if native.lean_kernels() is None or native.attention_kernel() is None:
        return "no C compiler for lean.c and attention.c"
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "mlp_bias", False):
        return "an MLP other than SiLU-gated without bias"
    if getattr(config, "use_sliding_window", False) or any(
        kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()
    ):
        return "sliding-window attention"
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "layers"):
        return "not a Hugging Face decoder model (model.model.layers)"
    if not isinstance(getattr(model, "lm_head", None), Int8Linear):
        return "no int8 LM head (#int8 not applied?)"
    for layer in body.layers:
        attention, mlp = layer.self_attn, layer.mlp
        parts = [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj]
        parts += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if not all(
            isinstance(p, Int8Linear | Int4Linear) and p.product.kernel is not None for p in parts
        ):
            return "products not all in int8.c or int4.c (#int8 on a CPU without AVX512-VNNI?)"
        if any(p.out_features % BLOCK for p in parts[:3] + parts[4:6]):
            return f"projection sizes not multiples of {BLOCK}"
    head_dim = body.layers[0].self_attn.head_dim
    if not kernel_takes(
        head_dim=head_dim, heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads, dtype=body.embed_tokens.weight.dtype,
    ):  # fmt: skip
        return "attention shapes attention.c does not take"
    return None


def agrees(model: PreTrainedModel, lean: LeanForward, *, length: int = 12) -> bool:
    """Whether the lean forward's logits correlate with transformers' by CORRELATION or
    more in every row: random tokens through transformers, then 3 more as a chain by each."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (1, length + 3), generator=generator)
    results = []
    for use_lean in (False, True):
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=tokens[:, :length], cache=cache, use_cache=True)
            positions = torch.arange(length, length + 3)[None]
            if use_lean:
                logits = lean(tokens[:, length:], cache, position_ids=positions)
            else:
                step = model(input_ids=tokens[:, length:], position_ids=positions, cache=cache)
                logits = step.logits
        results.append(logits.float())
    return bool(correlation(*results).min() >= CORRELATION)


def correlation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of a and b [..., V] along the vocabulary; [...]."""
    a, b = a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True)
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-30)


def _lean_layer(layer: torch.nn.Module) -> _Layer:
    attention, mlp = layer.self_attn, layer.mlp
    qkv = (attention.q_proj, attention.k_proj, attention.v_proj)
    return _Layer(
        input_norm=layer.input_layernorm.weight.float(),
        qkv=_stacked(qkv),
        o=attention.o_proj.product,
        post_norm=layer.post_attention_layernorm.weight.float(),
        gate_up=_stacked((mlp.gate_proj, mlp.up_proj)),
        down=mlp.down_proj.product,
    )


def _stacked(linears: tuple[Int8Linear | Int4Linear, ...]) -> Product:
    """One product for the linears' rows stacked; each linear then reads its part of it."""
    products = [linear.product for linear in linears]
    stacked = type(products[0]).stacked(products)
    for linear in linears:  # their buffers (the product's tensors) now views of the stacked copy
        for name, _ in list(linear.named_buffers(recurse=False)):
            setattr(linear, name, getattr(linear.product, name))
    return stacked
