"""The peer protocol's codecs: round trips, hard limits, and nothing but ProtocolError on garbage."""

import asyncio
import contextlib
import os
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiers.remote import protocol as proto
from tiers.row_format import HEADER_BYTES, RowHeader

KEYS = st.lists(st.binary(min_size=1, max_size=proto.MAX_KEY_BYTES), max_size=64)
DECODERS = [
    proto.decode_challenge,
    proto.decode_auth,
    proto.decode_welcome,
    proto.decode_agent,
    proto.decode_keys,
    proto.decode_transfer,
    proto.decode_landed,
    proto.decode_commit,
    proto.decode_flags,
    proto.decode_id,
    proto.decode_got,
    proto.decode_count,
    proto.decode_stats,
    proto.decode_error,
]


@given(KEYS, st.data())
def test_requests_round_trip(keys, data):
    lengths = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=len(keys), max_size=len(keys)))
    addrs = data.draw(st.lists(st.integers(1, 2**48), min_size=len(keys), max_size=len(keys)))
    assert proto.decode_keys(proto.encode_keys(keys)) == keys
    assert proto.decode_transfer(proto.encode_transfer(keys, lengths, addrs, 1500)) == (
        keys,
        lengths,
        addrs,
        1500,
    )
    headers = [RowHeader(b"L" * 16, n, n * 7).pack() for n in range(len(keys))]
    assert proto.decode_commit(proto.encode_commit(9, headers)) == (9, headers)
    got = [headers[i] if i % 2 else None for i in range(len(keys))]
    assert proto.decode_got(proto.encode_got(got)) == got


def test_replies_round_trip():
    landed = [proto.Landed.READ, proto.Landed.REFUSED, proto.Landed.EXISTS]
    assert proto.decode_landed(proto.encode_landed(3, landed)) == (3, landed)
    assert proto.decode_agent(proto.encode_agent(1 << 40, b"metadata")) == (1 << 40, b"metadata")
    assert proto.decode_flags(proto.encode_flags([True, False, True])) == [True, False, True]
    assert proto.decode_stats(proto.encode_stats({"rows": 3, "slots": 9})) == {"rows": 3, "slots": 9}
    assert proto.decode_error(proto.encode_error(proto.ErrorCode.LIMIT, "too many")) == (2, "too many")
    welcome = proto.Welcome(b"i" * 16, 4096, 10, 1 << 20)
    assert proto.decode_welcome(proto.encode_welcome(welcome)) == welcome


def test_a_welcome_whose_request_bound_is_under_one_slot_is_refused():
    with pytest.raises(proto.ProtocolError, match="under one slot"):
        proto.decode_welcome(proto.encode_welcome(proto.Welcome(b"i" * 16, 4096, 10, 4095)))


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
    wraps = proto.encode_transfer([b"k"], [16], [2**64 - 8], 100)
    with pytest.raises(proto.ProtocolError, match="not one"):
        proto.decode_transfer(wraps)
    no_budget = proto.encode_transfer([b"k"], [16], [4096], 100)
    with pytest.raises(proto.ProtocolError, match="budget"):
        proto.decode_transfer(struct.pack("<I", 0) + no_budget[4:])


@given(st.binary(max_size=600))
@settings(max_examples=300)
def test_garbage_raises_only_protocol_error(payload):
    for decode in DECODERS:
        with contextlib.suppress(proto.ProtocolError):
            decode(payload)


def _read(data: bytes, max_body: int = proto.MAX_FRAME, session: proto.Session | None = None) -> proto.Frame:
    async def run() -> proto.Frame:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await proto.read_frame(reader, max_body, session)

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


async def test_a_frame_must_begin_within_idle_s_and_end_within_frame_s():
    frame = proto.encode_frame(proto.Msg.STATS, 5)
    reader = asyncio.StreamReader()
    with pytest.raises(proto.IdleTimeout):  # nothing came
        await proto.read_frame(reader, idle_s=0.05, frame_s=0.05)
    reader.feed_data(frame[:3])  # begun, never finished: the frame deadline, not the idle one
    with pytest.raises(proto.ProtocolError, match="not complete"):
        await proto.read_frame(reader, idle_s=10.0, frame_s=0.05)
    reader = asyncio.StreamReader()
    reader.feed_data(frame[:1])

    async def rest() -> None:
        await asyncio.sleep(0.02)
        reader.feed_data(frame[1:])

    feeding = asyncio.create_task(rest())
    assert await proto.read_frame(reader, idle_s=0.01, frame_s=5.0) == proto.Frame(proto.Msg.STATS, 5, b"")
    await feeding


