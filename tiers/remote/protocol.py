"""The control plane between ``RemoteTier`` and ``kvtier peer``: frames, messages, limits, auth.

Only small messages travel here (keys, slot numbers, 40-byte row headers); the rows
themselves move by NIXL, one-sided, between the client's host pool and the peer's pool.

Frame: ``[u32 body length][u8 type][u32 request id][payload]``, little-endian. Every
length and count is checked against a hard limit *before* anything is allocated, and a
payload must be consumed exactly: a frame that is too long, of an unknown type, or whose
payload does not parse is a ``ProtocolError``, and the peer closes that connection (and
only that one). Nothing is ever unpickled.

Handshake (challenge-response over a shared secret, so the token never travels)::

    peer   -> CHALLENGE  magic, version, server nonce
    client -> AUTH       version, client nonce, tenant, HMAC(token, "client" | transcript)
    peer   -> WELCOME    (sealed) instance id, pool geometry, NIXL metadata

The transcript is the CHALLENGE payload followed by the AUTH payload up to its MAC, so the
client's MAC binds both nonces, the protocol version and the tenant it claims: a relay
cannot graft one client's proof onto another claim. The peer accepts the claim only if the
MAC verifies under a token that grants that tenant (``tiers/remote/auth.py``). A wrong MAC
closes the connection before the peer says anything about itself: no NIXL metadata, no
pool address. A client without a token uses the empty key, which only a peer started
without a token accepts. Before authentication a frame may be at most
``MAX_HANDSHAKE_FRAME`` bytes, so an anonymous connection cannot make the peer buffer more.

**The channel after AUTH is authenticated** (``Session``): both sides derive a session key
from the token and the transcript (so from both nonces), one key per direction, and every
later frame, WELCOME first, ends with a 16-byte keyed BLAKE2b tag over an implicit
per-direction sequence number and the whole body. A frame injected, replayed, dropped,
reordered or rewritten by anyone without the token fails its tag; the receiver raises
``AuthenticationError`` and closes the connection (on the client: every call in flight
is a miss, never a served row). The client uses WELCOME's NIXL metadata only after the
WELCOME's tag verified, so the peer's proof of the token and the metadata are one thing.
Nothing is encrypted: keys, row headers and metadata are readable on the wire (rows move
by NIXL, outside this channel; see ``docs/threat-model.md``).

Requests carry a request id chosen by the client; the reply to a request carries the
same id, so one connection serves many concurrent calls. ``RELEASE`` and ``PUT_ABORT``
have no reply (they only give resources back).
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

PROTOCOL_VERSION = 2
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
MAX_ERROR_TEXT = 256
MAX_STATS = 64

NO_SLOT = 0xFFFFFFFF
"""In ALLOCATED and LEASED: no slot (refused, or a miss)."""
EXISTS = 0xFFFFFFFE
"""In ALLOCATED: the key is stored already; nothing to write, the put succeeded."""
MAX_SLOTS = 0xFFFFFFF0

_LEN = struct.Struct("<I")
_BODY = struct.Struct("<BI")
FRAME_OVERHEAD = _LEN.size + _BODY.size
_CHALLENGE = struct.Struct(f"<4sH{NONCE_BYTES}s")
_AUTH_HEAD = struct.Struct(f"<H{NONCE_BYTES}sB")
_WELCOME = struct.Struct(f"<{INSTANCE_ID_BYTES}sQIQQII")
_SEQ = struct.Struct("<Q")
_ID = struct.Struct("<Q")
_ERROR = struct.Struct("<HH")


class ProtocolError(Exception):
    """A frame or message that breaks the protocol; the connection that sent it is closed."""


class AuthenticationError(ProtocolError):
    """A frame whose tag does not verify: injected, replayed, reordered or rewritten."""


class Msg(IntEnum):
    CHALLENGE = 1
    AUTH = 2
    WELCOME = 3
    PUT_ALLOC = 10
    ALLOCATED = 11
    PUT_COMMIT = 12
    COMMITTED = 13
    PUT_ABORT = 14
    GET = 20
    LEASED = 21
    RELEASE = 22
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


_MSG_VALUES = frozenset(int(m) for m in Msg)


@dataclass(frozen=True)
class Frame:
    type: Msg
    request_id: int
    payload: bytes


def encode_frame(msg_type: Msg, request_id: int, payload: bytes = b"") -> bytes:
    return _LEN.pack(_BODY.size + len(payload)) + _BODY.pack(msg_type, request_id) + payload


async def read_frame(
    reader: asyncio.StreamReader, max_body: int = MAX_FRAME, session: Session | None = None
) -> Frame:
    """The next frame; ``ProtocolError`` on a bad length or type, ``IncompleteReadError`` at EOF.

    With ``session`` the frame must carry a valid tag (``AuthenticationError`` otherwise),
    checked before its type or payload is looked at.
    """
    (length,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    least = _BODY.size + (TAG_BYTES if session is not None else 0)
    if length < least or length > max_body:
        raise ProtocolError(f"frame of {length} bytes (allowed {least}..{max_body})")
    body = await reader.readexactly(length)
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
    """What an authenticated client learns about the peer: enough to address its pool."""

    instance_id: bytes  # new at every start of the peer: a changed id means a restart
    slot_bytes: int
    num_slots: int
    pool_addr: int  # address of slot 0 in the peer's process; slot i at pool_addr + i * slot_bytes
    probe_addr: int  # a few bytes holding instance_id, read once to prove the data plane works
    probe_len: int
    agent_metadata: bytes


def encode_welcome(w: Welcome) -> bytes:
    head = _WELCOME.pack(
        w.instance_id,
        w.slot_bytes,
        w.num_slots,
        w.pool_addr,
        w.probe_addr,
        w.probe_len,
        len(w.agent_metadata),
    )
    return head + w.agent_metadata


def decode_welcome(payload: bytes) -> Welcome:
    r = _Reader(payload)
    instance_id, slot_bytes, num_slots, pool_addr, probe_addr, probe_len, md_len = r.unpack(_WELCOME)
    if md_len > MAX_METADATA_BYTES:
        raise ProtocolError(f"agent metadata of {md_len} bytes (at most {MAX_METADATA_BYTES})")
    metadata = r.take(md_len)
    r.end()
    if slot_bytes == 0 or num_slots == 0 or num_slots > MAX_SLOTS or probe_len < INSTANCE_ID_BYTES:
        raise ProtocolError("peer announces an empty pool")
    if pool_addr == 0 or pool_addr + num_slots * slot_bytes > probe_addr or probe_addr + probe_len > 1 << 64:
        raise ProtocolError("peer announces a pool that does not fit its address space")
    return Welcome(instance_id, slot_bytes, num_slots, pool_addr, probe_addr, probe_len, metadata)


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


def encode_put_alloc(keys: Sequence[bytes], lengths: Sequence[int]) -> bytes:
    if len(keys) != len(lengths):
        raise ValueError("one length per key")
    return encode_keys(keys) + struct.pack(f"<{len(lengths)}I", *lengths)


def decode_put_alloc(payload: bytes) -> tuple[list[bytes], list[int]]:
    r = _Reader(payload)
    keys = _keys(r)
    lengths = r.u32s(len(keys))
    r.end()
    return keys, lengths


def encode_allocated(alloc_id: int, slots: Sequence[int]) -> bytes:
    return _ID.pack(alloc_id) + _LEN.pack(len(slots)) + struct.pack(f"<{len(slots)}I", *slots)


def decode_allocated(payload: bytes) -> tuple[int, list[int]]:
    """``(allocation id, per key: a slot, NO_SLOT or EXISTS)``."""
    r = _Reader(payload)
    alloc_id = r.u64()
    slots = r.u32s(r.count(MAX_KEYS, 4))
    r.end()
    return alloc_id, slots


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
    """PUT_ABORT and RELEASE: an allocation or lease id."""
    return _ID.pack(value)


def decode_id(payload: bytes) -> int:
    r = _Reader(payload)
    value = r.u64()
    r.end()
    return value


_NO_HEADER = bytes(HEADER_BYTES)


def encode_leased(lease_id: int, entries: Sequence[tuple[int, bytes] | None]) -> bytes:
    """Per key ``(slot, header)`` for a hit, ``None`` for a miss."""
    parts = [_ID.pack(lease_id), _LEN.pack(len(entries))]
    for entry in entries:
        slot, header = entry if entry is not None else (NO_SLOT, _NO_HEADER)
        parts.append(_LEN.pack(slot))
        parts.append(header)
    return b"".join(parts)


def decode_leased(payload: bytes) -> tuple[int, list[tuple[int, bytes] | None]]:
    r = _Reader(payload)
    lease_id = r.u64()
    n = r.count(MAX_KEYS, 4 + HEADER_BYTES)
    entries: list[tuple[int, bytes] | None] = []
    for _ in range(n):
        slot = r.u32()
        header = r.take(HEADER_BYTES)
        entries.append(None if slot == NO_SLOT else (slot, header))
    r.end()
    return lease_id, entries


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
