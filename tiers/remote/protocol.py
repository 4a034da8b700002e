"""The control plane between ``RemoteTier`` and ``kvtier peer``: frames, messages, limits, auth.

Only small messages travel here (keys, addresses, 40-byte row headers); the rows move by
NIXL, and **the peer initiates every transfer**: it READs a put's rows out of the client's
registered host rows into its own slots, and WRITEs a get's rows from its slots into the
client's. A client never receives the peer's NIXL metadata, pool address or slot numbers,
so no client can address the peer's memory through NIXL, whatever the transport enforces
(``docs/threat-model.md``).

Frame: ``[u32 body length][u8 type][u32 request id][payload]``, little-endian. Every
length and count is checked against a hard limit *before* anything is allocated, and a
payload must be consumed exactly: a frame that is too long, of an unknown type, or whose
payload does not parse is a ``ProtocolError``, and the peer closes that connection (and
only that one). Nothing is ever unpickled.

Handshake (challenge-response over a shared secret, so the token never travels)::

    peer   -> CHALLENGE  magic, version, server nonce
    client -> AUTH       version, client nonce, tenant, HMAC(token, "client" | transcript)
    peer   -> WELCOME    (sealed) instance id, slot size, slots of the tenant, request bound
    client -> AGENT      (sealed) the client's NIXL metadata, the address of its probe bytes
    peer   -> READY      (sealed) once the peer READ the probe bytes and found the value
                         only this session can put there

The transcript is the CHALLENGE payload followed by the AUTH payload up to its MAC, so the
client's MAC binds both nonces, the protocol version and the tenant it claims: a relay
cannot graft one client's proof onto another claim. The peer accepts the claim only if the
MAC verifies under a token that grants that tenant (``tiers/remote/auth.py``). A wrong MAC
closes the connection before the peer says anything about itself. A client without a token
uses the empty key, which only a peer started without a token accepts. Before
authentication a frame may be at most ``MAX_HANDSHAKE_FRAME`` bytes, so an anonymous
connection cannot make the peer buffer more.

The probe makes the client *prove* that the NIXL agent it announces is its own: the peer
READs ``PROBE_BYTES`` at the announced address and compares them with
``Session.probe_value``, derived from the session key. A client that replays another
engine's metadata (readable on the wire) cannot make that engine's memory hold its own
session's value, so it cannot make the peer read or write another process's memory. The
peer also refuses metadata of an agent name another connection has loaded.

**The channel after AUTH is authenticated** (``Session``): both sides derive a session key
from the token and the transcript (so from both nonces), one key per direction, and every
later frame, WELCOME first, ends with a 16-byte keyed BLAKE2b tag over an implicit
per-direction sequence number and the whole body. A frame injected, replayed, dropped,
reordered or rewritten by anyone without the token fails its tag; the receiver raises
``AuthenticationError`` and closes the connection (on the client: every call in flight
is a miss, never a served row). Nothing is encrypted: keys, row headers and metadata are
readable on the wire (rows move by NIXL, outside this channel).

Requests carry a request id chosen by the client; the reply to a request carries the
same id, so one connection serves many concurrent calls, and the peer may answer them in
any order. ``PUT_ABORT`` has no reply.
``PUT`` and ``GET`` carry the time the client still waits (``budget_ms``): the peer's
transfer for them ends by then, done or failed.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from tiers.row_format import HEADER_BYTES

PROTOCOL_VERSION = 4  # 4: WELCOME carries the peer's request bound
MAGIC = b"KVTP"
NONCE_BYTES = 32
MAC_BYTES = 32
TAG_BYTES = 16
"""The per-frame tag after the handshake: keyed BLAKE2b-128 (as strong as HMAC here, and
one C call over the body: ~1 us for a small frame)."""
MAX_TENANT_BYTES = 64
TENANT_PATTERN = re.compile(rb"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
DEFAULT_TENANT = "default"
INSTANCE_ID_BYTES = 16

MAX_FRAME = 1 << 20
"""Largest body after authentication: 4096 keys of 128 bytes with their lengths fit."""
MAX_HANDSHAKE_FRAME = 256
MAX_KEYS = 4096
MAX_KEY_BYTES = 128
MAX_METADATA_BYTES = 64 << 10
PROBE_BYTES = 32
MAX_BUDGET_MS = 60_000
MAX_ERROR_TEXT = 256
MAX_STATS = 64

NO_SLOT = 0xFFFFFFFF
"""From ``PeerPool.allocate``/``lookup``: no slot (refused, or a miss)."""
EXISTS = 0xFFFFFFFE
"""From ``PeerPool.allocate``: the key is stored already; nothing to write, the put succeeded."""
MAX_SLOTS = 0xFFFFFFF0


class Landed(IntEnum):
    """Per key of a LANDED reply: what became of a row the client offered."""

    REFUSED = 0  # no slot for it, or the peer's READ failed: not stored
    EXISTS = 1  # stored already: nothing was read, the put succeeded
    READ = 2  # read into a slot: stored once PUT_COMMIT brings its header


_LEN = struct.Struct("<I")
_BODY = struct.Struct("<BI")
FRAME_OVERHEAD = _LEN.size + _BODY.size
_CHALLENGE = struct.Struct(f"<4sH{NONCE_BYTES}s")
_AUTH_HEAD = struct.Struct(f"<H{NONCE_BYTES}sB")
_WELCOME = struct.Struct(f"<{INSTANCE_ID_BYTES}sQIQ")
_AGENT_HEAD = struct.Struct("<QI")
_BUDGET = struct.Struct("<I")
_SEQ = struct.Struct("<Q")
_ID = struct.Struct("<Q")
_ERROR = struct.Struct("<HH")


class ProtocolError(Exception):
    """A frame or message that breaks the protocol; the connection that sent it is closed."""


class AuthenticationError(ProtocolError):
    """A frame whose tag does not verify: injected, replayed, reordered or rewritten."""


class IdleTimeout(Exception):
    """No byte of a next frame came within ``read_frame``'s ``idle_s`` (nothing was consumed)."""


