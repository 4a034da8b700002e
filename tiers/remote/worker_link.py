"""The link between ``kvtier peer`` and its tenant workers: length-prefixed JSON messages.

A tenant worker (``tiers/remote/tenant_worker.py``) is the process that loads a tenant's
clients' NIXL metadata; hostile metadata may make it misbehave in any way NIXL or UCX can,
so what it sends back is parsed as data only: JSON (never pickle, which would run code in the
serving process), one object per message, at most ``MAX_MESSAGE`` bytes, behind a 4-byte
little-endian length. Bytes (probe values, metadata) travel as hex strings.

Requests carry an ``id``; the worker answers each (except ``forget``) with the same ``id``
and either ``ok`` (the result) or ``error`` (text) and ``timeout`` (whether it ran out of its
deadline). Deadlines are ``time.monotonic()`` values: CLOCK_MONOTONIC is one clock for every
process of the host.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from typing import Any

MAX_MESSAGE = 64 << 20
_LENGTH = struct.Struct("<I")


class LinkError(Exception):
    """The other end sent something that is not a message of this link, or left."""


def encode(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE:
        raise LinkError(f"a message of {len(body)} bytes (at most {MAX_MESSAGE})")
    return _LENGTH.pack(len(body)) + body


def _decode(body: bytes) -> dict[str, Any]:
    try:
        message = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise LinkError(f"not a message: {exc}") from None
    if not isinstance(message, dict):
        raise LinkError("a message that is not an object")
    return message


async def read_message(reader: asyncio.StreamReader) -> dict[str, Any]:
    """The next message; ``LinkError`` when the other end left or sent garbage."""
    try:
        (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        if length > MAX_MESSAGE:
            raise LinkError(f"a message of {length} bytes (at most {MAX_MESSAGE})")
        return _decode(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise LinkError("the other end left") from exc


def read_message_blocking(sock: socket.socket) -> dict[str, Any]:
    """``read_message`` on a blocking socket."""
    head = _recv_exactly(sock, _LENGTH.size)
    (length,) = _LENGTH.unpack(head)
    if length > MAX_MESSAGE:
        raise LinkError(f"a message of {length} bytes (at most {MAX_MESSAGE})")
    return _decode(_recv_exactly(sock, length))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise LinkError("the other end left")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)
