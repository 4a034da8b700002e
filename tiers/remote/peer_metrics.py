"""What a peer's operator watches, kept where the peer serves: the puts and gets it served
(how many, the bytes its READs and WRITEs moved, how long each took) and a snapshot of
those with the pool's figures for a metrics endpoint.

Everything here is recorded and read on the peer's event loop (a snapshot is taken there
too, ``run``'s hook), so nothing needs a lock. ``tiers/`` never imports ``offload/``: the
Prometheus text is written by ``offload.peer_metrics`` (``kvtier peer --metrics-port``),
which reads a ``PeerSnapshot``.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tiers.remote import protocol as proto

if TYPE_CHECKING:
    from tiers.remote.pool import PeerPool

TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Seconds: a CMA copy of a few rows takes well under a millisecond, a transfer over a slow
link up to the client's budget (seconds)."""


class LatencyRecord:
    """Observations in buckets (``counts[i]``: values ``<= buckets[i]`` and above the bucket
    before; the last count: above every bound) and their sum. The buckets are Prometheus's,
    not yet cumulative."""

    def __init__(self, buckets: tuple[float, ...] = TRANSFER_BUCKETS) -> None:
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sum += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def copy(self) -> LatencyRecord:
        other = LatencyRecord(self.buckets)
        other.counts = list(self.counts)
        other.sum = self.sum
        return other


@dataclass
class TransferRecord:
    """The PUTs and GETs a peer answered: for a put, the rows its READ brought in; for a get,
    the rows its WRITE delivered (verified); and the seconds from the request to the answer
    sent (a put's commit, a round trip later, is not in it). Transfers that failed are the
    server's ``transfers_failed``, not here."""

    puts: int = 0
    gets: int = 0
    put_bytes: int = 0
    get_bytes: int = 0
    put_seconds: LatencyRecord = field(default_factory=LatencyRecord)
    get_seconds: LatencyRecord = field(default_factory=LatencyRecord)

    def served(self, answer: tuple[proto.Msg, int, bytes], lengths: list[int], seconds: float) -> None:
        """Count one answered PUT (``LANDED``) or GET (``GOT``); the bytes moved are read off
        the answer (which rows it says were READ, or delivered), so they are what moved."""
        msg, _rid, payload = answer
        if msg == proto.Msg.LANDED:
            _alloc, landed = proto.decode_landed(payload)
            self.puts += 1
            self.put_bytes += sum(n for n, x in zip(lengths, landed, strict=True) if x == proto.Landed.READ)
            self.put_seconds.observe(seconds)
        elif msg == proto.Msg.GOT:
            headers = proto.decode_got(payload)
            self.gets += 1
            self.get_bytes += sum(n for n, h in zip(lengths, headers, strict=True) if h is not None)
            self.get_seconds.observe(seconds)

    def copy(self) -> TransferRecord:
        return TransferRecord(
            self.puts,
            self.gets,
            self.put_bytes,
            self.get_bytes,
            self.put_seconds.copy(),
            self.get_seconds.copy(),
        )


@dataclass(frozen=True)
class PeerSnapshot:
    """A peer's figures at one moment, for a metrics endpoint.

    ``pool``: ``PeerPool.stats()``; ``tenants``: ``PeerPool.stats(tenant)`` per tenant of the
    token file (empty for a peer without one: there any client names any tenant, so they are
    namespaces, too many to label by); ``counters``: the server's counts (connections,
    refusals, failed transfers); ``open_connections``: authenticated connections now.
    """

    pool: Mapping[str, int]
    tenants: Mapping[str, Mapping[str, int]]
    counters: Mapping[str, int]
    open_connections: int
    transfers: TransferRecord


def take_snapshot(
    pool: PeerPool, counters: Mapping[str, object], transfers: TransferRecord, open_connections: int
) -> PeerSnapshot:
    """The figures of ``pool``, the server's ``counters`` (its numbers) and ``transfers`` now
    (on the peer's loop: nothing changes while they are copied)."""
    return PeerSnapshot(
        pool=pool.stats(),
        tenants={tenant: pool.stats(tenant) for tenant in sorted(pool.quotas or ())},
        counters={name: value for name, value in counters.items() if type(value) is int},
        open_connections=open_connections,
        transfers=transfers.copy(),
    )
