"""The namespace: what must match for two engines to share stored rows.

Persistent and remote tiers prefix every key with it. It digests the model id, the
layout (what of it must match: the logical shape of the rows where the physical layout
converts, ``RowLayout.logical_description``, else the whole layout fingerprint), the
dtype, the parallel shard (tensor-parallel rank of world size: each rank's rows hold
different heads) and an optional tenant salt, so a row is only ever found by an engine
that would have computed the same keys and values, and a tenant never sees another
tenant's rows, not even as a hit. The physical layout of each row is in its header.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

NAMESPACE_BYTES = 16


@dataclass(frozen=True)
class Namespace:
    model: str
    layout: str
    dtype: str
    shard: tuple[int, int] = (0, 1)  # (rank, world size)
    tenant: str = ""

    def digest(self) -> bytes:
        rank, world = self.shard
        if not 0 <= rank < world:
            raise ValueError(f"shard rank {rank} is outside a world of {world}")
        text = "\x1f".join(
            ["kvtier-ns-v2", self.model, self.layout, self.dtype, f"{rank}/{world}", self.tenant]
        )
        return hashlib.blake2b(text.encode(), digest_size=NAMESPACE_BYTES).digest()
