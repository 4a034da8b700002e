"""Issue 16's attacks on ``kvtier peer``, each tried against real peers on 127.0.0.1.

Every test tries the attack the way the issue's attacker did and asserts what the attacker
wanted did not happen (no foreign row read, deleted, answered or evicted; no forged or
misplaced row served; no lockout; no crash), and where it helps, that the same test sees the
harm in a setting without the defence (so the check can fail).
"""

from __future__ import annotations

import asyncio
import os
import struct
import time

import numpy as np
import pytest

from tests.security.relay import C2S, S2C, Relay, frame_type
from tests.tiers.peer_fixtures import HostRows, RawAgent, RawConnection, key, open_tier
from tiers.base import RowsAbandoned
from tiers.remote import protocol as proto

KIB = 1024
ROW = 64 * KIB
VICTIM_TOKEN = b"victim-token-" + os.urandom(8).hex().encode()
ATTACKER_TOKEN = b"attacker-token-" + os.urandom(8).hex().encode()
TENANTS = {"victim": VICTIM_TOKEN, "attacker": ATTACKER_TOKEN}
NAMESPACE = b"shared-namespace"  # the attacker knows the victim's namespace and keys

multiprocess = pytest.mark.multiprocess


def rows_and_keys(n: int, seed: int, salt: bytes = b"v") -> tuple[HostRows, list[bytes]]:
    return HostRows([ROW] * n, seed=seed), [key(i, salt=salt) for i in range(n)]


def pairs(keys: list[bytes], views: list[memoryview]) -> list[tuple[bytes, memoryview]]:
    return list(zip(keys, views, strict=True))


async def hits_of(tier, rows: list[tuple[bytes, memoryview]]) -> list[bool]:
    """A get's hits; a get the peer did not answer (the connection was closed on tampering)
    raises ``RowsAbandoned``, whose per-row results are the hits."""
    try:
        return await tier.get(rows)
    except RowsAbandoned as exc:
        return exc.ok


# -- tenants from credentials ------------------------------------------------------------


@multiprocess
async def test_a_token_cannot_claim_a_tenant_it_does_not_grant(spawn_peers):
    (peer,) = spawn_peers(tenants=TENANTS)
    raw = RawConnection(peer.port)
    try:
        assert raw.handshake(ATTACKER_TOKEN, tenant="victim") is None  # closed before WELCOME
    finally:
        raw.close()
    raw = RawConnection(peer.port)
    try:
        assert raw.handshake(ATTACKER_TOKEN, tenant="attacker") is not None  # its own: welcome
    finally:
        raw.close()
    rows, keys = rows_and_keys(2, seed=1)
    async with open_tier(
        [peer.address], rows.view, namespace=NAMESPACE, token=ATTACKER_TOKEN, tenant="victim"
    ) as tier:
        assert tier.peers_up() == []
        assert await tier.put(pairs(keys, rows.src)) == [False, False]
    async with open_tier(
        [peer.address], rows.view, namespace=NAMESPACE, token=VICTIM_TOKEN, tenant="victim"
    ) as tier:
        assert tier.peers_up() == [peer.address]
        assert (await tier.peer_stats(peer.address))["auth_failures"] >= 2


@multiprocess
async def test_a_single_token_grants_only_the_default_tenant(spawn_peers):
    (peer,) = spawn_peers(token=VICTIM_TOKEN)
    rows, _ = rows_and_keys(1, seed=2)
    async with open_tier([peer.address], rows.view, token=VICTIM_TOKEN, tenant="other") as tier:
        assert tier.peers_up() == []
    async with open_tier([peer.address], rows.view, token=VICTIM_TOKEN) as tier:
        assert tier.peers_up() == [peer.address]


