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
from tests.tiers.peer_fixtures import HostRows, RawConnection, key, open_tier
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
def test_a_tenant_is_shown_only_its_own_run_of_the_pool(spawn_peers):
    """Each tenant's WELCOME announces, and its NIXL metadata registers, only that tenant's
    run of slots: an unmodified NIXL agent holding the attacker's metadata refuses to READ
    the victim's run (and an RDMA NIC would refuse a forged request; UCX TCP/CMA would not)."""
    from nixl_cu12._bindings import nixlNotFoundError

    from tiers.remote.nixl_agent import create_agent
    from tiers.remote.nixl_metadata import parse_agent_metadata

    (peer,) = spawn_peers(tenants=TENANTS)
    welcomes = {}
    for tenant, token in TENANTS.items():
        raw = RawConnection(peer.port)
        try:
            welcomes[tenant] = raw.handshake(token, tenant=tenant)
        finally:
            raw.close()
    victim, attacker = welcomes["victim"], welcomes["attacker"]
    assert victim is not None and attacker is not None
    for welcome in (victim, attacker):
        ((addr, length, _),) = parse_agent_metadata(welcome.agent_metadata).regions
        assert addr == welcome.pool_addr and addr + length >= welcome.probe_addr + welcome.probe_len
        assert length < welcome.num_slots * welcome.slot_bytes + 4096  # this run and its probe only
    victim_run = range(victim.pool_addr, victim.probe_addr + victim.probe_len)
    assert attacker.pool_addr not in victim_run and victim.pool_addr not in range(
        attacker.pool_addr, attacker.probe_addr + attacker.probe_len
    )
    agent = create_agent(f"attacker-{os.urandom(4).hex()}")
    scratch = np.zeros(ROW, dtype=np.uint8)
    agent.register_memory([(scratch.ctypes.data, ROW, 0, "")], "DRAM")
    name = agent.add_remote_agent(attacker.agent_metadata)
    local = agent.get_xfer_descs([(scratch.ctypes.data, ROW, 0)], "DRAM")
    own = agent.get_xfer_descs([(attacker.pool_addr, ROW, 0)], "DRAM")
    agent.release_xfer_handle(agent.initialize_xfer("READ", local, own, name))  # the control
    for addr in (victim.pool_addr, victim.probe_addr):
        foreign = agent.get_xfer_descs([(addr, 16, 0)], "DRAM")
        with pytest.raises(nixlNotFoundError):
            agent.initialize_xfer(
                "READ", agent.get_xfer_descs([(scratch.ctypes.data, 16, 0)], "DRAM"), foreign, name
            )


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
    assert {proto.Msg.WELCOME, proto.Msg.LEASED} <= {frame_type(f) for f in relay.seen[S2C]}


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
        assert await tier.get(pairs(keys, rows.dst)) == [False] * 4  # the connection was closed
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
        assert await tier.get(pairs(keys, rows.dst)) == [False] * 4  # the peer closed on it
    assert await _rows_still_there(peer.address, keys, rows)


WELCOME_AT = 4 + 5  # length, type, request id
SLOTS_AT = WELCOME_AT + proto.INSTANCE_ID_BYTES + 8


def _rewrite_welcome(frame: bytes, what: str) -> bytes:
    """Rewrites that pass every check but the tag: the pool one slot earlier (the client
    would WRITE each row one slot off, over another row, and READ the wrong ones), or one
    byte of the NIXL metadata that NIXL accepts."""
    out = bytearray(frame)
    if what == "pool address":
        slot_bytes, num_slots, pool_addr = struct.unpack_from(
            "<QIQ", out, WELCOME_AT + proto.INSTANCE_ID_BYTES
        )
        struct.pack_into("<IQ", out, SLOTS_AT, num_slots + 1, pool_addr - slot_bytes)
    else:
        out[-proto.TAG_BYTES - 2] ^= 0x01  # the last byte of the region's meta info
    return bytes(out)


@multiprocess
@pytest.mark.parametrize("what", ["pool address", "metadata"])
async def test_a_relay_cannot_rewrite_the_welcome(spawn_peers, what):
    (peer,) = spawn_peers(token=VICTIM_TOKEN)
    rows, keys = rows_and_keys(4, seed=8)

    def rewrite(direction: str, index: int, frame: bytes) -> list[bytes]:
        if direction == S2C and frame_type(frame) == proto.Msg.WELCOME:
            return [_rewrite_welcome(frame, what)]
        return [frame]

    async with (
        Relay(peer.port, rewrite) as relay,
        open_tier([relay.address], rows.view, namespace=NAMESPACE, token=VICTIM_TOKEN) as tier,
    ):
        assert tier.peers_up() == []
        assert await tier.put(pairs(keys, rows.src)) == [False] * 4
    async with open_tier([peer.address], rows.view, namespace=NAMESPACE, token=VICTIM_TOKEN) as clean:
        assert await clean.contains(keys) == [False] * 4  # nothing was written anywhere


