"""How rows move between the host tier and one peer: parts, checksums and NIXL transfers.

Per owner peer (all owners concurrently, ``tier.RemoteTier``):

- put: PUT_ALLOC (keys, lengths) -> slots; the rows are WRITten into the peer's slots, a
  NIXL request per ``transfer_bytes`` of rows with **one descriptor per row**, and
  checksummed; PUT_COMMIT with the row headers makes them visible. A key the peer holds already
  is not sent again (keys name their content).
- get: GET (keys) -> slots, row headers and a lease; the rows are READ into the caller's
  buffers, then verified against their headers (layout id, length, xxh3) before they count
  as hits; RELEASE ends the lease. A row that fails verification is a miss, never garbage.

Checksums overlap the copies where a core is free for it. On loopback UCX copies with CMA
inside ``transfer()`` on the agent's thread (``tiers/remote/nixl_agent.py``), so a second thread
hashes part k (a put hashes the rows it just wrote, a get verifies the rows it just read)
while the agent's thread copies part k+1; the hash releases the GIL
(``tiers/fast_checksum.py``) and finds the part's rows still in cache (xxh3 runs at about
twice its speed there), so parts are small (``transfer_bytes``, 2 MiB by default). All
parts of one call go to the agent's thread as one job. A part goes to the second thread
only while it keeps up, and calls after one that found no core free for it hash on the
agent's thread, right after each copy, as all do with ``checksum_thread=False`` (measured
on a 2-core machine shared with other work: there the second thread overlapped nothing and
cost CPU, so the tier falls back and the two settings measure the same). Rows should be
64-byte aligned, as torch allocations are: a copy between addresses that differ mod 64
runs at half speed (the peer's slots are 2 MiB aligned).

A READ is never abandoned while it may still write a caller's buffer: a transfer that
misses its deadline has its handle released and the remote agent removed before the call
returns (``tiers/remote/nixl_agent.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Set
from typing import cast

from tiers.fast_checksum import checksum_at
from tiers.remote.membership import Link
from tiers.remote.nixl_agent import AgentThread, TransferError, descriptors, settle
from tiers.remote.protocol import EXISTS, NO_SLOT
from tiers.remote.stats import RemoteStats
from tiers.row_format import RowHeader, header_refusal

log = logging.getLogger(__name__)

MARGIN_S = 0.02
"""Transfers time out this much before the call's deadline, to report in time."""

Slots = list[tuple[int, int]]
"""``(row index, peer slot)`` pairs of one call."""


