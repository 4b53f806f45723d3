"""Row-invariant numerics: a forward over n tokens gives every token, bit for bit, the
logits that one-token forwards would give it. Speculative decoding then stays exact in any
dtype.

Greedy speculative decoding is token-identical to plain decoding only if the verify pass
(k + 1 tokens in one forward) computes each token's logits exactly as plain decoding's
one-token steps do. In float32 the rounding differences between the two (about 1e-6) have
not flipped an argmax in our runs; in bfloat16 they are about 1e-2, and most 128-token
greedy outputs diverge somewhere. Two kinds of operation depend on how many rows a forward
holds:

- Attention. A fused kernel computes a block of queries at once, and masked-out keys change
  the length of its reductions. Here, in the decode phase (at most MAX_LOOP_ROWS query
  rows), each query row gets what it would get computed alone over exactly the keys it
  may see, in cache order. A tree's rows see their ancestors' keys, which sit where a
  chain would have put them. Two ways:
  - attention.c (compiled by native.py where there is a C compiler, for head sizes a
    multiple of 16): all rows of a layer in one call, every score, exponential and sum
    by one fixed sequence of rounded operations whatever else the call holds, the keys
    the rows share read once. About 2.4 ms a one-token step of the default model after
    250 tokens and 3.3 ms for 4 rows, against 3.9 and 7.3 ms for the loop below
    (scripts/verify_row_profile.py; docs/exact-bfloat16.md).
  - Otherwise a loop over the rows: the same calls, on the same shapes, as a one-token
    step, written out in float32 (two batched products over the key heads and a softmax)
    rather than a call of SDPA: the CPU's fused kernel costs about 0.12 ms a call for one
    query, which made every extra verify row cost about 7% of a one-token step (30 layers,
    default model, 120-token context); written out, about 1.5%.
  A process takes one of the two for every forward of a model, so its plain steps and its
  verify passes agree.
- Matrix products. A BLAS may pick its algorithm (and so its order of additions) by the
  number of rows, or by the input's rank. `use_row_invariant` probes every weight shape of
  the model with 2-D inputs, cheapest product first. Where the CPU has AMX, amx.c's product
  on the tiles ("amx", amx.py; bfloat16 weights): rows in blocks of 16, each computed from
  its own inputs alone, so row-invariant by construction, and 16 rows cost about one; the
  Qwen2.5-Coder 1.5B's step 157 ms against 195 with the products below, its 16-row pass
  179 against 217 (docs/exact-bfloat16.md, "Products on AMX tiles"). Then oneDNN's
  product on weights packed once for it ("packed", kernels.py), where torch has oneDNN:
  F.linear in bfloat16 goes to oneDNN too, but seemingly rearranges the weights on every
  call; on an Intel Xeon with
  AMX, packed, every product of a default-model step took 26-28 ms for 1-8 rows against
  38 ms (1 thread), at the cost of a second copy of the weights. Then F.linear: if it
  gives each row the same bits whatever the row count, it is kept, with inputs flattened
  to 2-D as probed ("flat"; some BLAS builds take another kernel for a 3-D input of one
  row than of several). A shape that fails runs on
  blocks of exactly PAD_ROWS (8) rows (zero-padded, "padded"), so a row's bits never
  depend on the others. Shapes are probed one by one because padding costs: a padded
  product costs what 8 rows do, about 1.8 one-row products in bfloat16 on an AMD EPYC,
  where of the default model's five weight shapes only the 576 x 1536 down projection
  fails (F.linear on fewer rows would not do: the call size at which a row first loses its
  one-row bits depends on the data; scripts/product_probe.py). Blocks of 4, 8 and 16 rows
  all pass there; 8 serves a plain step and a verify pass of up to 8 rows with one block
  (scripts/product_kinds.py, docs/exact-bfloat16.md). Where a row gets the same bits in
  a block of 8 and of 16 (its probe), the shape runs more than 8 rows in blocks of 16
  ("padded16"): a verify pass of 9-16 rows (a 15-node tree) then reads the weights once,
  as for the Qwen2.5-Coder 1.5B's 8960 -> 1536 down projection on an Intel Xeon with AMX.
  None passing, the model is refused.

Everything else in a decoder layer (norms, rotary embeddings, activations) works row by row.
Whatever the parts promise, `forwards_agree` checks the whole model at load.
Prompts longer than MAX_LOOP_ROWS use the fused kernel: plain and speculative decoding feed
a prompt through the same single forward, so they still agree.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from specmtp import native
from specmtp.amx import amx_available
from specmtp.errors import SpecMTPError
from specmtp.kernels import (
    AMX,
    PACKED,
    PACKED_PRODUCTS,
    WIDE,
    KernelPlan,
    invariant_linear,
    kernel_plan,
    pack_for,
    packing_allowed,
    settle_packed,
    use_tuned_linear,
)

ATTENTION = "specmtp_row_invariant"
MAX_LOOP_ROWS = 32  # query rows computed one by one; longer inputs (prompts) use the fused kernel
PROBE_ROWS = MAX_LOOP_ROWS  # products are probed at every row count a verify pass may hold
# Attention features some models pass that the per-row loop does not apply: refused, not ignored.
UNSUPPORTED = ("softcap", "s_aux", "sinks", "sliding_window")


def row_invariant_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention in the transformers interface, each query row alone over its visible keys.

    query [B, H, n, d]; key, value [B, Hkv, S, d]; attention_mask None (causal: the n
    queries are the last n positions), boolean (True: visible) or additive (0: visible,
    the dtype's minimum: hidden) [B, 1, n, S]. Returns [B, n, H, d] and no weights.
    """
    unsupported = [name for name in UNSUPPORTED if kwargs.get(name) is not None]
    if unsupported:
        raise SpecMTPError(
            f"row-invariant attention does not implement {', '.join(unsupported)}; "
            "run this model in float32"
        )
    batch, _, n, _ = query.shape
    if n > MAX_LOOP_ROWS or dropout > 0.0:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    kernel = native.attention_kernel()
    if kernel is not None and _kernel_takes(query, key, value):
        return _native_attention(kernel, query, key, value, attention_mask, scale), None
    groups = query.shape[1] // key.shape[1]  # query heads per key head (GQA)
    per_batch = []
    for b in range(batch):
        # [Hkv, S, d] in float32, converted once for every row (exact: each row's slice of
        # it holds the bits a one-token step's conversion gives)
        keys, values = _RowKeys(key[b].float()), _RowKeys(value[b].float())
        # [n, Hkv, G, d]: query head h = kv head h // G, as SDPA's enable_gqa pairs them
        grouped = (query[b].float() * scale).transpose(0, 1).unflatten(1, (-1, groups))
        grouped = grouped.contiguous()  # a row's strides do not depend on n
        rows = []
        for j, (prefix, extra) in enumerate(_visible_keys(attention_mask, b, n, key.shape[2])):
            k, v = keys.visible(prefix, extra), values.visible(prefix, extra)
            rows.append(torch.bmm(torch.bmm(grouped[j], k.transpose(1, 2)).softmax(-1), v))
        per_batch.append(torch.stack(rows))  # [n, Hkv, G, d]
    out = torch.stack(per_batch).flatten(2, 3)  # [B, n, H, d]
    return out.to(query.dtype), None


