"""``kvtier peer``: a process that lends its memory to remote tiers as a pool of rows.

    kvtier peer --listen HOST:PORT --capacity SIZE [--row-bytes SIZE] [--token-file F] [--policy NAME]

``--token-file`` maps tokens to tenants (``tiers/remote/auth.py``); each connection acts as
the one tenant it authenticated as, in that tenant's namespace and quota. The threat model
(who may reach what, what each transport enforces) is ``docs/threat-model.md``.

The pool is cut into fixed-size slots of ``--row-bytes`` (the largest row served; rows of
every KV group share the slots, a smaller row uses the head of its slot), one run per tenant.
Fixed slots keep a slot's address a multiplication and make eviction a one-for-one swap; vLLM
pads every group's page to one size anyway, so little is wasted. This process keeps the index
(``pool.py``) but never holds a row and never loads a client's NIXL metadata: each tenant's
**worker** process (``tiers/remote/served_memory.py``, ``tenant_worker.py``) holds its
tenant's run of slots, registers it with its own NIXL agent, and moves and verifies that
tenant's rows; a worker that crashes on hostile metadata, or stalls past a deadline and is
killed, ends only its tenant's connections and rows.

**The peer initiates every transfer** (``tiers/remote/protocol.py``): a client announces its
own NIXL agent (metadata checked by ``tiers/remote/nixl_metadata.py``, then proven its own by
a probe read) and names, per request, the addresses of its rows; the peer READs a put's rows
into slots it allocated for that tenant and WRITEs a get's rows from the slots it looked
up, then answers. No client ever receives the pool's address, a slot number or the peer's
NIXL metadata, so no client reaches a row it was not granted, or any other memory of this
process, through NIXL, on any transport (``docs/threat-model.md`` says what remains). A
client on this host must also reach, through its agent, the process that holds its connection
(``socket_owner.py``). A worker's agent lives on a thread of its own (``AgentThread``); with no
transfer in flight it sleeps, so an idle peer costs almost no CPU however many clients are
connected. This process is non-dumpable. The control plane runs on
one uvloop event loop: handshake, put (read, then commit), get, contains, delete, stats;
puts and gets of one connection run concurrently (``MAX_TRANSFERS_PER_CONNECTION``). A
transfer that fails or runs past the client's budget is answered ``TRANSFER_FAILED`` and
closes that connection (its agent was dropped; the client reconnects).

A malformed or oversized message, or one whose tag fails, closes that connection only; a
failed handshake closes the connection before the peer says anything about itself.
Availability: a connection has ``--handshake-timeout`` to authenticate; at most
``MAX_UNAUTHENTICATED_PER_SOURCE`` unauthenticated connections per source address and
``MAX_UNAUTHENTICATED`` in all are kept (a new one pushes out the oldest, so idle sockets
cannot lock a real client out); ``--max-connections`` counts authenticated connections only,
and one tenant holds at most ``--max-connections-per-tenant`` of them (an equal share), so
no tenant locks another out. After the handshake a connection without a request for
``--idle-timeout`` is closed (clients reopen it), and a frame must come whole within
``--frame-timeout`` of its first byte. The work one request causes is bounded (each key once,
at most ``--max-request-bytes`` of rows), and so is each tenant's share of the data plane
(``tiers/remote/fair_share.py``: transfers and bytes in flight per tenant).
UCX is bound to the interface of ``--listen`` (``UCX_NET_DEVICES``) unless the user set it.
SIGTERM or SIGINT stops the peer cleanly (exit status 0). When ready it writes one line to stdout,
``kvtier peer listening on HOST:PORT ...``, which is how scripts and tests learn a port
chosen with ``:0``. Everything else goes to the log (stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import math
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import uvloop

from policies import make_policy
from tiers.address import Address
from tiers.base import Stats
from tiers.remote import protocol as proto
from tiers.remote.auth import Credentials, read_token_file
from tiers.remote.fair_share import Busy, TenantShares
from tiers.remote.net_iface import bind_ucx_to
from tiers.remote.nixl_metadata import MetadataError, check_client_metadata
from tiers.remote.peer_metrics import PeerSnapshot, TransferRecord, take_snapshot
from tiers.remote.pool import PeerPool, PoolLimitError, UnknownAllocation
from tiers.remote.served_memory import ServedMemory, TransferFailed, make_undumpable
from tiers.remote.socket_owner import owner_pids
from tiers.row_format import RowHeader
from tiers.sizes import parse_size

log = logging.getLogger("kvtier.peer")


@dataclass
class ServerCounters(Stats):
    """What the peer's connections did (the pool counts what happened to rows)."""

    connections: int = 0  # authenticated
    auth_failures: int = 0
    protocol_errors: int = 0
    pushed_out: int = 0  # unauthenticated connections closed to make room for newer ones
    agents_refused: int = 0  # AGENT frames whose metadata or probe did not pass
    transfers_failed: int = 0  # a READ or WRITE of a client's rows that failed or ran late
    limit_refusals: int = 0  # PUTs answered LIMIT (too many uncommitted allocations)
    connections_refused: int = 0  # authenticated, but over --max-connections or its tenant's cap
    idle_closed: int = 0  # connections closed after --idle-timeout without a request
    requests_refused: int = 0  # repeated keys, over --max-request-bytes, or the tenant's share full
    transfers: TransferRecord = field(default_factory=TransferRecord)  # answered: counts, bytes, seconds


