"""Block keys: the engine's chained prefix hash of a block plus its KV-group index.

The same bytes as vLLM's ``OffloadKey`` (``block_hash + group_idx.to_bytes(4, "big")``), so
keys pass through the vLLM adapter unchanged and stay cheap to hash.
"""

from __future__ import annotations

from typing import NewType

OffloadKey = NewType("OffloadKey", bytes)

GROUP_BYTES = 4


def make_key(block_hash: bytes, group: int = 0) -> OffloadKey:
    return OffloadKey(bytes(block_hash) + group.to_bytes(GROUP_BYTES, "big"))


def key_group(key: bytes) -> int:
    """The KV-group index a key belongs to."""
    if len(key) <= GROUP_BYTES:
        raise ValueError(f"key {key!r} is too short to hold a block hash and a group index")
    return int.from_bytes(key[-GROUP_BYTES:], "big")


def key_hash(key: bytes) -> bytes:
    """The block-hash part of a key."""
    return key[:-GROUP_BYTES]
