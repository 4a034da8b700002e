"""One authenticated control connection to one ``kvtier peer``.

It speaks ``tiers/remote/protocol.py`` and nothing else: the rows move by NIXL, initiated by
the peer against this client's registered memory (``RemoteTier`` owns the agent and hands
the handshake an ``Announcement`` of it). Many calls share the connection at once: each
request carries an id, a reader task hands each reply to the call waiting for it, and every
wait has a deadline.

Failures come in two kinds, so the caller can tell a sick peer from a refused request:

- ``PeerUnavailable`` (and ``PeerTimeout``): the connection is unusable (refused, closed,
  authentication failed, a reply late or malformed). The caller marks the peer down.
- ``PeerRefused``: the peer answered ERROR to this one request (an expired allocation, a
  limit); the connection is fine. (A transfer the peer could not finish is not a refusal:
  the peer drops this client's agent and the connection, so it is ``PeerUnavailable``, or
  ``PeerTimeout`` when the transfer ran out of time.)

When the connection breaks while idle (the peer was killed: EOF), ``on_lost`` is called
once, so the peer is marked down before any call has to fail on it. A connection the peer
closes for being idle (``--idle-timeout``: ERROR ``IDLE`` first) is not a failure:
``closed_idle`` is set before ``on_lost``, and the owner reopens it on its next call; a
call that crossed the notice fails with ``PeerIdleClosed`` (the peer did not serve it).

Every frame after AUTH is sealed and verified (``peer_protocol.Session``). A reply whose
tag fails (a relay injected, replayed or rewrote it) breaks the connection like any
protocol error: every call in flight fails with ``PeerUnavailable`` (its rows are misses),
and nothing from that frame is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from tiers.remote import protocol as proto

log = logging.getLogger(__name__)


class PeerUnavailable(Exception):
    """The peer cannot be used now; its keys are misses until it is reached again."""


class PeerTimeout(PeerUnavailable):
    """A reply did not come by the deadline (a stopped or hung peer)."""


class PeerIdleClosed(PeerUnavailable):
    """The peer closed the connection as idle; a request still waiting was never served (the
    peer reads nothing after its notice), so nothing of it can land."""


class PeerRefused(Exception):
    """The peer answered ERROR to one request; the connection stays usable."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"peer refused (code {code}): {text}")
        self.code = code


def _remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _budget_ms(deadline: float) -> int:
    return max(1, int(_remaining(deadline) * 1000))


@dataclass(frozen=True)
class Announcement:
    """This client's NIXL agent, as the handshake announces it to a peer.

    ``write_probe(value)`` puts the session's probe value at ``probe_addr`` (inside the
    registered memory ``metadata`` describes) before AGENT is sent; ``progressing()`` keeps
    the agent's worker progressed while the peer reads it (and during every transfer)."""

    metadata: bytes
    probe_addr: int
    write_probe: Callable[[bytes], None]
    progressing: Callable[[], AbstractContextManager[None]]


