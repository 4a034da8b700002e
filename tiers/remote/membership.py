"""Which of the remote tier's peers are up: handshakes, failures, backoff and rejoins.

A peer that fails to answer in time, closes its connection, or fails a transfer is **marked
down**: its keys are misses (or go to their next owner), it is retried after an exponential
backoff (``backoff_s`` doubling to ``max_backoff_s``), and a restarted peer (new instance,
new NIXL metadata) rejoins on its next successful handshake.

The peer initiates every transfer, so a client loads no peer's NIXL metadata: each
handshake announces this client's agent (its metadata and a few probe bytes in its scratch
area, which hold a value only this session can compute) and ends when the peer has READ
them, which proves the data plane and wires the transport up before the first real
transfer.

A peer that closes a connection for being idle (its ``--idle-timeout``) is **parked**, not
marked down: it stays up (routing keeps its keys), no failure is counted, and the next call
reopens the connection before it routes (``reopen_parked``); only if that handshake fails
is the peer down. An idle engine costs the peer no connection and loses nothing. (A call
sent in the instant the peer closes fails with ``PeerIdleClosed``: its rows are misses or
unstored, never partly written, since the peer read none of it.)

Everything here runs on the tier's event loop; ``Peer.up`` is a plain read, safe from the
scheduler's thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tiers.address import Address
from tiers.remote.client import Announcement, PeerClient
from tiers.remote.net_iface import on_this_host
from tiers.remote.nixl_agent import AgentThread
from tiers.remote.protocol import DEFAULT_TENANT, PROBE_BYTES, Welcome
from tiers.remote.routing import peer_seed
from tiers.remote.stats import RemoteStats
from tiers.shared import Backoff

log = logging.getLogger(__name__)

SCRATCH_PER_PEER = 64
"""Bytes of the scratch area per peer (the probe bytes its handshake's READ takes)."""


@dataclass(eq=False)
class Peer:
    """One ``kvtier peer``: its address, and while it is up its connection."""

    address: str
    host: str
    port: int
    seed: int
    scratch_offset: int
    on_this_host: bool = False  # its transfers are CMA copies: they need no fast progress here
    client: PeerClient | None = None
    failures: int = 0
    retry_at: float = 0.0
    connecting: asyncio.Task | None = None
    parked: bool = False  # its idle connection was closed by the peer: reopened on next use

    @property
    def up(self) -> bool:
        return self.parked or (self.client is not None and not self.client.closed)


@dataclass(frozen=True, eq=False)
class Link:
    """One call's view of an up peer: the connection it started with, so a peer that goes
    down (or comes back) meanwhile cannot change it under the call."""

    peer: Peer
    client: PeerClient

    @property
    def welcome(self) -> Welcome:
        return self.client.welcome


class Membership:
    """The peers of one remote tier and their state; see the module docstring.

    ``attach(agent, metadata)`` before ``connect_all``: the handshake announces that agent
    (``metadata``: its NIXL metadata, taken once ``scratch``, ``SCRATCH_PER_PEER`` bytes per
    peer, and the host rows were registered with it).
    """

    def __init__(
        self,
        addresses: Sequence[Address],
        stats: RemoteStats,
        *,
        token: bytes | None = None,
        tenant: str = DEFAULT_TENANT,
        deadline_s: float = 2.0,
        backoff: Backoff,
    ) -> None:
        self.peers: list[Peer] = []
        for i, address in enumerate(addresses):  # parsed already (RemoteSettings.peers)
            text = str(address)
            peer = Peer(text, address.host, address.port, peer_seed(text), i * SCRATCH_PER_PEER)
            peer.on_this_host = on_this_host(address.host)
            self.peers.append(peer)
        self.scratch = np.zeros(len(self.peers) * SCRATCH_PER_PEER, dtype=np.uint8)
        self.token = token
        self.tenant = tenant
        self.deadline_s = deadline_s
        self.backoff = backoff
        self._stats = stats
        self._agent: AgentThread | None = None
        self._metadata = b""
        self._cleanup: set[asyncio.Future] = set()

    def attach(self, agent: AgentThread | None, metadata: bytes = b"") -> None:
        """The NIXL agent the handshakes announce, and its metadata (``None``: closed)."""
        self._agent = agent
        self._metadata = metadata

    # -- who is up ------------------------------------------------------------------------

    def up_addresses(self) -> list[str]:
        return [p.address for p in self.peers if p.up]

    def links(self) -> list[Link]:
        """A link per peer that is up now, for one call (after ``reconnect_due`` and
        ``reopen_parked``)."""
        return [Link(p, p.client) for p in self.peers if p.client is not None and not p.client.closed]

    def peer(self, address: str) -> Peer:
        return next(p for p in self.peers if p.address == address)

    # -- coming and going -----------------------------------------------------------------

    async def connect_all(self) -> None:
        await asyncio.gather(*(self.connect(peer) for peer in self.peers))

    def reconnect_due(self) -> None:
        """Start a handshake with every peer that is down and whose backoff has passed."""
        now = time.monotonic()
        for peer in self.peers:
            if not peer.up and peer.connecting is None and now >= peer.retry_at:
                peer.connecting = asyncio.create_task(self.connect(peer))

    async def reopen_parked(self) -> None:
        """Reconnect every parked peer and wait for those handshakes (each within
        ``deadline_s``): a peer whose handshake fails is down, as any other."""
        parked = [peer for peer in self.peers if peer.parked]
        if not parked:
            return
        for peer in parked:
            if peer.connecting is None:
                peer.connecting = asyncio.create_task(self.connect(peer))
        await asyncio.wait([asyncio.shield(p.connecting) for p in parked if p.connecting is not None])

    async def connect(self, peer: Peer) -> None:
        """Handshake, announcing this client's agent; the peer READs its probe bytes (which
        proves the data plane and wires the transport up before the first real transfer)."""
        agent = self._agent
        assert agent is not None
        deadline = time.monotonic() + self.deadline_s
        peer.connecting = peer.connecting or asyncio.current_task()
        probe = self.scratch[peer.scratch_offset : peer.scratch_offset + PROBE_BYTES]

        def write_probe(value: bytes) -> None:
            probe[:] = np.frombuffer(value, dtype=np.uint8)

        announcement = Announcement(self._metadata, probe.ctypes.data, write_probe, agent.incoming)
        try:
            client = await PeerClient.connect(
                peer.host,
                peer.port,
                self.token,
                deadline,
                self._on_lost(peer),
                self.tenant,
                agent=announcement,
            )
        except Exception as exc:  # whatever went wrong, the peer is not usable now
            peer.parked = False
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
            probe[:] = 0
        welcome = client.welcome
        if peer.failures:
            self._stats.rejoins += 1
            log.warning("peer %s is back (instance %s)", peer.address, welcome.instance_id.hex()[:8])
        peer.client, peer.failures, peer.parked = client, 0, False

    def _on_lost(self, peer: Peer) -> Callable[[PeerClient, str], None]:
        def lost(client: PeerClient, reason: str) -> None:
            if client.closed_idle:
                self.park(peer, client)
            else:
                self.mark_down(peer, reason, client)

        return lost

    def park(self, peer: Peer, client: PeerClient) -> None:
        """The peer closed ``client`` for being idle: keep the peer up, reopen on next use."""
        if peer.client is not client:
            return
        peer.client, peer.parked = None, True
        log.info("peer %s closed an idle connection; it is reopened on the next call", peer.address)
        self._close_later(client)

    def mark_down(self, peer: Peer, reason: str, client: PeerClient | None = None) -> None:
        """Stop routing to ``peer``; retry it after a backoff. With ``client``: only if that is
        still the peer's connection (a late failure must not take down a rejoined peer)."""
        if client is not None and peer.client is not client:
            return
        client, peer.client = peer.client, None
        if client is None:
            return
        self._stats.peer_failures += 1
        self._back_off(peer)
        log.warning(
            "peer %s down: %s; next try in %.1f s", peer.address, reason, peer.retry_at - time.monotonic()
        )
        self._close_later(client)

    def _close_later(self, client: PeerClient) -> None:
        task = asyncio.ensure_future(client.close())
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

    def _back_off(self, peer: Peer) -> None:
        peer.failures += 1
        peer.retry_at = self.backoff.retry_at(peer.failures)

    async def disconnect(self, grace_s: float) -> None:
        """Stop every handshake and close every connection (waiting up to ``grace_s`` for
        closes already under way)."""
        for peer in self.peers:
            if peer.connecting is not None:
                peer.connecting.cancel()
        await asyncio.gather(*(p.connecting for p in self.peers if p.connecting), return_exceptions=True)
        for peer in self.peers:
            if peer.client is not None:
                await peer.client.close()
                peer.client = None
        if self._cleanup:
            await asyncio.wait(self._cleanup, timeout=grace_s)