class Msg(IntEnum):
    CHALLENGE = 1
    AUTH = 2
    WELCOME = 3
    AGENT = 4
    READY = 5
    PUT = 10
    LANDED = 11
    PUT_COMMIT = 12
    COMMITTED = 13
    PUT_ABORT = 14
    GET = 20
    GOT = 21
    CONTAINS = 30
    CONTAINED = 31
    DELETE = 40
    DELETED = 41
    STATS = 50
    STATS_REPLY = 51
    ERROR = 60


class ErrorCode(IntEnum):
    UNKNOWN_ALLOCATION = 1  # expired or never made: the put's keys are not stored
    LIMIT = 2  # too many allocations or leases held by this connection
    BAD_REQUEST = 3  # well-formed but inconsistent (a header count that does not match)
    TRANSFER_FAILED = 4  # the peer's NIXL transfer failed; the connection closes after this
    # reply (the peer dropped this client's NIXL agent)
    TRANSFER_TIMEOUT = 5  # the same, because the transfer ran out of the client's budget
    IDLE = 6  # request id 0: the peer closes this connection, idle for its --idle-timeout;
    # it read nothing after this notice, so no request still waiting for a reply was served


_MSG_VALUES = frozenset(int(m) for m in Msg)


@dataclass(frozen=True)
class Frame:
    type: Msg
    request_id: int
    payload: bytes


def encode_frame(msg_type: Msg, request_id: int, payload: bytes = b"") -> bytes:
    return _LEN.pack(_BODY.size + len(payload)) + _BODY.pack(msg_type, request_id) + payload


