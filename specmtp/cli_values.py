"""Flag values the commands parse themselves (not argparse types), so that bad input ends
in the commands' one-line `specmtp: error:` (cli.main) rather than argparse's usage."""

from __future__ import annotations

import re
from typing import Any

from specmtp.errors import SpecMTPError

_SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> int:
    """Bytes from '2G', '800M', '1.5GiB' or a plain number."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise SpecMTPError(f"bad size {text!r}: use bytes or a number with K, M, G or T")
    return int(float(match[1]) * _SIZE_UNITS[match[2].upper()])


def parse_numbers(text: str | None, kind: type, flag: str) -> tuple[Any, ...]:
    """The comma-separated numbers of a flag given as text; () when it was not given."""
    if not text:
        return ()
    try:
        return tuple(kind(part) for part in text.split(","))
    except ValueError:
        raise SpecMTPError(f"{flag} takes comma-separated numbers, got {text!r}") from None
