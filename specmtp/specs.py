"""Options a draft spec may carry after its name: `#nodes=N`, `#vocab=N`, `#heads=DIR`,
`#min-p=P` and `#int8` (int8.py: MTP heads and draft models draft with int8 products).

`mtp-tree#nodes=4` verifies a dynamic tree's 4 likeliest nodes a round (`#nodes=auto`: as many
as `specmtp tune` found fastest on this machine, read from its profile); `MODEL#nodes=4`
a draft model's tree of its 4 likeliest continuations (draft_tree_drafter.py);
`MODEL#vocab=N` cuts a draft model's output matrix to N tokens; `MODEL#heads=DIR` drafts
with MTP heads trained on that draft model (`specmtp train-mtp --target MODEL`). `#heads=`
comes last: its path runs to the end of the spec. `store:FILE#min-p=0.5` drafts from a
datastore only while its continuation's estimated probability is at least 0.5;
`MODEL#min-p=0.3` a draft model only while its path's own probability is at least 0.3.
"""

from __future__ import annotations

from specmtp.errors import SpecMTPError

TREE_NODES = "#nodes="
TUNED_NODES = TREE_NODES + "auto"  # a dynamic tree whose node budget a tuning profile holds
OUTPUT_VOCAB = "#vocab="
DRAFT_HEADS = "#heads="
MIN_PROBABILITY = "#min-p="


def split_flag(spec: str, option: str) -> tuple[str, bool]:
    """`SPEC#flag` (`option` "#flag", anywhere among SPEC's `#` options) -> (SPEC without
    it, True); a spec without it -> (spec, False)."""
    name, *options = spec.split("#")
    if option[1:] not in options:
        return spec, False
    if not name:
        raise SpecMTPError(f"bad draft spec {spec!r}: {option} follows a drafter's name")
    options.remove(option[1:])
    return "#".join([name, *options]), True


def split_count(spec: str, option: str, usage: str) -> tuple[str, int | None]:
    """`BASE{option}N` -> (BASE, N) with N >= 1; a spec without the option -> (spec, None).
    `usage` is how the option is written, for the error message."""
    base, found, count = spec.partition(option)
    if not found:
        return spec, None
    if not count.isdigit() or int(count) < 1 or not base:
        raise SpecMTPError(f"bad draft spec {spec!r}: use {usage} with N >= 1")
    return base, int(count)


def split_tree_nodes(spec: str, usage: str) -> tuple[str, int | None, bool]:
    """`BASE#nodes=N` -> (BASE, N, False); `BASE#nodes=auto` -> (BASE, None, True): the
    budget comes from a tuning profile; a spec without the option -> (spec, None, False)."""
    base, found, rest = spec.partition(TUNED_NODES)
    if found and not rest and base:
        return base, None, True
    base, nodes = split_count(spec, TREE_NODES, usage)
    return base, nodes, False


def split_heads(spec: str) -> tuple[str, str | None]:
    """`MODEL#heads=DIR` -> (MODEL, DIR); a spec without the option -> (spec, None)."""
    base, found, path = spec.partition(DRAFT_HEADS)
    if not found:
        return spec, None
    if not base or not path:
        raise SpecMTPError(f"bad draft spec {spec!r}: use MODEL{DRAFT_HEADS}DIR")
    return base, path


def split_probability(spec: str, option: str, usage: str) -> tuple[str, float | None]:
    """`BASE{option}P` -> (BASE, P) with 0 <= P < 1; a spec without the option -> (spec,
    None). Options after P stay with BASE (`D#min-p=0.3#nodes=4` -> (`D#nodes=4`, 0.3)).
    `usage` is how the option is written, for the error message."""
    base, found, text = spec.partition(option)
    if not found:
        return spec, None
    text, more, rest = text.partition("#")
    base += more + rest
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0 or not base:
        raise SpecMTPError(f"bad draft spec {spec!r}: use {usage} with 0 <= P < 1")
    return base, value
