"""lean.py's decoder layers in one C call (lean.c's specmtp_lean_layers), and the key and
value buffers that call writes into.

lean.py's `layer_step` runs a layer in a dozen calls from Python; on a draft step of the
Qwen2.5 0.5B draft (24 layers, 2 threads, this Intel Xeon) those calls, the DynamicCache's
appends (a torch.cat of the whole cache per layer) and the attention call's Python cost
about 7.6 ms of a 26.6 ms forward (docs/bench-lean-layers-2026-12-07/prof_round_5338b66.txt),
each call slow for running with caches the layer's 8 MB of weights just flushed.
specmtp_lean_layers runs the same kernels in the same order in C: 17.7 ms for one row
against 23.9 (step_ab.txt there).

Its new keys and values go straight into per-cache buffers [layers, 2, kv_heads, capacity,
d] (`KVBuffers`), and the transformers DynamicCache the rest of specmtp uses keeps each
layer's keys and values as views of them: a crop or `CachedModel.keep` (in place, then a
shorter view) leaves the views where they were; a transformers forward (a prompt) replaces
them with fresh tensors, which the next step copies into the buffers once.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from specmtp.int4 import Int4Product
from specmtp.int8 import Int8Product

if TYPE_CHECKING:  # lean.py imports this module
    from specmtp.lean import _Layer

MIN_CAPACITY = 256  # positions a cache's buffers hold at first; they double as needed


class CProduct(ctypes.Structure):
    """lean.c's Product: an int4.c or int8.c product and its weights."""

    _fields_ = [
        ("kernel", ctypes.c_void_p),
        ("bits", ctypes.c_int64),
        ("in_features", ctypes.c_int64),
        ("out_features", ctypes.c_int64),
        ("weights", ctypes.c_void_p),
        ("first", ctypes.c_void_p),
        ("second", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
    ]


class CLayer(ctypes.Structure):
    """lean.c's Layer: the norms' weights, the four products and the cache's buffers."""

    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", CProduct),
        ("o", CProduct),
        ("gate_up", CProduct),
        ("down", CProduct),
        ("keys", ctypes.c_void_p),
        ("values", ctypes.c_void_p),
    ]


_STEP_INTEGERS = "n hidden intermediate capacity past heads kv_heads d kv_bf16 threads"
_STEP_POINTERS = (
    "cos sin prefix extra_start extras final_norm qkv q attended o gate_up activation down"
)


class CStep(ctypes.Structure):
    """lean.c's Step: one call's shapes, rotary tables, visible keys and scratch."""

    _fields_ = (
        [(name, ctypes.c_int64) for name in _STEP_INTEGERS.split()]
        + [(name, ctypes.c_void_p) for name in _STEP_POINTERS.split()]
        + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
    )


def c_product(product: Int4Product | Int8Product) -> CProduct:
    """The product as lean.c calls it (its kernel's address, its weights' pointers)."""
    kernel = ctypes.cast(product.kernel, ctypes.c_void_p).value
    bias = None if product.bias is None else product.bias.data_ptr()
    shape = (product.in_features, product.out_features)
    if isinstance(product, Int4Product):
        weights = (product.records.data_ptr(), product.qsums.data_ptr(), None)
        return CProduct(kernel, 4, *shape, *weights, bias)
    weights = (product.packed.data_ptr(), product.padded_scale.data_ptr(), product.wsum.data_ptr())
    return CProduct(kernel, 8, *shape, *weights, bias)


class KVBuffers:
    """One DynamicCache's keys and values in buffers [layers, 2, kv_heads, capacity, d],
    the cache's layers views of them, and the layers as lean.c reads them (`layers`)."""

    def __init__(self, layers: list[_Layer], kv_heads: int, d: int, dtype: torch.dtype) -> None:
        self.weights = [
            (layer.input_norm, layer.post_norm, *map(c_product, (layer.qkv, layer.o)),
             *map(c_product, (layer.gate_up, layer.down)))
            for layer in layers
        ]  # fmt: skip
        self.buffer = torch.empty(len(layers), 2, kv_heads, 0, d, dtype=dtype)
        self.layers = (CLayer * len(layers))()
        self.pointers: list[tuple[int, int]] = []  # each layer's keys' and values' buffer

    @property
    def capacity(self) -> int:
        return self.buffer.shape[3]

    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def hold(self, cache: DynamicCache, past: int, length: int) -> None:
        """Make the buffers hold the cache's `past` positions, with room for `length`."""
        if length > self.capacity:
            self._grow(max(length, 2 * self.capacity, MIN_CAPACITY), cache, past)
            return
        if past == 0:
            return
        for index, layer in enumerate(cache.layers):
            for kind, states in enumerate((layer.keys, layer.values)):
                if not self._is_view(states, index, kind, past):
                    self.buffer[index, kind, :, :past] = states[0]

    def publish(self, cache: DynamicCache, length: int) -> None:
        """Set the cache's layers to views of the buffers' first `length` positions."""
        for index, layer in enumerate(cache.layers):
            keys, values = self.buffer[index, :, :, :length, :][:, None].unbind(0)
            if not layer.is_initialized:
                layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values  # [1, kv_heads, length, d]

    def _is_view(self, states: torch.Tensor, index: int, kind: int, past: int) -> bool:
        return (
            states.data_ptr() == self.pointers[index][kind]
            and states.shape[-2] == past
            and states.stride()[1:] == self.buffer.stride()[2:]
        )

    def _grow(self, capacity: int, cache: DynamicCache, past: int) -> None:
        layers, _, kv_heads, _, d = self.buffer.shape
        buffer = self.buffer.new_empty(layers, 2, kv_heads, capacity, d)
        if past:
            for index, layer in enumerate(cache.layers):
                buffer[index, 0, :, :past] = layer.keys[0]
                buffer[index, 1, :, :past] = layer.values[0]
        self.buffer = buffer
        self.pointers = [(layer[0].data_ptr(), layer[1].data_ptr()) for layer in buffer]
        for index, (input_norm, post_norm, *products) in enumerate(self.weights):
            self.layers[index] = CLayer(
                input_norm.data_ptr(), post_norm.data_ptr(), *products, *self.pointers[index]
            )
