"""Sizes with units (``8GiB``, ``512MB``): the one rule for the peer's command line and for
``offload/config.py`` (which wraps its errors to name the configuration key)."""

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
        size = int(float(number) * scale)
    if size <= 0:
        raise ValueError("a size must be positive")
    return size
