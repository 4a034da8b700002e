"""What the lower tiers share: host-buffer checks, row addresses, byte views, the bounded
memory of stored keys, backoff and the machine's IPv6 addresses (``host:port`` is
``tiers.address``).

Each of these was written once per tier (disk, remote, Mooncake) and drifted apart in small
ways; one copy keeps their rules the same. Nothing here imports NIXL, Mooncake or LMDB, so
every tier (and its server or launcher) may import it.
"""

from __future__ import annotations

import ctypes
import ipaddress
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiers.base import TierError
from tiers.buffer_address import buffer_address

# -- rows and the host buffer -------------------------------------------------------------------


def byte_view(buffer: Any, *, writable: bool = False) -> memoryview:
    """A flat byte view of a host row (a memoryview, bytes, or any C-contiguous buffer).

    ``writable``: a row a get writes into must be writable (``ValueError`` otherwise)."""
    view = memoryview(buffer)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if writable and view.readonly:
        raise ValueError("get needs writable row buffers")
    return view


def address_of(view: memoryview) -> int:
    """The address of a row's first byte: ``ctypes`` for a writable view (~0.3 us, against
    ~2 us through numpy or the buffer protocol), ``buffer_address`` for a read-only one."""
    if view.readonly:
        return buffer_address(view)
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


@dataclass(frozen=True)
class HostRegion:
    """The host tier's memory as a tier that moves rows by address sees it (NIXL, Mooncake):
    registered once at ``open``, and every row handed to ``put``/``get`` must lie inside it
    (a row elsewhere would be a transfer to or from memory nobody registered)."""

    addr: int
    length: int

    @classmethod
    def of(cls, host_buffer: memoryview | None, tier: str) -> HostRegion:
        """Check ``host_buffer`` (``TierError`` naming ``tier`` if absent, read-only or not
        contiguous) and take its address and length."""
        if host_buffer is None:
            raise TierError(f"the {tier} tier moves rows by address: open() needs the host tier's buffer")
        buffer = memoryview(host_buffer)
        if buffer.readonly or not buffer.c_contiguous:
            raise TierError("the host buffer must be writable and contiguous")
        array = np.frombuffer(buffer.cast("B") if buffer.format != "B" else buffer, dtype=np.uint8)
        return cls(array.ctypes.data, array.nbytes)

    def rows(self, rows: Sequence[tuple[bytes, Any]]) -> tuple[list[memoryview], list[int]]:
        """Flat byte views of the rows of ``(key, row)`` pairs, and their checked addresses."""
        views = [byte_view(row) for _, row in rows]
        return views, [self.address(view) for view in views]

    def address(self, view: memoryview) -> int:
        """The address of ``view`` (a flat byte view), checked to lie inside the region."""
        addr = address_of(view) if len(view) else self.addr
        if not (self.addr <= addr and addr + len(view) <= self.addr + self.length):
            raise ValueError("a row is not a slice of the host buffer given to open()")
        return addr


# -- what a client stored -----------------------------------------------------------------------


class KnownKeys:
    """The keys a client stored, for ``may_contain``: at most ``limit``, the oldest forgotten first.

    A plain dict (insertion-ordered): membership tests are safe from the scheduler's thread
    while the tier's loop adds and removes keys."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._keys: dict[bytes, None] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: bytes) -> None:
        self._keys[key] = None
        if len(self._keys) > self.limit:
            del self._keys[next(iter(self._keys))]

    def add_stored(self, rows: Sequence[tuple[bytes, Any]], stored: Sequence[bool]) -> None:
        """Remember the key of each row a ``put`` stored (``stored``: its result)."""
        for (key, _), done in zip(rows, stored, strict=True):
            if done:
                self.add(bytes(key))

    def discard(self, key: bytes) -> None:
        self._keys.pop(key, None)


# -- failures -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Backoff:
    """How long something that failed ``failures`` times in a row rests before it is tried
    again: ``base_s`` doubling per failure up to ``max_s``, jittered down by up to a quarter
    so that clients that lost the same server do not all come back at once."""

    base_s: float
    max_s: float

    def delay(self, failures: int) -> float:
        """The rest after ``failures`` (>= 1) consecutive failures, before jitter."""
        return min(self.max_s, self.base_s * 2 ** (failures - 1))

    def retry_at(self, failures: int) -> float:
        """The ``time.monotonic()`` at which to try again."""
        return time.monotonic() + self.delay(failures) * random.uniform(0.75, 1.0)


# -- addresses ----------------------------------------------------------------------------------


def ipv6_interfaces() -> dict[ipaddress.IPv6Address, str]:
    """This machine's IPv6 addresses and the interface holding each, from
    ``/proc/net/if_inet6`` (empty where it does not exist: no IPv6)."""
    found: dict[ipaddress.IPv6Address, str] = {}
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if len(fields) >= 6:
            found[ipaddress.IPv6Address(bytes.fromhex(fields[0]))] = fields[5]
    return found