def test_the_client_mac_binds_token_and_whole_transcript():
    challenge = proto.encode_challenge(os.urandom(32))
    auth = proto.encode_auth_body(os.urandom(32), "team-a")
    mac = proto.client_mac(b"secret", challenge + auth)
    assert proto.macs_equal(mac, proto.client_mac(b"secret", challenge + auth))
    assert not proto.macs_equal(mac, proto.client_mac(b"wrong", challenge + auth))
    other_tenant = proto.encode_auth_body(auth[2:34], "team-b")  # same nonces, another claim
    assert not proto.macs_equal(mac, proto.client_mac(b"secret", challenge + other_tenant))
    assert not proto.macs_equal(
        mac, proto.client_mac(b"secret", proto.encode_challenge(os.urandom(32)) + auth)
    )
    nonce, tenant, got = proto.decode_auth(auth + mac)
    assert (nonce, tenant, got) == (auth[2:34], "team-a", mac)
    assert len(mac) == proto.MAC_BYTES and HEADER_BYTES == 40


@pytest.mark.parametrize("tenant", ["", "a/b", "x" * 65, "-lead", "nul\x00", "é"])
def test_tenant_names_that_could_smuggle_a_separator_are_refused(tenant):
    with pytest.raises(ValueError):
        proto.encode_auth_body(bytes(32), tenant)
    raw = struct.pack("<H32sB", proto.PROTOCOL_VERSION, bytes(32), len(tenant.encode())) + tenant.encode()
    with pytest.raises(proto.ProtocolError):
        proto.decode_auth(raw + bytes(proto.MAC_BYTES))


def _pair(token: bytes = b"t" * 16) -> tuple[proto.Session, proto.Session]:
    transcript = os.urandom(80)
    return proto.Session(token, transcript, is_client=True), proto.Session(token, transcript, is_client=False)


def _open(session: proto.Session, frame: bytes) -> proto.Frame:
    return _read(frame, proto.MAX_FRAME, session)


def test_a_session_seals_and_verifies_in_order():
    client, peer = _pair()
    for i in range(3):
        got = _open(peer, client.seal(proto.Msg.GET, i, proto.encode_keys([b"k%d" % i])))
        assert got == proto.Frame(proto.Msg.GET, i, proto.encode_keys([b"k%d" % i]))
    assert _open(client, peer.seal(proto.Msg.DELETED, 9, proto.encode_count(1))).request_id == 9


def test_a_session_refuses_injected_replayed_reflected_reordered_and_altered_frames():
    client, peer = _pair()
    first = client.seal(proto.Msg.GET, 1, proto.encode_keys([b"a"]))
    second = client.seal(proto.Msg.GET, 2, proto.encode_keys([b"b"]))
    keys = proto.encode_keys([b"a"])
    forged = struct.pack("<IBI", 5 + len(keys) + proto.TAG_BYTES, proto.Msg.DELETE, 3) + keys + bytes(16)
    with pytest.raises(proto.AuthenticationError):
        _open(peer, forged)  # injected
    with pytest.raises(proto.AuthenticationError):
        _open(peer, second)  # reordered (or the first was dropped)
    _open(peer, first)
    with pytest.raises(proto.AuthenticationError):
        _open(peer, first)  # replayed
    altered = bytearray(second)
    altered[-proto.TAG_BYTES - 1] ^= 1
    with pytest.raises(proto.AuthenticationError):
        _open(peer, bytes(altered))
    reply = peer.seal(proto.Msg.GET, 1, proto.encode_keys([b"a"]))
    with pytest.raises(proto.AuthenticationError):
        _open(peer, reply)  # reflected: the peer's own frame sent back to it
    other_client, _ = _pair()  # another connection: other nonces, other keys
    with pytest.raises(proto.AuthenticationError):
        _open(peer, other_client.seal(proto.Msg.GET, 2, proto.encode_keys([b"b"])))
    wrong_token = proto.Session(b"u" * 16, os.urandom(80), is_client=True)
    with pytest.raises(proto.AuthenticationError):
        _open(peer, wrong_token.seal(proto.Msg.GET, 2, b""))


@given(st.data())
@settings(max_examples=200)
def test_any_altered_byte_of_a_sealed_frame_is_refused(data):
    client, peer = _pair()
    frame = client.seal(proto.Msg.GET, 7, proto.encode_keys([b"key-one", b"key-two"]))
    at = data.draw(st.integers(4, len(frame) - 1))  # past the length: every byte the tag covers
    altered = frame[:at] + bytes([frame[at] ^ data.draw(st.integers(1, 255))]) + frame[at + 1 :]
    with pytest.raises(proto.AuthenticationError):
        _open(peer, altered)
    assert _open(peer, frame).request_id == 7  # the untouched frame still verifies after
