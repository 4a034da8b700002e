"""The header every persisted or remote row carries: what it is, how long, and its checksum.

``[magic 4 | version u16 | reserved u16 | layout id 16 | row length u64 | xxh3-64 u64]``,
little-endian, 40 bytes, followed (on disk) by the row. A row is served only when all of
these match what the reader expects: the format version, the reader's layout id (the
layout fingerprint, so a row of another layout is never copied into the KV cache as if it
were this one), its length, and the checksum of the bytes actually read. A torn write, a
flipped bit or a foreign row is therefore a miss, never garbage.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Collection, Set
from dataclasses import dataclass

import xxhash

MAGIC = b"KVTR"
VERSION = 1
LAYOUT_ID_BYTES = 16
_HEADER = struct.Struct(f"<4sHH{LAYOUT_ID_BYTES}sQQ")
HEADER_BYTES = _HEADER.size


def checksum(row: memoryview | bytes) -> int:
    """xxh3-64 of the row: fast enough (~10 GB/s) to verify every row on every read."""
    return xxhash.xxh3_64_intdigest(row)


def served_layouts(layout_id: bytes, readable: Collection[bytes] = ()) -> frozenset[bytes]:
    """The layout ids a tier serves: its own (``ValueError`` unless ``LAYOUT_ID_BYTES``
    long) and ``readable``, the layouts its owner converts from."""
    if len(layout_id) != LAYOUT_ID_BYTES:
        raise ValueError(f"layout id must be {LAYOUT_ID_BYTES} bytes, got {len(layout_id)}")
    return frozenset({bytes(layout_id), *readable})


def layout_id_from_fingerprint(fingerprint: str) -> bytes:
    """The 16-byte id stored in headers, from ``CanonicalKVCaches.fingerprint`` (hex)."""
    raw = bytes.fromhex(fingerprint)
    if len(raw) != LAYOUT_ID_BYTES:
        raise ValueError(f"layout fingerprint {fingerprint!r} is not {LAYOUT_ID_BYTES} bytes of hex")
    return raw


@dataclass(frozen=True)
class RowHeader:
    layout_id: bytes
    row_length: int
    checksum: int
    version: int = VERSION

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, self.version, 0, self.layout_id, self.row_length, self.checksum)

    @classmethod
    def for_row(cls, layout_id: bytes, row: memoryview | bytes) -> RowHeader:
        return cls(layout_id, len(row), checksum(row))

    @classmethod
    def unpack(cls, data: memoryview | bytes) -> RowHeader | None:
        """The header at the start of ``data``, or ``None`` if it is not one of ours."""
        if len(data) < HEADER_BYTES:
            return None
        magic, version, _reserved, layout_id, length, digest = _HEADER.unpack_from(data)
        if magic != MAGIC:
            return None
        return cls(layout_id, length, digest, version)


def verify(
    header: RowHeader | None,
    layouts: Set[bytes],
    row: memoryview | bytes,
    digest: Callable[[memoryview | bytes], int] = checksum,
) -> str | None:
    """Why ``row`` must not be served under ``header`` (a short reason), or ``None`` if it may.

    ``layouts``: the layout ids the reader can use (its own, and those it converts from).
    ``digest`` computes the row's checksum (last, only when everything else matches); a tier
    that knows the row's address passes ``fast_checksum.checksum_at``, which frees the GIL."""
    why = header_refusal(header, layouts, len(row))
    if why is None and digest(row) != header.checksum:  # type: ignore[union-attr]
        return "checksum mismatch"
    return why


def header_refusal(header: RowHeader | None, layouts: Set[bytes], length: int) -> str | None:
    """``verify`` before the row's bytes are at hand: why a row of ``length`` bytes must not be
    served under ``header``, checksum aside (a remote tier checks this before it READs the
    row, and the checksum once it landed)."""
    if header is None:
        return "no valid header"
    if header.version != VERSION:
        return f"format version {header.version}, expected {VERSION}"
    if header.layout_id not in layouts:
        return "another layout"
    if header.row_length != length:
        return f"length {header.row_length}, expected {length}"
    return None
