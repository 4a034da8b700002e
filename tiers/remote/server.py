"""``kvtier peer``: a process that lends its memory to remote tiers as a pool of rows.

    kvtier peer --listen HOST:PORT --capacity SIZE [--row-bytes SIZE] [--token-file F] [--policy NAME]

``--token-file`` maps tokens to tenants (``tiers/remote/auth.py``); each connection acts as
the one tenant it authenticated as, in that tenant's namespace and quota. The threat model
(who may reach what, what each transport enforces) is ``docs/threat-model.md``.

The pool is one buffer, pre-faulted, registered with NIXL once per run of slots (one run
per tenant of the token file, else one) and kept registered for the life of the process
(deregistering would not revoke a client's access anyway; what a client may touch is
guarded by protocol, in ``tiers/remote/pool.py``, and by the transport: ``ServedMemory``).
It is cut into fixed-size slots of ``--row-bytes`` (the largest row served; rows of every KV group
share the slots, a smaller row uses the head of its slot). Fixed slots keep a slot's
address a multiplication and make eviction a one-for-one swap; vLLM pads every group's page
to one size anyway, so little is wasted.

Data never passes through this process's code: clients READ and WRITE slots with NIXL
(one-sided; over CMA the copy is done by the client's kernel call). The peer only runs the
control plane (``tiers/remote/protocol.py``) on one uvloop event loop: handshake, two-phase
put (allocate, client writes, commit), get (slots and a lease, client reads, release),
contains, delete, stats. Its NIXL agent has no progress thread; the loop progresses it
every millisecond while clients are connected (a new client's first transfer needs the
target to answer the transport's wire-up) and rarely otherwise.

A malformed or oversized message, or one whose tag fails, closes that connection only; a
failed handshake closes the connection before the peer says anything about itself.
Availability: a connection has ``--handshake-timeout`` to authenticate; at most
``MAX_UNAUTHENTICATED_PER_SOURCE`` unauthenticated connections per source address and
``MAX_UNAUTHENTICATED`` in all are kept (a new one pushes out the oldest, so idle sockets
cannot lock a real client out); ``--max-connections`` counts authenticated connections only.
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
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import uvloop

from policies import make_policy
from tiers.address import Address
from tiers.base import Stats
from tiers.remote import protocol as proto
from tiers.remote.auth import Credentials, read_token_file
from tiers.remote.net_iface import bind_ucx_to
from tiers.remote.nixl_agent import create_agent
from tiers.remote.pool import PeerPool, PoolLimitError, UnknownAllocation
from tiers.sizes import parse_size

log = logging.getLogger("kvtier.peer")


@dataclass
class ServerCounters(Stats):
    """What the peer's connections did (the pool counts what happened to rows)."""

    connections: int = 0  # authenticated
    auth_failures: int = 0
    protocol_errors: int = 0
    pushed_out: int = 0  # unauthenticated connections closed to make room for newer ones


PAGE = 4096
HUGE_PAGE = 2 << 20
PROBE_BYTES = 64  # after the last slot: the instance id, read once by each client
HANDSHAKE_TIMEOUT_S = 3.0
MAX_UNAUTHENTICATED_PER_SOURCE = 16
MAX_UNAUTHENTICATED = 512
MAX_TTL_S = 3600.0
MAX_CONNECTIONS = 65536
WRITE_TIMEOUT_S = 10.0
FAST_PROGRESS_S = 0.001
IDLE_PROGRESS_S = 1.0
BUSY_WINDOW_S = 2.5
"""The agent is progressed every ``FAST_PROGRESS_S`` this long after the last request, else
every ``IDLE_PROGRESS_S``. Every client call opens with a request (allocate, lease, contains)
and ends within its deadline (at most 2 s), so the one-sided transfers it makes (which the
target progresses over UCX TCP) all fall inside the window; a peer whose clients are
connected but quiet stops costing a core (16 such peers: 0.44 of a core at 1 ms polling).
32 idle peers with a connected client, each on a host of its own: 0.128 of a core with
``IDLE_PROGRESS_S`` 0.05 and ``SWEEP_S`` 0.1; 0.036 with 1.0 and 0.1; 0.010 with both 1.0."""
SWEEP_S = 1.0
"""Expired allocations and leases are taken back this often, or four times per the shorter
TTL if that is more often (TTLs are safety nets: a late sweep only holds slots longer)."""


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


@dataclass(frozen=True)
class Region:
    """One run of slots and its probe, as its tenant's clients see it."""

    first_slot: int  # the pool's slot number of this run's slot 0 (wire slots are relative)
    num_slots: int
    pool_addr: int
    probe_addr: int
    metadata: bytes  # NIXL metadata describing this region only


