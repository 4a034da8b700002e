"""The peer protocol's codecs: round trips, hard limits, and nothing but ProtocolError on garbage."""

import asyncio
import contextlib
import os
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiers import peer_protocol as proto
from tiers.row_format import HEADER_BYTES, RowHeader

KEYS = st.lists(st.binary(min_size=1, max_size=proto.MAX_KEY_BYTES), max_size=64)
DECODERS = [
    proto.decode_challenge,
    proto.decode_auth,
    proto.decode_welcome,
    proto.decode_keys,
    proto.decode_put_alloc,
    proto.decode_allocated,
    proto.decode_commit,
    proto.decode_flags,
    proto.decode_id,
    proto.decode_leased,
    proto.decode_count,
    proto.decode_stats,
    proto.decode_error,
]


@given(KEYS, st.data())
def test_requests_round_trip(keys, data):
    lengths = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=len(keys), max_size=len(keys)))
    assert proto.decode_keys(proto.encode_keys(keys)) == keys
    assert proto.decode_put_alloc(proto.encode_put_alloc(keys, lengths)) == (keys, lengths)
    headers = [RowHeader(b"L" * 16, n, n * 7).pack() for n in range(len(keys))]
    assert proto.decode_commit(proto.encode_commit(9, headers)) == (9, headers)
    entries = [(i, headers[i]) if i % 2 else None for i in range(len(keys))]
    assert proto.decode_leased(proto.encode_leased(5, entries)) == (5, entries)


def test_replies_round_trip():
    slots = [0, 7, proto.NO_SLOT, proto.EXISTS]
    assert proto.decode_allocated(proto.encode_allocated(3, slots)) == (3, slots)
    assert proto.decode_flags(proto.encode_flags([True, False, True])) == [True, False, True]
    assert proto.decode_stats(proto.encode_stats({"rows": 3, "slots": 9})) == {"rows": 3, "slots": 9}
    assert proto.decode_error(proto.encode_error(proto.ErrorCode.LIMIT, "too many")) == (2, "too many")
    welcome = proto.Welcome(b"m" * 32, b"i" * 16, 4096, 10, 1 << 40, 1 << 41, 16, b"metadata")
    assert proto.decode_welcome(proto.encode_welcome(welcome)) == welcome


def test_limits_are_enforced_before_allocation():
    too_many = struct.pack("<I", proto.MAX_KEYS + 1)
    with pytest.raises(proto.ProtocolError, match="at most"):
        proto.decode_keys(too_many)
    claims_more_than_sent = struct.pack("<I", 100) + b"\x01a"
    with pytest.raises(proto.ProtocolError, match="do not fit"):
        proto.decode_keys(claims_more_than_sent)
    with pytest.raises(proto.ProtocolError, match="a key of 0 bytes"):
        proto.decode_keys(struct.pack("<I", 1) + b"\x00\x00")
    with pytest.raises(proto.ProtocolError, match="trailing"):
        proto.decode_id(struct.pack("<Q", 1) + b"x")
    with pytest.raises(ValueError):
        proto.encode_keys([b"k" * (proto.MAX_KEY_BYTES + 1)])


@given(st.binary(max_size=600))
@settings(max_examples=300)
def test_garbage_raises_only_protocol_error(payload):
    for decode in DECODERS:
        with contextlib.suppress(proto.ProtocolError):
            decode(payload)


def _read(data: bytes, max_body: int = proto.MAX_FRAME) -> proto.Frame:
    async def run() -> proto.Frame:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await proto.read_frame(reader, max_body)

    return asyncio.run(run())


def test_frames_are_checked_before_they_are_read():
    frame = proto.encode_frame(proto.Msg.GET, 77, proto.encode_keys([b"abc"]))
    assert _read(frame) == proto.Frame(proto.Msg.GET, 77, proto.encode_keys([b"abc"]))
    with pytest.raises(proto.ProtocolError, match="frame of"):
        _read(struct.pack("<I", proto.MAX_FRAME + 1))
    with pytest.raises(proto.ProtocolError, match="frame of"):
        _read(proto.encode_frame(proto.Msg.AUTH, 0, bytes(300)), proto.MAX_HANDSHAKE_FRAME)
    with pytest.raises(proto.ProtocolError, match="unknown message type"):
        _read(struct.pack("<IBI", 5, 255, 0))
    with pytest.raises(asyncio.IncompleteReadError):
        _read(frame[:-1])


def test_macs_bind_token_and_both_nonces():
    server, client = os.urandom(32), os.urandom(32)
    mac = proto.client_mac(b"secret", server, client)
    assert proto.macs_equal(mac, proto.client_mac(b"secret", server, client))
    assert not proto.macs_equal(mac, proto.client_mac(b"wrong", server, client))
    assert not proto.macs_equal(mac, proto.client_mac(b"secret", os.urandom(32), client))
    assert not proto.macs_equal(mac, proto.server_mac(b"secret", server, client))  # no reflection
    assert len(mac) == proto.MAC_BYTES and HEADER_BYTES == 40