async def read_frame(
    reader: asyncio.StreamReader,
    max_body: int = MAX_FRAME,
    session: Session | None = None,
    *,
    idle_s: float | None = None,
    frame_s: float | None = None,
) -> Frame:
    """The next frame; ``ProtocolError`` on a bad length or type, ``IncompleteReadError`` at EOF.

    With ``session`` the frame must carry a valid tag (``AuthenticationError`` otherwise),
    checked before its type or payload is looked at. ``idle_s``: ``IdleTimeout`` if the
    frame's first byte does not come by then; ``frame_s``: once it came, the whole frame must
    come within that many seconds, else ``ProtocolError`` (a trickled frame holds nothing long).
    """
    first = b""
    if idle_s is not None:
        try:
            async with asyncio.timeout(idle_s):
                first = await reader.readexactly(1)
        except TimeoutError:
            raise IdleTimeout(f"no frame for {idle_s:g} s") from None
    try:
        async with asyncio.timeout(frame_s):
            (length,) = _LEN.unpack(first + await reader.readexactly(_LEN.size - len(first)))
            least = _BODY.size + (TAG_BYTES if session is not None else 0)
            if length < least or length > max_body:
                raise ProtocolError(f"frame of {length} bytes (allowed {least}..{max_body})")
            body = await reader.readexactly(length)
    except TimeoutError:
        raise ProtocolError(f"a frame not complete {frame_s:g} s after its first byte") from None
    if session is not None:
        body = session.open(body)
    msg_type, request_id = _BODY.unpack_from(body)
    if msg_type not in _MSG_VALUES:
        raise ProtocolError(f"unknown message type {msg_type}")
    return Frame(Msg(msg_type), request_id, body[_BODY.size :])


class _Reader:
    """A cursor over one payload that refuses to read past its end or to stop short of it."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if n < 0 or end > len(self.data):
            raise ProtocolError(f"message truncated: needs {end} bytes, has {len(self.data)}")
        out = self.data[self.pos : end]
        self.pos = end
        return out

    def unpack(self, fmt: struct.Struct) -> tuple:
        return fmt.unpack(self.take(fmt.size))

    def u8(self) -> int:
        return self.take(1)[0]

    def u32(self) -> int:
        return _LEN.unpack(self.take(4))[0]

    def u64(self) -> int:
        return _ID.unpack(self.take(8))[0]

    def count(self, limit: int, item_bytes: int) -> int:
        """A u32 count, checked against ``limit`` and against the bytes actually left."""
        n = self.u32()
        if n > limit:
            raise ProtocolError(f"{n} items (at most {limit})")
        if n * item_bytes > len(self.data) - self.pos:
            raise ProtocolError(f"{n} items of at least {item_bytes} bytes do not fit the message")
        return n

    def u32s(self, n: int) -> list[int]:
        return list(struct.unpack(f"<{n}I", self.take(4 * n)))

    def end(self) -> None:
        if self.pos != len(self.data):
            raise ProtocolError(f"{len(self.data) - self.pos} trailing bytes")


# -- authentication ---------------------------------------------------------------------


def valid_tenant(tenant: str) -> bool:
    """1..64 of ``[A-Za-z0-9._-]``, starting alphanumeric: no separator can be smuggled in."""
    raw = tenant.encode("utf-8", errors="replace")
    return TENANT_PATTERN.fullmatch(raw) is not None


def client_mac(token: bytes, transcript: bytes) -> bytes:
    """The client's proof: binds the token to the whole transcript (nonces, version, tenant)."""
    return hmac.new(token, b"kvtier-peer-v2/client" + transcript, hashlib.sha256).digest()


def macs_equal(expected: bytes, received: bytes) -> bool:
    """Constant-time comparison: the time taken says nothing about how many bytes matched."""
    return hmac.compare_digest(expected, received)


