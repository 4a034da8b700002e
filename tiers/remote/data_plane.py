"""How rows move between the host tier and one peer: requests, checksums, and the peer's transfers.

**The peer initiates every NIXL transfer** against this client's registered host rows, so no
client ever holds a key to a peer's memory (``tiers/remote/protocol.py``). Per owner peer
(all owners concurrently, ``tier.RemoteTier``), one request per ``transfer_bytes`` of rows:

- put: PUT (keys, lengths, row addresses) -> the peer allocates slots for the keys it does
  not hold, READs those rows and answers LANDED; meanwhile this client checksums the rows
  on a thread beside (``checksum_thread``); PUT_COMMIT with the row headers makes them
  visible. A key the peer holds already is not read again (keys name their content).
- get: GET (keys, lengths, row addresses) -> the peer WRITEs each row it holds with that
  length into the caller's buffer, verifies each row's bytes against the checksum its put
  committed as the row leaves its slot (hashed right after the copy, while the bytes are in
  cache: ``tiers/remote/server.py``), and answers GOT with the headers of the rows that
  passed; a row whose layout or length this client does not serve is a miss here. A row
  that fails is a miss, never garbage. In flight, bytes are the transport's to keep (CMA
  is a kernel copy; TCP and RDMA carry their own checks).

Where the checksum is computed follows where the bytes are: a put's on this client (the
source of truth, hashed while the peer reads), a get's on the peer (hashed in cache right
after each part's copy). Two requests per peer are in flight, so the peer moves one's rows
while this client handles the other's.

A get's rows are safe to reuse only once the peer answered: its WRITE is over then. A get
that ends any other way (no answer by the deadline, a closed connection, a failed
transfer) may still have bytes on their way into the caller's buffers, so it is reported
**abandoned** (``tiers.base.RowsAbandoned``) and the caller never reuses those rows. A put
can end any way: a late READ only reads, and a row is visible only after its commit, whose
header checksum catches a row read from memory that changed meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Set

from tiers.fast_checksum import checksum_at
from tiers.remote.client import PeerIdleClosed, PeerRefused, PeerTimeout, PeerUnavailable
from tiers.remote.membership import Link
from tiers.remote.nixl_agent import AgentThread, TransferError
from tiers.remote.protocol import Landed
from tiers.remote.stats import RemoteStats
from tiers.row_format import RowHeader, header_refusal

log = logging.getLogger(__name__)


class GetAbandoned(PeerUnavailable):
    """A get ended without the peer's answer: its WRITE may still land in the caller's rows."""


class DataPlane:
    """Moves one request's rows to or from one peer (``put_part``/``get_part``); see the module
    docstring. The rows are given as flat byte ``views`` and their ``addrs`` inside the
    registered host buffer; per-row outcomes go into the caller's flag list.

    ``attach(agent)`` before the first call (``None``: closed, and calls fail)."""

    def __init__(
        self,
        layout_id: bytes,
        layouts: Set[bytes],
        stats: RemoteStats,
        *,
        transfer_bytes: int = 4 << 20,
        checksum_thread: bool = True,
    ) -> None:
        self.layout_id = layout_id
        self.layouts = layouts
        self.transfer_bytes = transfer_bytes
        self.checksum_thread = checksum_thread
        self._stats = stats
        self._agent: AgentThread | None = None

    def attach(self, agent: AgentThread | None) -> None:
        self._agent = agent

    def _live_agent(self) -> AgentThread:
        if self._agent is None:
            raise TransferError("the remote tier is closed")
        return self._agent

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
        agent = self._live_agent()
        client = link.client
        eligible = [i for i in idxs if 0 < len(views[i]) <= link.welcome.slot_bytes]
        if not eligible:
            return
        hashing = self._hash(lambda: [checksum_at(views[i], addrs[i]) for i in eligible])
        try:
            with agent.incoming(fast=not link.peer.on_this_host):
                alloc_id, landed = await client.put(
                    [wire[i] for i in eligible],
                    [len(views[i]) for i in eligible],
                    [addrs[i] for i in eligible],
                    deadline,
                )
            checksums = await hashing
        finally:
            hashing.cancel()  # if the request failed first; a running hash just finishes
        self._stats.transfers += 1
        read: list[int] = []
        headers: list[bytes] = []
        for i, state, checksum in zip(eligible, landed, checksums, strict=True):
            if state == Landed.EXISTS:
                stored[i] = True
            elif state == Landed.READ:
                read.append(i)
                headers.append(RowHeader(self.layout_id, len(views[i]), checksum).pack())
        if not read:
            return
        self._stats.descriptors += len(read)
        self._stats.bytes_written += sum(len(views[i]) for i in read)
        try:
            flags = await client.put_commit(alloc_id, headers, deadline)
        except BaseException:
            client.put_abort(alloc_id)
            raise
        for i, ok in zip(read, flags, strict=True):
            stored[i] = ok

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
        """Have ``link``'s peer WRITE rows ``idxs`` into their buffers; ``loaded[i]`` is set for
        each row that landed verified with a header this client serves, ``served[i]`` to its
        layout id. Raises ``GetAbandoned`` when the peer did not answer (its WRITE may still
        land)."""
        agent = self._live_agent()
        try:
            with agent.incoming(fast=not link.peer.on_this_host):
                headers = await link.client.get(
                    [wire[i] for i in idxs], [len(views[i]) for i in idxs], [addrs[i] for i in idxs], deadline
                )
        except (PeerRefused, PeerIdleClosed):
            raise  # refused, or never read by the peer: nothing can land
        except PeerUnavailable as exc:
            if isinstance(exc, PeerTimeout):
                self._stats.timeouts += 1
            raise GetAbandoned(str(exc)) from exc
        self._stats.transfers += 1
        for i, raw in zip(idxs, headers, strict=True):
            if raw is None:
                continue
            header = RowHeader.unpack(raw)
            why = header_refusal(header, self.layouts, len(views[i]))
            if why is not None or header is None:
                self._stats.corrupt += 1
                log.warning("peer %s: a row refused (%s): a miss", link.peer.address, why)
                continue
            loaded[i] = True
            served[i] = header.layout_id
            self._stats.descriptors += 1
            self._stats.bytes_read += len(views[i])

    # -- checksums ------------------------------------------------------------------------

    def _hash(self, work: Callable[[], list[int]]) -> asyncio.Future[list[int]]:
        """Checksum a put's rows on a thread beside the event loop (the hash releases the GIL),
        so they are hashed while the peer reads them; with ``checksum_thread`` off, right here
        (before the request goes out)."""
        loop = asyncio.get_running_loop()
        if self.checksum_thread:
            self._stats.parts_checksummed_beside += 1
            return loop.run_in_executor(None, work)
        future: asyncio.Future[list[int]] = loop.create_future()
        future.set_result(work())
        return future
