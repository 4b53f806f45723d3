"""Drafters from `--draft` specs: prompt lookup, MTP heads (chain or tree), shipped and
user draft models (with `#vocab=N` and `#heads=DIR`), and lookup-first pairs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from pathlib import Path

import torch

from specmtp.datastore import (
    BEFORE_FALLBACK_MIN_PROBABILITY,
    Datastore,
    DatastoreDrafter,
    StoreTreeDrafter,
    shipped_store_file,
)
from specmtp.draft_model import (
    DRAFT_CONFIG,
    SHIPPED_DRAFTS,
    DraftLM,
    is_draft_dir,
    load_draft,
    shipped_drafts_dir,
)
from specmtp.draft_model_drafter import DraftModelDrafter
from specmtp.draft_tree_drafter import DraftTreeDrafter
from specmtp.drafters import Drafter, LookupFirstDrafter, NgramDrafter
from specmtp.errors import SpecMTPError
from specmtp.heads import SequentialMTP
from specmtp.heads_io import load_heads, shipped_heads_dir
from specmtp.int4 import INT4, split_int4, use_int4_products
from specmtp.int8 import INT8, split_int8, use_int8_products
from specmtp.kernels import (
    packing_allowed,
    tuned_linear_enabled,
    use_tuned_linear,
    without_packing,
)
from specmtp.lean import lean_forward
from specmtp.merged_drafter import MergedDrafter
from specmtp.models import LoadedModel, load_model
from specmtp.mtp_drafter import MTPDrafter
from specmtp.output_vocab import output_vocab_ids
from specmtp.specs import (
    DRAFT_HEADS,
    MIN_PROBABILITY,
    OUTPUT_VOCAB,
    TREE_NODES,
    TUNED_NODES,
    split_count,
    split_heads,
    split_probability,
    split_tree_nodes,
)
from specmtp.tree import TREE_FILE, TokenTree
from specmtp.vocab import check_tokenizers_agree, usable_vocab_size, vocab_digest


def build_drafter(
    spec: str | Drafter | None, target: LoadedModel, *, dtype: torch.dtype = torch.float32
) -> tuple[Drafter | None, int]:
    """Turn a draft spec string into a drafter; also return the vocabulary both share.

    This is the one place that dispatches on the spec: `ngram` or `ngram:N` (longest
    n-gram N); `mtp` / `mtp:HEADS_DIR` (MTP heads drafting a chain); `mtp-tree`,
    `mtp-tree:HEADS_DIR` (a tree, from the heads' tree.json) or `mtp-tree:TREE.json` (a
    custom tree on the shipped heads), each with `#nodes=N` for a dynamic tree (the tree's N
    likeliest nodes each round) or `#nodes=auto` (N from the tuning profile); `general`,
    `distilled`, `distilled-mtp` (drafts shipped for the default model; `distilled-mtp-ar`
    drafts with its LM head alone) or
    `draft:DIR` / `draft-ar:DIR` (one made by `specmtp distill`); `ngram+SPEC` or
    `ngram:N+SPEC` (prompt lookup when the context's last 2..N tokens occurred before, SPEC
    otherwise); `store` / `store:FILE` (retrieval: prompt lookup, then a datastore of the
    target's answers, the one shipped for the default model unless a file is given) and
    `store+SPEC` / `store:FILE+SPEC` (SPEC when neither matches), each with `#min-p=P`
    (the store's continuation only while its estimated probability is >= P; default 0
    alone, BEFORE_FALLBACK_MIN_PROBABILITY before SPEC), and alone with `#nodes=N` after
    it (a tree of the N likeliest continuations a round, REST's trie); `ngram|SPEC`,
    `store|SPEC` (the lookup's continuation and MTP heads' drafts verified as one tree,
    merged_drafter.py; SPEC `mtp` or `mtp-tree`); otherwise a model spec
    as for the target, with `#vocab=N` (its output matrix cut to N tokens) and/or
    `#heads=DIR` last (MTP heads trained on that model), and `#nodes=N` (a token tree of
    its N likeliest continuations a round, draft_tree_drafter.py; draft models and shipped
    drafts too), and `#min-p=P` (no deeper in a round than the draft's own path
    probability >= P; draft models and shipped drafts drafting with their LM head). MTP
    heads and draft models take `#int8` among their options: int8 products, cheaper drafts
    (int8.py); draft models `#int4`: their decoder layers in 4 bits (int4.py). A Drafter
    object is used as is.
    """
    target_vocab = usable_vocab_size(target, target)
    if spec is None or not isinstance(spec, str):
        return spec, target_vocab
    name, at, gamma = spec.partition("@")
    if at and (name.startswith("ngram") or "|" in name or name.partition(":")[0].partition("#")[0]
               in ("mtp", "mtp-tree", "draft", "draft-ar", "store", *SHIPPED_DRAFTS)):  # fmt: skip
        raise SpecMTPError(
            f"draft {spec!r}: the @gamma suffix is `specmtp bench --draft` syntax; "
            f"here give --draft {name} --gamma {gamma}"
        )
    if "|" in spec:
        return build_merged_drafter(spec, target, dtype=dtype)
    if spec.startswith("ngram") and "+" in spec:
        return build_lookup_first_drafter(spec, target, dtype=dtype)
    if spec == "store" or spec.startswith(("store:", "store+", "store#")):
        return build_store_drafter(spec, target, dtype=dtype)
    spec, quantized = split_quantized(spec)
    # A quantized drafter's products all become int8 or int4: packing its weights first
    # would only hold them twice for a while (peak memory).
    with without_packing() if quantized else nullcontext():
        drafter, vocab = build_model_based_drafter(spec, target, dtype=dtype, quantized=quantized)
    return (use_quantized_drafter(drafter, spec, quantized) if quantized else drafter), vocab


def split_quantized(spec: str) -> tuple[str, str | None]:
    """`SPEC#int8` or `SPEC#int4` -> (SPEC without it, the option); else (spec, None)."""
    spec, int8 = split_int8(spec)
    spec, int4 = split_int4(spec)
    if int8 and int4:
        raise SpecMTPError(f"bad draft spec {spec!r}: {INT8} or {INT4}, not both")
    return spec, INT4 if int4 else INT8 if int8 else None


# Draft models loaded within sharing_draft_models(), by what makes two loads the same model.
_SHARED_DRAFTS: ContextVar[dict[tuple[object, ...], LoadedModel] | None] = ContextVar(
    "specmtp_shared_drafts", default=None
)


@contextmanager
def sharing_draft_models() -> Iterator[None]:
    """Within: a draft model given by name or path loads once for each form it is used in
    (dtype, `#vocab=N`, `#int8` or `#int4`) and every drafter built from that form drafts
    with the same weights; each drafter keeps its own caches, and drafting only reads the
    weights. The bench builds all its methods before it runs them: without this, every
    `--draft` naming the same 0.5B draft held its own copy (1.4 GB each in bfloat16)."""
    token = _SHARED_DRAFTS.set({})
    try:
        yield
    finally:
        _SHARED_DRAFTS.reset(token)


def load_draft_model(spec: str, *, dtype: torch.dtype, form: tuple[object, ...]) -> LoadedModel:
    """load_model, or within sharing_draft_models() the model already loaded for `spec` in
    this `form` (what the caller will change in place: the output vocabulary, int8 or int4)."""
    shared = _SHARED_DRAFTS.get()
    if shared is None:
        return load_model(spec, dtype=dtype)
    key = (spec, dtype, packing_allowed(), *form)
    if key not in shared:
        shared[key] = load_model(spec, dtype=dtype)
    return shared[key]


def build_model_based_drafter(
    spec: str, target: LoadedModel, *, dtype: torch.dtype, quantized: str | None = None
) -> tuple[Drafter, int]:
    """build_drafter's one-drafter specs: MTP heads, draft models and prompt lookup."""
    target_vocab = usable_vocab_size(target, target)
    spec, heads_dir = split_heads(spec)
    spec, min_probability = split_probability(spec, MIN_PROBABILITY, f"MODEL{MIN_PROBABILITY}P")
    spec, nodes, tuned = split_tree_nodes(spec, f"SPEC{TREE_NODES}N (or mtp-tree{TUNED_NODES})")
    spec, output_vocab = split_count(spec, OUTPUT_VOCAB, f"MODEL{OUTPUT_VOCAB}N")
    method, _, argument = spec.partition(":")
    if (nodes is not None or tuned) and method in ("mtp", "ngram"):
        option = TUNED_NODES if tuned else f"{TREE_NODES}N"
        raise SpecMTPError(f"{option} applies to mtp-tree and draft models, not to {spec!r}")
    if min_probability is not None and (method in ("mtp", "mtp-tree", "ngram") or heads_dir):
        raise SpecMTPError(f"{MIN_PROBABILITY}P applies to draft models drafting with their "
                           f"LM head, not to {spec!r}")  # fmt: skip
    for option, value in ((OUTPUT_VOCAB + "N", output_vocab), (DRAFT_HEADS + "DIR", heads_dir)):
        if value is not None and (
            method in ("mtp", "mtp-tree", "draft", "draft-ar", "ngram") or method in SHIPPED_DRAFTS
        ):
            raise SpecMTPError(
                f"{option} applies to a draft model given by name or path, not to {spec!r}"
            )
    if method in ("mtp", "mtp-tree"):
        return build_mtp_drafter(
            spec, target, tree=method == "mtp-tree", path=argument, nodes=nodes, tuned=tuned
        ), target_vocab
    if method in SHIPPED_DRAFTS or method in ("draft", "draft-ar"):
        return build_small_drafter(
            spec, target, nodes=nodes, tuned=tuned, min_probability=min_probability or 0.0
        ), target_vocab
    if spec == "ngram" or spec.startswith("ngram:"):
        size = spec.partition(":")[2] or "3"
        if not size.isdigit() or int(size) < 1:
            raise SpecMTPError(f"bad n-gram draft spec {spec!r}: use ngram or ngram:N with N >= 1")
        return NgramDrafter(max_ngram=int(size)), target_vocab
    if (nodes is not None or tuned) and heads_dir is not None:
        raise SpecMTPError(f"a draft tree ({TREE_NODES}N) drafts with the model's LM head, not "
                           f"with heads ({DRAFT_HEADS}DIR): {spec!r}")  # fmt: skip
    return build_model_drafter(
        spec, target, dtype=dtype, output_vocab=output_vocab, heads_dir=heads_dir, nodes=nodes,
        tuned=tuned, min_probability=min_probability or 0.0, quantized=quantized,
    )  # fmt: skip


def use_quantized_drafter(drafter: Drafter, spec: str, option: str) -> Drafter:
    """`SPEC#int8`: the drafter's products in int8 (int8.py); `SPEC#int4` (draft models): its
    decoder layers' products in 4 bits (int4.py), the rest in int8; its name marked so."""
    if option == INT4 and not isinstance(drafter, DraftModelDrafter):
        raise SpecMTPError(f"{INT4} applies to draft models, not to {spec!r}")
    if isinstance(drafter, MTPDrafter):
        use_int8_products(drafter.heads)
    elif isinstance(drafter, DraftModelDrafter):
        if option == INT4:
            use_int4_products(drafter.runner.model)
        use_int8_products(drafter.runner.model)
        drafter.runner.lean = lean_forward(drafter.runner.model)
        if drafter.heads is not None:  # heads trained on it (#heads=DIR): not inside the model
            use_int8_products(drafter.heads)
    else:
        raise SpecMTPError(f"{INT8} applies to MTP heads and draft models, not to {spec!r}")
    drafter.name = f"{drafter.name}{option}"
    return drafter


def build_model_drafter(
    spec: str,
    target: LoadedModel,
    *,
    dtype: torch.dtype,
    output_vocab: int | None = None,
    heads_dir: str | None = None,
    nodes: int | None = None,
    tuned: bool = False,
    min_probability: float = 0.0,
    quantized: str | None = None,
) -> tuple[DraftModelDrafter, int]:
    """A causal LM with the target's tokenizer, given by name or path, drafting on its own
    or, with `heads_dir`, with MTP heads trained on it (several tokens a forward); with
    `nodes`, a token tree of that many nodes a round (`tuned`: as many as its tuning
    profile gives); drafting no further in a round than paths of at least
    `min_probability`. `quantized` (`#int8`, `#int4`): the caller quantizes its products
    (use_quantized_drafter).
    Within sharing_draft_models(), drafters of the same model in the same form share it,
    unless heads are trained on it (they may hold its LM head)."""
    if heads_dir is None:
        draft = load_draft_model(spec, dtype=dtype, form=(output_vocab, quantized))
    else:
        draft = load_model(spec, dtype=dtype)
    check_tokenizers_agree(
        target.tokenizer, draft.tokenizer, target_name=target.spec, draft_name=draft.spec
    )
    vocab = usable_vocab_size(target, draft)
    heads = None
    if heads_dir is not None:  # before the output matrix is cut: the heads check its shape
        heads, config = load_heads(heads_dir, target_model=draft.model)
        largest = config.vocab_size - 1 if config.draft_vocab is None else max(config.draft_vocab)
        if isinstance(heads, SequentialMTP) and largest >= vocab:
            raise SpecMTPError(
                f"the sequential heads in {heads_dir} can draft token id {largest}, but the "
                f"target's vocabulary ends at {vocab - 1}; train them with --draft-vocab"
            )
    name = spec if output_vocab is None else f"{spec}{OUTPUT_VOCAB}{output_vocab}"
    name = name if heads_dir is None else f"{name}{DRAFT_HEADS}{heads_dir}"
    name = min_p_name(name, min_probability)
    kept = None
    if output_vocab is not None:
        kept = output_vocab_ids(draft, output_vocab, vocab, always=eos_token_ids(draft))
    if nodes is not None or tuned:
        tree = DraftTreeDrafter(
            draft.model, vocab_size=vocab, nodes=nodes, name=tree_name(name, nodes),
            output_ids=kept, min_probability=min_probability, tuned_nodes=tuned,
        )  # fmt: skip
        return tree, vocab
    drafter = DraftModelDrafter(
        draft.model, vocab_size=vocab, name=name, heads=heads, output_ids=kept,
        min_probability=min_probability,
    )  # fmt: skip
    return drafter, vocab


def build_lookup_first_drafter(
    spec: str, target: LoadedModel, *, dtype: torch.dtype
) -> tuple[LookupFirstDrafter, int]:
    """`ngram+SPEC` / `ngram:N+SPEC`: prompt lookup over matches of 2..N tokens (N = 3 by
    default), the drafter SPEC when there is none."""
    lookup, _, rest = spec.partition("+")
    size = lookup.partition(":")[2] or "3"
    if lookup not in ("ngram", f"ngram:{size}") or not size.isdigit() or int(size) < 2:
        raise SpecMTPError(f"bad draft spec {spec!r}: use ngram+SPEC or ngram:N+SPEC, N >= 2")
    if not rest or rest.startswith("ngram"):
        raise SpecMTPError(f"bad draft spec {spec!r}: after ngram+ name a model drafter")
    fallback, vocab = build_drafter(rest, target, dtype=dtype)
    assert fallback is not None  # rest is a non-empty spec
    return LookupFirstDrafter(fallback, max_ngram=int(size)), vocab


def build_merged_drafter(
    spec: str, target: LoadedModel, *, dtype: torch.dtype
) -> tuple[MergedDrafter, int]:
    """`LOOKUP|SPEC`: the lookup's copied continuation and MTP heads' drafts (SPEC: `mtp` or
    `mtp-tree`, with their options) verified as one tree; LOOKUP is `ngram` / `ngram:N`
    (matches of 2..N tokens) or `store` / `store:FILE` (the context, then the datastore,
    `#min-p=P` as for `store+SPEC`)."""
    lookup_spec, _, rest = spec.partition("|")
    if rest.partition(":")[0].partition("#")[0] not in ("mtp", "mtp-tree"):
        raise SpecMTPError(
            f"bad draft spec {spec!r}: LOOKUP|SPEC unites a lookup with MTP heads (SPEC: mtp or "
            "mtp-tree, with their options); for another drafter use LOOKUP+SPEC"
        )
    heads, vocab = build_drafter(rest, target, dtype=dtype)
    assert isinstance(heads, MTPDrafter)
    if lookup_spec.startswith("store"):
        lookup = build_store_lookup(lookup_spec, spec, target)
        return MergedDrafter(heads, lookup=lookup), vocab
    size = lookup_spec.partition(":")[2] or "3"
    if lookup_spec not in ("ngram", f"ngram:{size}") or not size.isdigit() or int(size) < 2:
        raise SpecMTPError(
            f"bad draft spec {spec!r}: before | give ngram, ngram:N (N >= 2), store or store:FILE"
        )
    return MergedDrafter(heads, lookup=NgramDrafter(max_ngram=int(size), min_ngram=2)), vocab


def build_store_drafter(
    spec: str, target: LoadedModel, *, dtype: torch.dtype
) -> tuple[Drafter, int]:
    """`store` / `store:FILE`, alone or as `...+SPEC` with SPEC drafting when neither the
    context nor the store has a match."""
    store_spec, plus, rest = spec.partition("+")
    base, nodes = split_count(store_spec, TREE_NODES, f"store[#min-p=P]{TREE_NODES}N")
    base, min_probability = split_probability(base, MIN_PROBABILITY, "store#min-p=P")
    path = base.partition(":")[2]
    if base != "store" and not path:
        raise SpecMTPError(f"bad draft spec {spec!r}: use store, store:FILE or either +SPEC")
    if plus and (not rest or rest.startswith(("ngram", "store"))):
        raise SpecMTPError(f"bad draft spec {spec!r}: after store+ name a model drafter")
    if plus and nodes is not None:
        raise SpecMTPError(f"draft {spec!r}: a store tree ({TREE_NODES}N) drafts alone, not +SPEC")
    store = load_store(path, target)
    if min_probability is None:
        min_probability = BEFORE_FALLBACK_MIN_PROBABILITY if plus else 0.0
    if nodes is not None:  # alone, a one-token context match beats drafting nothing
        tree = StoreTreeDrafter(
            store, nodes=nodes, name=store_spec, min_probability=min_probability,
            last_token_lookup=True,
        )  # fmt: skip
        return tree, usable_vocab_size(target, target)
    lookup = DatastoreDrafter(
        store, name=store_spec, min_probability=min_probability, last_token_lookup=not plus
    )
    if not plus:
        return lookup, usable_vocab_size(target, target)
    fallback, vocab = build_drafter(rest, target, dtype=dtype)
    assert fallback is not None  # rest is a non-empty spec
    return LookupFirstDrafter(fallback, lookup=lookup), vocab


def build_store_lookup(lookup_spec: str, spec: str, target: LoadedModel) -> DatastoreDrafter:
    """The lookup arm of `store|SPEC`: the context, then the store (chains)."""
    base, min_probability = split_probability(lookup_spec, MIN_PROBABILITY, "store#min-p=P")
    path = base.partition(":")[2]
    if base != "store" and not path:
        raise SpecMTPError(f"bad draft spec {spec!r}: before | give store or store:FILE")
    if min_probability is None:
        min_probability = BEFORE_FALLBACK_MIN_PROBABILITY
    return DatastoreDrafter(
        load_store(path, target), name=lookup_spec, min_probability=min_probability
    )


def load_store(path: str, target: LoadedModel) -> Datastore:
    """The datastore at `path`, or the one shipped for the default model when empty."""
    return Datastore.load(
        Path(path) if path else shipped_store_file(), vocab_digest=vocab_digest(target.tokenizer)
    )


def build_small_drafter(
    spec: str,
    target: LoadedModel,
    *,
    nodes: int | None = None,
    tuned: bool = False,
    min_probability: float = 0.0,
) -> DraftModelDrafter:
    """A draft made by `specmtp distill`: shipped by name, or from a directory. It drafts
    several tokens per forward when it has MTP heads, unless the spec ends in `-ar`; with
    `nodes`, a token tree of that many nodes a round, with its LM head; drafting no further
    in a round than paths of at least `min_probability` (LM head alone too)."""
    draft = load_small_draft(spec, target)
    if tuned_linear_enabled() and draft.device.type == "cpu":
        use_tuned_linear(draft)
    vocab = usable_vocab_size(target, target)
    multi_token = draft.heads is not None and not spec.partition(":")[0].endswith("-ar")
    if multi_token and (nodes is not None or tuned or min_probability):
        option = f"{MIN_PROBABILITY}P" if min_probability else f"{TREE_NODES}N"
        raise SpecMTPError(
            f"{option} drafts with the LM head alone: name the draft's -ar form, not {spec!r}"
        )
    name = min_p_name(spec, min_probability)
    if nodes is None and not tuned:
        return DraftModelDrafter(
            draft, vocab_size=vocab, name=name, multi_token=multi_token,
            min_probability=min_probability,
        )  # fmt: skip
    return DraftTreeDrafter(
        draft, vocab_size=vocab, nodes=nodes, name=tree_name(name, nodes),
        min_probability=min_probability, tuned_nodes=tuned,
    )  # fmt: skip


def min_p_name(name: str, min_probability: float) -> str:
    """A draft's name with its `#min-p=P`, when P > 0."""
    return f"{name}{MIN_PROBABILITY}{min_probability:g}" if min_probability else name


def tree_name(name: str, nodes: int | None) -> str:
    """A draft tree's name: the draft's, then `#nodes=N`, or `#nodes=auto` (tuned)."""
    return f"{name}{TUNED_NODES}" if nodes is None else f"{name}{TREE_NODES}{nodes}"


def load_small_draft(spec: str, target: LoadedModel) -> DraftLM:
    """The draft named by a shipped name (`distilled`, ...) or `draft:DIR` / `draft-ar:DIR`."""
    method, _, path = spec.partition(":")
    if method in SHIPPED_DRAFTS:
        directory = shipped_drafts_dir() / SHIPPED_DRAFTS[method]
    elif method in ("draft", "draft-ar") and path:
        directory = Path(path)
    else:
        raise SpecMTPError(f"bad draft spec {spec!r}: use draft:DIR, draft-ar:DIR or a shipped "
                           f"draft ({', '.join(SHIPPED_DRAFTS)})")  # fmt: skip
    if not is_draft_dir(directory):
        raise SpecMTPError(f"no draft in {directory} (it has no {DRAFT_CONFIG})")
    return load_draft(directory, target=target.model)


def build_mtp_drafter(
    spec: str,
    target: LoadedModel,
    *,
    tree: bool,
    path: str,
    nodes: int | None = None,
    tuned: bool = False,
) -> MTPDrafter:
    """MTP heads for `target`: the ones shipped for the default model unless a path is given;
    with `nodes`, a dynamic tree of that many nodes out of the tree; `tuned`, one whose
    node count a tuning profile will give (`#nodes=auto`)."""
    heads_dir, tree_file = shipped_heads_dir(), None
    if path.endswith(".json"):
        tree_file = Path(path)
    elif path:
        heads_dir = Path(path)
    heads, _ = load_heads(heads_dir, target_model=target.model)
    token_tree = None
    if tree:
        token_tree = TokenTree.load(tree_file or heads_dir / TREE_FILE)
        if token_tree.max_depth > heads.config.num_heads:
            raise SpecMTPError(
                f"the tree is {token_tree.max_depth} deep but the heads predict "
                f"{heads.config.num_heads} tokens"
            )
    name = (
        f"{spec}{TUNED_NODES}" if tuned else spec if nodes is None else f"{spec}{TREE_NODES}{nodes}"
    )
    return MTPDrafter(heads, tree=token_tree, nodes=nodes, tuned_nodes=tuned, name=name)


def eos_token_ids(loaded: LoadedModel) -> list[int]:
    """The ids that end generation: the generation config's and the tokenizer's."""
    ids = loaded.model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if loaded.tokenizer.eos_token_id is not None:
        ids.append(loaded.tokenizer.eos_token_id)
    return sorted(set(ids))
