"""The remote tier: rows kept in the memory of ``kvtier peer`` processes, moved by NIXL.

``RemoteTier`` composes three parts, each with one job:

- ``membership``: which peers are up (handshakes, failures, backoff, rejoins);
- ``routing``: which peer owns a key (rendezvous hashing over the peers that are up);
- ``data_plane``: moving one owner's rows (parts, checksums, NIXL transfers).

This module holds the lifecycle (the NIXL agent, the host buffer registered once) and the
``LowerTier`` verbs: each routes its keys to their owners and runs the data plane per
owner, all owners concurrently. A peer's share of a call that needs several control
requests (more than ``keys_per_request`` keys) keeps two of them in flight: one's messages
travel while the other's rows move.

Every call has one deadline (``deadline_s``, default 2 s) covering the control messages and
the transfers (the peer is told the time left and ends its transfer by then). A peer that
fails within it (no answer in time, a closed connection, a failed transfer) is marked down
(``membership``): its keys keep whatever result they had (a miss, a failed put) or go to
their next owner; a refused request fails only its own keys. A connection that a peer
closed for being idle is no failure: the next call reopens it before it routes
(``membership``). A get that a peer did not answer may still have bytes on their way into
the caller's rows: the call then raises ``RowsAbandoned`` with its per-row results, and
those rows are never reused (``data_plane``).

Keys on the wire are ``namespace + key``: the namespace (a digest that includes the tenant
salt) keeps engines that must not share rows apart. Tenants are kept apart by the peer
itself: the client claims ``tenant`` in its handshake, the peer accepts the claim only if
the token grants it, and keeps each tenant's rows in its own namespace and quota
(``tiers/remote/pool.py``).

Threads: the coroutines run on the caller's event loop; the NIXL agent on its own thread
(which progresses the worker while a peer moves rows: ``AgentThread.incoming``), checksums
on the loop's executor. ``may_contain`` and ``stats``
only read plain dicts and ints, so the scheduler may call them from its thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import replace
from functools import partial

from tiers.base import LowerTier, Row, RowsAbandoned, TierError
from tiers.remote.client import PeerRefused, PeerTimeout, PeerUnavailable
from tiers.remote.data_plane import DataPlane, GetAbandoned
from tiers.remote.membership import Link, Membership, Peer
from tiers.remote.net_iface import configure_ucx_for_peers
from tiers.remote.nixl_agent import GRACE_S, AgentThread, TransferError, TransferTimeout
from tiers.remote.protocol import MAX_KEYS, valid_tenant
from tiers.remote.routing import batches, batches_by_bytes, group_by_owner, rendezvous_owner, wire_keys
from tiers.remote.stats import RemoteStats
from tiers.row_format import served_layouts
from tiers.settings import RemoteSettings
from tiers.shared import Backoff, HostRegion, KnownKeys

__all__ = ["RemoteTier", "rendezvous_owner"]

log = logging.getLogger(__name__)

_REQUESTS_IN_FLIGHT = 2  # per peer, when a call needs several requests
_AGENT_START_S = 30.0


class RemoteTier(LowerTier):
    """A client of one or more ``kvtier peer`` processes; see the module docstring.

    ``settings`` (``RemoteSettings``, the TOML's keys): ``peers`` (``host:port``; a key's
    owner is chosen by hashing each peer's address as written), ``peer_tenant`` (the tenant
    claimed at the peers, which ``token`` must grant, else the peer refuses it),
    ``deadline_s`` (the most any call takes: control messages and transfers together) and
    ``checksum_thread`` (hash a put's rows on a thread beside the event loop while the other
    request in flight moves; ``False``: on the loop; a get's rows are verified by the peer).

    ``namespace``: prefixes every key on the wire. ``layout_id``: the 16-byte layout id of
    the rows this client puts; ``get`` also serves rows of ``readable_layouts`` (layouts its
    owner converts from). ``token``: the secret this client proves to the peers (``None``:
    peers started without one), read from ``settings.token_file`` by whoever builds the
    tier. ``backoff_s``/``max_backoff_s``: how long a failed peer rests before it is tried
    again (doubling per failure). ``transfer_bytes``: rows per request (one transfer of the
    peer's) are cut at about this many bytes (at least one row): few and large, because each
    request costs a round trip and several thread hand-offs (measured on the 2-core VM: 16 MiB
    requests ran at two thirds of the speed of 64 MiB ones). ``keys_per_request``: keys
    per control message at most (the protocol allows ``MAX_KEYS``). ``max_tracked_keys``: how many
    stored keys ``may_contain`` remembers.
    """

    kind = "remote"
    index_is_partial = True  # other clients' rows are found by ``contains``, not ``may_contain``

    def __init__(
        self,
        settings: RemoteSettings,
        namespace: bytes,
        layout_id: bytes,
        *,
        token: bytes | None = None,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        transfer_bytes: int = 64 << 20,
        keys_per_request: int = 1024,
        max_tracked_keys: int = 1 << 20,
        readable_layouts: Collection[bytes] = (),
    ) -> None:
        self.settings = settings
        peers = [str(peer) for peer in settings.peers]
        tenant, deadline_s, checksum_thread = (
            settings.peer_tenant,
            settings.deadline_s,
            settings.checksum_thread,
        )
        if not peers:
            raise ValueError("the remote tier needs at least one peer")
        if len(set(peers)) != len(peers):
            raise ValueError(f"peers {list(peers)} name a peer twice")
        layouts = served_layouts(layout_id, readable_layouts)
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be positive, got {deadline_s!r}")
        if not valid_tenant(tenant):
            raise ValueError(f"tenant {tenant!r}: 1..64 of A-Z a-z 0-9 . _ -, starting alphanumeric")
        if not 0 < keys_per_request <= MAX_KEYS:
            raise ValueError(f"keys_per_request must be in 1..{MAX_KEYS}")
        self.namespace = bytes(namespace)
        self.layout_id = bytes(layout_id)
        self.layouts = layouts  # what get may serve
        self.token = token
        self.tenant = tenant
        self.deadline_s = deadline_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.keys_per_request = keys_per_request
        self.max_tracked_keys = max_tracked_keys
        self._stats = RemoteStats()
        self._members = Membership(
            settings.peers,
            self._stats,
            token=token,
            tenant=tenant,
            deadline_s=deadline_s,
            backoff=Backoff(backoff_s, max_backoff_s),
        )
        self._data = DataPlane(
            self.layout_id,
            self.layouts,
            self._stats,
            transfer_bytes=transfer_bytes,
            checksum_thread=checksum_thread,
        )
        self._agent: AgentThread | None = None
        self._host = HostRegion(0, 0)
        self._registrations: list = []
        self._known = KnownKeys(max_tracked_keys)  # keys this client stored (may_contain)

    @property
    def transfer_bytes(self) -> int:
        """Rows per request are cut at about this many bytes (``data_plane``)."""
        return self._data.transfer_bytes

    # -- lifecycle --------------------------------------------------------------------------

    async def open(self, host_buffer: memoryview | None = None) -> None:
        """Start the NIXL agent, register the host tier once and reach every peer.

        UCX is first pointed at the network of the configured peers (``net_iface``:
        ``UCX_NET_DEVICES``, and ``UCX_TLS=^sm`` when no peer is on this host), unless the
        user set those variables.

        A peer that cannot be reached now is not an error (it is retried with backoff); a
        missing or read-only host buffer, or a NIXL agent that cannot start, is.
        """
        self._host = HostRegion.of(host_buffer, "remote")
        configure_ucx_for_peers([peer.host for peer in self._members.peers])  # before UCX starts
        self._agent = AgentThread(f"kvtier-remote-{os.getpid()}-{uuid.uuid4().hex[:8]}", after_thread=False)
        scratch = self._members.scratch
        try:
            await self._agent.start(_AGENT_START_S)
            regions = [
                (self._host.addr, self._host.length, 0, ""),
                (scratch.ctypes.data, scratch.nbytes, 0, ""),
            ]
            self._registrations = [
                await self._agent.call(lambda a, r=r: a.register_memory([r], "DRAM"), _AGENT_START_S)
                for r in regions
            ]
            metadata = await self._agent.call(lambda a: a.get_agent_metadata(), _AGENT_START_S)
        except Exception as exc:
            self._agent.close()
            raise TierError(f"remote tier: cannot start a NIXL agent: {exc}") from exc
        self._members.attach(self._agent, metadata)
        self._data.attach(self._agent)
        await self._members.connect_all()
        up = self._members.up_addresses()
        log.info("remote tier: %d of %d peers up %s", len(up), len(self._members.peers), up)

    async def close(self) -> None:
        await self._members.disconnect(GRACE_S)
        if self._agent is not None:
            agent, self._agent = self._agent, None
            self._members.attach(None)
            self._data.attach(None)
            registrations, self._registrations = self._registrations, []

            def teardown(a) -> None:
                for reg in registrations:
                    with contextlib.suppress(Exception):
                        a.deregister_memory(reg)

            with contextlib.suppress(Exception):
                await agent.call(teardown, GRACE_S * 4)
            # On this thread, not the loop's executor: vLLM closes its connector from a
            # weakref finaliser at interpreter exit, where that executor was found already
            # shut down ("cannot schedule new futures after shutdown") and the agent was
            # left open. Bounded by the join timeout of the agent's threads.
            agent.close()

    # -- the LowerTier verbs ----------------------------------------------------------------

    def may_contain(self, key: bytes) -> bool:
        return key in self._known

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        deadline = self._deadline()
        found = [False] * len(keys)
        wire = wire_keys(self.namespace, keys)

        async def ask(link: Link, idxs: list[int]) -> None:
            for part in batches(idxs, self.keys_per_request):
                flags = await link.client.contains([wire[i] for i in part], deadline)
                for i, flag in zip(part, flags, strict=True):
                    found[i] = flag

        await self._per_owner(wire, ask)
        return found

    async def put(self, rows: Sequence[Row]) -> list[bool]:
        stored = await self._by_parts(rows, self._data.put_part)
        ok = sum(stored)
        self._stats.stored += ok
        self._stats.dropped += len(rows) - ok
        self._known.add_stored(rows, stored)
        return stored

    async def get(self, rows: Sequence[Row], layouts: list[bytes | None] | None = None) -> list[bool]:
        """Have the owners WRITE the rows into the buffers; ``layouts``, when given, receives
        each hit's layout id. ``RowsAbandoned`` (with the per-row results) when an owner did not
        answer: the rows that are not hits must never be reused."""
        served: list[bytes | None] = [None] * len(rows)
        abandoned: list[str] = []
        loaded = await self._by_parts(rows, partial(self._data.get_part, served=served), abandoned)
        if layouts is not None:
            for i, hit in enumerate(loaded):
                layouts[i] = served[i] if hit else None
        hits = sum(loaded)
        self._stats.hits += hits
        self._stats.misses += len(rows) - hits
        if abandoned:
            self._stats.abandoned += 1
            raise RowsAbandoned(f"remote get: no answer from {', '.join(sorted(set(abandoned)))}", loaded)
        return loaded

    async def delete(self, keys: Sequence[bytes]) -> None:
        """Delete on every reachable peer: a key may have a copy on its former owner."""
        deadline = self._deadline()
        for key in keys:
            self._known.discard(bytes(key))
        wire = wire_keys(self.namespace, keys)

        async def delete_on(peer: Peer) -> None:
            client = peer.client
            if client is None:
                return
            try:
                for part in batches(list(range(len(wire))), self.keys_per_request):
                    await client.delete([wire[i] for i in part], deadline)
            except PeerRefused as exc:
                log.warning("peer %s refused a delete: %s", peer.address, exc)
            except PeerUnavailable as exc:
                self._members.mark_down(peer, str(exc), client)

        self._members.reconnect_due()
        await self._members.reopen_parked()
        await asyncio.gather(*(delete_on(p) for p in self._members.peers if p.up))

    def stats(self) -> RemoteStats:
        return replace(
            self._stats,
            peers=len(self._members.peers),
            peers_up=sum(1 for p in self._members.peers if p.up),
            known_keys=len(self._known),
        )

    # -- introspection for tests and benchmarks ---------------------------------------------

    def peers_up(self) -> list[str]:
        return self._members.up_addresses()

    def owner(self, key: bytes) -> str | None:
        """The reachable peer that owns ``key`` now (``None``: no peer is up)."""
        up = self._members.up_addresses()
        return rendezvous_owner(self.namespace + bytes(key), up) if up else None

    async def peer_stats(self, address: str) -> dict[str, int]:
        """The STATS of one reachable peer (``PeerUnavailable`` if it is down)."""
        peer = self._members.peer(address)
        if peer.parked:
            await self._members.reopen_parked()
        if peer.client is None or not peer.up:
            raise PeerUnavailable(f"{address} is down")
        return await peer.client.stats(self._deadline())

    # -- one call, per owner ----------------------------------------------------------------

    async def _by_parts(
        self,
        rows: Sequence[Row],
        run_part: Callable[..., Awaitable[None]],
        abandoned: list[str] | None = None,
    ) -> list[bool]:
        """Run ``run_part`` on each owner's keys, a request per ``transfer_bytes`` of rows (and
        at most ``keys_per_request`` keys); a flag per row. The address of each owner whose
        part raised ``GetAbandoned`` goes into ``abandoned``."""
        deadline = self._deadline()
        done = [False] * len(rows)
        wire = wire_keys(self.namespace, [key for key, _ in rows])
        views, addrs = self._host.rows(rows)  # a row outside the host buffer fails here
        sizes = [len(view) for view in views]

        async def on_owner(link: Link, idxs: list[int]) -> None:
            try:
                max_bytes = min(self.transfer_bytes, link.welcome.max_request_bytes)
                await on_parts(link, batches_by_bytes(idxs, sizes, max_bytes, self.keys_per_request))
            except GetAbandoned:
                if abandoned is not None:
                    abandoned.append(link.peer.address)
                raise

        async def on_parts(link: Link, parts: list[list[int]]) -> None:
            if len(parts) == 1:
                await run_part(link, parts[0], wire, views, addrs, done, deadline)
                return
            # Two requests in flight, so the peer moves one's rows while this client hashes the
            # other's. Every one runs to its end before the first error is raised.
            window = asyncio.Semaphore(_REQUESTS_IN_FLIGHT)

            async def one(part: list[int]) -> None:
                async with window:
                    await run_part(link, part, wire, views, addrs, done, deadline)

            outcomes = await asyncio.gather(*(one(part) for part in parts), return_exceptions=True)
            errors = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
            if errors:  # an abandoned get first: the caller must learn of it
                raise next((e for e in errors if isinstance(e, GetAbandoned)), errors[0])

        await self._per_owner(wire, on_owner)
        return done

    async def _per_owner(self, wire: list[bytes], work: Callable[[Link, list[int]], Awaitable[None]]) -> None:
        """Route ``wire`` keys to their owners and run ``work`` per owner, concurrently.

        A peer that fails is marked down; its keys keep whatever result they had (a miss,
        a failed put). A refused request fails only its own keys.
        """
        self._members.reconnect_due()
        await self._members.reopen_parked()
        links = self._members.links()
        groups = group_by_owner(wire, links, [link.peer.seed for link in links])
        if not groups:
            return

        async def guarded(link: Link, idxs: list[int]) -> None:
            try:
                await work(link, idxs)
            except PeerRefused as exc:
                log.warning("peer %s refused a request: %s", link.peer.address, exc)
            except (PeerUnavailable, TransferError) as exc:
                if isinstance(exc, PeerTimeout | TransferTimeout):
                    self._stats.timeouts += 1
                self._members.mark_down(link.peer, str(exc), link.client)

        if len(groups) == 1:  # no task to spawn and wait for (each costs an event-loop turn)
            ((link, idxs),) = groups.items()
            await guarded(link, idxs)
        else:
            await asyncio.gather(*(guarded(link, idxs) for link, idxs in groups.items()))

    def _deadline(self) -> float:
        if self._agent is None:
            raise TierError("the remote tier is not open")
        return time.monotonic() + self.deadline_s