@multiprocess
async def test_a_tenant_cannot_get_contains_delete_or_overwrite_another_tenants_rows(spawn_peers):
    (peer,) = spawn_peers(tenants=TENANTS)
    rows, keys = rows_and_keys(8, seed=3)
    forged = HostRows([ROW] * 8, seed=99)
    async with (
        open_tier(
            [peer.address], rows.view, namespace=NAMESPACE, token=VICTIM_TOKEN, tenant="victim"
        ) as victim,
        open_tier(
            [peer.address], forged.view, namespace=NAMESPACE, token=ATTACKER_TOKEN, tenant="attacker"
        ) as attacker,
    ):
        assert await victim.put(pairs(keys, rows.src)) == [True] * 8
        assert await attacker.contains(keys) == [False] * 8
        forged.clear_dst()
        assert await attacker.get(pairs(keys, forged.dst)) == [False] * 8
        assert not forged.buffer[8 * ROW :].any()  # nothing of the victim's landed
        await attacker.delete(keys)
        assert await attacker.put(pairs(keys, forged.src)) == [True] * 8  # in its own namespace
        assert (await attacker.peer_stats(peer.address))["rows"] == 8  # its own rows only
        rows.clear_dst()
        assert await victim.get(pairs(keys, rows.dst)) == [True] * 8
        assert all(rows.same(i) for i in range(8))  # the victim's bytes, not the attacker's
        assert (await victim.peer_stats(peer.address))["rows"] == 8


@multiprocess
@pytest.mark.parametrize("tenants", [True, False], ids=["quotas", "shared-pool-control"])
async def test_flooding_one_tenant_does_not_evict_another(spawn_peers, tenants):
    """16 slots, two tenants: 8 each. The attacker writes 64 rows; the victim keeps its 8.
    The control (a peer without tokens: one shared pool) shows the flood does evict there."""
    if tenants:
        (peer,) = spawn_peers(tenants=TENANTS, capacity="1MiB", row_bytes="64KiB")
        tokens = {"victim": VICTIM_TOKEN, "attacker": ATTACKER_TOKEN}
    else:
        (peer,) = spawn_peers(capacity="1MiB", row_bytes="64KiB")
        tokens = {"victim": None, "attacker": None}
    rows, keys = rows_and_keys(8, seed=4)
    flood, flood_keys = rows_and_keys(64, seed=5, salt=b"f")
    async with (
        open_tier([peer.address], rows.view, token=tokens["victim"], tenant="victim") as victim,
        open_tier([peer.address], flood.view, token=tokens["attacker"], tenant="attacker") as attacker,
    ):
        assert await victim.put(pairs(keys, rows.src)) == [True] * 8
        for start in range(0, 64, 8):
            await attacker.put(pairs(flood_keys[start : start + 8], flood.src[start : start + 8]))
        rows.clear_dst()
        kept = await victim.get(pairs(keys, rows.dst))
    if tenants:
        assert kept == [True] * 8
        assert all(rows.same(i) for i in range(8))
    else:
        assert sum(kept) < 8  # the harm the quotas prevent


@multiprocess
async def test_no_client_is_given_anything_that_addresses_the_peers_memory(spawn_peers):
    """Every frame a peer sends a fully served client (handshake, put, get, contains, stats)
    carries no NIXL metadata and no address: the client's NIXL agent has nothing to load, so
    it cannot initiate a transfer into the peer on any transport. The control: the client's
    own frames do carry its metadata (the search finds what is there)."""
    (peer,) = spawn_peers(tenants=TENANTS)
    rows, keys = rows_and_keys(4, seed=14)
    async with (
        Relay(peer.port) as relay,
        open_tier(
            [relay.address], rows.view, namespace=NAMESPACE, token=ATTACKER_TOKEN, tenant="attacker"
        ) as tier,
    ):
        assert await tier.put(pairs(keys, rows.src)) == [True] * 4
        rows.clear_dst()
        assert await tier.get(pairs(keys, rows.dst)) == [True] * 4
        await tier.contains(keys)
        await tier.peer_stats(relay.address)
    sent = b"".join(relay.seen[S2C])
    assert b"nixlSerDes" not in sent and b"kvtier-peer-" not in sent
    assert {proto.Msg.WELCOME, proto.Msg.READY, proto.Msg.LANDED, proto.Msg.GOT} <= {
        frame_type(f) for f in relay.seen[S2C]
    }
    assert b"nixlSerDes" in b"".join(relay.seen[C2S])  # the client announces its own agent


