"""Sizes with units (``8GiB``, ``512MB``) for the command lines of ``tiers/``.

``offload/config.py`` has the same rule for the configuration file; ``tiers/`` is a leaf
and may not import ``offload/``, so the peer's CLI parses its own sizes here.
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


def parse_size(text: str | int) -> int:
    """Bytes from ``"8GiB"``, ``"1.5MiB"``, ``"4096"`` or an int; ``ValueError`` names the text."""
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a size")
    if isinstance(text, int):
        size = text
    else:
        match = _SIZE.match(text)
        if not match:
            raise ValueError(f"{text!r} is not a size such as '8GiB' or a number of bytes")
        number, unit = match.groups()
        scale = _UNITS.get(unit.upper() or "B")
        if scale is None:
            raise ValueError(f"{text!r}: unknown unit {unit!r}; use one of B, KB, MB, GB, KiB, MiB, GiB, TiB")
        size = int(float(number) * scale)
    if size <= 0:
        raise ValueError(f"{text!r}: a size must be positive")
    return size
