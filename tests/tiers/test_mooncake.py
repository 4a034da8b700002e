"""MooncakeTier against a real ``mooncake_master`` on 127.0.0.1, started by the tests.

One master (short leases) is shared by the tests that leave it running, each test with its
own tiers (clients that mount their own segments) in a namespace of its own; the test that
kills and restarts a master starts its own. Without the ``mooncake`` package these tests
skip, unless ``KVTIER_REQUIRE_MOONCAKE=1`` (``make test``) makes that an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import sys
import time

import pytest

pytest.importorskip("mooncake.store")

from tests.tiers.mooncake_fixtures import SEGMENT, free_port, open_tier, start_master
from tests.tiers.peer_fixtures import LAYOUT, HostRows, aligned_buffer, key
from tiers.address import Address
from tiers.base import TierError
from tiers.mooncake import MooncakeTier, object_key
from tiers.row_format import RowHeader, checksum
from tiers.settings import MooncakeSettings

KIB = 1024
MIB = 1 << 20
SLACK_S = 1.5  # how far past its deadline a call may return and still count as "no hang"

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    process = start_master(tmp_path_factory.mktemp("mooncake"))
    yield process
    process.close()


def rows_and_keys(sizes: list[int], seed: int) -> tuple[HostRows, list[bytes]]:
    return HostRows(sizes, seed=seed), [key(i, group=i % 2, salt=b"mc%d-" % seed) for i in range(len(sizes))]


async def test_rows_round_trip_byte_exact_and_lookups_batch(master):
    rows, keys = rows_and_keys([64 * KIB if i % 2 == 0 else 16 * KIB for i in range(12)], seed=1)
    async with open_tier(master, rows.view, namespace=b"round-trip") as tier:
        assert await tier.put(list(zip(keys, rows.src, strict=True))) == [True] * 12
        assert all(tier.may_contain(k) for k in keys)
        assert await tier.contains([*keys, key(999)]) == [True] * 12 + [False]
        rows.clear_dst()
        assert await tier.get(list(zip(keys, rows.dst, strict=True))) == [True] * 12
        assert all(rows.same(i) for i in range(12))
        assert await tier.get([(key(999), rows.dst[0])]) == [False]
        stats = tier.stats()
        assert (stats["stored"], stats["hits"], stats["misses"], stats["absent"]) == (12, 12, 1, 1)
        assert stats["corrupt"] == stats["errors"] == 0


async def test_a_row_corrupted_in_the_store_is_a_miss_and_removed(master):
    rows, keys = rows_and_keys([32 * KIB] * 3, seed=2)
    async with open_tier(master, rows.view, namespace=b"corrupt") as tier:
        assert await tier.put(list(zip(keys, rows.src, strict=True))) == [True] * 3
        # The tier's own client holds the only segment: the object's bytes lie in this process.
        (replica,) = tier._store.get_replica_desc(object_key(tier.namespace, keys[1]))
        address = replica.get_memory_descriptor().buffer_descriptor.buffer_address
        flipped = ctypes.c_uint8.from_address(address + 40 + 1000)  # a byte of the row, past the header
        flipped.value ^= 0x01
        rows.clear_dst()
        assert await tier.get(list(zip(keys, rows.dst, strict=True))) == [True, False, True]
        assert rows.same(0) and rows.same(2)
        assert tier.stats()["corrupt"] == 1
        assert await tier.contains(keys) == [True, False, True]  # the corrupt object is gone


async def test_an_object_of_another_layout_or_length_is_a_miss(master):
    """A sound row of a layout the reader cannot use is another engine's: a miss, left in
    the store; a row of the wrong length is a miss too."""
    rows, keys = rows_and_keys([16 * KIB] * 2, seed=3)
    async with open_tier(master, rows.view, namespace=b"foreign") as tier:
        store = tier._store
        row = bytes(rows.src[0])
        other_layout = RowHeader(b"another-layout\0\0", len(row), checksum(row)).pack() + row
        assert store.put(object_key(tier.namespace, keys[0]), other_layout) == 0
        assert store.put(object_key(tier.namespace, keys[1]), b"short") == 0
        assert await tier.get(list(zip(keys, rows.dst, strict=True))) == [False, False]
        stats = tier.stats()
        assert (stats["corrupt"], stats["mismatched"]) == (0, 2)
        assert await tier.contains(keys[:1]) == [True]


async def test_a_row_of_a_readable_layout_is_served_and_its_layout_reported(master):
    rows, keys = rows_and_keys([16 * KIB] * 2, seed=5)
    other = b"convertible-lay\0"
    async with open_tier(master, rows.view, namespace=b"convert", readable_layouts=[other]) as tier:
        row = bytes(rows.src[0])
        framed = RowHeader(other, len(row), checksum(row)).pack() + row
        assert tier._store.put(object_key(tier.namespace, keys[0]), framed) == 0
        assert await tier.put(list(zip(keys[1:], rows.src[1:], strict=True))) == [True]
        layouts: list[bytes | None] = [None, None]
        assert await tier.get(list(zip(keys, rows.dst, strict=True)), layouts) == [True, True]
        assert layouts == [other, LAYOUT]
        assert bytes(rows.dst[0]) == row and bytes(rows.dst[1]) == bytes(rows.src[1])


async def test_tenants_in_different_namespaces_never_see_each_other(master):
    rows, keys = rows_and_keys([16 * KIB] * 4, seed=4)
    async with (
        open_tier(master, rows.view, namespace=b"tenant-a") as tenant_a,
        open_tier(master, rows.view, namespace=b"tenant-b") as tenant_b,
    ):
        assert await tenant_a.put(list(zip(keys, rows.src, strict=True))) == [True] * 4
        assert await tenant_b.contains(keys) == [False] * 4
        rows.clear_dst()
        assert await tenant_b.get(list(zip(keys, rows.dst, strict=True))) == [False] * 4
        assert bytes(rows.dst[0]) == bytes(16 * KIB)  # nothing was written
        assert await tenant_a.get(list(zip(keys, rows.dst, strict=True))) == [True] * 4
        assert all(rows.same(i) for i in range(4))


async def test_a_full_store_drops_and_counts_then_evicts_old_rows(tmp_path):
    master = start_master(tmp_path)  # its own: the pool is this tier's segment, nothing else
    n = 40  # 40 MiB into the only segment, 32 MiB
    rows = HostRows([MIB] * n, seed=5)
    keys = [key(i, salt=b"full") for i in range(n)]
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(master.close)
        tier = await stack.enter_async_context(open_tier(master, rows.view, namespace=b"full"))
        stored = await tier.put(list(zip(keys, rows.src, strict=True)))
        assert 0 < sum(stored) < n
        stats = tier.stats()
        assert stats["full"] == stats["dropped"] == n - sum(stored)
        # Once leases expire, a put that finds no room makes the master evict a share of the
        # objects (5% by default) to make room: new rows get in, old ones become misses. (The
        # batch left some room unused: 8 more rows need more than that.)
        deadline = time.monotonic() + 10
        for later in [key(i, salt=b"later") for i in range(8)]:
            while not all(await tier.put([(later, rows.src[0])])):
                assert time.monotonic() < deadline, f"nothing evicted: {tier.stats()}"
                await asyncio.sleep(0.1)
        rows.clear_dst()
        first = [k for k, ok in zip(keys, stored, strict=True) if ok]
        found = await tier.get(list(zip(first, rows.dst[: len(first)], strict=True)))
        assert not all(found), (len(first), tier.stats())  # evicted by the master to make room: misses
        assert tier.stats()["absent"] == found.count(False)


async def test_master_killed_and_restarted_misses_meanwhile_then_recovers(tmp_path):
    master = start_master(tmp_path)
    rows, keys = rows_and_keys([64 * KIB] * 6, seed=6)
    tier = MooncakeTier(
        MooncakeSettings(capacity_bytes=SEGMENT, master=Address.parse(master.address), deadline_s=1.0),
        b"restart".ljust(16, b"\0"),
        LAYOUT,
        backoff_s=0.2,
        max_backoff_s=0.5,
    )
    await tier.open(rows.view)
    try:
        assert await tier.put(list(zip(keys[:3], rows.src[:3], strict=True))) == [True] * 3
        master.kill()
        for _ in range(3):  # each call answers within its deadline, whether it reached the store or not
            start = time.monotonic()
            assert await tier.get(list(zip(keys[:3], rows.dst[:3], strict=True))) == [False] * 3
            assert await tier.contains(keys[:3]) == [False] * 3
            assert await tier.put(list(zip(keys[3:], rows.src[3:], strict=True))) == [False] * 3
            assert time.monotonic() - start < 3 * tier.deadline_s + SLACK_S
            await asyncio.sleep(0.3)
        assert tier.stats()["master_lost"] >= 1
        master.restart()
        deadline = time.monotonic() + 20
        while not all(await tier.put(list(zip(keys[3:], rows.src[3:], strict=True)))):
            assert time.monotonic() < deadline, f"no recovery: {tier.stats()}\n{master.log()}"
            await asyncio.sleep(0.2)
        rows.clear_dst()
        assert await tier.get(list(zip(keys, rows.dst, strict=True))) == [False] * 3 + [True] * 3
        assert all(rows.same(i) for i in range(3, 6))  # the old rows died with the old master
        assert tier.stats()["recoveries"] >= 1
        master.kill()  # closing with the master gone must not stall the process either
        start = time.monotonic()
        await tier.close()
        assert time.monotonic() - start < SLACK_S
    finally:
        await tier.close()
        master.close()


async def test_a_hung_master_costs_one_deadline_then_calls_skip_it_until_it_answers(tmp_path):
    master = start_master(tmp_path)
    rows, keys = rows_and_keys([64 * KIB] * 4, seed=7)
    try:
        async with open_tier(master, rows.view, deadline_s=0.5, backoff_s=0.2, max_backoff_s=0.5) as tier:
            assert await tier.put(list(zip(keys[:2], rows.src[:2], strict=True))) == [True] * 2
            master.stop()  # it still accepts connections, and never answers (the store waits 30 s)
            start = time.monotonic()
            assert await tier.put(list(zip(keys[2:], rows.src[2:], strict=True))) == [False] * 2
            assert time.monotonic() - start < tier.deadline_s + SLACK_S
            assert tier.stats()["master_up"] == 0
            start = time.monotonic()
            for _ in range(3):  # down: answered at once, or after one more deadline once the backoff ends
                assert await tier.put(list(zip(keys[2:], rows.src[2:], strict=True))) == [False] * 2
                assert await tier.contains(keys[2:]) == [False] * 2
            assert time.monotonic() - start < 2 * tier.deadline_s + SLACK_S
            master.cont()
            deadline = time.monotonic() + 20
            while not all(await tier.put(list(zip(keys[2:], rows.src[2:], strict=True)))):
                assert time.monotonic() < deadline, f"no recovery: {tier.stats()}"
                await asyncio.sleep(0.2)
            assert await tier.contains(keys) == [True] * 4  # nothing was lost: the master only paused
            assert tier.stats()["recoveries"] >= 1
    finally:
        master.close()


async def test_an_unreachable_master_fails_open_with_its_address(tmp_path):
    host = aligned_buffer(MIB)
    settings = MooncakeSettings(capacity_bytes=0, master=Address.parse(f"127.0.0.1:{free_port()}"))
    tier = MooncakeTier(settings, b"n" * 16, LAYOUT, open_timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(TierError, match=f"no master listens at {tier.master}"):
        await tier.open(memoryview(host))
    assert time.monotonic() - start < SLACK_S


def test_without_the_package_the_tier_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # what an absent package looks like
    with pytest.raises(TierError, match=r"pip install 'kvtier\[mooncake\]'.*libibverbs1"):
        MooncakeTier(
            MooncakeSettings(capacity_bytes=1 << 30, master=Address.parse("127.0.0.1:1")), b"n" * 16, LAYOUT
        )