def kernel_takes(*, head_dim: int, heads: int, kv_heads: int, dtype: torch.dtype) -> bool:
    """Whether attention.c (native.py) takes attention of these shapes and dtype. Neither
    the row count nor the keys' count matters, so plain steps and verify passes of a model
    always take the same path."""
    groups = heads // kv_heads
    return (
        dtype in native.KERNEL_DTYPES
        and head_dim % native.KERNEL_LANES == 0
        and head_dim <= native.KERNEL_MAX_D
        and groups <= native.KERNEL_LANES
        and groups * kv_heads == heads
    )


def attention_path(model: nn.Module) -> str:
    """What computes `model`'s row-invariant attention here, for reports."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = next(model.parameters()).dtype
    takes = kernel_takes(head_dim=head_dim, heads=heads, kv_heads=kv_heads, dtype=dtype)
    return native.kernel_name() if takes else native.LOOP


def _kernel_takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    return (
        query.dtype == key.dtype == value.dtype
        and value.shape[-1] == query.shape[-1]
        and kernel_takes(
            head_dim=query.shape[-1], heads=query.shape[1], kv_heads=key.shape[1], dtype=key.dtype
        )
    )


def _native_attention(
    kernel: Callable[..., int],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """row_invariant_attention's result, every row of a batch row in one call of the kernel."""
    batch, heads, n, d = query.shape
    out = query.new_empty(batch, n, heads, d)  # [B, n, H, d]
    for b in range(batch):
        queries, keys, values = (_last_contiguous(t[b]) for t in (query, key, value))
        prefix, start, extras = _kernel_rows(mask, b, n, key.shape[2])
        failed = kernel(
            queries.data_ptr(),
            queries.dtype == torch.bfloat16,
            *queries.stride()[:2],
            scale,
            keys.data_ptr(),
            values.data_ptr(),
            keys.dtype == torch.bfloat16,
            *keys.stride()[:2],
            *values.stride()[:2],
            n,
            heads,
            keys.shape[0],
            d,
            prefix.data_ptr(),
            start.data_ptr(),
            extras.data_ptr(),
            out[b].data_ptr(),
            out.dtype == torch.bfloat16,
        )
        if failed:
            raise SpecMTPError(f"the attention kernel failed (code {failed}): out of memory?")
    return out


