"""RemoteTier against real ``kvtier peer`` processes on 127.0.0.1.

Three peers with a token are shared by the tests that leave them intact (each test in a
namespace of its own); tests that kill, stop or restart a peer start their own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.tiers.peer_fixtures import HostRows, RawAgent, RawConnection, key, open_tier, start_peers
from tiers.base import RowsAbandoned
from tiers.remote import data_plane as remote_module
from tiers.remote import protocol as proto
from tiers.remote import rendezvous_owner
from tiers.remote.server import parse_args
from tiers.row_format import RowHeader

TOKEN = b"kvtier-test-token-" + os.urandom(8).hex().encode()
KIB = 1024
SLACK_S = 1.5  # how far past its deadline a call may finish and still count as "no hang"

multiprocess = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    peers = start_peers(
        tmp_path_factory.mktemp("peers"), 3, capacity="32MiB", token=TOKEN, extra=["--alloc-ttl", "0.5"]
    )
    yield peers
    for peer in peers:
        peer.close()


async def eventually(condition: Callable[[], object], timeout: float = 10.0, poke=None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        if poke is not None:
            await poke()
        await asyncio.sleep(0.05)


def two_group_rows(n: int, seed: int) -> tuple[HostRows, list[bytes]]:
    """Rows of two KV groups with different row sizes (64 KiB and 16 KiB), keys to match."""
    rows = HostRows([64 * KIB if i % 2 == 0 else 16 * KIB for i in range(n)], seed=seed)
    keys = [key(i // 2, group=i % 2, salt=b"s%d-" % seed) for i in range(n)]
    return rows, keys


@multiprocess
async def test_a_call_of_several_requests_per_peer_round_trips(shared):
    """More keys than one control request carries: a peer's requests overlap (two in flight)
    and every row still lands where it belongs, with no allocation or lease left behind."""
    addresses = [p.address for p in shared[:2]]
    rows, keys = two_group_rows(40, seed=7)
    async with open_tier(
        addresses, rows.view, namespace=b"several", token=TOKEN, keys_per_request=3, transfer_bytes=32 * KIB
    ) as tier:
        assert await tier.put(list(zip(keys, rows.src, strict=True))) == [True] * 40
        rows.clear_dst()
        assert await tier.get(list(zip(keys, rows.dst, strict=True))) == [True] * 40
        assert all(rows.same(i) for i in range(40))
        for address in addresses:
            stats = await tier.peer_stats(address)
            assert stats["leases"] == 0 and stats["pending_slots"] == 0


@multiprocess
async def test_rows_round_trip_after_the_peer_went_idle(shared):
    """A peer whose agent has nothing in flight sleeps (it initiates every transfer, so no
    client needs it to progress); requests after quiet spells still complete, byte-exact."""
    rows, keys = two_group_rows(8, seed=11)
    async with open_tier([shared[0].address], rows.view, namespace=b"idle", token=TOKEN) as tier:
        assert await tier.put(list(zip(keys, rows.src, strict=True))) == [True] * 8
        await asyncio.sleep(3.0)
        rows.clear_dst()
        assert await tier.get(list(zip(keys, rows.dst, strict=True))) == [True] * 8
        assert all(rows.same(i) for i in range(8))
        await asyncio.sleep(3.0)
        assert (
            await tier.put(list(zip([key(100 + i) for i in range(8)], rows.src, strict=True))) == [True] * 8
        )


@multiprocess
@pytest.mark.parametrize("n_peers", [2, 3])
async def test_rows_round_trip_byte_exact(shared, n_peers):
    addresses = [p.address for p in shared[:n_peers]]
    rows, keys = two_group_rows(48, seed=n_peers)
    async with open_tier(addresses, rows.view, namespace=b"roundtrip%d" % n_peers, token=TOKEN) as tier:
        assert sorted(tier.peers_up()) == sorted(addresses)
        before = {a: await tier.peer_stats(a) for a in addresses}
        assert await tier.put(list(zip(keys, rows.src, strict=True))) == [True] * 48
        assert all(tier.may_contain(k) for k in keys)
        assert await tier.contains([*keys, key(10**6)]) == [True] * 48 + [False]

        rows.clear_dst()
        assert await tier.get(list(zip(keys, rows.dst, strict=True))) == [True] * 48
        assert all(rows.same(i) for i in range(48))

        owners = Counter(rendezvous_owner(tier.namespace + k, addresses) for k in keys)
        assert len(owners) == n_peers  # every peer holds a share
        for address in addresses:
            after = await tier.peer_stats(address)
            assert after["rows_put"] - before[address]["rows_put"] == owners[address]
            assert after["leases"] == 0  # every read's lease was released

        assert await tier.put(list(zip(keys, rows.src, strict=True))) == [True] * 48  # stored already
        await tier.delete(keys[:10])
        assert await tier.contains(keys[:12]) == [False] * 10 + [True] * 2
        assert not tier.may_contain(keys[0])
        rows.clear_dst()
        assert await tier.get(list(zip(keys[:12], rows.dst[:12], strict=True))) == [False] * 10 + [True] * 2
        assert tier.stats()["corrupt"] == 0


@multiprocess
@pytest.mark.parametrize("checksum_thread", [True, False], ids=["hash-beside", "hash-inline"])
async def test_a_row_that_fails_its_checksum_is_a_miss(shared, monkeypatch, checksum_thread):
    """Rows whose headers promise another checksum than their bytes (written so by a faulty
    put) fail the peer's check as they are served: misses, dropped from the pool and counted
    there; the other rows of their parts are hits."""
    rows, keys = two_group_rows(24, seed=11)
    bad = {3, 10, 17}
    bad_addrs = {np.frombuffer(rows.src[i], dtype=np.uint8).ctypes.data for i in bad}
    honest = remote_module.checksum_at

    def faulty(view, addr):
        return honest(view, addr) ^ (1 if addr in bad_addrs else 0)

    async with open_tier(
        [shared[0].address],
        rows.view,
        namespace=b"corrupt%d" % checksum_thread,
        token=TOKEN,
        transfer_bytes=96 * KIB,
        checksum_thread=checksum_thread,
    ) as tier:
        monkeypatch.setattr(remote_module, "checksum_at", faulty)
        assert await tier.put(list(zip(keys, rows.src, strict=True))) == [True] * 24
        monkeypatch.setattr(remote_module, "checksum_at", honest)
        rows.clear_dst()
        before = (await tier.peer_stats(shared[0].address))["rows_corrupt"]
        loaded = await tier.get(list(zip(keys, rows.dst, strict=True)))
        assert loaded == [i not in bad for i in range(24)]
        assert all(rows.same(i) for i in range(24) if i not in bad)
        assert tier.stats()["hits"] == 24 - len(bad)
        assert (await tier.peer_stats(shared[0].address))["rows_corrupt"] - before == len(bad)
        assert await tier.contains(keys) == [i not in bad for i in range(24)]  # dropped at the peer
        assert tier.stats()["transfers"] > 2  # several requests per call


@multiprocess
async def test_tenants_never_see_each_other(shared):
    addresses = [p.address for p in shared]
    rows, keys = two_group_rows(8, seed=11)
    async with (
        open_tier(addresses, rows.view, namespace=b"tenant-a", token=TOKEN) as a,
        open_tier(addresses, rows.view, namespace=b"tenant-b", token=TOKEN) as b,
    ):
        assert await a.put(list(zip(keys, rows.src, strict=True))) == [True] * 8
        assert await b.contains(keys) == [False] * 8
        rows.clear_dst()
        assert await b.get(list(zip(keys, rows.dst, strict=True))) == [False] * 8
        assert not rows.buffer[sum(rows.sizes) :].any()  # nothing was copied in
        assert await a.get(list(zip(keys, rows.dst, strict=True))) == [True] * 8


@multiprocess
async def test_a_wrong_or_missing_token_reads_nothing(shared):
    peer = shared[0]
    rows, keys = two_group_rows(4, seed=12)
    async with open_tier([peer.address], rows.view, namespace=b"token", token=TOKEN) as good:
        assert await good.put(list(zip(keys, rows.src, strict=True))) == [True] * 4
        failures = (await good.peer_stats(peer.address))["auth_failures"]
        for token in (b"not-the-token", None):
            async with open_tier([peer.address], rows.view, namespace=b"token", token=token) as bad:
                assert bad.peers_up() == []
                rows.clear_dst()
                assert await bad.get(list(zip(keys, rows.dst, strict=True))) == [False] * 4
                assert await bad.put(list(zip(keys, rows.src, strict=True))) == [False] * 4
                assert not rows.buffer[sum(rows.sizes) :].any()
        raw = RawConnection(peer.port)
        try:
            assert raw.handshake(b"not-the-token") is None  # closed before WELCOME: no metadata, no address
        finally:
            raw.close()
        stats = await good.peer_stats(peer.address)
        assert stats["auth_failures"] == failures + 3
        rows.clear_dst()
        assert await good.get(list(zip(keys, rows.dst, strict=True))) == [True] * 4  # still serving


def _authenticated(port: int, retry_s: float = 15.0) -> RawConnection:
    """A connection past the whole handshake (its agent announced), ready for requests.

    A fuzzed frame may crash the tenant's worker (a token holder can, to its own tenant's);
    while it restarts (backoff up to 5 s) the peer closes new handshakes unanswered, so a
    handshake is tried again for up to ``retry_s``: the claim under test is the next frame's."""
    give_up = time.monotonic() + retry_s
    while True:
        agent = RawAgent()
        raw = RawConnection(port, timeout=5.0)
        try:
            assert raw.handshake(TOKEN, agent=agent) is not None
        except BaseException:
            raw.close()
            agent.close()
            if time.monotonic() > give_up:
                raise
            time.sleep(0.25)
            continue
        raw.agent = agent  # type: ignore[attr-defined]  # closed with the connection (_close)
        return raw