@multiprocess
def test_a_client_cannot_make_the_peer_move_memory_it_did_not_register(spawn_peers):
    """Addresses outside the client's own registered memory: NIXL refuses the transfer at the
    peer, the peer answers TRANSFER_FAILED and closes that connection, and it lives on."""
    (peer,) = spawn_peers(token=VICTIM_TOKEN)
    agent = RawAgent()
    raw = RawConnection(peer.port, timeout=5.0)
    try:
        assert raw.handshake(VICTIM_TOKEN, agent=agent) is not None
        outside = agent.addr + len(agent.buffer) + (1 << 20)
        raw.request(proto.Msg.PUT, 3, proto.encode_transfer([b"k1"], [4096], [outside], 2000))
        frame = raw.read_frame()
        assert frame is not None and frame.type == proto.Msg.ERROR
        assert proto.decode_error(frame.payload)[0] == proto.ErrorCode.TRANSFER_FAILED
        assert raw.closed_by_peer()
    finally:
        raw.close()
        agent.close()
    control = RawAgent()
    raw = RawConnection(peer.port, timeout=5.0)
    try:  # the control: the same request inside the registered memory is served
        assert raw.handshake(VICTIM_TOKEN, agent=control) is not None
        raw.request(proto.Msg.PUT, 3, proto.encode_transfer([b"k1"], [4096], [control.addr], 2000))
        frame = raw.read_frame()
        assert frame is not None and frame.type == proto.Msg.LANDED
    finally:
        raw.close()
        control.close()


@multiprocess
def test_a_client_cannot_announce_another_engines_agent(spawn_peers):
    """The confused deputy: a token holder replays the metadata another engine sent (it is
    readable on the wire), so the peer would READ that engine's memory into the attacker's
    rows and WRITE into it. The probe refuses it: the other engine's memory cannot hold this
    session's value. The control: the victim's own connection with the same agent is served."""
    (peer,) = spawn_peers(tenants=TENANTS)
    victim = RawAgent()
    victim.buffer[:] = 7  # its host rows: what the attacker wants read
    try:
        raw = RawConnection(peer.port, timeout=5.0)
        try:
            welcome = raw.handshake(ATTACKER_TOKEN, tenant="attacker")
            assert welcome is not None and raw.session is not None
            raw.request(proto.Msg.AGENT, 0, proto.encode_agent(victim.probe_addr, victim.metadata))
            assert raw.closed_by_peer()  # no READY: refused
        finally:
            raw.close()
        raw = RawConnection(peer.port, timeout=5.0)
        try:
            assert raw.handshake(VICTIM_TOKEN, tenant="victim", agent=victim) is not None  # READY
        finally:
            raw.close()
    finally:
        victim.close()


# -- the channel: a relay without the token ----------------------------------------------


def _delete_frame(keys: list[bytes]) -> bytes:
    """A DELETE of the victim's keys as the peer names them (namespace + key), with a tag the
    relay cannot compute and a request id the client never uses (so its reply is dropped)."""
    payload = proto.encode_keys([NAMESPACE + k for k in keys])
    head = struct.pack("<IBI", 5 + len(payload) + proto.TAG_BYTES, proto.Msg.DELETE, 0x7777777)
    return head + payload + bytes(proto.TAG_BYTES)


async def _rows_still_there(address: str, keys: list[bytes], rows: HostRows) -> bool:
    """Read through a clean connection: are the rows stored and byte-exact?"""
    rows.clear_dst()
    async with open_tier([address], rows.view, namespace=NAMESPACE, token=VICTIM_TOKEN) as clean:
        hits = await clean.get(pairs(keys, rows.dst))
    return all(hits) and all(rows.same(i) for i in range(len(keys)))