def _last_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


KernelRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# The kernel's reading of the visible keys (_kernel_rows), per (batch row, n, S): for the
# causal case, and for the mask _last_mask holds (its entries go stale with it).
_kernel_rows_read: tuple[object, dict[tuple[int, int, int], KernelRows]] = (None, {})


def _kernel_rows(mask: torch.Tensor | None, b: int, n: int, length: int) -> KernelRows:
    """_visible_keys as the kernel reads them: int64 prefix [n], extra_start [n + 1] and the
    extras [m] (row r's are extras[extra_start[r]:extra_start[r + 1]])."""
    global _kernel_rows_read
    visible = None if mask is None else _visible_keys(mask, b, n, length)  # refreshes _last_mask
    owner = None if mask is None else _last_mask
    if _kernel_rows_read[0] is not owner or len(_kernel_rows_read[1]) > 64:
        _kernel_rows_read = (owner, {})
    read = _kernel_rows_read[1]
    if (b, n, length) not in read:
        rows = visible if visible is not None else _visible_keys(None, b, n, length)
        counts = [0 if extra is None else extra.numel() for _, extra in rows]
        extras = [extra for _, extra in rows if extra is not None]
        read[b, n, length] = (
            torch.tensor([prefix for prefix, _ in rows], dtype=torch.int64),
            torch.tensor([0, *counts], dtype=torch.int64).cumsum(0),
            torch.cat(extras).to(torch.int64) if extras else torch.zeros(1, dtype=torch.int64),
        )
    return read[b, n, length]