def _close(raw: RawConnection) -> None:
    raw.close()
    agent = getattr(raw, "agent", None)
    if agent is not None:
        agent.close()


def _answers_or_closes(raw: RawConnection) -> str:
    """After a fuzzed frame: the connection either still answers STATS or was closed."""
    probe_id = 0xABCDEF
    try:
        raw.request(proto.Msg.STATS, probe_id)
        while True:
            frame = raw.read_frame()
            if frame is None:
                return "closed"
            if frame.request_id == probe_id and frame.type == proto.Msg.STATS_REPLY:
                return "answers"
    except (ConnectionResetError, BrokenPipeError):
        return "closed"
    except proto.AuthenticationError:
        return "tampered"


FRAMES = st.tuples(
    st.one_of(st.sampled_from(list(proto.Msg)), st.integers(0, 255)),
    st.integers(0, 2**32 - 1),
    st.one_of(
        st.binary(max_size=2048),
        st.lists(st.binary(min_size=1, max_size=proto.MAX_KEY_BYTES), max_size=20).map(proto.encode_keys),
        st.integers(0, 2**32 - 1).map(lambda n: struct.pack("<I", n)),
    ),
)


@multiprocess
@given(FRAMES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzzed_frames_after_auth_answer_or_close(shared, frame):
    msg_type, request_id, payload = frame
    raw = _authenticated(shared[2].port)
    try:
        assert raw.session is not None
        raw.send(raw.session.seal(msg_type, request_id, payload))  # sealed: the decoders are what is fuzzed
        assert _answers_or_closes(raw) in ("answers", "closed")
    finally:
        _close(raw)


@multiprocess
@given(st.binary(max_size=300))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzzed_bytes_before_auth_are_closed(shared, junk):
    raw = RawConnection(shared[2].port, timeout=5.0)
    try:
        raw.send(junk)
        raw.sock.shutdown(socket.SHUT_WR)
        assert raw.closed_by_peer()
    finally:
        raw.close()


@multiprocess
async def test_oversized_and_malformed_messages_close_only_that_connection(shared):
    peer = shared[2]
    bystander = _authenticated(peer.port)
    try:
        for bad in (
            lambda s: struct.pack("<I", proto.MAX_FRAME + 1),  # too long: refused before it is read
            lambda s: s.seal(proto.Msg.GET, 1, struct.pack("<I", proto.MAX_KEYS + 1)),  # too many keys
            lambda s: s.seal(proto.Msg.WELCOME, 1, b""),  # not a request
            lambda s: proto.encode_frame(proto.Msg.STATS, 1),  # not sealed
        ):
            raw = _authenticated(peer.port)
            raw.send(bad(raw.session))
            assert raw.closed_by_peer()
            _close(raw)
        assert _answers_or_closes(bystander) == "answers"
    finally:
        _close(bystander)
    rows, keys = two_group_rows(4, seed=13)
    async with open_tier([peer.address], rows.view, namespace=b"after-fuzz", token=TOKEN) as tier:
        assert await tier.put(list(zip(keys, rows.src, strict=True))) == [True] * 4
        rows.clear_dst()
        assert await tier.get(list(zip(keys, rows.dst, strict=True))) == [True] * 4
        assert all(rows.same(i) for i in range(4))
        assert (await tier.peer_stats(peer.address))["protocol_errors"] >= 4


@multiprocess
def test_an_uncommitted_put_expires(shared):
    raw = _authenticated(shared[1].port)
    try:
        keys = [key(i, salt=b"expire") for i in range(3)]
        addrs = [raw.agent.addr + i * KIB for i in range(3)]  # type: ignore[attr-defined]
        raw.request(proto.Msg.PUT, 7, proto.encode_transfer(keys, [KIB] * 3, addrs, 2000))
        frame = raw.read_frame()
        assert frame is not None and frame.type == proto.Msg.LANDED
        alloc_id, landed = proto.decode_landed(frame.payload)
        assert landed == [proto.Landed.READ] * 3
        time.sleep(1.0)  # --alloc-ttl 0.5, swept every 0.125 s (a quarter of it)
        header = RowHeader(b"L" * 16, KIB, 0).pack()
        raw.request(proto.Msg.PUT_COMMIT, 8, proto.encode_commit(alloc_id, [header] * 3))
        frame = raw.read_frame()
        assert frame is not None and frame.type == proto.Msg.ERROR
        assert proto.decode_error(frame.payload)[0] == proto.ErrorCode.UNKNOWN_ALLOCATION
        raw.request(proto.Msg.CONTAINS, 9, proto.encode_keys(keys))
        frame = raw.read_frame()
        assert frame is not None and proto.decode_flags(frame.payload) == [False] * 3
    finally:
        _close(raw)


@multiprocess
async def test_sixteen_concurrent_clients_lose_and_mix_up_nothing(shared):
    addresses = [p.address for p in shared]
    n_private, n_shared, size = 10, 4, 32 * KIB
    shared_keys = [key(i, salt=b"common") for i in range(n_shared)]

    async def client(c: int) -> None:
        rows = HostRows([size] * (n_private + n_shared), seed=100 + c)
        for j in range(n_shared):  # the same key always names the same bytes, in every client
            rows.buffer[(n_private + j) * size : (n_private + j + 1) * size] = np.random.default_rng(
                j
            ).integers(0, 256, size, dtype=np.uint8)
        keys = [key(i, salt=b"client%d-" % c) for i in range(n_private)] + shared_keys
        # A deadline far past any wait here: the claim is that nothing is lost or mixed up
        # among sixteen clients, and on a loaded 2-core machine sixteen clients sharing the
        # peers' tenant workers can take longer than the 2 s default (a late call is a miss).
        async with open_tier(
            addresses, rows.view, namespace=b"sixteen", token=TOKEN, deadline_s=10.0
        ) as tier:
            for _ in range(3):
                assert await tier.put(list(zip(keys, rows.src, strict=True))) == [True] * len(keys)
                rows.clear_dst()
                assert await tier.get(list(zip(keys, rows.dst, strict=True))) == [True] * len(keys)
                assert all(rows.same(i) for i in range(len(keys))), f"client {c} got another row"
                await asyncio.sleep(0)

    await asyncio.gather(*(client(c) for c in range(16)))


async def get_or_abandoned(tier, pairs: list) -> tuple[list[bool], bool]:
    """``(hits, abandoned)``: a get that a peer did not answer raises ``RowsAbandoned``."""
    try:
        return await tier.get(pairs), False
    except RowsAbandoned as exc:
        return exc.ok, True


@multiprocess
async def test_a_peer_killed_mid_transfer_turns_into_misses(spawn_peers):
    peers = spawn_peers(2, capacity="64MiB", row_bytes="256KiB")
    addresses = [p.address for p in peers]
    victim, survivor = peers
    n = 48
    rows = HostRows([256 * KIB] * n, seed=21)
    deadline = 1.0
    async with open_tier(addresses, rows.view, deadline_s=deadline, backoff_s=60.0) as tier:
        first = [key(i, salt=b"kill-first") for i in range(n)]
        assert await tier.put(list(zip(first, rows.src, strict=True))) == [True] * n
        killer = threading.Timer(0.3, victim.kill)
        killer.start()
        try:
            start = time.monotonic()
            round_no = 0
            while time.monotonic() - start < 1.5:
                keys = [key(i, salt=b"kill%d-" % round_no) for i in range(n)]
                round_no += 1
                for verb in ("put", "get"):
                    began = time.monotonic()
                    if verb == "put":
                        await tier.put(list(zip(keys, rows.src, strict=True)))
                    else:
                        rows.clear_dst()
                        loaded, _ = await get_or_abandoned(tier, list(zip(keys, rows.dst, strict=True)))
                        assert all(rows.same(i) for i, ok in enumerate(loaded) if ok)  # nothing corrupt
                    assert time.monotonic() - began < deadline + SLACK_S  # no hang
                await tier.delete(keys)  # keep the pools from evicting the first rows
        finally:
            killer.join()
        assert tier.peers_up() == [survivor.address]
        rows.clear_dst()
        loaded = await tier.get(list(zip(first, rows.dst, strict=True)))
        for i, k in enumerate(first):
            if rendezvous_owner(tier.namespace + k, addresses) == victim.address:
                assert not loaded[i]  # its rows died with it
            else:
                assert loaded[i] and rows.same(i)
        assert any(not ok for ok in loaded) and any(loaded)
        assert tier.stats()["peer_failures"] >= 1


@multiprocess
async def test_a_stopped_peer_hits_the_deadline_not_a_hang(spawn_peers):
    peers = spawn_peers(2)
    addresses = [p.address for p in peers]
    victim, survivor = peers
    rows, keys = two_group_rows(24, seed=22)
    # Long enough that the survivor answers within it on a loaded machine (its hits are part
    # of the claim); the stopped peer still never answers, so the deadline is what ends the call.
    deadline = 2.0
    async with open_tier(addresses, rows.view, deadline_s=deadline, backoff_s=60.0) as tier:
        assert await tier.put(list(zip(keys, rows.src, strict=True))) == [True] * 24
        victim.stop()
        try:
            rows.clear_dst()
            began = time.monotonic()
            loaded, abandoned = await get_or_abandoned(tier, list(zip(keys, rows.dst, strict=True)))
            elapsed = time.monotonic() - began
            assert deadline * 0.9 <= elapsed < deadline + SLACK_S  # the deadline fired
            # The stopped peer never answered: its WRITE may still land, so the call says so
            # (the engine then never reuses those rows) and still returns the survivor's hits.
            assert abandoned and tier.stats()["abandoned"] == 1
            owned = [rendezvous_owner(tier.namespace + k, addresses) for k in keys]
            assert loaded == [o == survivor.address for o in owned]
            assert all(rows.same(i) for i, ok in enumerate(loaded) if ok)
            assert tier.peers_up() == [survivor.address]
            assert tier.stats()["timeouts"] >= 1
            began = time.monotonic()  # marked down: its keys now go to the survivor, at once
            assert await tier.put(list(zip(keys, rows.src, strict=True))) == [True] * 24
            assert time.monotonic() - began < deadline
        finally:
            victim.cont()


@multiprocess
async def test_a_restarted_peer_rejoins(spawn_peers):
    peers = spawn_peers(2)
    addresses = [p.address for p in peers]
    victim = peers[0]
    rows, keys = two_group_rows(24, seed=23)
    async with open_tier(addresses, rows.view, backoff_s=0.2, max_backoff_s=0.4) as tier:
        assert await tier.put(list(zip(keys, rows.src, strict=True))) == [True] * 24
        victim.kill()
        await eventually(lambda: victim.address not in tier.peers_up())  # EOF alone marks it down
        restarted = spawn_peers(1, port=victim.port)[0]

        async def poke():
            await tier.contains(keys[:1])  # calls retry a down peer once its backoff is over

        await eventually(lambda: victim.address in tier.peers_up(), poke=poke)
        assert tier.stats()["rejoins"] >= 1
        owned = [rendezvous_owner(tier.namespace + k, addresses) == victim.address for k in keys]
        assert await tier.contains(keys) == [not o for o in owned]  # a new instance starts empty
        assert await tier.put(list(zip(keys, rows.src, strict=True))) == [True] * 24
        assert (await tier.peer_stats(restarted.address))["rows"] == sum(owned)
        rows.clear_dst()
        assert await tier.get(list(zip(keys, rows.dst, strict=True))) == [True] * 24
        assert all(rows.same(i) for i in range(24))


@multiprocess
async def test_sigterm_stops_the_peer_cleanly(spawn_peers):
    peer = spawn_peers(1)[0]
    rows, keys = two_group_rows(2, seed=24)
    async with open_tier([peer.address], rows.view) as tier:
        assert tier.peers_up() == [peer.address]
        peer.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(peer.proc.wait, 10) == 0
        await eventually(lambda: tier.peers_up() == [])
        assert await tier.put(list(zip(keys, rows.src, strict=True))) == [False, False]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--capacity", "1GiB"], "--listen"),
        (["--listen", "nowhere", "--capacity", "1GiB"], "HOST:PORT"),
        (["--listen", "127.0.0.1:0", "--capacity", "8 bananas"], "unit"),
        (["--listen", "127.0.0.1:0", "--capacity", "1MiB", "--row-bytes", "2MiB"], "less than one row"),
        (["--listen", "127.0.0.1:0", "--capacity", "1GiB", "--token-file", "/nonexistent"], "token-file"),
        (["--listen", "127.0.0.1:0", "--capacity", "1GiB", "--policy", "nope"], "policy"),
    ],
)
def test_peer_cli_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_peer_cli_reads_sizes_and_token(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_bytes(b"  s3cret-s3cret-s3cret\n")
    settings = parse_args(
        [
            "--listen",
            "127.0.0.1:7070",
            "--capacity",
            "1GiB",
            "--row-bytes",
            "512KiB",
            "--token-file",
            str(token_file),
        ]
    )
    assert (settings.host, settings.port, settings.capacity_bytes, settings.row_bytes) == (
        "127.0.0.1",
        7070,
        2**30,
        512 * KIB,
    )
    assert dict(settings.credentials.tokens) == {"default": (b"s3cret-s3cret-s3cret",)}