@multiprocess
async def test_a_relay_that_only_forwards_changes_nothing(spawn_peers):
    """The control for the relay tests: their misses come from the tampering, not the relay."""
    (peer,) = spawn_peers(token=VICTIM_TOKEN)
    rows, keys = rows_and_keys(4, seed=12)
    async with (
        Relay(peer.port) as relay,
        open_tier([relay.address], rows.view, namespace=NAMESPACE, token=VICTIM_TOKEN) as tier,
    ):
        assert await tier.put(pairs(keys, rows.src)) == [True] * 4
        rows.clear_dst()
        assert await tier.get(pairs(keys, rows.dst)) == [True] * 4
        assert all(rows.same(i) for i in range(4)) and tier.stats()["peer_failures"] == 0
    assert {proto.Msg.WELCOME, proto.Msg.GOT} <= {frame_type(f) for f in relay.seen[S2C]}


@multiprocess
async def test_a_relay_cannot_inject_a_delete(spawn_peers):
    (peer,) = spawn_peers(token=VICTIM_TOKEN)
    rows, keys = rows_and_keys(4, seed=6)
    async with open_tier([peer.address], rows.view, namespace=NAMESPACE, token=VICTIM_TOKEN) as tier:
        assert await tier.put(pairs(keys, rows.src)) == [True] * 4

    def inject(direction: str, index: int, frame: bytes) -> list[bytes]:
        if direction == C2S and frame_type(frame) == proto.Msg.GET:
            return [_delete_frame(keys), frame]  # a DELETE slipped in before the client's GET
        return [frame]

    async with (
        Relay(peer.port, inject) as relay,
        open_tier([relay.address], rows.view, namespace=NAMESPACE, token=VICTIM_TOKEN) as tier,
    ):
        rows.clear_dst()
        assert await hits_of(tier, pairs(keys, rows.dst)) == [False] * 4  # the connection was closed
        assert tier.stats()["peer_failures"] == 1
    assert await _rows_still_there(peer.address, keys, rows)


@multiprocess
async def test_a_relay_cannot_replay_a_frame(spawn_peers):
    (peer,) = spawn_peers(token=VICTIM_TOKEN)
    rows, keys = rows_and_keys(4, seed=7)
    async with (
        Relay(peer.port) as relay,
        open_tier([relay.address], rows.view, namespace=NAMESPACE, token=VICTIM_TOKEN) as tier,
    ):
        assert await tier.put(pairs(keys, rows.src)) == [True] * 4
        await tier.delete(keys[:1])  # the relay records this DELETE ...
        assert await tier.put(pairs(keys[:1], rows.src[:1])) == [True]  # ... the row comes back
        (recorded,) = [f for f in relay.seen[C2S] if frame_type(f) == proto.Msg.DELETE]
        relay.inject_to_peer(recorded)  # ... and the relay replays the DELETE
        await asyncio.sleep(0.3)
        rows.clear_dst()
        assert await hits_of(tier, pairs(keys, rows.dst)) == [False] * 4  # the peer closed on it
    assert await _rows_still_there(peer.address, keys, rows)


WELCOME_AT = 4 + 5  # length, type, request id


def _rewrite(frame: bytes, what: str) -> bytes:
    """Rewrites that pass every check but the tag: the WELCOME's slot size (the client would
    offer rows the peer cannot hold), or one byte of the AGENT's metadata that NIXL accepts
    (the last byte of the region's meta info)."""
    out = bytearray(frame)
    if what == "slot size":
        (slot_bytes,) = struct.unpack_from("<Q", out, WELCOME_AT + proto.INSTANCE_ID_BYTES)
        struct.pack_into("<Q", out, WELCOME_AT + proto.INSTANCE_ID_BYTES, slot_bytes * 2)
    else:
        out[-proto.TAG_BYTES - 2] ^= 0x01
    return bytes(out)