class _RowKeys:
    """One batch row's keys (or values) [Hkv, S, d], as each query row sees them.

    A chain row sees a prefix: a view, no copy. A tree row sees the prefix, then its
    ancestors: they are copied into one scratch buffer after a copy of the prefix, which
    the next tree row reuses (its prefix is usually the same), so a tree of N rows copies
    the prefix once per layer rather than N times.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.buffer: torch.Tensor | None = None
        self.valid = 0  # leading buffer positions that hold the tensor's own

    def visible(self, prefix: int, extra: torch.Tensor | None) -> torch.Tensor:
        if extra is None:
            return self.tensor[:, :prefix]
        if self.buffer is None:
            self.buffer = self.tensor.new_empty(self.tensor.shape)  # S >= any visible length
        if self.valid < prefix:
            self.buffer[:, self.valid : prefix] = self.tensor[:, self.valid : prefix]
        end = prefix + extra.shape[0]
        torch.index_select(self.tensor, 1, extra, out=self.buffer[:, prefix:end])
        self.valid = prefix  # past it, this row's ancestors
        return self.buffer[:, :end]


VisibleKeys = list[tuple[int, torch.Tensor | None]]
# Every layer of a forward gets the same mask: the last one read, a copy of its contents (it
# is stale once they differ, even if the same tensor was changed in place) and what was read
# from it per batch row.
_last_mask: tuple[torch.Tensor, torch.Tensor, dict[tuple[int, int, int], VisibleKeys]] | None = None


def _visible_keys(mask: torch.Tensor | None, b: int, n: int, length: int) -> VisibleKeys:
    """Per query row of batch row b: the length of the prefix of keys it sees, and the
    indices [m] of the keys it sees past that prefix (None when there are none)."""
    global _last_mask
    if mask is None:
        return [(length - n + j + 1, None) for j in range(n)]
    if _last_mask is None or _last_mask[0] is not mask or not torch.equal(_last_mask[1], mask):
        _last_mask = (mask, mask.clone(), {})
    read = _last_mask[2]
    if (b, n, length) not in read:
        read[b, n, length] = _read_mask(mask, b)
    return read[b, n, length]


def _read_mask(mask: torch.Tensor, b: int) -> VisibleKeys:
    visible = mask[b, 0] if mask.dtype == torch.bool else mask[b, 0] == 0  # [n, S]
    prefixes = visible.cumprod(-1).sum(-1)  # [n]
    rest = visible.sum(-1) - prefixes  # [n]
    out: list[tuple[int, torch.Tensor | None]] = []
    for j, (prefix, extra) in enumerate(zip(prefixes.tolist(), rest.tolist(), strict=True)):
        past = visible[j, prefix:].nonzero().squeeze(-1) + prefix if extra else None
        out.append((prefix, past))
    return out


AttentionInterface.register(ATTENTION, row_invariant_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)


def rows_invariant(weight: torch.Tensor, *, product: str = "flat", seed: int = 0) -> bool:
    """Whether every row of a product with `weight` [out, in] (a TunedLinear.invariant_product)
    gets the same bits at every row count 1..PROBE_ROWS and at every place in the block
    (random inputs)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(PROBE_ROWS, weight.shape[1], generator=generator).to(weight.dtype)
    with torch.inference_mode():
        packed = pack_for(product, weight)

        def linear(rows: torch.Tensor) -> torch.Tensor:
            return invariant_linear(rows, weight, None, product, packed=packed)

        full = linear(x)  # [R, out]
        for m in range(1, PROBE_ROWS):
            if not torch.equal(linear(x[:m]), full[:m]):
                return False
            if not torch.equal(linear(x[m : m + 1]), full[m : m + 1]):
                return False
    return True


def product_kinds() -> tuple[str, ...]:
    """The row-invariant products, cheapest first: amx.c's on AMX tiles ("amx", where the
    machine runs it; bfloat16 weights only), oneDNN's on weights packed once ("packed",
    where torch has it), F.linear ("flat"), padded blocks of PAD_ROWS rows. The first two
    read a copy of the weights, made only where packing is allowed."""
    if not packing_allowed():
        return ("flat", "padded")
    return (*((AMX,) if amx_available() else ()), PACKED, "flat", "padded")


def invariant_product(weight: torch.Tensor, kinds: Sequence[str] | None = None) -> str | None:
    """The first of `kinds` (product_kinds) that takes `weight` and passes its probe; None
    if none does."""
    kinds = product_kinds() if kinds is None else kinds
    takes_amx = weight.dtype == torch.bfloat16 and amx_available()
    kinds = [p for p in kinds if p != AMX or takes_amx]
    return next((p for p in kinds if rows_invariant(weight, product=p)), None)


