"""``tiers/remote/worker_link.py``: what a tenant worker sends is parsed as data, bounded."""

from __future__ import annotations

import asyncio
import struct

import pytest

from tiers.remote import worker_link as link


async def _read(data: bytes):
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return await link.read_message(reader)


async def test_a_message_round_trips():
    message = {"id": 3, "ok": [[True, False], None], "name": "kvtier-remote-x"}
    assert await _read(link.encode(message)) == message


@pytest.mark.parametrize(
    "data",
    [
        struct.pack("<I", link.MAX_MESSAGE + 1),  # too long: refused before it is read
        struct.pack("<I", 4) + b"[1]x",  # not an object
        struct.pack("<I", 3) + b"\x80ab",  # not JSON
        struct.pack("<I", 8) + b"{}",  # cut short
        b"\x01",
    ],
)
async def test_garbage_from_a_worker_is_a_link_error(data):
    with pytest.raises(link.LinkError):
        await _read(data)