@multiprocess
@pytest.mark.parametrize("what", ["slot size", "agent metadata"])
async def test_a_relay_cannot_rewrite_the_welcome_or_the_agent(spawn_peers, what):
    (peer,) = spawn_peers(token=VICTIM_TOKEN)
    rows, keys = rows_and_keys(4, seed=8)
    target = (S2C, proto.Msg.WELCOME) if what == "slot size" else (C2S, proto.Msg.AGENT)

    def rewrite(direction: str, index: int, frame: bytes) -> list[bytes]:
        if (direction, frame_type(frame)) == target:
            return [_rewrite(frame, what)]
        return [frame]

    async with (
        Relay(peer.port, rewrite) as relay,
        open_tier([relay.address], rows.view, namespace=NAMESPACE, token=VICTIM_TOKEN) as tier,
    ):
        assert tier.peers_up() == []
        assert await tier.put(pairs(keys, rows.src)) == [False] * 4
    assert target[1] in {frame_type(f) for f in relay.seen[target[0]]}
    async with open_tier([peer.address], rows.view, namespace=NAMESPACE, token=VICTIM_TOKEN) as clean:
        assert await clean.contains(keys) == [False] * 4  # nothing was written anywhere


@multiprocess
async def test_a_relay_cannot_rewrite_got_row_headers(spawn_peers):
    """The relay swaps the first two headers of a GOT reply: each row would verify against the
    other's header only if the checksums matched, and the tag fails first. The connection
    closes; the rows, written by the peer before it answered, are not served."""
    (peer,) = spawn_peers(token=VICTIM_TOKEN)
    rows, keys = rows_and_keys(4, seed=9)
    async with open_tier([peer.address], rows.view, namespace=NAMESPACE, token=VICTIM_TOKEN) as tier:
        assert await tier.put(pairs(keys, rows.src)) == [True] * 4

    def swap(direction: str, index: int, frame: bytes) -> list[bytes]:
        if direction == S2C and frame_type(frame) == proto.Msg.GOT:
            entries_at, size = 9 + 4, 1 + 40
            out = bytearray(frame)
            first = bytes(out[entries_at : entries_at + size])
            out[entries_at : entries_at + size] = out[entries_at + size : entries_at + 2 * size]
            out[entries_at + size : entries_at + 2 * size] = first
            return [bytes(out)]
        return [frame]

    async with (
        Relay(peer.port, swap) as relay,
        open_tier([relay.address], rows.view, namespace=NAMESPACE, token=VICTIM_TOKEN) as tier,
    ):
        rows.clear_dst()
        assert await hits_of(tier, pairs(keys, rows.dst)) == [False] * 4
        assert tier.stats()["peer_failures"] == 1 and tier.stats()["abandoned"] == 1
    assert proto.Msg.GOT in {frame_type(f) for f in relay.seen[S2C]}


# -- a hostile client's metadata ---------------------------------------------------------