class Session:
    """The authenticated channel after AUTH: one key and one sequence number per direction.

    The keys are derived from the token and the transcript, so they are fresh per connection
    (both nonces are in the transcript) and a frame from one connection, or one direction,
    never verifies on another. The sequence numbers are not sent: each side counts, so a
    replayed, dropped or reordered frame verifies under the wrong number and fails.
    ``seal`` must be called in the order the frames are written to the stream (every writer
    here seals and writes in one synchronous step).
    """

    def __init__(self, token: bytes, transcript: bytes, *, is_client: bool) -> None:
        master = hmac.new(
            token, b"kvtier-peer-v2/session" + hashlib.sha256(transcript).digest(), hashlib.sha256
        ).digest()
        to_peer = hmac.new(master, b"client->peer", hashlib.sha256).digest()
        to_client = hmac.new(master, b"peer->client", hashlib.sha256).digest()
        self.probe_value = hmac.new(master, b"probe", hashlib.sha256).digest()[:PROBE_BYTES]
        """What the client puts in its probe bytes and the peer expects to read there: only
        the two ends of this session can compute it."""
        self._send_key, self._recv_key = (to_peer, to_client) if is_client else (to_client, to_peer)
        self._send_seq = 0
        self._recv_seq = 0

    def _tag(self, key: bytes, seq: int, body: bytes | memoryview) -> bytes:
        h = hashlib.blake2b(_SEQ.pack(seq), key=key, digest_size=TAG_BYTES)
        h.update(body)
        return h.digest()

    def seal(self, msg_type: Msg, request_id: int, payload: bytes = b"") -> bytes:
        """One frame with its tag under the next send sequence number."""
        body = _BODY.pack(msg_type, request_id) + payload
        tag = self._tag(self._send_key, self._send_seq, body)
        self._send_seq += 1
        return _LEN.pack(len(body) + TAG_BYTES) + body + tag

    def open(self, body: bytes) -> bytes:
        """``body`` without its tag, once the tag verified under the next receive number."""
        view = memoryview(body)
        expected = self._tag(self._recv_key, self._recv_seq, view[:-TAG_BYTES])
        if not hmac.compare_digest(expected, view[-TAG_BYTES:]):
            raise AuthenticationError(f"frame {self._recv_seq} fails its tag (injected, replayed or altered)")
        self._recv_seq += 1
        return body[:-TAG_BYTES]


def encode_challenge(nonce: bytes) -> bytes:
    return _CHALLENGE.pack(MAGIC, PROTOCOL_VERSION, nonce)


def decode_challenge(payload: bytes) -> bytes:
    r = _Reader(payload)
    magic, version, nonce = r.unpack(_CHALLENGE)
    r.end()
    if magic != MAGIC:
        raise ProtocolError("not a kvtier peer (bad magic)")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"peer speaks protocol {version}, this client {PROTOCOL_VERSION}")
    return nonce


def encode_auth_body(client_nonce: bytes, tenant: str) -> bytes:
    """AUTH up to its MAC (the part the transcript includes)."""
    raw = tenant.encode()
    if not valid_tenant(tenant):
        raise ValueError(f"tenant {tenant!r}: 1..{MAX_TENANT_BYTES} of A-Z a-z 0-9 . _ -")
    return _AUTH_HEAD.pack(PROTOCOL_VERSION, client_nonce, len(raw)) + raw


def decode_auth(payload: bytes) -> tuple[bytes, str, bytes]:
    """``(client nonce, tenant, mac)``; the transcript's AUTH part is ``payload[:-MAC_BYTES]``."""
    r = _Reader(payload)
    version, nonce, size = r.unpack(_AUTH_HEAD)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"client speaks protocol {version}, this peer {PROTOCOL_VERSION}")
    raw = r.take(size)
    mac = r.take(MAC_BYTES)
    r.end()
    if TENANT_PATTERN.fullmatch(raw) is None:
        raise ProtocolError("a tenant name that is not one")
    return nonce, raw.decode("ascii"), mac


@dataclass(frozen=True)
class Welcome:
    """What an authenticated client learns about the peer: who it is, how big its slots are
    and how many bytes of rows one request may name (so a client cuts its requests to fit
    rather than having each refused)."""

    instance_id: bytes  # new at every start of the peer: a changed id means a restart
    slot_bytes: int  # the largest row the peer stores
    num_slots: int  # the slots of the client's tenant (its quota, or the whole pool)
    max_request_bytes: int  # the peer's --max-request-bytes: at least one slot


def encode_welcome(w: Welcome) -> bytes:
    return _WELCOME.pack(w.instance_id, w.slot_bytes, w.num_slots, w.max_request_bytes)