class DataPlane:
    """Moves one call's rows to or from one peer (``put_part``/``get_part``); see the module
    docstring. The rows are given as flat byte ``views`` and their ``addrs`` inside the
    registered host buffer; per-row outcomes go into the caller's flag list.

    ``attach(agent)`` before the first call (``None``: closed, and transfers fail)."""

    def __init__(
        self, layout_id: bytes, layouts: Set[bytes], stats: RemoteStats, *, transfer_bytes: int = 2 << 20
    ) -> None:
        self.layout_id = layout_id
        self.layouts = layouts
        self.transfer_bytes = transfer_bytes
        self._stats = stats
        self._agent: AgentThread | None = None

    def attach(self, agent: AgentThread | None) -> None:
        self._agent = agent

    # -- put ------------------------------------------------------------------------------

    async def put_part(
        self,
        link: Link,
        idxs: list[int],
        wire: list[bytes],
        views: list[memoryview],
        addrs: list[int],
        stored: list[bool],
        deadline: float,
    ) -> None:
        """Store rows ``idxs`` at ``link``'s peer; ``stored[i]`` is set for each row the peer
        now holds (committed now, or already there)."""
        client = link.client
        slot_bytes = link.welcome.slot_bytes
        eligible = [i for i in idxs if 0 < len(views[i]) <= slot_bytes]
        if not eligible:
            return
        alloc_id, slots = await client.put_alloc(
            [wire[i] for i in eligible], [len(views[i]) for i in eligible], deadline
        )
        writes: Slots = []
        for i, slot in zip(eligible, slots, strict=True):
            if slot == EXISTS:
                stored[i] = True
            elif slot != NO_SLOT:
                writes.append((i, slot))
        if not writes:
            return
        try:
            headers = await self._write(link, writes, views, addrs, deadline)
        except BaseException:
            client.put_abort(alloc_id)
            raise
        for (i, _), ok in zip(writes, await client.put_commit(alloc_id, headers, deadline), strict=True):
            stored[i] = ok

    async def _write(
        self,
        link: Link,
        writes: Slots,
        views: list[memoryview],
        addrs: list[int],
        deadline: float,
    ) -> list[bytes]:
        """WRITE the rows, one NIXL request per part, and return their headers.

        Each part is checksummed right after it was copied, while the next one is (see the
        module docstring): the copy has just pulled the part's rows into cache, so hashing
        them costs little (measured: xxh3 runs at ~2x the speed on cached rows than on rows
        in DRAM). Raises if any part failed, once no part is in flight any more.
        """
        parts = self._parts(writes, views)
        outcomes = await self._transfer(
            link,
            "WRITE",
            parts,
            views,
            addrs,
            deadline,
            after=lambda k: [checksum_at(views[i], addrs[i]) for i, _ in parts[k]],
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        self._stats.bytes_written += sum(len(views[i]) for i, _ in writes)
        checksums = [checksum for part_sums in cast(list[list[int]], outcomes) for checksum in part_sums]
        return [
            RowHeader(self.layout_id, len(views[i]), checksum).pack()
            for (i, _), checksum in zip(writes, checksums, strict=True)
        ]

    # -- get ------------------------------------------------------------------------------

    async def get_part(
        self,
        link: Link,
        idxs: list[int],
        wire: list[bytes],
        views: list[memoryview],
        addrs: list[int],
        loaded: list[bool],
        deadline: float,
        *,
        served: list[bytes | None],
    ) -> None:
        """READ rows ``idxs`` from ``link``'s peer; ``loaded[i]`` is set for each row that
        landed and verified, ``served[i]`` to its layout id."""
        client = link.client
        lease_id, entries = await client.get([wire[i] for i in idxs], deadline)
        try:
            reads: Slots = []
            expected: dict[int, int] = {}  # row -> checksum its header promises
            for i, entry in zip(idxs, entries, strict=True):
                if entry is None:
                    continue
                slot, raw = entry
                header = RowHeader.unpack(raw)
                why = self._unservable(header, len(views[i]), link.welcome.slot_bytes)
                if why is not None or header is None:
                    self._stats.corrupt += 1
                    log.warning("peer %s: a row not read (%s): a miss", link.peer.address, why)
                    continue
                reads.append((i, slot))
                expected[i] = header.checksum
                served[i] = header.layout_id
            if reads:
                await self._read_and_verify(link, reads, views, addrs, expected, loaded, deadline)
        finally:
            if lease_id:
                client.release(lease_id)

    def _unservable(self, header: RowHeader | None, length: int, slot_bytes: int) -> str | None:
        """``row_format.verify`` without the checksum, which can only be checked after the READ."""
        why = header_refusal(header, self.layouts, length)
        if why is None and length > slot_bytes:
            return f"length {length}, beyond the peer's {slot_bytes}-byte slots"
        return why

    async def _read_and_verify(
        self,
        link: Link,
        reads: Slots,
        views: list[memoryview],
        addrs: list[int],
        expected: dict[int, int],
        loaded: list[bool],
        deadline: float,
    ) -> None:
        """READ the rows, one NIXL request per part, and verify each part as soon as it lands
        (still in cache), while the next one is read. Returns only when no READ can still write the
        caller's buffers; rows of parts that landed and verified are hits even if another
        part failed."""
        parts = self._parts(reads, views)
        outcomes = await self._transfer(
            link,
            "READ",
            parts,
            views,
            addrs,
            deadline,
            after=lambda k: _verify(parts[k], views, addrs, expected),
        )
        errors = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        for part, outcome in zip(parts, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                continue
            for (i, _), good in zip(part, outcome, strict=True):
                if good:
                    loaded[i] = True
                else:
                    self._stats.corrupt += 1
                    log.warning("peer %s: a row failed its checksum: a miss", link.peer.address)
            self._stats.bytes_read += sum(len(views[i]) for i, _ in part)
        if errors:
            raise errors[0]

    # -- transfers ------------------------------------------------------------------------

    def _parts(self, items: Slots, views: list[memoryview]) -> list[Slots]:
        """Cut ``(row, slot)`` pairs into NIXL requests of about ``transfer_bytes`` (one row at least)."""
        parts: list[Slots] = []
        start, size = 0, 0
        for n, (i, _) in enumerate(items):
            size += len(views[i])
            if size >= self.transfer_bytes:
                parts.append(items[start : n + 1])
                start, size = n + 1, 0
        if start < len(items):
            parts.append(items[start:])
        return parts

    async def _transfer(
        self,
        link: Link,
        op: str,
        parts: list[Slots],
        views: list[memoryview],
        addrs: list[int],
        deadline: float,
        after: Callable[[int], object],
    ) -> list[object]:
        """One NIXL request per part (one descriptor per row, host row <-> peer slot), all
        posted by one job on the agent's thread; each part's outcome: ``after(k)`` or an error
        (``after`` runs beside the agent's thread, or on it without ``checksum_thread``)."""
        if self._agent is None:
            raise TransferError("the remote tier is closed")
        welcome = link.welcome
        items = [item for part in parts for item in part]
        lengths = [len(views[i]) for i, _ in items]
        local = descriptors([addrs[i] for i, _ in items], lengths)
        remote = descriptors([welcome.pool_addr + slot * welcome.slot_bytes for _, slot in items], lengths)
        sizes = [len(part) for part in parts]
        self._stats.transfers += len(parts)
        self._stats.descriptors += len(items)
        future = self._agent.transfer(
            op, local, remote, sizes, link.remote_agent, deadline - MARGIN_S, after=after
        )
        return await settle(future, deadline, len(parts))


def _verify(part: Slots, views: list[memoryview], addrs: list[int], expected: dict[int, int]) -> list[bool]:
    return [checksum_at(views[i], addrs[i]) == expected[i] for i, _ in part]
