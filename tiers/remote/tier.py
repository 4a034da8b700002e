"""The remote tier: rows kept in the memory of ``kvtier peer`` processes, moved by NIXL.

Who owns a key: **rendezvous hashing**. Each key goes to the reachable peer with the highest
``xxh3(key, seed=hash(peer address))``, so when a peer leaves only its keys move (each to
its second choice) and when it comes back they move back: no directory, no rebalancing.
Keys that lived on a peer that left are misses (a cache may lose rows; it may not invent
them).

How a batch moves (per owner peer, all owners concurrently):

- put: PUT_ALLOC (keys, lengths) -> slots; the rows are WRITten into the peer's slots, a
  NIXL request per ``transfer_bytes`` of rows with **one descriptor per row**, and
  checksummed; PUT_COMMIT with the row headers makes them visible. A key the peer holds already
  is not sent again (keys name their content).
- get: GET (keys) -> slots, row headers and a lease; the rows are READ into the caller's
  buffers, then verified against their headers (layout id, length, xxh3) before they count
  as hits; RELEASE ends the lease. A row that fails verification is a miss, never garbage.
- A peer's share of a call that needs several control requests (more than
  ``keys_per_request`` keys) keeps two of them in flight: one's messages travel while the
  other's rows move.

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

Every call has one deadline (``deadline_s``, default 2 s) covering the control messages and
the transfers. A peer that fails to answer in time, closes its connection, or fails a
transfer is **marked down**: its keys are misses (or go to their next owner), it is
retried after an exponential backoff (``backoff_s`` doubling to ``max_backoff_s``), and a
restarted peer (new instance, new NIXL metadata) rejoins on its next successful handshake.
A READ is never abandoned while it may still write a caller's buffer: a transfer that
misses its deadline has its handle released and the remote agent removed before the call
returns (``tiers/remote/nixl_agent.py``).

Keys on the wire are ``namespace + key``: the namespace (a digest that includes the tenant
salt) keeps engines that must not share rows apart. Tenants are kept apart by the peer
itself: the client claims ``tenant`` in its handshake, the peer accepts the claim only if
the token grants it, and keeps each tenant's rows in its own namespace and quota
(``tiers/remote/pool.py``). A peer's NIXL metadata is used only after the WELCOME carrying it
verified, and after it passed ``tiers/remote/nixl_metadata.py``'s shape checks (malformed metadata
crashed NIXL; now it is a peer that cannot be used).

Threads: the coroutines run on the caller's event loop; NIXL runs on the agent's own
thread, checksums on the thread beside it. ``may_contain`` and ``stats``
only read plain dicts and ints, so the scheduler may call them from its thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import logging
import os
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from functools import partial
from typing import cast

import numpy as np
import xxhash

from tiers.base import LowerTier, Row, TierError
from tiers.buffer_address import buffer_address
from tiers.fast_checksum import checksum_at
from tiers.remote.client import PeerClient, PeerRefused, PeerTimeout, PeerUnavailable
from tiers.remote.nixl_agent import AgentThread, TransferError, TransferTimeout, descriptors, quietly
from tiers.remote.nixl_metadata import MetadataError, check_peer_metadata
from tiers.remote.protocol import (
    DEFAULT_TENANT,
    EXISTS,
    INSTANCE_ID_BYTES,
    MAX_KEY_BYTES,
    MAX_KEYS,
    NO_SLOT,
    Welcome,
    valid_tenant,
)
from tiers.row_format import LAYOUT_ID_BYTES, RowHeader
from tiers.row_format import VERSION as ROW_FORMAT_VERSION

log = logging.getLogger(__name__)


_MARGIN_S = 0.02  # transfers time out this much before the call's deadline, to report in time
_SCRATCH_PER_PEER = 64
_REQUESTS_IN_FLIGHT = 2  # per peer, when a call needs several control requests
_GRACE_S = 0.5  # how long past a deadline the agent's thread may take to report a timeout
_AGENT_START_S = 30.0


def _peer_seed(address: str) -> int:
    return xxhash.xxh3_64_intdigest(address.encode())


def rendezvous_owner(key: bytes, addresses: Sequence[str]) -> str:
    """The address among ``addresses`` that owns ``key`` (the wire key: namespace + key)."""
    return max(addresses, key=lambda a: xxhash.xxh3_64_intdigest(key, seed=_peer_seed(a)))


def _parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer {address!r} is not 'host:port'")
    return host.strip("[]"), int(port)


@dataclass(eq=False)
class _Peer:
    address: str
    host: str
    port: int
    seed: int
    scratch_offset: int
    client: PeerClient | None = None
    remote_agent: str | None = None
    failures: int = 0
    retry_at: float = 0.0
    connecting: asyncio.Task | None = None

    @property
    def up(self) -> bool:
        return self.client is not None and not self.client.closed


@dataclass(frozen=True, eq=False)
class _Link:
    """One call's view of an up peer: the connection and NIXL name it started with, so a
    peer that goes down (or comes back) meanwhile cannot change them under the call."""

    peer: _Peer
    client: PeerClient
    remote_agent: str

    @property
    def welcome(self) -> Welcome:
        return self.client.welcome


class RemoteTier(LowerTier):
    """A client of one or more ``kvtier peer`` processes; see the module docstring.

    ``peers``: ``"host:port"`` strings. ``namespace``: prefixes every key on the wire.
    ``layout_id``: the 16-byte layout id of the rows this client puts; ``get`` also serves
    rows of ``readable_layouts`` (layouts its owner converts from). ``token``: the secret
    this client proves to the peers (``None``: peers started without one); ``tenant``: the
    tenant it claims there, which that token must grant (else the peer refuses it).
    ``deadline_s``: the most any call takes (control messages and transfers together).
    ``backoff_s``/``max_backoff_s``: how long a failed peer rests before it is tried again
    (doubling per failure).
    ``transfer_bytes``: rows per NIXL request are cut at about this many bytes (at least one
    row; one descriptor per row). ``keys_per_request``: keys per control message (the
    protocol allows ``MAX_KEYS``). ``max_tracked_keys``: how many stored keys
    ``may_contain`` remembers. ``checksum_thread``: hash each part on a thread beside the
    agent's while the next part is copied (``False``: on the agent's thread, after the copy).
    """

    kind = "remote"
    index_is_partial = True  # other clients' rows are found by ``contains``, not ``may_contain``

    def __init__(
        self,
        peers: Sequence[str],
        namespace: bytes,
        layout_id: bytes,
        *,
        token: bytes | None = None,
        tenant: str = DEFAULT_TENANT,
        deadline_s: float = 2.0,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        transfer_bytes: int = 2 << 20,
        keys_per_request: int = 1024,
        max_tracked_keys: int = 1 << 20,
        readable_layouts: Collection[bytes] = (),
        checksum_thread: bool = True,
    ) -> None:
        if not peers:
            raise ValueError("the remote tier needs at least one peer")
        if len(set(peers)) != len(peers):
            raise ValueError(f"peers {list(peers)} name a peer twice")
        if len(layout_id) != LAYOUT_ID_BYTES:
            raise ValueError(f"layout id must be {LAYOUT_ID_BYTES} bytes, got {len(layout_id)}")
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be positive, got {deadline_s!r}")
        if not valid_tenant(tenant):
            raise ValueError(f"tenant {tenant!r}: 1..64 of A-Z a-z 0-9 . _ -, starting alphanumeric")
        if not 0 < keys_per_request <= MAX_KEYS:
            raise ValueError(f"keys_per_request must be in 1..{MAX_KEYS}")
        self._peers = []
        for i, address in enumerate(peers):
            host, port = _parse_address(address)
            self._peers.append(_Peer(address, host, port, _peer_seed(address), i * _SCRATCH_PER_PEER))
        self.namespace = bytes(namespace)
        self.layout_id = bytes(layout_id)
        self.layouts = frozenset({self.layout_id, *readable_layouts})  # what get may serve
        self.token = token
        self.tenant = tenant
        self.deadline_s = deadline_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.transfer_bytes = transfer_bytes
        self.keys_per_request = keys_per_request
        self.max_tracked_keys = max_tracked_keys
        self.checksum_thread = checksum_thread
        self._agent: AgentThread | None = None
        self._host_addr = 0
        self._host_len = 0
        self._scratch = np.zeros(len(self._peers) * _SCRATCH_PER_PEER, dtype=np.uint8)
        self._registrations: list = []
        self._known: dict[bytes, None] = {}  # keys this client stored (may_contain), oldest first
        self._cleanup: set[asyncio.Future] = set()
        self._counters = dict.fromkeys(
            (
                "stored",
                "dropped",
                "hits",
                "misses",
                "corrupt",
                "bytes_written",
                "bytes_read",
                "transfers",
                "descriptors",
                "timeouts",
                "peer_failures",
                "rejoins",
            ),
            0,
        )

    # -- lifecycle --------------------------------------------------------------------------

    async def open(self, host_buffer: memoryview | None = None) -> None:
        """Start the NIXL agent, register the host tier once and reach every peer.

        A peer that cannot be reached now is not an error (it is retried with backoff); a
        missing or read-only host buffer, or a NIXL agent that cannot start, is.
        """
        if host_buffer is None:
            raise TierError("the remote tier moves rows by address: open() needs the host tier's buffer")
        buffer = memoryview(host_buffer)
        if buffer.readonly or not buffer.c_contiguous:
            raise TierError("the host buffer must be writable and contiguous")
        array = np.frombuffer(buffer.cast("B") if buffer.format != "B" else buffer, dtype=np.uint8)
        self._host_addr = array.ctypes.data
        self._host_len = array.nbytes
        self._agent = AgentThread(
            f"kvtier-remote-{os.getpid()}-{uuid.uuid4().hex[:8]}", after_thread=self.checksum_thread
        )
        try:
            await self._agent.start(_AGENT_START_S)
            regions = [
                (self._host_addr, self._host_len, 0, ""),
                (self._scratch.ctypes.data, self._scratch.nbytes, 0, ""),
            ]
            self._registrations = [
                await self._agent.call(lambda a, r=r: a.register_memory([r], "DRAM"), _AGENT_START_S)
                for r in regions
            ]
        except Exception as exc:
            self._agent.close()
            raise TierError(f"remote tier: cannot start a NIXL agent: {exc}") from exc
        await asyncio.gather(*(self._connect(peer) for peer in self._peers))
        up = [p.address for p in self._peers if p.up]
        log.info("remote tier: %d of %d peers up %s", len(up), len(self._peers), up)

    async def close(self) -> None:
        for peer in self._peers:
            if peer.connecting is not None:
                peer.connecting.cancel()
        await asyncio.gather(*(p.connecting for p in self._peers if p.connecting), return_exceptions=True)
        for peer in self._peers:
            if peer.client is not None:
                await peer.client.close()
                peer.client = None
        if self._cleanup:
            await asyncio.wait(self._cleanup, timeout=_GRACE_S)
        if self._agent is not None:
            agent, self._agent = self._agent, None
            names = [p.remote_agent for p in self._peers if p.remote_agent]
            registrations, self._registrations = self._registrations, []

            def teardown(a) -> None:
                for name in names:
                    with contextlib.suppress(Exception):
                        a.remove_remote_agent(name)
                for reg in registrations:
                    with contextlib.suppress(Exception):
                        a.deregister_memory(reg)

            with contextlib.suppress(Exception):
                await agent.call(teardown, _GRACE_S * 4)
            await asyncio.to_thread(agent.close)
        for peer in self._peers:
            peer.remote_agent = None

    # -- the LowerTier verbs ----------------------------------------------------------------

    def may_contain(self, key: bytes) -> bool:
        return key in self._known

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        deadline = self._deadline()
        found = [False] * len(keys)
        wire = self._wire(keys)

        async def ask(link: _Link, idxs: list[int]) -> None:
            for part in _batches(idxs, self.keys_per_request):
                flags = await link.client.contains([wire[i] for i in part], deadline)
                for i, flag in zip(part, flags, strict=True):
                    found[i] = flag

        await self._per_owner(wire, ask)
        return found

    async def put(self, rows: Sequence[Row]) -> list[bool]:
        stored = await self._by_parts(rows, self._put_part)
        ok = sum(stored)
        self._counters["stored"] += ok
        self._counters["dropped"] += len(rows) - ok
        for (key, _), done in zip(rows, stored, strict=True):
            if done:
                self._remember(bytes(key))
        return stored

    async def get(self, rows: Sequence[Row], layouts: list[bytes | None] | None = None) -> list[bool]:
        """READ rows into the buffers; ``layouts``, when given, receives each hit's layout id."""
        served: list[bytes | None] = [None] * len(rows)
        loaded = await self._by_parts(rows, partial(self._get_part, served=served))
        if layouts is not None:
            for i, hit in enumerate(loaded):
                layouts[i] = served[i] if hit else None
        hits = sum(loaded)
        self._counters["hits"] += hits
        self._counters["misses"] += len(rows) - hits
        return loaded

    async def _by_parts(self, rows: Sequence[Row], run_part: Callable[..., Awaitable[None]]) -> list[bool]:
        """Run ``run_part`` on each owner's keys, ``keys_per_request`` at a time; a flag per row."""
        deadline = self._deadline()
        done = [False] * len(rows)
        wire = self._wire([key for key, _ in rows])
        views = [_bytes_view(row) for _, row in rows]
        addrs = [self._addr(view) for view in views]  # a row outside the host buffer fails here

        async def on_owner(link: _Link, idxs: list[int]) -> None:
            batches = _batches(idxs, self.keys_per_request)
            if len(batches) == 1:
                await run_part(link, batches[0], wire, views, addrs, done, deadline)
                return
            # Two requests in flight, so one's control messages travel while the other's rows
            # move. Every one runs to its end (a READ may not outlive the call) before the
            # first error is raised.
            window = asyncio.Semaphore(_REQUESTS_IN_FLIGHT)

            async def one(part: list[int]) -> None:
                async with window:
                    await run_part(link, part, wire, views, addrs, done, deadline)

            outcomes = await asyncio.gather(*(one(part) for part in batches), return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome

        await self._per_owner(wire, on_owner)
        return done

    async def delete(self, keys: Sequence[bytes]) -> None:
        """Delete on every reachable peer: a key may have a copy on its former owner."""
        deadline = self._deadline()
        for key in keys:
            self._known.pop(bytes(key), None)
        wire = self._wire(keys)

        async def delete_on(peer: _Peer) -> None:
            client = peer.client
            if client is None:
                return
            try:
                for part in _batches(list(range(len(wire))), self.keys_per_request):
                    await client.delete([wire[i] for i in part], deadline)
            except PeerRefused as exc:
                log.warning("peer %s refused a delete: %s", peer.address, exc)
            except PeerUnavailable as exc:
                self._mark_down(peer, str(exc), client)

        self._reconnect_due()
        await asyncio.gather(*(delete_on(p) for p in self._peers if p.up))

    def stats(self) -> dict[str, float]:
        up = sum(1 for p in self._peers if p.up)
        beside = self._agent.parts_after_beside if self._agent is not None else 0
        return {
            **self._counters,
            "peers": len(self._peers),
            "peers_up": up,
            "known_keys": len(self._known),
            "parts_checksummed_beside": beside,
        }

    # -- introspection for tests and benchmarks ---------------------------------------------

    def peers_up(self) -> list[str]:
        return [p.address for p in self._peers if p.up]

    def owner(self, key: bytes) -> str | None:
        """The reachable peer that owns ``key`` now (``None``: no peer is up)."""
        up = [p.address for p in self._peers if p.up]
        return rendezvous_owner(self.namespace + bytes(key), up) if up else None

    async def peer_stats(self, address: str) -> dict[str, int]:
        """The STATS of one reachable peer (``PeerUnavailable`` if it is down)."""
        peer = next(p for p in self._peers if p.address == address)
        if peer.client is None or not peer.up:
            raise PeerUnavailable(f"{address} is down")
        return await peer.client.stats(self._deadline())

    # -- one owner's share of a call --------------------------------------------------------

    async def _per_owner(
        self, wire: list[bytes], work: Callable[[_Link, list[int]], Awaitable[None]]
    ) -> None:
        """Route ``wire`` keys to their owners and run ``work`` per owner, concurrently.

        A peer that fails is marked down; its keys keep whatever result they had (a miss,
        a failed put). A refused request fails only its own keys.
        """
        self._reconnect_due()
        links = [
            _Link(p, p.client, p.remote_agent)
            for p in self._peers
            if p.up and p.client is not None and p.remote_agent is not None
        ]
        if not links:
            return
        groups: dict[_Link, list[int]] = {}
        if len(links) == 1:
            groups[links[0]] = list(range(len(wire)))
        else:
            for i, key in enumerate(wire):
                best = max(links, key=lambda link: xxhash.xxh3_64_intdigest(key, seed=link.peer.seed))
                groups.setdefault(best, []).append(i)

        async def guarded(link: _Link, idxs: list[int]) -> None:
            try:
                await work(link, idxs)
            except PeerRefused as exc:
                log.warning("peer %s refused a request: %s", link.peer.address, exc)
            except (PeerUnavailable, TransferError) as exc:
                if isinstance(exc, PeerTimeout | TransferTimeout):
                    self._counters["timeouts"] += 1
                self._mark_down(link.peer, str(exc), link.client)

        if len(groups) == 1:  # no task to spawn and wait for (each costs an event-loop turn)
            ((link, idxs),) = groups.items()
            await guarded(link, idxs)
        else:
            await asyncio.gather(*(guarded(link, idxs) for link, idxs in groups.items()))

    async def _put_part(
        self,
        link: _Link,
        idxs: list[int],
        wire: list[bytes],
        views: list[memoryview],
        addrs: list[int],
        stored: list[bool],
        deadline: float,
    ) -> None:
        client = link.client
        slot_bytes = link.welcome.slot_bytes
        eligible = [i for i in idxs if 0 < len(views[i]) <= slot_bytes]
        if not eligible:
            return
        alloc_id, slots = await client.put_alloc(
            [wire[i] for i in eligible], [len(views[i]) for i in eligible], deadline
        )
        writes: list[tuple[int, int]] = []  # (row index, slot)
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
        link: _Link,
        writes: list[tuple[int, int]],
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
        self._counters["bytes_written"] += sum(len(views[i]) for i, _ in writes)
        checksums = [checksum for part_sums in cast(list[list[int]], outcomes) for checksum in part_sums]
        return [
            RowHeader(self.layout_id, len(views[i]), checksum).pack()
            for (i, _), checksum in zip(writes, checksums, strict=True)
        ]

    async def _get_part(
        self,
        link: _Link,
        idxs: list[int],
        wire: list[bytes],
        views: list[memoryview],
        addrs: list[int],
        loaded: list[bool],
        deadline: float,
        *,
        served: list[bytes | None],
    ) -> None:
        client = link.client
        lease_id, entries = await client.get([wire[i] for i in idxs], deadline)
        try:
            reads: list[tuple[int, int]] = []
            expected: dict[int, int] = {}  # row -> checksum its header promises
            for i, entry in zip(idxs, entries, strict=True):
                if entry is None:
                    continue
                slot, raw = entry
                header = RowHeader.unpack(raw)
                why = self._unservable(header, len(views[i]), link.welcome.slot_bytes)
                if why is not None or header is None:
                    self._counters["corrupt"] += 1
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
        if header is None:
            return "no valid header"
        if header.version != ROW_FORMAT_VERSION:
            return f"format version {header.version}"
        if header.layout_id not in self.layouts:
            return "another layout"
        if header.row_length != length or length > slot_bytes:
            return f"length {header.row_length}, expected {length}"
        return None

    async def _read_and_verify(
        self,
        link: _Link,
        reads: list[tuple[int, int]],
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
            after=lambda k: self._verify(parts[k], views, addrs, expected),
        )
        errors = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        for part, outcome in zip(parts, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                continue
            for (i, _), good in zip(part, outcome, strict=True):
                if good:
                    loaded[i] = True
                else:
                    self._counters["corrupt"] += 1
                    log.warning("peer %s: a row failed its checksum: a miss", link.peer.address)
            self._counters["bytes_read"] += sum(len(views[i]) for i, _ in part)
        if errors:
            raise errors[0]

    @staticmethod
    def _verify(
        part: list[tuple[int, int]], views: list[memoryview], addrs: list[int], expected: dict[int, int]
    ) -> list[bool]:
        return [checksum_at(views[i], addrs[i]) == expected[i] for i, _ in part]

    # -- transfers --------------------------------------------------------------------------

    def _parts(self, items: list[tuple[int, int]], views: list[memoryview]) -> list[list[tuple[int, int]]]:
        """Cut ``(row, slot)`` pairs into NIXL requests of about ``transfer_bytes`` (one row at least)."""
        parts: list[list[tuple[int, int]]] = []
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
        link: _Link,
        op: str,
        parts: list[list[tuple[int, int]]],
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
        self._counters["transfers"] += len(parts)
        self._counters["descriptors"] += len(items)
        future = self._agent.transfer(
            op, local, remote, sizes, link.remote_agent, deadline - _MARGIN_S, after=after
        )
        return await self._settle(future, deadline, len(parts))

    async def _settle(self, future: concurrent.futures.Future, deadline: float, n: int) -> list[object]:
        """Wait until every part has finished, failed or timed out: one outcome per part.

        The agent's thread resolves each part by its deadline; the extra grace only guards
        against a NIXL call that itself blocks, which no measurement has shown.
        """
        try:
            return await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(future)),
                max(0.0, deadline - time.monotonic()) + _GRACE_S,
            )
        except TimeoutError:
            log.error("NIXL agent did not report %d transfers %.1f s past their deadline", n, _GRACE_S)
            return [TransferTimeout("the NIXL agent is not answering")] * n

    # -- transfers --------------------------------------------------------------------------

    def _wire(self, keys: Sequence[bytes]) -> list[bytes]:
        """Keys as the peers see them: namespace first (which keeps tenants apart)."""
        wire = [self.namespace + bytes(k) for k in keys]
        if any(len(w) > MAX_KEY_BYTES for w in wire):
            raise ValueError(f"namespace + key longer than {MAX_KEY_BYTES} bytes")
        return wire

    def _addr(self, view: memoryview) -> int:
        addr = _address(view) if len(view) else self._host_addr
        if not (self._host_addr <= addr and addr + len(view) <= self._host_addr + self._host_len):
            raise ValueError("a row is not a slice of the host buffer given to open()")
        return addr

    # -- peers coming and going -------------------------------------------------------------

    def _deadline(self) -> float:
        if self._agent is None:
            raise TierError("the remote tier is not open")
        return time.monotonic() + self.deadline_s

    def _reconnect_due(self) -> None:
        now = time.monotonic()
        for peer in self._peers:
            if not peer.up and peer.connecting is None and now >= peer.retry_at:
                peer.connecting = asyncio.create_task(self._connect(peer))

    async def _connect(self, peer: _Peer) -> None:
        """Handshake, load the peer's NIXL metadata, and READ its probe bytes (which proves
        the data plane and wires the transport up before the first real transfer)."""
        agent = self._agent
        assert agent is not None
        deadline = time.monotonic() + self.deadline_s
        client: PeerClient | None = None
        name: str | None = None
        peer.connecting = peer.connecting or asyncio.current_task()
        try:
            client = await PeerClient.connect(
                peer.host, peer.port, self.token, deadline, self._on_lost(peer), self.tenant
            )
            welcome = client.welcome
            try:
                check_peer_metadata(
                    welcome.agent_metadata,
                    f"kvtier-peer-{welcome.instance_id.hex()}",
                    welcome.pool_addr,
                    welcome.probe_addr + welcome.probe_len,
                )
            except MetadataError as exc:
                raise PeerUnavailable(f"{peer.address}: NIXL metadata refused: {exc}") from exc
            raw_name = await agent.call(
                lambda a: a.add_remote_agent(welcome.agent_metadata), max(0.01, deadline - time.monotonic())
            )
            name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
            scratch = self._scratch.ctypes.data + peer.scratch_offset
            probe = descriptors([scratch], [INSTANCE_ID_BYTES])
            future = agent.transfer(
                "READ", probe, descriptors([welcome.probe_addr], [INSTANCE_ID_BYTES]), [1], name, deadline
            )
            (outcome,) = await self._settle(future, deadline, 1)
            if isinstance(outcome, BaseException):
                raise outcome
            got = self._scratch[peer.scratch_offset : peer.scratch_offset + INSTANCE_ID_BYTES].tobytes()
            if got != welcome.instance_id:
                raise PeerUnavailable(f"{peer.address}: the probe read other memory than the peer announced")
        except BaseException as exc:  # whatever went wrong, the peer is not usable now
            if client is not None:
                await client.close()
            if name is not None and not isinstance(exc, TransferTimeout):
                self._remove_agent(name)
            if not isinstance(exc, Exception):
                raise  # cancelled: the tier is closing
            self._back_off(peer)
            log.warning(
                "peer %s unreachable (%s); next try in %.1f s",
                peer.address,
                exc,
                peer.retry_at - time.monotonic(),
            )
            return
        finally:
            peer.connecting = None
        if peer.failures:
            self._counters["rejoins"] += 1
            log.warning("peer %s is back (instance %s)", peer.address, welcome.instance_id.hex()[:8])
        peer.client, peer.remote_agent, peer.failures = client, name, 0

    def _on_lost(self, peer: _Peer) -> Callable[[PeerClient, str], None]:
        def lost(client: PeerClient, reason: str) -> None:
            self._mark_down(peer, reason, client)

        return lost

    def _mark_down(self, peer: _Peer, reason: str, client: PeerClient | None = None) -> None:
        """Stop routing to ``peer``; retry it after a backoff. With ``client``: only if that is
        still the peer's connection (a late failure must not take down a rejoined peer)."""
        if client is not None and peer.client is not client:
            return
        client, peer.client = peer.client, None
        if client is None:
            return
        self._counters["peer_failures"] += 1
        self._back_off(peer)
        log.warning(
            "peer %s down: %s; next try in %.1f s", peer.address, reason, peer.retry_at - time.monotonic()
        )
        task = asyncio.ensure_future(client.close())
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)
        if peer.remote_agent is not None:
            self._remove_agent(peer.remote_agent)
            peer.remote_agent = None

    def _back_off(self, peer: _Peer) -> None:
        peer.failures += 1
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (peer.failures - 1))
        peer.retry_at = time.monotonic() + delay * random.uniform(0.75, 1.0)

    def _remove_agent(self, name: str) -> None:
        """Drop a peer's NIXL metadata (and connection) on the agent's thread, after anything
        already queued towards it."""
        if self._agent is not None:
            self._agent.submit(lambda a: quietly(a.remove_remote_agent, name))

    def _remember(self, key: bytes) -> None:
        self._known[key] = None
        if len(self._known) > self.max_tracked_keys:
            del self._known[next(iter(self._known))]


def _batches(idxs: list[int], size: int) -> list[list[int]]:
    return [idxs[i : i + size] for i in range(0, len(idxs), size)]


def _address(view: memoryview) -> int:
    """The address of a row's first byte: ``ctypes`` for a writable view (~0.3 us, against
    ~2 us through numpy or the buffer protocol), ``buffer_address`` for a read-only one."""
    if view.readonly:
        return buffer_address(view)
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _bytes_view(row: memoryview) -> memoryview:
    view = memoryview(row)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