HANDSHAKE_TIMEOUT_S = 3.0
MAX_UNAUTHENTICATED_PER_SOURCE = 16
MAX_UNAUTHENTICATED = 512
MAX_TTL_S = 3600.0
MAX_CONNECTIONS = 65536
MAX_TRANSFERS_PER_CONNECTION = 8
IDLE_TIMEOUT_S = 300.0
"""An authenticated connection without a request for this long is closed (the client reopens
it on its next call: ``tiers/remote/membership.py``)."""
FRAME_TIMEOUT_S = 10.0
"""Once a frame's first byte came, the whole frame (at most ``proto.MAX_FRAME``) must come
within this: 100 KB/s, far below any network a peer serves over."""
MAX_REQUEST_BYTES = 256 << 20
"""The rows one PUT or GET may name, in all: four times a client's default ``transfer_bytes``
(64 MiB, cut after the row that reaches it), so one request causes a bounded copy and hash."""
TENANT_TRANSFERS = 16
"""Transfers of one tenant in flight at once (``fair_share``); a real engine keeps two per
peer per tier."""
WRITE_TIMEOUT_S = 10.0
GET_PART_BYTES = 2 << 20
"""A GET's WRITE is cut into parts of about this size, each verified right after its copy,
while its rows are still in cache (xxh3 ran at about twice its DRAM speed on cached rows)."""
REPLY_MARGIN_S = 0.01
"""A transfer ends this long before the client's budget runs out, so the answer can reach it."""
SWEEP_S = 1.0
"""Expired allocations and leases are taken back this often, or four times per the shorter
TTL if that is more often (TTLs are safety nets: a late sweep only holds slots longer)."""


@dataclass(frozen=True)
class _Rows:
    """What a PUT or GET names: per key its row's length and address in the client's memory,
    and when the peer's transfer must end (the client's budget, less ``REPLY_MARGIN_S``)."""

    keys: list[bytes]
    lengths: list[int]
    addrs: list[int]
    deadline: float


class Refused(Exception):
    """A well-formed request the peer will not serve (answered ERROR ``code``; the connection
    stays): repeated keys, more rows than ``--max-request-bytes``, a full share."""

    def __init__(self, code: proto.ErrorCode, text: str) -> None:
        super().__init__(text)
        self.code = code


