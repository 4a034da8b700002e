"""The remote tier's counters, kept by its parts (membership, data plane, the tier itself)."""

from __future__ import annotations

from dataclasses import dataclass

from tiers.base import TierStats


@dataclass
class RemoteStats(TierStats):
    """Counters since the tier was built and, in a ``stats()`` snapshot, its levels."""

    stored: int = 0
    dropped: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # rows refused by their header (before the READ) or checksum (after)
    bytes_written: int = 0
    bytes_read: int = 0
    transfers: int = 0  # PUT and GET requests answered (one NIXL request of the peer's each)
    descriptors: int = 0  # rows moved by them
    timeouts: int = 0
    abandoned: int = 0  # gets that ended without the peer's answer (their rows are never reused)
    peer_failures: int = 0  # peers marked down
    rejoins: int = 0  # peers back after a failure
    peers: int = 0
    peers_up: int = 0
    known_keys: int = 0  # what may_contain remembers
    parts_checksummed_beside: int = 0  # requests whose rows were hashed on a thread beside the loop