def use_row_invariant(model: nn.Module) -> str:
    """Make `model`'s forwards row-invariant (module docstring); returns its products'
    description (KernelPlan.row_invariant). Each weight shape takes the product
    `invariant_product` finds for it; if the whole model then fails `forwards_agree`, padded
    blocks everywhere are tried; neither passing with the attention kernel, both are tried
    again with the torch loop (and the kernel is not used again in this process); nothing
    passing, the model is refused."""
    plan = kernel_plan(model) or use_tuned_linear(model)
    if model.config._attn_implementation != ATTENTION:
        plan.stock_attention = model.config._attn_implementation
        model.set_attn_implementation(ATTENTION)
    plan.row_invariant_attention = attention_path(model)
    found = _agreeing_products(model, plan)
    if found is None and plan.row_invariant_attention == native.NATIVE:
        print(
            "specmtp: the attention kernel is not row-invariant here; using torch", file=sys.stderr
        )
        native.refuse()
        plan.row_invariant_attention = attention_path(model)
        found = _agreeing_products(model, plan)
    if found is None:
        raise SpecMTPError(
            "this machine's kernels round a token differently by how many tokens a forward "
            f"holds, even in fixed blocks, so {model.dtype} decoding cannot be made exact "
            "here; use float32"
        )
    return found


def _agreeing_products(model: nn.Module, plan: KernelPlan) -> str | None:
    """The first choice of products with which the whole model passes `forwards_agree`,
    set on its layers and described in the plan; None when none passes."""
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    weights = {(m.weight.shape, m.weight.dtype): m.weight for m in layers}
    for products in _product_choices(weights):
        products = _widened(products, weights)
        for layer in layers:
            layer.invariant_product = products[layer.weight.shape, layer.weight.dtype]
        plan.row_invariant = describe_products(products)
        settle_packed(model)  # packed copies for exactly the layers whose product packs
        if forwards_agree(model):
            return plan.row_invariant
    return None


Shape = tuple[torch.Size, torch.dtype]  # a weight's shape and dtype: one probe for all alike


def _widened(products: dict[Shape, str], weights: dict[Shape, torch.Tensor]) -> dict[Shape, str]:
    """`products` with each padded shape in blocks of WIDE_PAD_ROWS past PAD_ROWS rows
    (WIDE) where that passes the probe: a row's bits the same in blocks of either height."""
    return {
        shape: WIDE if kind == "padded" and rows_invariant(weights[shape], product=WIDE) else kind
        for shape, kind in products.items()
    }


def _product_choices(weights: dict[Shape, torch.Tensor]) -> Iterator[dict[Shape, str]]:
    """Products per weight shape to try, in order: each shape's own, the same without
    packed weights, then padded blocks everywhere (each when it differs and passes)."""
    tried: list[dict[Shape, str | None]] = []
    kinds = product_kinds()
    for allowed in (kinds, [kind for kind in kinds if kind not in PACKED_PRODUCTS]):
        chosen = {key: invariant_product(weight, allowed) for key, weight in weights.items()}
        if None not in chosen.values() and chosen not in tried:
            yield chosen  # type: ignore[misc]  # no None in it
        tried.append(chosen)
    if all(set(c.values()) != {"padded"} for c in tried) and all(
        rows_invariant(w, product="padded") for w in weights.values()
    ):
        yield dict.fromkeys(weights, "padded")


def describe_products(products: dict[Shape, str]) -> str:
    """The products of a model's weights in a few words: the one every shape takes (e.g.
    "flat"), or the commonest and then the others with their shapes ("flat, padded for
    576x1536")."""
    kinds = list(products.values())
    common = max(dict.fromkeys(kinds), key=kinds.count)
    others = [
        f"{kind} for {'x'.join(map(str, shape))}"
        for (shape, _), kind in products.items()
        if kind != common
    ]
    return ", ".join([common, *others])


@torch.inference_mode()
def forwards_agree(model: nn.Module, *, prompt: int = 6, rows: int = 4, seed: int = 0) -> bool:
    """End to end on random tokens: does one forward of `rows` tokens after a prompt give
    the logits, bit for bit, of `rows` one-token forwards?"""
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (1, prompt + rows), generator=generator, device=model.device)
    logits = []
    for chunks in ([rows], [1] * rows):
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :prompt], cache=cache, use_cache=True)
        start, out = prompt, []
        for n in chunks:
            out.append(
                model(input_ids=ids[:, start : start + n], cache=cache, use_cache=True).logits
            )
            start += n
        logits.append(torch.cat(out, 1))  # [1, rows, V]
    return torch.equal(logits[0], logits[1])
