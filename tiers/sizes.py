"""Sizes with units (``8GiB``, ``512MB``): the one rule for the peer's command line and for
``offload/config.py`` (which wraps its errors to name the configuration key).

Units are decimal or binary, as their names say: ``KB``, ``MB``, ``GB``, ``TB`` are powers of
1000 (``8GB`` is 8,000,000,000 bytes), ``KiB``, ``MiB``, ``GiB``, ``TiB`` powers of 1024
(``8GiB`` is 8,589,934,592 bytes, 7% more). Case does not matter (``8gib``); a bare number
is bytes. Memory is sized in binary units, disks are sold in decimal ones: say which.
"""

from __future__ import annotations

import re

_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
MAX_SIZE = 2**53
"""8 PiB. A larger size is a typo (``99999999TiB``) that no tier can hold; beyond it a float
also stops counting single bytes, and the C sizes it would become (an LMDB map, a torch
allocation) overflow or fail with errors that do not name the key."""


def parse_size(text: str | int) -> int:
    """Bytes from ``"8GiB"``, ``"1.5MiB"``, ``"4096"`` or an int; ``ValueError`` says what is wrong."""
    if isinstance(text, bool):
        raise ValueError("not a size")
    if isinstance(text, int):
        size = text
    else:
        match = _SIZE.match(text)
        if not match:
            raise ValueError("not a size such as '8GiB' or a number of bytes")
        number, unit = match.groups()
        scale = _UNITS.get(unit.upper() or "B")
        if scale is None:
            raise ValueError(f"unknown unit {unit!r}; use one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
        if len(number.partition(".")[0]) > 20:
            raise ValueError("larger than 8 PiB, the most any tier can be")
        size = int(float(number) * scale)
    if size <= 0:
        raise ValueError("a size must be positive")
    if size > MAX_SIZE:
        raise ValueError(f"{size} B is larger than 8 PiB, the most any tier can be")
    return size