def decode_welcome(payload: bytes) -> Welcome:
    r = _Reader(payload)
    instance_id, slot_bytes, num_slots, max_request_bytes = r.unpack(_WELCOME)
    r.end()
    if slot_bytes == 0 or num_slots == 0 or num_slots > MAX_SLOTS:
        raise ProtocolError("peer announces an empty pool")
    if max_request_bytes < slot_bytes:
        raise ProtocolError(f"peer announces requests of {max_request_bytes} B, under one slot")
    return Welcome(instance_id, slot_bytes, num_slots, max_request_bytes)


def encode_agent(probe_addr: int, metadata: bytes) -> bytes:
    """AGENT: where the client's probe bytes are, and its NIXL agent metadata."""
    if not 0 < len(metadata) <= MAX_METADATA_BYTES:
        raise ValueError(f"agent metadata of {len(metadata)} bytes (1..{MAX_METADATA_BYTES})")
    return _AGENT_HEAD.pack(probe_addr, len(metadata)) + metadata


def decode_agent(payload: bytes) -> tuple[int, bytes]:
    r = _Reader(payload)
    probe_addr, size = r.unpack(_AGENT_HEAD)
    if not 0 < size <= MAX_METADATA_BYTES:
        raise ProtocolError(f"agent metadata of {size} bytes (1..{MAX_METADATA_BYTES})")
    metadata = r.take(size)
    r.end()
    if probe_addr == 0 or probe_addr + PROBE_BYTES > 1 << 64:
        raise ProtocolError("a probe address that is not one")
    return probe_addr, metadata


# -- requests and replies ---------------------------------------------------------------


def encode_keys(keys: Sequence[bytes]) -> bytes:
    if len(keys) > MAX_KEYS:
        raise ValueError(f"{len(keys)} keys in one message (at most {MAX_KEYS})")
    parts = [_LEN.pack(len(keys))]
    for key in keys:
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"a key of {len(key)} bytes (1..{MAX_KEY_BYTES})")
        parts.append(bytes((len(key),)))
        parts.append(key)
    return b"".join(parts)


def _keys(r: _Reader) -> list[bytes]:
    n = r.count(MAX_KEYS, 2)
    keys = []
    for _ in range(n):
        size = r.u8()
        if size == 0 or size > MAX_KEY_BYTES:
            raise ProtocolError(f"a key of {size} bytes (1..{MAX_KEY_BYTES})")
        keys.append(r.take(size))
    return keys


def decode_keys(payload: bytes) -> list[bytes]:
    """GET, CONTAINS and DELETE carry only keys."""
    r = _Reader(payload)
    keys = _keys(r)
    r.end()
    return keys


def encode_transfer(
    keys: Sequence[bytes], lengths: Sequence[int], addrs: Sequence[int], budget_ms: int
) -> bytes:
    """PUT and GET: per key the row's length and its address in the client's registered
    memory (where the peer READs it from, or WRITEs it to), and the client's time left."""
    if not len(keys) == len(lengths) == len(addrs):
        raise ValueError("one length and one address per key")
    budget = max(1, min(int(budget_ms), MAX_BUDGET_MS))
    return (
        _BUDGET.pack(budget)
        + encode_keys(keys)
        + struct.pack(f"<{len(lengths)}I", *lengths)
        + struct.pack(f"<{len(addrs)}Q", *addrs)
    )


def decode_transfer(payload: bytes) -> tuple[list[bytes], list[int], list[int], int]:
    """``(keys, lengths, addresses, budget_ms)``; an address range that wraps is refused."""
    r = _Reader(payload)
    (budget,) = r.unpack(_BUDGET)
    keys = _keys(r)
    lengths = r.u32s(len(keys))
    addrs = list(struct.unpack(f"<{len(keys)}Q", r.take(8 * len(keys))))
    r.end()
    if not 0 < budget <= MAX_BUDGET_MS:
        raise ProtocolError(f"a budget of {budget} ms (1..{MAX_BUDGET_MS})")
    if any(a == 0 or a + n > 1 << 64 for a, n in zip(addrs, lengths, strict=True)):
        raise ProtocolError("a row address that is not one")
    return keys, lengths, addrs, budget


def encode_landed(alloc_id: int, landed: Sequence[Landed]) -> bytes:
    return _ID.pack(alloc_id) + _LEN.pack(len(landed)) + bytes(int(x) for x in landed)