@multiprocess
async def test_a_relay_cannot_rewrite_leased_row_headers(spawn_peers):
    """The relay swaps two entries of a LEASED reply (slot and header): under the old
    protocol each row verified against the swapped header and was served as the other key."""
    (peer,) = spawn_peers(token=VICTIM_TOKEN)
    rows, keys = rows_and_keys(4, seed=9)
    async with open_tier([peer.address], rows.view, namespace=NAMESPACE, token=VICTIM_TOKEN) as tier:
        assert await tier.put(pairs(keys, rows.src)) == [True] * 4

    def swap(direction: str, index: int, frame: bytes) -> list[bytes]:
        if direction == S2C and frame_type(frame) == proto.Msg.LEASED:
            entries_at, size = 9 + 8 + 4, 4 + 40
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
        assert await tier.get(pairs(keys, rows.dst)) == [False] * 4
        assert not rows.buffer[4 * ROW :].any()  # not one byte of a misplaced row served
        assert tier.stats()["peer_failures"] == 1


# -- a hostile peer's metadata -----------------------------------------------------------


async def _hostile_peer(token: bytes, metadata: bytes, welcome: proto.Welcome) -> asyncio.AbstractServer:
    """A peer that knows the token and sends ``metadata`` in a WELCOME that verifies."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        challenge = proto.encode_challenge(os.urandom(proto.NONCE_BYTES))
        writer.write(proto.encode_frame(proto.Msg.CHALLENGE, 0, challenge))
        frame = await proto.read_frame(reader, proto.MAX_HANDSHAKE_FRAME)
        session = proto.Session(token, challenge + frame.payload[: -proto.MAC_BYTES], is_client=False)
        forged = proto.Welcome(**{**welcome.__dict__, "agent_metadata": metadata})
        writer.write(session.seal(proto.Msg.WELCOME, 0, proto.encode_welcome(forged)))
        await reader.read()  # hold the connection until the client leaves
        writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


def _mutations(real: bytes) -> list[bytes]:
    """Blobs whose framing is broken: lengths, counts, tags, names, truncation, extra bytes,
    and a registered region that is not where the WELCOME says the pool is.

    Flips *inside* the UCX worker address (an opaque blob) are not here: no shape check can
    judge them, and one of them made NIXL crash this process in a trial (SIGSEGV). Only a
    peer that holds the token can send metadata at all (the WELCOME's tag), so that case is
    a hostile peer, not the network: ``docs/threat-model.md`` says so.
    """
    rng = np.random.default_rng(16)
    name_at = real.index(b"Agent") + 5
    blob_at = real.index(b"UCX|c") + 5
    (blob_len,) = struct.unpack_from("<Q", real, blob_at)
    opaque = range(blob_at + 8, blob_at + 8 + blob_len)
    mutations = [
        b"",
        os.urandom(466),
        real[: len(real) // 2],
        real + b"x",
        real[:name_at] + struct.pack("<Q", 1 << 40) + real[name_at + 8 :],
        real.replace(b"kvtier-peer-", b"kvtier-peeR-"),  # another agent's name
        real[:blob_at] + struct.pack("<Q", blob_len + 1) + real[blob_at + 8 :],  # blob overruns
    ]
    desc_at = len(real) - 1 - 35  # the one registered region: address, length, device, meta info
    mutations += [
        real[: desc_at + 7] + bytes([real[desc_at + 7] ^ 0x10]) + real[desc_at + 8 :],  # moved
        real[: desc_at + 16] + b"\x01" + real[desc_at + 17 :],  # device 1
        real[: desc_at + 8] + struct.pack("<Q", 1 << 45) + real[desc_at + 16 :],  # huge length
    ]
    framing = [i for i in range(len(real)) if i not in opaque and not desc_at <= i < len(real) - 1]
    for at in rng.choice(framing, 40, replace=False):
        out = bytearray(real)
        out[int(at)] ^= int(rng.integers(1, 256))
        mutations.append(bytes(out))
    return mutations


@multiprocess
async def test_malformed_metadata_from_a_peer_is_refused_before_nixl(spawn_peers):
    """Each blob crashed (or could crash) NIXL's parser; each is refused, the process lives."""
    (peer,) = spawn_peers(token=VICTIM_TOKEN)
    raw = RawConnection(peer.port)
    try:
        welcome = raw.handshake(VICTIM_TOKEN)
    finally:
        raw.close()
    assert welcome is not None
    rows, keys = rows_and_keys(2, seed=10)
    refused = 0
    for metadata in _mutations(welcome.agent_metadata):
        server = await _hostile_peer(VICTIM_TOKEN, metadata, welcome)
        port = server.sockets[0].getsockname()[1]
        try:
            async with open_tier([f"127.0.0.1:{port}"], rows.view, token=VICTIM_TOKEN) as tier:
                assert tier.peers_up() == [], metadata
                assert await tier.get(pairs(keys, rows.dst)) == [False, False]
                refused += 1
        finally:
            server.close()
    assert refused == 50
    server = await _hostile_peer(VICTIM_TOKEN, welcome.agent_metadata, welcome)  # control: accepted
    port = server.sockets[0].getsockname()[1]
    try:
        async with open_tier([f"127.0.0.1:{port}"], rows.view, token=VICTIM_TOKEN) as tier:
            assert tier.peers_up() == [f"127.0.0.1:{port}"]
    finally:
        server.close()


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