def _mutations(real: bytes) -> list[bytes]:
    """Blobs whose framing is broken: lengths, counts, tags, names, truncation, extra bytes,
    and a registered region that does not hold the announced probe bytes.

    Flips *inside* the UCX worker address (an opaque blob) are not here: no shape check can
    judge them (``docs/threat-model.md`` says so).
    """
    rng = np.random.default_rng(16)
    name_at = real.index(b"Agent") + 5
    blob_at = real.index(b"UCX|c") + 5
    (blob_len,) = struct.unpack_from("<Q", real, blob_at)
    opaque = range(blob_at + 8, blob_at + 8 + blob_len)
    mutations = [
        os.urandom(466),
        real[: len(real) // 2],
        real + b"x",
        real[:name_at] + struct.pack("<Q", 1 << 40) + real[name_at + 8 :],
        real.replace(b"kvtier-remote-", b"kvtier-remotE-"),  # not a kvtier client's agent
        real[:blob_at] + struct.pack("<Q", blob_len + 1) + real[blob_at + 8 :],  # blob overruns
    ]
    desc_at = len(real) - 1 - 35  # the one registered region: address, length, device, meta info
    mutations += [
        real[: desc_at + 7] + bytes([real[desc_at + 7] ^ 0x10]) + real[desc_at + 8 :],  # moved
        real[: desc_at + 16] + b"\x01" + real[desc_at + 17 :],  # device 1
        real[: desc_at + 8] + struct.pack("<Q", 16) + real[desc_at + 16 :],  # too short for the probe
    ]
    framing = [i for i in range(len(real)) if i not in opaque and not desc_at <= i < len(real) - 1]
    for at in rng.choice(framing, 40, replace=False):
        out = bytearray(real)
        out[int(at)] ^= int(rng.integers(1, 256))
        mutations.append(bytes(out))
    return mutations


@multiprocess
def test_malformed_metadata_from_a_client_is_refused_before_nixl(spawn_peers):
    """Each blob crashed (or could crash) NIXL's parser in the process that loads it: the peer
    refuses each, closing that connection, and lives on to serve the control's agent. (A
    random flip may leave a well-formed blob, e.g. another valid agent name; such a blob
    still has to pass the probe, so it can only ever name this client's own memory.)"""
    (peer,) = spawn_peers(token=VICTIM_TOKEN)
    agent = RawAgent()
    try:
        refused = 0
        for metadata in _mutations(agent.metadata):
            raw = RawConnection(peer.port, timeout=5.0)
            try:
                assert raw.handshake(VICTIM_TOKEN) is not None and raw.session is not None
                agent.write_probe(raw.session.probe_value)
                raw.request(proto.Msg.AGENT, 0, proto.encode_agent(agent.probe_addr, metadata))
                refused += raw.closed_by_peer()
            finally:
                raw.close()
        assert refused >= 45 and peer.proc.poll() is None
        raw = RawConnection(peer.port, timeout=5.0)
        try:  # the control: the real metadata is loaded (READY)
            assert raw.handshake(VICTIM_TOKEN, agent=agent) is not None
        finally:
            raw.close()
    finally:
        agent.close()


# -- availability ------------------------------------------------------------------------


@multiprocess
async def test_idle_unauthenticated_sockets_do_not_lock_out_a_real_client(spawn_peers):
    """300 idle sockets (more than --max-connections' 256) from the client's own address and
    another; the handshake deadline is long, so only the caps protect the client here."""
    (peer,) = spawn_peers(token=VICTIM_TOKEN, extra=["--handshake-timeout", "60"])
    idle = []
    try:
        for i in range(300):
            idle.append(RawConnection(peer.port, source="127.0.0.2" if i % 2 else "127.0.0.1"))
        rows, keys = rows_and_keys(4, seed=11)
        async with open_tier([peer.address], rows.view, token=VICTIM_TOKEN) as tier:
            assert tier.peers_up() == [peer.address]
            assert await tier.put(pairs(keys, rows.src)) == [True] * 4
            rows.clear_dst()
            assert await tier.get(pairs(keys, rows.dst)) == [True] * 4
        # per source only the newest 16 stay: the oldest were pushed out, long before 60 s
        assert idle[0].closed_by_peer() and idle[1].closed_by_peer()
    finally:
        for conn in idle:
            conn.close()


@multiprocess
def test_a_connection_that_does_not_authenticate_is_closed_at_the_handshake_deadline(spawn_peers):
    (peer,) = spawn_peers(token=VICTIM_TOKEN, extra=["--handshake-timeout", "1"])
    idle = RawConnection(peer.port, timeout=10.0)
    try:
        started = time.monotonic()
        assert idle.closed_by_peer()  # it reads the CHALLENGE, then EOF
        assert 0.8 < time.monotonic() - started < 3.0
    finally:
        idle.close()
