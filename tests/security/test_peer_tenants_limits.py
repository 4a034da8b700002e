"""Issue 36, items 4 and 5: a tenant holding a valid token cannot lock other tenants out of
``kvtier peer`` nor make one request cost the peer far more than the rows it names.

Each test tries the attack against a real peer on 127.0.0.1, with small timeouts given by
flags where the defence is a timeout, and asserts what the attacker wanted did not happen:
another tenant refused, a connection held by an idle or trickling client, a copy per
repeated key, another tenant's get pushed past its deadline.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from tests.tiers.peer_fixtures import HostRows, RawAgent, RawConnection, key, open_tier
from tiers.base import RowsAbandoned
from tiers.remote import protocol as proto
from tiers.remote.server import parse_args

KIB, MIB = 1024, 1 << 20
VICTIM_TOKEN = b"victim-token-" + os.urandom(8).hex().encode()
ATTACKER_TOKEN = b"attacker-token-" + os.urandom(8).hex().encode()
TENANTS = {"victim": VICTIM_TOKEN, "attacker": ATTACKER_TOKEN}
NAMESPACE = b"ns-limits".ljust(16, b"\x00")  # as open_tier pads it: the wire keys' prefix

multiprocess = pytest.mark.multiprocess


def pairs(keys: list[bytes], views: list[memoryview]) -> list[tuple[bytes, memoryview]]:
    return list(zip(keys, views, strict=True))


def stats_of(raw: RawConnection, rid: int = 99) -> dict[str, int]:
    raw.request(proto.Msg.STATS, rid)
    frame = raw.read_frame()
    assert frame is not None and frame.type == proto.Msg.STATS_REPLY, frame
    return proto.decode_stats(frame.payload)


def error_of(frame: proto.Frame | None) -> tuple[int, str]:
    assert frame is not None and frame.type == proto.Msg.ERROR, frame
    return proto.decode_error(frame.payload)


# -- connections: a cap per tenant, idle and frame deadlines -------------------------------


def test_the_connection_cap_per_tenant_is_an_equal_share_and_its_flags_are_checked(tmp_path, capsys):
    tokens = tmp_path / "tokens"
    tokens.write_bytes(b"".join(t.encode() + b": " + tok + b"\n" for t, tok in TENANTS.items()))
    base = ["--listen", "127.0.0.1:0", "--capacity", "1MiB", "--row-bytes", "64KiB"]
    assert parse_args([*base, "--token-file", str(tokens)]).tenant_cap() == 128  # 256 / 2
    capped = parse_args([*base, "--token-file", str(tokens), "--max-connections-per-tenant", "3"])
    assert capped.tenant_cap() == 3
    assert parse_args(base).tenant_cap() is None  # no tokens: claimed tenants prove nothing
    for extra, flag in [
        (["--max-connections-per-tenant", "0"], "--max-connections-per-tenant"),
        (["--max-connections", "4", "--max-connections-per-tenant", "5"], "--max-connections-per-tenant"),
        (["--idle-timeout", "0"], "--idle-timeout"),
        (["--idle-timeout", "inf"], "--idle-timeout"),
        (["--frame-timeout", "-1"], "--frame-timeout"),
        (["--max-request-bytes", "32KiB"], "--max-request-bytes"),  # less than a row
        (["--max-request-bytes", "1MiB", "--tenant-bytes", "512KiB"], "--tenant-bytes"),
        (["--tenant-transfers", "0"], "--tenant-transfers"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            parse_args([*base, *extra])
        assert exit_info.value.code == 2
        assert flag in capsys.readouterr().err


@multiprocess
async def test_one_tenant_at_its_connection_cap_cannot_lock_another_out(spawn_peers):
    """--max-connections 4, two tenants: 2 each. The attacker opens as many as it can and
    holds them; the victim still connects, stores and reads."""
    (peer,) = spawn_peers(tenants=TENANTS, extra=["--max-connections", "4", "--handshake-timeout", "30"])
    held: list[RawConnection] = []
    try:
        refused = 0
        for _ in range(4):
            raw = RawConnection(peer.port, timeout=5.0)
            held.append(raw)
            refused += raw.handshake(ATTACKER_TOKEN, tenant="attacker") is None
        assert refused == 2  # its share is 2: the rest are refused, not queued
        rows = HostRows([64 * KIB] * 2, seed=1)
        keys = [key(i) for i in range(2)]
        async with open_tier(
            [peer.address], rows.view, namespace=NAMESPACE, token=VICTIM_TOKEN, tenant="victim"
        ) as victim:
            assert victim.peers_up() == [peer.address]
            assert await victim.put(pairs(keys, rows.src)) == [True, True]
            assert await victim.get(pairs(keys, rows.dst)) == [True, True]
    finally:
        for raw in held:
            raw.close()


@multiprocess
def test_an_idle_authenticated_connection_is_told_and_closed(spawn_peers):
    (peer,) = spawn_peers(token=VICTIM_TOKEN, extra=["--idle-timeout", "0.5"])
    agent = RawAgent()
    raw = RawConnection(peer.port, timeout=5.0)
    try:
        assert raw.handshake(VICTIM_TOKEN, agent=agent) is not None
        assert stats_of(raw)["rows"] == 0  # a request: the idle clock starts again
        started = time.monotonic()
        code, text = error_of(raw.read_frame())  # nothing sent: the notice, then EOF
        assert code == proto.ErrorCode.IDLE and "--idle-timeout" in text
        assert raw.read_frame() is None
        assert time.monotonic() - started < 4.0
    finally:
        raw.close()
        agent.close()


@multiprocess
def test_a_trickled_frame_is_closed_at_the_frame_deadline(spawn_peers):
    """The first bytes of a STATS frame, then nothing: closed after --frame-timeout, though
    the idle timeout (5 s) has not passed."""
    (peer,) = spawn_peers(token=VICTIM_TOKEN, extra=["--frame-timeout", "0.5", "--idle-timeout", "5"])
    agent = RawAgent()
    raw = RawConnection(peer.port, timeout=5.0)
    try:
        assert raw.handshake(VICTIM_TOKEN, agent=agent) is not None
        assert raw.session is not None
        frame = raw.session.seal(proto.Msg.STATS, 1)
        for byte in frame[:6]:  # a byte at a time: the frame never completes
            raw.send(bytes([byte]))
            time.sleep(0.05)
        started = time.monotonic()
        raw.sock.settimeout(3.0)
        try:
            closed = raw.read_frame() is None  # EOF, well before the idle timeout
        except ConnectionResetError:
            closed = True
        except TimeoutError:  # still open
            closed = False
        assert closed and time.monotonic() - started < 3.0
    finally:
        raw.close()
        agent.close()


@multiprocess
async def test_an_engine_idle_past_the_idle_timeout_loses_nothing(spawn_peers):
    """The peer closes the tier's idle connection; the next call reopens it: every row is
    still a hit, and the peer was never counted as failed."""
    (peer,) = spawn_peers(token=VICTIM_TOKEN, extra=["--idle-timeout", "0.3"])
    rows = HostRows([64 * KIB] * 4, seed=2)
    keys = [key(i) for i in range(4)]
    async with open_tier([peer.address], rows.view, token=VICTIM_TOKEN) as tier:
        assert await tier.put(pairs(keys[:2], rows.src[:2])) == [True, True]
        await asyncio.sleep(1.0)  # closed as idle meanwhile
        assert tier.peers_up() == [peer.address]
        assert await tier.get(pairs(keys[:2], rows.dst[:2])) == [True, True]
        await asyncio.sleep(1.0)
        assert await tier.put(pairs(keys[2:], rows.src[2:])) == [True, True]
        await asyncio.sleep(1.0)
        assert await tier.contains(keys) == [True] * 4
        assert all(rows.same(i) for i in range(2))
        stats = tier.stats()
        assert stats.peer_failures == 0 and stats.hits == 2 and stats.misses == 0
        assert (await tier.peer_stats(peer.address))["rows"] == 4


# -- the work of one request ---------------------------------------------------------------


@multiprocess
async def test_a_get_naming_one_key_thousands_of_times_is_refused(spawn_peers):
    """One stored row, a GET naming it 4,096 times: refused (BAD_REQUEST) without a copy;
    the connection stays usable and the same row named once is served."""
    (peer,) = spawn_peers(token=VICTIM_TOKEN, capacity="4MiB", row_bytes="64KiB")
    rows = HostRows([64 * KIB], seed=3)
    async with open_tier([peer.address], rows.view, namespace=NAMESPACE, token=VICTIM_TOKEN) as tier:
        assert await tier.put([(key(0), rows.src[0])]) == [True]
    wire = NAMESPACE + key(0)
    agent = RawAgent()
    raw = RawConnection(peer.port, timeout=10.0)
    try:
        assert raw.handshake(VICTIM_TOKEN, agent=agent) is not None
        hits = stats_of(raw)["rows_hit"]
        n = proto.MAX_KEYS
        raw.request(
            proto.Msg.GET, 1, proto.encode_transfer([wire] * n, [64 * KIB] * n, [agent.addr] * n, 9000)
        )
        code, text = error_of(raw.read_frame())
        assert code == proto.ErrorCode.BAD_REQUEST and "repeated" in text
        assert stats_of(raw)["rows_hit"] == hits  # no row was looked up, none copied
        for msg in (proto.Msg.CONTAINS, proto.Msg.DELETE):
            raw.request(msg, 2, proto.encode_keys([wire] * n))
            assert error_of(raw.read_frame())[0] == proto.ErrorCode.BAD_REQUEST
        raw.request(proto.Msg.GET, 3, proto.encode_transfer([wire], [64 * KIB], [agent.addr], 9000))
        frame = raw.read_frame()
        assert frame is not None and frame.type == proto.Msg.GOT
        assert proto.decode_got(frame.payload)[0] is not None
        assert stats_of(raw)["rows_hit"] == hits + 1
    finally:
        raw.close()
        agent.close()


@multiprocess
def test_a_request_over_the_byte_bound_is_refused_with_a_clear_error(spawn_peers):
    """4,096 distinct rows of 128 KiB named in one GET or PUT: 512 MiB, over the default
    --max-request-bytes (256 MiB). Refused (LIMIT, naming the flag), the connection kept."""
    (peer,) = spawn_peers(token=VICTIM_TOKEN, capacity="4MiB", row_bytes="128KiB")
    agent = RawAgent()
    raw = RawConnection(peer.port, timeout=10.0)
    try:
        assert raw.handshake(VICTIM_TOKEN, agent=agent) is not None
        n = proto.MAX_KEYS
        wires = [key(i) for i in range(n)]
        for rid, msg in enumerate((proto.Msg.GET, proto.Msg.PUT), start=1):
            raw.request(msg, rid, proto.encode_transfer(wires, [128 * KIB] * n, [agent.addr] * n, 9000))
            code, text = error_of(raw.read_frame())
            assert code == proto.ErrorCode.LIMIT and "--max-request-bytes" in text
        stats = stats_of(raw)
        assert stats["rows_missed"] == 0 and stats["rows_refused"] == 0  # nothing looked at
        half = n // 2  # 256 MiB: within the bound
        raw.request(
            proto.Msg.GET,
            5,
            proto.encode_transfer(wires[:half], [128 * KIB] * half, [agent.addr] * half, 9000),
        )
        frame = raw.read_frame()
        assert frame is not None and frame.type == proto.Msg.GOT
    finally:
        raw.close()
        agent.close()


@multiprocess
async def test_a_client_cuts_its_requests_to_the_bound_its_peer_announces(spawn_peers):
    """A peer started with ``--max-request-bytes`` under the client's ``transfer_bytes``
    (64 MiB): the client learns the bound at the handshake and sends requests within it, so
    every row is stored and served. Before the peer announced it, each request named all 24
    rows (3 MiB) and was refused: every put and get a miss, for as long as the engine ran."""
    (peer,) = spawn_peers(
        capacity="8MiB", row_bytes="128KiB", extra=["--max-request-bytes", "512KiB", "--tenant-bytes", "1MiB"]
    )
    n = 24
    rows = HostRows([128 * KIB] * n, seed=31)
    keys = [key(i, salt=b"bound") for i in range(n)]
    async with open_tier([peer.address], rows.view) as tier:
        assert tier.transfer_bytes > n * 128 * KIB
        assert await tier.put(list(zip(keys, rows.src, strict=True))) == [True] * n
        rows.clear_dst()
        assert await tier.get(list(zip(keys, rows.dst, strict=True))) == [True] * n
        assert all(rows.same(i) for i in range(n))


@multiprocess
async def test_a_flood_of_gets_does_not_push_another_tenants_get_past_its_deadline(spawn_peers):
    """The attacker stores 48 rows of 2 MiB and floods GETs naming all of them (96 MiB each)
    from 6 connections, 16 each (9 GiB of copies, about 3 s here). The victim's get of 2 rows,
    started meanwhile with a 1 s deadline, is served in time: the attacker's share of the
    data plane (--tenant-bytes 96MiB) is one request in flight. (Without the shares the
    victim's get waited behind the whole flood and was abandoned at its deadline.)"""
    (peer,) = spawn_peers(
        tenants=TENANTS,
        capacity="256MiB",
        row_bytes="2MiB",
        extra=["--max-request-bytes", "96MiB", "--tenant-bytes", "96MiB"],
    )
    n = 48
    stored = HostRows([2 * MIB] * n, seed=4)
    keys = [key(i, salt=b"a") for i in range(n)]
    async with open_tier(
        [peer.address], stored.view, namespace=NAMESPACE, token=ATTACKER_TOKEN, tenant="attacker"
    ) as attacker:
        assert await attacker.put(pairs(keys, stored.src)) == [True] * n
    del stored
    victim_rows = HostRows([2 * MIB] * 2, seed=5)
    victim_keys = [key(i, salt=b"v") for i in range(2)]
    wires = [NAMESPACE + k for k in keys]
    agents = [RawAgent(n * 2 * MIB + MIB) for _ in range(6)]
    floods = [RawConnection(peer.port, timeout=10.0) for _ in agents]
    sending: list[threading.Thread] = []
    try:
        for raw, agent in zip(floods, agents, strict=True):
            assert raw.handshake(ATTACKER_TOKEN, tenant="attacker", agent=agent) is not None
        async with open_tier(
            [peer.address],
            victim_rows.view,
            namespace=NAMESPACE,
            token=VICTIM_TOKEN,
            tenant="victim",
            deadline_s=1.0,
        ) as victim:
            assert await victim.put(pairs(victim_keys, victim_rows.src)) == [True, True]

            def flood(raw: RawConnection, agent: RawAgent) -> None:
                addrs = [agent.addr + i * 2 * MIB for i in range(n)]
                request = proto.encode_transfer(wires, [2 * MIB] * n, addrs, 5000)
                for rid in range(1, 17):
                    raw.request(proto.Msg.GET, rid, request)

            sending = [threading.Thread(target=flood, args=pair) for pair in zip(floods, agents, strict=True)]
            for thread in sending:
                thread.start()
            await asyncio.sleep(0.3)  # the flood is queued at the peer
            victim_rows.clear_dst()
            try:
                got = await victim.get(pairs(victim_keys, victim_rows.dst))
            except RowsAbandoned as exc:  # no answer in time: what the attacker wanted
                got = exc.ok
            assert got == [True, True]
            assert victim_rows.same(0) and victim_rows.same(1)
            assert victim.stats().peer_failures == 0
    finally:
        for thread in sending:
            thread.join(10)
        peer.close()  # before the agents' memory goes: the peer may still be writing into it
        for raw in floods:
            raw.close()
        for agent in agents:
            agent.close()