class PeerClient:
    """An authenticated connection; build it with ``PeerClient.connect``."""

    def __init__(
        self,
        address: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        welcome: proto.Welcome,
        session: proto.Session,
        on_lost: Callable[[PeerClient, str], None] | None,
    ) -> None:
        self.address = address
        self.welcome = welcome
        self._session = session
        self._reader = reader
        self._writer = writer
        self._on_lost = on_lost
        self._pending: dict[int, asyncio.Future[proto.Frame]] = {}
        self._next_id = 0
        self.closed = False
        self.closed_idle = False  # the peer closed it for being idle: reopen, no failure
        self._reading = asyncio.create_task(self._read_replies(), name=f"kvtier-peer-{address}")

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        token: bytes | None,
        deadline: float,
        on_lost: Callable[[PeerClient, str], None] | None = None,
        tenant: str = proto.DEFAULT_TENANT,
        *,
        agent: Announcement,
    ) -> PeerClient:
        """Connect and authenticate (both ways) as ``tenant``, and have the peer load and probe
        ``agent``, by ``deadline`` (``time.monotonic()``)."""
        address = f"{host}:{port}"
        key = token or b""
        try:
            async with asyncio.timeout(_remaining(deadline)):
                reader, writer = await asyncio.open_connection(host, port, limit=proto.MAX_FRAME + 64)
        except TimeoutError as exc:
            raise PeerTimeout(f"{address}: connect timed out") from exc
        except OSError as exc:
            raise PeerUnavailable(f"{address}: {exc.strerror or exc}") from exc
        try:
            async with asyncio.timeout(_remaining(deadline)):
                frame = await proto.read_frame(reader, proto.MAX_HANDSHAKE_FRAME)
                if frame.type != proto.Msg.CHALLENGE:
                    raise proto.ProtocolError(f"expected CHALLENGE, got {frame.type.name}")
                proto.decode_challenge(frame.payload)
                auth = proto.encode_auth_body(os.urandom(proto.NONCE_BYTES), tenant)
                transcript = frame.payload + auth
                writer.write(proto.encode_frame(proto.Msg.AUTH, 0, auth + proto.client_mac(key, transcript)))
                session = proto.Session(key, transcript, is_client=True)
                try:
                    frame = await proto.read_frame(reader, proto.MAX_FRAME, session)
                except (asyncio.IncompleteReadError, ConnectionError) as exc:
                    raise PeerUnavailable(
                        f"{address}: closed during the handshake "
                        f"(wrong token, or tenant {tenant!r} not granted?)"
                    ) from exc
                except proto.AuthenticationError as exc:
                    raise PeerUnavailable(f"{address}: the WELCOME does not verify: {exc}") from exc
                if frame.type == proto.Msg.ERROR:  # authenticated, but over a connection cap
                    _code, text = proto.decode_error(frame.payload)
                    raise PeerUnavailable(f"{address}: refused: {text}")
                if frame.type != proto.Msg.WELCOME:
                    raise proto.ProtocolError(f"expected WELCOME, got {frame.type.name}")
                welcome = proto.decode_welcome(frame.payload)
                agent.write_probe(session.probe_value)
                writer.write(
                    session.seal(proto.Msg.AGENT, 0, proto.encode_agent(agent.probe_addr, agent.metadata))
                )
                with agent.progressing():
                    try:
                        frame = await proto.read_frame(reader, proto.MAX_FRAME, session)
                    except (asyncio.IncompleteReadError, ConnectionError) as exc:
                        raise PeerUnavailable(
                            f"{address}: the peer refused this client's NIXL agent"
                        ) from exc
                if frame.type != proto.Msg.READY:
                    raise proto.ProtocolError(f"expected READY, got {frame.type.name}")
        except BaseException as exc:
            writer.close()
            if isinstance(exc, TimeoutError):
                raise PeerTimeout(f"{address}: no handshake by the deadline") from exc
            if isinstance(exc, proto.ProtocolError | asyncio.IncompleteReadError | ConnectionError):
                raise PeerUnavailable(f"{address}: handshake failed: {exc}") from exc
            raise
        return cls(address, reader, writer, welcome, session, on_lost)

    # -- requests -------------------------------------------------------------------------

    async def put(
        self, keys: Sequence[bytes], lengths: Sequence[int], addrs: Sequence[int], deadline: float
    ) -> tuple[int, list[proto.Landed]]:
        """Have the peer READ the rows at ``addrs``: ``(allocation id, per key what became of it)``."""
        payload = await self._request(
            proto.Msg.PUT,
            proto.encode_transfer(keys, lengths, addrs, _budget_ms(deadline)),
            proto.Msg.LANDED,
            deadline,
        )
        alloc_id, landed = self._decode(proto.decode_landed, payload)
        if len(landed) != len(keys):
            self._break("LANDED does not match its request")
        return alloc_id, landed

    async def put_commit(self, alloc_id: int, headers: Sequence[bytes], deadline: float) -> list[bool]:
        payload = await self._request(
            proto.Msg.PUT_COMMIT, proto.encode_commit(alloc_id, headers), proto.Msg.COMMITTED, deadline
        )
        stored = self._decode(proto.decode_flags, payload)
        if len(stored) != len(headers):
            self._break("COMMITTED does not match its request")
        return stored

    def put_abort(self, alloc_id: int) -> None:
        self._send(proto.Msg.PUT_ABORT, proto.encode_id(alloc_id))

    async def get(
        self, keys: Sequence[bytes], lengths: Sequence[int], addrs: Sequence[int], deadline: float
    ) -> list[bytes | None]:
        """Have the peer WRITE the rows it holds into ``addrs``: per key the header of a row it
        wrote and verified, or ``None`` for a miss. Only the reply means the peer's WRITE is
        over: after any exception it may still be writing (the caller must not reuse those
        rows)."""
        payload = await self._request(
            proto.Msg.GET,
            proto.encode_transfer(keys, lengths, addrs, _budget_ms(deadline)),
            proto.Msg.GOT,
            deadline,
        )
        headers = self._decode(proto.decode_got, payload)
        if len(headers) != len(keys):
            self._break("GOT does not match its request")
        return headers

    async def contains(self, keys: Sequence[bytes], deadline: float) -> list[bool]:
        payload = await self._request(
            proto.Msg.CONTAINS, proto.encode_keys(keys), proto.Msg.CONTAINED, deadline
        )
        flags = self._decode(proto.decode_flags, payload)
        if len(flags) != len(keys):
            self._break("CONTAINED does not match its request")
        return flags

    async def delete(self, keys: Sequence[bytes], deadline: float) -> int:
        payload = await self._request(proto.Msg.DELETE, proto.encode_keys(keys), proto.Msg.DELETED, deadline)
        return self._decode(proto.decode_count, payload)

    async def stats(self, deadline: float) -> dict[str, int]:
        payload = await self._request(proto.Msg.STATS, b"", proto.Msg.STATS_REPLY, deadline)
        return self._decode(proto.decode_stats, payload)

    async def close(self) -> None:
        """Close deliberately (``on_lost`` is not called)."""
        self._on_lost = None
        self._lose("closed by the client")
        self._reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reading

    # -- internals ------------------------------------------------------------------------

    async def _request(self, msg: proto.Msg, payload: bytes, reply: proto.Msg, deadline: float) -> bytes:
        if self.closed:
            raise PeerUnavailable(f"{self.address}: connection closed")
        self._next_id = self._next_id % 0xFFFFFFFF + 1
        request_id = self._next_id
        future: asyncio.Future[proto.Frame] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            async with asyncio.timeout(_remaining(deadline)):
                self._writer.write(self._session.seal(msg, request_id, payload))
                await self._writer.drain()
                frame = await future
        except TimeoutError as exc:
            raise PeerTimeout(f"{self.address}: no {reply.name} by the deadline") from exc
        except ConnectionError as exc:
            self._lose(f"write failed: {exc}")
            raise PeerUnavailable(f"{self.address}: {exc}") from exc
        finally:
            self._pending.pop(request_id, None)
        if frame.type == proto.Msg.ERROR:
            code, text = self._decode(proto.decode_error, frame.payload)
            if code in (proto.ErrorCode.TRANSFER_FAILED, proto.ErrorCode.TRANSFER_TIMEOUT):
                # The peer dropped this client's agent and closes the connection: every call
                # on it is over, and the peer is at fault (late, or its transfer failed).
                self._lose(f"its transfer failed: {text}")
                failure = PeerTimeout if code == proto.ErrorCode.TRANSFER_TIMEOUT else PeerUnavailable
                raise failure(f"{self.address}: its transfer failed: {text}")
            raise PeerRefused(code, text)
        if frame.type != reply:
            self._break(f"{frame.type.name} in reply to {msg.name}")
        return frame.payload

    def _send(self, msg: proto.Msg, payload: bytes) -> None:
        """A message without a reply; lost silently if the connection is gone (the peer's
        expiry and its cleanup of a closed connection give the resources back anyway)."""
        if not self.closed:
            self._writer.write(self._session.seal(msg, 0, payload))

    def _decode(self, decoder, payload: bytes):
        try:
            return decoder(payload)
        except proto.ProtocolError as exc:
            self._break(str(exc))

    def _break(self, why: str):
        self._lose(f"protocol error: {why}")
        raise PeerUnavailable(f"{self.address}: protocol error: {why}")

    async def _read_replies(self) -> None:
        reason = "connection closed by the peer"
        try:
            while True:
                frame = await proto.read_frame(self._reader, proto.MAX_FRAME, self._session)
                if frame.request_id == 0 and frame.type == proto.Msg.ERROR:
                    code, text = proto.decode_error(frame.payload)
                    if code == proto.ErrorCode.IDLE:
                        self.closed_idle = True
                        reason = f"closed by the peer: {text}"
                        break
                future = self._pending.get(frame.request_id)
                if future is not None and not future.done():
                    future.set_result(frame)
                # else: a reply to a call that already gave up; dropped
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except proto.ProtocolError as exc:
            reason = f"protocol error: {exc}"
        self._lose(reason)

    def _lose(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self._writer.transport.abort()
        failure = PeerIdleClosed if self.closed_idle else PeerUnavailable
        for future in self._pending.values():
            if not future.done():
                future.set_exception(failure(f"{self.address}: {reason}"))
        on_lost, self._on_lost = self._on_lost, None
        if on_lost is not None:
            on_lost(self, reason)