@dataclass(frozen=True)
class PeerSettings:
    host: str
    port: int
    capacity_bytes: int
    row_bytes: int
    credentials: Credentials  # Credentials.unauthenticated() when started without a token file
    policy: str
    alloc_ttl_s: float
    lease_ttl_s: float
    max_connections: int  # authenticated connections
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
    max_unauthenticated_per_source: int = MAX_UNAUTHENTICATED_PER_SOURCE
    max_unauthenticated: int = MAX_UNAUTHENTICATED
    max_connections_per_tenant: int | None = None  # None: an equal share of max_connections
    idle_timeout_s: float = IDLE_TIMEOUT_S
    frame_timeout_s: float = FRAME_TIMEOUT_S
    max_request_bytes: int = MAX_REQUEST_BYTES  # at least row_bytes (parse_args checks)
    tenant_transfers: int = TENANT_TRANSFERS
    tenant_bytes: int = 2 * MAX_REQUEST_BYTES  # rows in flight per tenant

    def tenant_cap(self) -> int | None:
        """Authenticated connections one tenant may hold: ``max_connections_per_tenant``, or
        an equal share of ``max_connections`` (so every tenant can always reach its share);
        ``None`` without a token file (claimed tenants prove nothing: the global cap only)."""
        if self.credentials.open:
            return None
        if self.max_connections_per_tenant is not None:
            return self.max_connections_per_tenant
        return max(1, self.max_connections // max(1, len(self.credentials.tenants)))


class PeerServer:
    """The control plane of one peer: connections, handshake, requests, expiry."""

    def __init__(self, settings: PeerSettings) -> None:
        self.settings = settings
        num_slots = settings.capacity_bytes // settings.row_bytes
        if num_slots < 1:
            raise ValueError(
                f"--capacity {settings.capacity_bytes} B holds no row of --row-bytes {settings.row_bytes} B"
            )
        num_slots = min(num_slots, proto.MAX_SLOTS)
        self.instance_id = os.urandom(proto.INSTANCE_ID_BYTES)
        self.pool = PeerPool(
            num_slots,
            settings.row_bytes,
            make_policy(settings.policy, num_slots),
            alloc_ttl_s=settings.alloc_ttl_s,
            lease_ttl_s=settings.lease_ttl_s,
            quotas=settings.credentials.quotas(num_slots),
        )
        self.memory = ServedMemory(
            self.pool.ranges,
            settings.row_bytes,
            shared=self.pool.quotas is None,
            on_rows_lost=self._rows_lost,
        )
        self._conn_ids = itertools.count(1)
        self._connections: dict[int, asyncio.StreamWriter] = {}  # authenticated
        self._tenant_connections: Counter[str] = Counter()  # authenticated, per tenant
        self._tenant_cap = settings.tenant_cap()
        self.shares = TenantShares(settings.tenant_transfers, settings.tenant_bytes)
        self._unauthenticated: dict[int, tuple[str, asyncio.StreamWriter]] = {}  # oldest first
        self._agents: dict[str, int] = {}  # loaded client agent -> its connection
        self._handlers: set[asyncio.Task] = set()
        self.counters = ServerCounters()

    async def serve(self, ready: asyncio.Future[tuple[str, int]], stop: asyncio.Event) -> None:
        try:
            await self.memory.start()
            server = await asyncio.start_server(
                self._on_connection, self.settings.host, self.settings.port, limit=proto.MAX_FRAME + 64
            )
        except BaseException:
            await self.memory.close()
            raise
        host, port = server.sockets[0].getsockname()[:2]
        ready.set_result((host, port))
        sweeping = asyncio.create_task(self._sweep())
        try:
            await stop.wait()
        finally:
            server.close()
            for writer in list(self._connections.values()):
                writer.close()
            for task in [sweeping, *self._handlers]:
                task.cancel()
            await asyncio.gather(sweeping, *self._handlers, return_exceptions=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 1.0)
            await self.memory.close()

    def _rows_lost(self, run: str) -> None:
        """A tenant worker ended, and the rows it held with it: forget them."""
        lost = self.pool.drop_run(run)
        if lost:
            log.warning("forgot %d rows of slot range %r: their tenant worker ended", lost, run)

    async def _sweep(self) -> None:
        interval = min(SWEEP_S, self.settings.alloc_ttl_s / 4, self.settings.lease_ttl_s / 4)
        while True:
            await asyncio.sleep(interval)
            self.pool.expire()

    # -- connections ------------------------------------------------------------------------

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        conn_id = next(self._conn_ids)
        peername = writer.get_extra_info("peername")
        source = str(peername[0]) if isinstance(peername, tuple) else str(peername)
        agent: str | None = None
        tenant = ""
        try:
            self._admit(conn_id, source, writer)
            tenant, session = await self._handshake(reader, writer, peername)
            self._unauthenticated.pop(conn_id, None)
            if session is None:
                return
            _first, num_slots = self.pool.ranges.get(tenant if self.pool.quotas is not None else "", (0, 0))
            if num_slots == 0:
                log.warning("refusing %s: tenant %r has no slots", peername, tenant)
                return
            refusal = self._over_cap(tenant)
            if refusal is not None:
                self.counters.connections_refused += 1
                log.warning("refusing %s: %s", peername, refusal)
                await self._send(writer, session, *_error(0, proto.ErrorCode.LIMIT, refusal))
                return
            self._connections[conn_id] = writer
            self._tenant_connections[tenant] += 1
            self.counters.connections += 1
            welcome = proto.Welcome(
                self.instance_id, self.pool.slot_bytes, num_slots, self.settings.max_request_bytes
            )
            await self._send(writer, session, proto.Msg.WELCOME, 0, proto.encode_welcome(welcome))
            agent = await self._load_agent(conn_id, tenant, session, reader, writer, peername)
            if agent is None:
                return
            await self._requests(conn_id, tenant, agent, session, reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client left
        except proto.ProtocolError as exc:
            self.counters.protocol_errors += 1
            log.warning("closing %s: %s", peername, exc)
        except TimeoutError:
            log.warning("closing %s: it does not read its replies", peername)
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("closing %s after an unexpected error", peername)
        finally:
            self.pool.drop_owner(conn_id)
            if self._connections.pop(conn_id, None) is not None:
                self._tenant_connections[tenant] -= 1
                if not self._tenant_connections[tenant]:
                    del self._tenant_connections[tenant]
            self._unauthenticated.pop(conn_id, None)
            if agent is not None and self._agents.get(agent) == conn_id:
                del self._agents[agent]
                self.memory.forget(agent)
            self._handlers.discard(task)
            writer.close()

    def _over_cap(self, tenant: str) -> str | None:
        """Why an authenticated connection of ``tenant`` is refused (``None``: it is not):
        ``--max-connections`` in all, and the tenant's cap (``PeerSettings.tenant_cap``), so
        one tenant opening connections cannot lock another out."""
        if len(self._connections) >= self.settings.max_connections:
            return f"{len(self._connections)} connections already (--max-connections)"
        if self._tenant_cap is not None and self._tenant_connections[tenant] >= self._tenant_cap:
            cap = self._tenant_cap
            return f"tenant {tenant!r} holds its {cap} connections (--max-connections-per-tenant)"
        return None

    def _admit(self, conn_id: int, source: str, writer: asyncio.StreamWriter) -> None:
        """Keep at most so many unauthenticated connections per source and in all: a new one
        pushes out the oldest (which had its chance), so idle sockets, however many, cannot
        keep a real client from reaching the handshake."""
        same = [cid for cid, (src, _) in self._unauthenticated.items() if src == source]
        for victim in same[: max(0, len(same) + 1 - self.settings.max_unauthenticated_per_source)]:
            self._push_out(victim)
        for victim in list(self._unauthenticated)[
            : max(0, len(self._unauthenticated) + 1 - self.settings.max_unauthenticated)
        ]:
            self._push_out(victim)
        self._unauthenticated[conn_id] = (source, writer)

    def _push_out(self, conn_id: int) -> None:
        source, writer = self._unauthenticated.pop(conn_id)
        self.counters.pushed_out += 1  # its handler counts the failed handshake too
        log.info("closing an unauthenticated connection from %s: too many from there", source)
        writer.transport.abort()

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peername
    ) -> tuple[str, proto.Session | None]:
        """The tenant and session of a client that proved a token granting that tenant;
        ``(.., None)`` (and the connection is to be closed, unanswered) otherwise."""
        nonce = os.urandom(proto.NONCE_BYTES)
        challenge = proto.encode_challenge(nonce)
        writer.write(proto.encode_frame(proto.Msg.CHALLENGE, 0, challenge))
        try:
            frame = await asyncio.wait_for(
                proto.read_frame(reader, proto.MAX_HANDSHAKE_FRAME), self.settings.handshake_timeout_s
            )
            if frame.type != proto.Msg.AUTH:
                raise proto.ProtocolError(f"{frame.type.name} before authentication")
            _client_nonce, tenant, mac = proto.decode_auth(frame.payload)
        except (proto.ProtocolError, TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            self.counters.auth_failures += 1
            log.warning("closing %s: no valid handshake (%s)", peername, exc or type(exc).__name__)
            return "", None
        transcript = challenge + frame.payload[: -proto.MAC_BYTES]
        granted = None
        for token in self.settings.credentials.tokens_for(tenant):  # every one: no early exit
            if proto.macs_equal(proto.client_mac(token, transcript), mac):
                granted = token
        if granted is None:
            self.counters.auth_failures += 1
            log.warning("closing %s: wrong or missing token for tenant %r", peername, tenant)
            return tenant, None
        return tenant, proto.Session(granted, transcript, is_client=False)

    async def _send(
        self, writer: asyncio.StreamWriter, session: proto.Session, msg: proto.Msg, rid: int, payload: bytes
    ) -> None:
        writer.write(session.seal(msg, rid, payload))  # sealed and written in one step: in order
        await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)

    async def _load_agent(
        self,
        conn_id: int,
        tenant: str,
        session: proto.Session,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peername,
    ) -> str | None:
        """The client's NIXL agent, loaded once its metadata passed the shape check and its
        probe bytes held this session's value (so the agent is the client's own, not another
        engine's metadata replayed); ``None`` (close the connection, unanswered) otherwise."""
        timeout = self.settings.handshake_timeout_s
        frame = await asyncio.wait_for(proto.read_frame(reader, proto.MAX_FRAME, session), timeout)
        if frame.type != proto.Msg.AGENT:
            raise proto.ProtocolError(f"{frame.type.name} before AGENT")
        probe_addr, metadata = proto.decode_agent(frame.payload)
        try:
            name = check_client_metadata(metadata, probe_addr, proto.PROBE_BYTES).name
            if name in self._agents:
                raise MetadataError(f"agent {name} is another connection's")
        except MetadataError as exc:
            return self._refuse_agent(peername, exc)
        self._agents[name] = conn_id  # held while it loads: a second claim to the name is refused
        ready = False
        try:
            loaded = await self.memory.load(tenant, metadata, time.monotonic() + timeout, writer.close)
            if loaded != name:
                raise MetadataError(f"NIXL loaded agent {loaded!r}, the metadata names {name!r}")
            got = await self.memory.read_probe(name, probe_addr, time.monotonic() + timeout)
            if not proto.macs_equal(session.probe_value, got):
                raise MetadataError("its probe bytes do not hold this session's value")
            owners = await asyncio.to_thread(owner_pids, writer.get_extra_info("socket"))
            if owners is not None:  # a client on this host: its agent must reach its own process
                deadline = time.monotonic() + timeout
                await self.memory.bind(name, sorted(owners), probe_addr, session.probe_value, deadline)
            ready = True
        except Exception as exc:
            return self._refuse_agent(peername, exc)
        finally:
            if not ready:  # refused, or the peer is stopping: the name is free again
                del self._agents[name]
                self.memory.forget(name)
        await self._send(writer, session, proto.Msg.READY, 0, b"")
        return name

    def _refuse_agent(self, peername, why: Exception) -> None:
        """Count and log a refused AGENT; the connection is then closed, unanswered."""
        self.counters.agents_refused += 1
        log.warning("closing %s: its NIXL agent is refused: %s", peername, why)

    async def _requests(
        self,
        conn_id: int,
        tenant: str,
        agent: str,
        session: proto.Session,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        """Serve requests until the client leaves; puts and gets run as tasks (at most
        ``MAX_TRANSFERS_PER_CONNECTION`` at once), everything else in order. A connection
        ends only once none of its transfers can still touch a slot.

        A frame must come whole within ``--frame-timeout`` of its first byte; a connection
        with no frame for ``--idle-timeout`` and no transfer in flight is told so (ERROR
        ``IDLE``, request id 0) and closed: nothing it sends after that is read."""
        window = asyncio.Semaphore(MAX_TRANSFERS_PER_CONNECTION)
        transfers: set[asyncio.Task] = set()
        idle_s, frame_s = self.settings.idle_timeout_s, self.settings.frame_timeout_s
        try:
            while True:
                try:
                    frame = await proto.read_frame(
                        reader, proto.MAX_FRAME, session, idle_s=idle_s, frame_s=frame_s
                    )
                except proto.IdleTimeout:
                    if transfers:
                        continue  # waiting for its own transfers is not idle
                    self.counters.idle_closed += 1
                    log.info("closing agent %s's connection: no request for %g s", agent, idle_s)
                    notice = f"no request for {idle_s:g} s (--idle-timeout): closing"
                    await self._send(writer, session, *_error(0, proto.ErrorCode.IDLE, notice))
                    return
                if frame.type in (proto.Msg.PUT, proto.Msg.GET):
                    await window.acquire()
                    task = asyncio.create_task(
                        self._serve_transfer(conn_id, tenant, agent, frame, session, writer)
                    )
                    transfers.add(task)
                    task.add_done_callback(lambda t: (transfers.discard(t), window.release()))
                    continue
                reply = self._dispatch(conn_id, tenant, frame)
                if reply is not None:
                    await self._send(writer, session, *reply)
        finally:
            self.shares.abandon(conn_id)  # the client is gone: what waits for its turn never starts
            if transfers:
                await asyncio.gather(*transfers, return_exceptions=True)

    async def _serve_transfer(
        self, conn: int, tenant: str, agent: str, frame: proto.Frame, session: proto.Session, writer
    ) -> None:
        """One PUT or GET: the transfer, then the answer. A failed transfer is answered
        ``TRANSFER_FAILED`` and closes the connection (the agent thread dropped the client's
        agent when it gave the transfer up)."""
        rid = frame.request_id
        try:
            keys, lengths, addrs, budget_ms = proto.decode_transfer(frame.payload)
            nbytes = self._bounded(keys, lengths)
            rows = _Rows(keys, lengths, addrs, time.monotonic() + budget_ms / 1000 - REPLY_MARGIN_S)
            serve = self._put if frame.type == proto.Msg.PUT else self._get
            started = time.monotonic()
            async with self.shares.admitted(tenant, conn, nbytes, rows.deadline):
                answer = (await serve(conn, tenant, agent, rows))(rid)
            await self._send(writer, session, *answer)
            self.counters.transfers.served(answer, rows.lengths, time.monotonic() - started)
        except (Refused, Busy) as exc:  # nothing moved; the connection stays
            self.counters.requests_refused += 1
            log.info("refused a %s of tenant %r: %s", frame.type.name, tenant, exc)
            code = exc.code if isinstance(exc, Refused) else proto.ErrorCode.LIMIT
            with contextlib.suppress(Exception):
                await self._send(writer, session, *_error(rid, code, str(exc)))
        except proto.ProtocolError as exc:
            self.counters.protocol_errors += 1
            log.warning("closing a connection: %s", exc)
            writer.close()
        except PoolLimitError as exc:
            self.counters.limit_refusals += 1
            with contextlib.suppress(Exception):
                await self._send(writer, session, *_error(rid, proto.ErrorCode.LIMIT, str(exc)))
        except TransferFailed as exc:
            self.counters.transfers_failed += 1
            log.warning("a transfer for agent %s failed: %s; closing its connection", agent, exc)
            code = proto.ErrorCode.TRANSFER_TIMEOUT if exc.timed_out else proto.ErrorCode.TRANSFER_FAILED
            with contextlib.suppress(Exception):
                await self._send(writer, session, *_error(rid, code, str(exc)))
            writer.close()
        except (ConnectionError, TimeoutError):
            writer.close()
        except Exception:  # a bug: the client must not wait for its deadline, nor the loop die
            log.exception("closing a connection after an unexpected error in a transfer")
            writer.close()

    def _bounded(self, keys: list[bytes], lengths: list[int]) -> int:
        """The bytes of rows a PUT or GET names, once they pass the bounds on the work one
        request may cause: each key once (a real client never repeats one; repeated, one
        stored row would be copied and hashed once per repeat), at most ``--max-request-bytes``."""
        _distinct(keys)
        nbytes = sum(lengths)
        if nbytes > self.settings.max_request_bytes:
            raise Refused(
                proto.ErrorCode.LIMIT,
                f"a request of {nbytes} B of rows (--max-request-bytes {self.settings.max_request_bytes})",
            )
        return nbytes

    async def _move(
        self,
        op: str,
        agent: str,
        rows: _Rows,
        slots: Sequence[int] | Mapping[int, int],
        idxs: list[int],
        **parts: Any,
    ) -> list[Any]:
        """``memory.transfer`` of rows ``idxs`` of a request, row ``i`` to or from slot
        ``slots[i]``, by the request's deadline (``parts``: ``part_sizes`` and ``checksums``)."""
        return await self.memory.transfer(
            op,
            agent,
            [slots[i] for i in idxs],
            [rows.addrs[i] for i in idxs],
            [rows.lengths[i] for i in idxs],
            rows.deadline,
            **parts,
        )

    async def _put(self, conn: int, tenant: str, agent: str, rows: _Rows):
        """Allocate slots for the keys not stored yet and READ those rows into them."""
        alloc_id, slots = self.pool.allocate(conn, rows.keys, rows.lengths, tenant=tenant)
        landed = [proto.Landed.EXISTS if s == proto.EXISTS else proto.Landed.REFUSED for s in slots]
        reads = [i for i, s in enumerate(slots) if s < proto.EXISTS]
        if reads:
            try:
                await self._move("READ", agent, rows, slots, reads)
            except BaseException:
                self.pool.abort(conn, alloc_id)
                raise
            for i in reads:
                landed[i] = proto.Landed.READ
        payload = proto.encode_landed(alloc_id if reads else 0, landed)
        return lambda rid: (proto.Msg.LANDED, rid, payload)

    async def _get(self, conn: int, tenant: str, agent: str, rows: _Rows):
        """WRITE the rows stored under the keys (with the length the client asks for) into the
        client's rows, verifying each part's rows against their committed checksums right after
        its copy (beside the next copy where a core is free); a row that fails is a miss and is
        dropped. The slots stay leased until the WRITE is over."""
        keys, lengths = rows.keys, rows.lengths
        lease_id, entries = self.pool.lookup(conn, keys, tenant)
        headers: list[bytes | None] = [None] * len(keys)
        try:
            writes: list[int] = []
            parsed: dict[int, RowHeader] = {}
            for i, entry in enumerate(entries):
                if entry is None:
                    continue
                header = RowHeader.unpack(entry[1])
                if header is not None and header.row_length == lengths[i]:
                    writes.append(i)
                    parsed[i] = header
            if writes:
                parts = _cut(writes, lengths, GET_PART_BYTES)
                slots = {i: entries[i][0] for i in writes}  # type: ignore[index]
                verify = [parsed[i].checksum for part in parts for i in part]  # in the tenant's worker
                verdicts = await self._move(
                    "WRITE",
                    agent,
                    rows,
                    slots,
                    writes,
                    part_sizes=[len(part) for part in parts],
                    checksums=verify,
                )
                corrupt = []
                for part, good in zip(parts, verdicts, strict=True):
                    for i, ok in zip(part, good, strict=True):
                        if ok:
                            headers[i] = entries[i][1]  # type: ignore[index]
                        else:
                            corrupt.append(keys[i])
                if corrupt:
                    log.warning("%d rows failed their checksum when served: dropped", len(corrupt))
                    self.pool.drop_corrupt(corrupt, tenant)
        finally:
            if lease_id:
                self.pool.release(conn, lease_id)
        payload = proto.encode_got(headers)
        return lambda rid: (proto.Msg.GOT, rid, payload)

    def _dispatch(self, conn: int, tenant: str, frame: proto.Frame) -> tuple[proto.Msg, int, bytes] | None:
        """The reply to one request that moves no rows, unsealed (``None`` for PUT_ABORT).
        Every verb acts in ``tenant``'s namespace only."""
        msg, rid, payload = proto.Msg, frame.request_id, frame.payload
        pool = self.pool
        try:
            if frame.type == msg.PUT_COMMIT:
                alloc_id, headers = proto.decode_commit(payload)
                stored = pool.commit(conn, alloc_id, headers)
                return msg.COMMITTED, rid, proto.encode_flags(stored)
            if frame.type == msg.PUT_ABORT:
                pool.abort(conn, proto.decode_id(payload))
                return None
            if frame.type == msg.CONTAINS:
                flags = pool.contains(_distinct(proto.decode_keys(payload)), tenant)
                return msg.CONTAINED, rid, proto.encode_flags(flags)
            if frame.type == msg.DELETE:
                deleted = pool.delete(_distinct(proto.decode_keys(payload)), tenant)
                return msg.DELETED, rid, proto.encode_count(deleted)
            if frame.type == msg.STATS:
                if payload:
                    raise proto.ProtocolError("STATS carries no payload")
                stats = {
                    **pool.stats(tenant),
                    "auth_failures": self.counters.auth_failures,
                    "protocol_errors": self.counters.protocol_errors,
                }
                return msg.STATS_REPLY, rid, proto.encode_stats(stats)
        except UnknownAllocation:
            return _error(rid, proto.ErrorCode.UNKNOWN_ALLOCATION, "allocation expired or unknown")
        except Refused as exc:
            self.counters.requests_refused += 1
            return _error(rid, exc.code, str(exc))
        except PoolLimitError as exc:
            return _error(rid, proto.ErrorCode.LIMIT, str(exc))
        except ValueError as exc:  # well-formed but inconsistent (a header count)
            return _error(rid, proto.ErrorCode.BAD_REQUEST, str(exc))
        raise proto.ProtocolError(f"{frame.type.name} is not a request")


def _cut(indexes: list[int], lengths: list[int], part_bytes: int) -> list[list[int]]:
    """``indexes`` in runs of about ``part_bytes`` of rows (one row at least)."""
    parts: list[list[int]] = [[]]
    size = 0
    for i in indexes:
        if size >= part_bytes:
            parts.append([])
            size = 0
        parts[-1].append(i)
        size += lengths[i]
    return parts


def _distinct(keys: list[bytes]) -> list[bytes]:
    """``keys``, if no key is repeated (``Refused`` otherwise)."""
    if len(set(keys)) != len(keys):
        raise Refused(proto.ErrorCode.BAD_REQUEST, f"a key repeated among {len(keys)} keys")
    return keys


def _error(rid: int, code: proto.ErrorCode, text: str) -> tuple[proto.Msg, int, bytes]:
    return proto.Msg.ERROR, rid, proto.encode_error(code, text)


# -- command line ---------------------------------------------------------------------------


def _listen_address(text: str) -> tuple[str, int]:
    try:
        address = Address.parse(text, any_port=True)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT") from None
    return address.host, address.port


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _seconds(text: str) -> float:
    """Seconds in (0, ``MAX_TTL_S``]: ``inf`` or ``nan`` would make an expiry never happen."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and 0 < value <= MAX_TTL_S):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds in (0, {MAX_TTL_S:g}]")
    return value


def _count(limit: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if not 1 <= value <= limit:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number in 1..{limit}")
        return value

    return parse


def parse_args(argv: list[str] | None) -> PeerSettings:
    parser = argparse.ArgumentParser(prog="kvtier peer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=_listen_address, required=True, metavar="HOST:PORT")
    parser.add_argument("--capacity", type=_size, required=True, metavar="SIZE", help="pool size, e.g. 8GiB")
    parser.add_argument(
        "--row-bytes", type=_size, default=2 << 20, metavar="SIZE", help="the largest row; one slot (2MiB)"
    )
    parser.add_argument(
        "--token-file",
        metavar="F",
        help="'tenant: token' lines (each tenant an equal quota), or one token granting tenant 'default'",
    )
    parser.add_argument("--policy", default="lru", metavar="NAME", help="eviction policy (lru)")
    parser.add_argument(
        "--alloc-ttl", type=_seconds, default=10.0, metavar="S", help="uncommitted puts expire"
    )
    parser.add_argument(
        "--lease-ttl", type=_seconds, default=10.0, metavar="S", help="unreleased reads expire"
    )
    parser.add_argument(
        "--handshake-timeout",
        type=_seconds,
        default=HANDSHAKE_TIMEOUT_S,
        metavar="S",
        help="a connection that has not authenticated by then is closed",
    )
    parser.add_argument(
        "--max-connections",
        type=_count(MAX_CONNECTIONS),
        default=256,
        metavar="N",
        help="authenticated connections",
    )
    parser.add_argument(
        "--max-connections-per-tenant",
        type=_count(MAX_CONNECTIONS),
        metavar="N",
        help="authenticated connections of one tenant (an equal share of --max-connections; "
        "without --token-file only --max-connections applies)",
    )
    parser.add_argument(
        "--idle-timeout",
        type=_seconds,
        default=IDLE_TIMEOUT_S,
        metavar="S",
        help="a connection without a request for this long is closed (clients reopen it)",
    )
    parser.add_argument(
        "--frame-timeout",
        type=_seconds,
        default=FRAME_TIMEOUT_S,
        metavar="S",
        help="a frame must come whole within this of its first byte",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=_size,
        metavar="SIZE",
        help="rows one PUT or GET may name, in all (256MiB, and one row at least)",
    )
    parser.add_argument(
        "--tenant-transfers",
        type=_count(MAX_CONNECTIONS),
        default=TENANT_TRANSFERS,
        metavar="N",
        help="PUTs and GETs of one tenant in flight at once; more wait their turn",
    )
    parser.add_argument(
        "--tenant-bytes",
        type=_size,
        metavar="SIZE",
        help="rows of one tenant in flight at once (twice --max-request-bytes); more wait",
    )
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    credentials = Credentials.unauthenticated()
    if args.token_file:
        try:
            credentials = read_token_file(args.token_file)
        except ValueError as exc:
            parser.error(f"--token-file: {exc}")
    else:
        log.warning("no --token-file: any client that reaches %s:%d can read and write rows", *args.listen)
    if args.capacity < args.row_bytes:
        parser.error(f"--capacity {args.capacity} B is less than one row of --row-bytes {args.row_bytes} B")
    if args.row_bytes > 0xFFFFFFFF:
        parser.error("--row-bytes must be below 4 GiB")
    if not credentials.open and args.capacity // args.row_bytes < len(credentials.tenants):
        parser.error(
            f"--capacity holds {args.capacity // args.row_bytes} rows: fewer than the "
            f"{len(credentials.tenants)} tenants of --token-file (each needs a quota of one row at least)"
        )
    try:
        make_policy(args.policy, 1)
    except ValueError as exc:
        parser.error(f"--policy: {exc}")
    if args.max_connections_per_tenant is not None and args.max_connections_per_tenant > args.max_connections:
        parser.error(
            f"--max-connections-per-tenant {args.max_connections_per_tenant} is more than "
            f"--max-connections {args.max_connections}"
        )
    max_request = max(MAX_REQUEST_BYTES, args.row_bytes)
    if args.max_request_bytes is not None:
        if args.max_request_bytes < args.row_bytes:
            parser.error(
                f"--max-request-bytes {args.max_request_bytes} B is less than one row of "
                f"--row-bytes {args.row_bytes} B"
            )
        max_request = args.max_request_bytes
    tenant_bytes = 2 * max_request if args.tenant_bytes is None else args.tenant_bytes
    if tenant_bytes < max_request:
        parser.error(f"--tenant-bytes {tenant_bytes} B is less than --max-request-bytes {max_request} B")
    return PeerSettings(
        host=args.listen[0],
        port=args.listen[1],
        capacity_bytes=args.capacity,
        row_bytes=args.row_bytes,
        credentials=credentials,
        policy=args.policy,
        alloc_ttl_s=args.alloc_ttl,
        lease_ttl_s=args.lease_ttl,
        max_connections=args.max_connections,
        handshake_timeout_s=args.handshake_timeout,
        max_connections_per_tenant=args.max_connections_per_tenant,
        idle_timeout_s=args.idle_timeout,
        frame_timeout_s=args.frame_timeout,
        max_request_bytes=max_request,
        tenant_transfers=args.tenant_transfers,
        tenant_bytes=tenant_bytes,
    )


def _auth_summary(credentials: Credentials) -> str:
    if credentials.open:
        return "none"
    return f"tokens for {len(credentials.tenants)} tenant(s)"


StatsHook = Callable[[Callable[[float], PeerSnapshot]], object]
"""Called once the peer listens, with a function that takes a ``PeerSnapshot`` on the peer's
event loop from any thread, waiting at most the seconds it is given (it raises if the loop
does not answer by then, or the peer is stopping): for a metrics and health endpoint that a
caller outside ``tiers/`` provides (``kvtier peer --metrics-port``)."""


async def run(settings: PeerSettings, on_ready: StatsHook | None = None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    started = time.monotonic()
    make_undumpable()  # no process of this user reaches the tokens or the sessions without CAP_SYS_PTRACE
    bind_ucx_to(settings.host)  # tenant workers inherit it: UCX reads it when their agents start
    server = PeerServer(settings)
    ready: asyncio.Future[tuple[str, int]] = loop.create_future()
    serving = asyncio.create_task(server.serve(ready, stop))
    await asyncio.wait([serving, ready], return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        await serving  # raises why it could not listen
    host, port = ready.result()
    pool = server.pool
    sys.stdout.write(
        f"kvtier peer listening on {host}:{port}: {pool.num_slots} slots of {pool.slot_bytes} B, "
        f"policy {settings.policy}, auth {_auth_summary(settings.credentials)}, "
        f"ready in {time.monotonic() - started:.2f} s\n"
    )
    sys.stdout.flush()
    if on_ready is not None:

        async def read() -> PeerSnapshot:
            if stop.is_set():
                raise RuntimeError("the peer is stopping")
            counters = server.counters
            return take_snapshot(pool, counters, counters.transfers, len(server._connections))

        def snapshot(timeout: float) -> PeerSnapshot:  # from another thread: read on the loop
            future = asyncio.run_coroutine_threadsafe(read(), loop)
            try:
                return future.result(timeout)
            finally:
                future.cancel()

        on_ready(snapshot)
    await serving
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None, on_ready: StatsHook | None = None) -> int:
    settings = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return uvloop.run(run(settings, on_ready))
    except OSError as exc:
        log.error("cannot serve on %s:%d: %s", settings.host, settings.port, exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