def decode_landed(payload: bytes) -> tuple[int, list[Landed]]:
    """``(allocation id, per key: REFUSED, EXISTS or READ)``."""
    r = _Reader(payload)
    alloc_id = r.u64()
    n = r.count(MAX_KEYS, 1)
    raw = r.take(n)
    r.end()
    if any(b > Landed.READ for b in raw):
        raise ProtocolError("an unknown LANDED status")
    return alloc_id, [Landed(b) for b in raw]


def encode_commit(alloc_id: int, headers: Sequence[bytes]) -> bytes:
    """One header per allocated slot, in allocation order; zero bytes for a row not written."""
    if any(len(h) != HEADER_BYTES for h in headers):
        raise ValueError(f"row headers are {HEADER_BYTES} bytes")
    return _ID.pack(alloc_id) + _LEN.pack(len(headers)) + b"".join(headers)


def decode_commit(payload: bytes) -> tuple[int, list[bytes]]:
    r = _Reader(payload)
    alloc_id = r.u64()
    n = r.count(MAX_KEYS, HEADER_BYTES)
    headers = [r.take(HEADER_BYTES) for _ in range(n)]
    r.end()
    return alloc_id, headers


def encode_flags(flags: Sequence[bool]) -> bytes:
    """COMMITTED and CONTAINED: one byte per key."""
    return _LEN.pack(len(flags)) + bytes(1 if f else 0 for f in flags)


def decode_flags(payload: bytes) -> list[bool]:
    r = _Reader(payload)
    n = r.count(MAX_KEYS, 1)
    flags = [b != 0 for b in r.take(n)]
    r.end()
    return flags


def encode_id(value: int) -> bytes:
    """PUT_ABORT: an allocation id."""
    return _ID.pack(value)


def decode_id(payload: bytes) -> int:
    r = _Reader(payload)
    value = r.u64()
    r.end()
    return value


def encode_got(headers: Sequence[bytes | None]) -> bytes:
    """GOT: per key the header of the row the peer wrote into the client's memory and verified
    against it, or ``None`` for a miss (not stored, stored with another length than the
    client's row, or failing its checksum)."""
    parts = [_LEN.pack(len(headers))]
    for header in headers:
        parts.append(b"\x00" if header is None else b"\x01" + header)
    return b"".join(parts)


def decode_got(payload: bytes) -> list[bytes | None]:
    r = _Reader(payload)
    n = r.count(MAX_KEYS, 1)
    headers: list[bytes | None] = []
    for _ in range(n):
        flag = r.u8()
        if flag > 1:
            raise ProtocolError("an unknown GOT flag")
        headers.append(r.take(HEADER_BYTES) if flag else None)
    r.end()
    return headers


def encode_count(n: int) -> bytes:
    return _LEN.pack(n)


def decode_count(payload: bytes) -> int:
    r = _Reader(payload)
    n = r.u32()
    r.end()
    return n


def encode_stats(stats: dict[str, int]) -> bytes:
    parts = [_LEN.pack(len(stats))]
    for name, value in stats.items():
        raw = name.encode()
        parts.append(bytes((len(raw),)) + raw + _ID.pack(max(0, int(value))))
    return b"".join(parts)


def decode_stats(payload: bytes) -> dict[str, int]:
    r = _Reader(payload)
    n = r.count(MAX_STATS, 10)
    stats = {}
    for _ in range(n):
        name = r.take(r.u8()).decode("ascii", errors="replace")
        stats[name] = r.u64()
    r.end()
    return stats


def encode_error(code: ErrorCode, text: str) -> bytes:
    raw = text.encode()[:MAX_ERROR_TEXT]
    return _ERROR.pack(code, len(raw)) + raw


def decode_error(payload: bytes) -> tuple[int, str]:
    r = _Reader(payload)
    code, size = r.unpack(_ERROR)
    if size > MAX_ERROR_TEXT:
        raise ProtocolError(f"error text of {size} bytes")
    text = r.take(size).decode(errors="replace")
    r.end()
    return code, text