class ServedMemory:
    """The slots in one buffer, one NIXL registration per run of slots (per tenant under
    quotas, else one), registered for the process lifetime.

    Each run is followed by a probe area holding the instance id; the first starts 2 MiB
    aligned, the others page aligned.
    A tenant's clients get metadata of their own run only (``get_partial_agent_metadata``):
    NIXL refuses to initiate a transfer outside it, and an RDMA NIC refuses one that a client
    forged (on UCX TCP and CMA nothing does: ``docs/threat-model.md``).

    A numpy allocation (numpy asks for transparent huge pages), every page faulted in at
    start rather than during a client's first transfer. Alignment is a measured matter: a
    CMA copy between buffers whose addresses differ mod 64 runs at about half speed, and
    host tiers are torch allocations (aligned), so slots are too.
    """

    def __init__(
        self, runs: dict[str, tuple[int, int]], slot_bytes: int, instance_id: bytes, agent_name: str
    ) -> None:
        def stride(count: int) -> int:  # page-aligned runs: a tenant costs at most a page more
            return -(-(count * slot_bytes + PROBE_BYTES) // PAGE) * PAGE

        runs = {name: run for name, run in runs.items() if run[1] > 0}
        self.buffer = np.zeros(sum(stride(count) for _, count in runs.values()) + HUGE_PAGE, dtype=np.uint8)
        self.buffer[::PAGE] = 0  # fault every page in now
        self.agent = create_agent(agent_name)
        offset = -self.buffer.ctypes.data % HUGE_PAGE
        registrations = {}
        placed = {}
        for name, (first, count) in runs.items():
            probe = offset + count * slot_bytes
            self.buffer[probe : probe + len(instance_id)] = np.frombuffer(instance_id, dtype=np.uint8)
            addr = self.buffer.ctypes.data + offset
            registrations[name] = self.agent.register_memory(
                [(addr, count * slot_bytes + PROBE_BYTES, 0, "")], "DRAM"
            )
            placed[name] = (first, count, addr, addr + count * slot_bytes)
            offset += stride(count)
        self.regions: dict[str, Region] = {}
        for name, (first, count, addr, probe_addr) in placed.items():
            if len(runs) == 1:
                metadata = self.agent.get_agent_metadata()
            else:
                metadata = self.agent.get_partial_agent_metadata(registrations[name], True, ["UCX"])
            self.regions[name] = Region(first, count, addr, probe_addr, metadata)

    def progress(self) -> None:
        """Let the agent answer transport wire-up from new clients (no progress thread)."""
        self.agent.get_new_notifs()


def progress_delay(since_request_s: float, connected: bool) -> float:
    """How long the peer waits before progressing its agent again (``BUSY_WINDOW_S``)."""
    if connected and since_request_s < BUSY_WINDOW_S:
        return FAST_PROGRESS_S
    return IDLE_PROGRESS_S


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
            self.pool.ranges, settings.row_bytes, self.instance_id, f"kvtier-peer-{self.instance_id.hex()}"
        )
        self._conn_ids = itertools.count(1)
        self._connections: dict[int, asyncio.StreamWriter] = {}  # authenticated
        self._unauthenticated: dict[int, tuple[str, asyncio.StreamWriter]] = {}  # oldest first
        self._handlers: set[asyncio.Task] = set()
        self.counters = ServerCounters()
        self._last_request = -math.inf  # time.monotonic() of the last request, for _progress
        self._request_came = asyncio.Event()  # wakes an idle _progress at once

    async def serve(self, ready: asyncio.Future[tuple[str, int]], stop: asyncio.Event) -> None:
        server = await asyncio.start_server(
            self._on_connection, self.settings.host, self.settings.port, limit=proto.MAX_FRAME + 64
        )
        host, port = server.sockets[0].getsockname()[:2]
        ready.set_result((host, port))
        background = [asyncio.create_task(self._progress()), asyncio.create_task(self._sweep())]
        try:
            await stop.wait()
        finally:
            server.close()
            for writer in list(self._connections.values()):
                writer.close()
            for task in [*background, *self._handlers]:
                task.cancel()
            await asyncio.gather(*background, *self._handlers, return_exceptions=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 1.0)

    # -- background -------------------------------------------------------------------------

    async def _progress(self) -> None:
        while True:
            try:
                self.memory.progress()
            except Exception as exc:  # never let the control plane die of a transport hiccup
                log.debug("NIXL progress: %s", exc)
            delay = progress_delay(time.monotonic() - self._last_request, bool(self._connections))
            if delay == FAST_PROGRESS_S:
                await asyncio.sleep(delay)
                continue
            self._request_came.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._request_came.wait(), delay)

    def _note_request(self) -> None:
        """A request arrived: progress the agent often while its transfers may follow."""
        self._last_request = time.monotonic()
        self._request_came.set()

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
        try:
            self._admit(conn_id, source, writer)
            tenant, session = await self._handshake(reader, writer, peername)
            self._unauthenticated.pop(conn_id, None)
            if session is None:
                return
            region = self.memory.regions.get(tenant if self.pool.quotas is not None else "")
            if region is None:
                log.warning("refusing %s: tenant %r has no slots", peername, tenant)
                return
            if len(self._connections) >= self.settings.max_connections:
                log.warning("refusing %s: %d connections already", peername, len(self._connections))
                return
            self._connections[conn_id] = writer
            self.counters.connections += 1
            await self._welcome(writer, session, region)
            await self._requests(conn_id, tenant, region.first_slot, session, reader, writer)
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
            self._connections.pop(conn_id, None)
            self._unauthenticated.pop(conn_id, None)
            self._handlers.discard(task)
            writer.close()

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

    async def _welcome(self, writer: asyncio.StreamWriter, session: proto.Session, region: Region) -> None:
        """The tenant's own run of slots: its address, size and the metadata of it alone."""
        welcome = proto.Welcome(
            instance_id=self.instance_id,
            slot_bytes=self.pool.slot_bytes,
            num_slots=region.num_slots,
            pool_addr=region.pool_addr,
            probe_addr=region.probe_addr,
            probe_len=proto.INSTANCE_ID_BYTES,
            agent_metadata=region.metadata,
        )
        self._note_request()  # the client wires up and reads its probe next
        writer.write(session.seal(proto.Msg.WELCOME, 0, proto.encode_welcome(welcome)))
        await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)

    async def _requests(
        self,
        conn_id: int,
        tenant: str,
        first_slot: int,
        session: proto.Session,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        while True:
            frame = await proto.read_frame(reader, proto.MAX_FRAME, session)
            self._note_request()
            reply = self._dispatch(conn_id, tenant, first_slot, frame)
            if reply is not None:
                writer.write(session.seal(*reply))
                await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)

    def _dispatch(
        self, conn: int, tenant: str, first: int, frame: proto.Frame
    ) -> tuple[proto.Msg, int, bytes] | None:
        """The reply to one request, unsealed (``None`` for the verbs that have none). Every
        verb acts in ``tenant``'s namespace only; slots on the wire count from ``first``, the
        tenant's run."""
        msg, rid, payload = proto.Msg, frame.request_id, frame.payload
        pool = self.pool
        try:
            if frame.type == msg.PUT_ALLOC:
                alloc_id, slots = pool.allocate(conn, *proto.decode_put_alloc(payload), tenant=tenant)
                wire = [s - first if s < proto.EXISTS else s for s in slots]
                return msg.ALLOCATED, rid, proto.encode_allocated(alloc_id, wire)
            if frame.type == msg.PUT_COMMIT:
                alloc_id, headers = proto.decode_commit(payload)
                stored = pool.commit(conn, alloc_id, headers)
                return msg.COMMITTED, rid, proto.encode_flags(stored)
            if frame.type == msg.PUT_ABORT:
                pool.abort(conn, proto.decode_id(payload))
                return None
            if frame.type == msg.GET:
                lease_id, entries = pool.lookup(conn, proto.decode_keys(payload), tenant)
                wire_entries = [(e[0] - first, e[1]) if e is not None else None for e in entries]
                return msg.LEASED, rid, proto.encode_leased(lease_id, wire_entries)
            if frame.type == msg.RELEASE:
                pool.release(conn, proto.decode_id(payload))
                return None
            if frame.type == msg.CONTAINS:
                flags = pool.contains(proto.decode_keys(payload), tenant)
                return msg.CONTAINED, rid, proto.encode_flags(flags)
            if frame.type == msg.DELETE:
                deleted = pool.delete(proto.decode_keys(payload), tenant)
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
            return (
                msg.ERROR,
                rid,
                proto.encode_error(proto.ErrorCode.UNKNOWN_ALLOCATION, "allocation expired or unknown"),
            )
        except PoolLimitError as exc:
            return msg.ERROR, rid, proto.encode_error(proto.ErrorCode.LIMIT, str(exc))
        except ValueError as exc:  # well-formed but inconsistent (a header count)
            return msg.ERROR, rid, proto.encode_error(proto.ErrorCode.BAD_REQUEST, str(exc))
        raise proto.ProtocolError(f"{frame.type.name} is not a request")


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
    )


def _auth_summary(credentials: Credentials) -> str:
    if credentials.open:
        return "none"
    return f"tokens for {len(credentials.tenants)} tenant(s)"


StatsHook = Callable[[Callable[[], dict[str, int]]], object]
"""Called once the peer listens, with a function returning the pool's stats (for a metrics
endpoint that a caller outside ``tiers/`` provides: ``kvtier peer --metrics-port``)."""


async def run(settings: PeerSettings, on_ready: StatsHook | None = None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    started = time.monotonic()
    bind_ucx_to(settings.host)  # before the agent exists: UCX reads it when it starts
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

        async def read_stats() -> dict[str, int]:
            return pool.stats()

        def stats() -> dict[str, int]:  # from another thread: read the pool on its own loop
            return asyncio.run_coroutine_threadsafe(read_stats(), loop).result(timeout=2.0)

        on_ready(stats)
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
