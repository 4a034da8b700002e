"""Spill and promotion through a real disk tier (LMDB in a temporary folder)."""

import asyncio
import threading

import pytest
import torch

from offload.api import Offloader
from offload.keys import make_key
from tests.offload.layouts import per_layer_blocks_first, scramble
from tiers.base import TierError
from tiers.disk.lmdb_store import ROWS_FILE


def keys_for(prefix: str, n: int) -> list[bytes]:
    return [make_key(f"{prefix}{i}".encode().ljust(16, b"."), 0) for i in range(n)]


def config(tmp_path, host_rows: int, row: int, **disk) -> dict:
    disk_tier = {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "64MiB", "admission": "all"}
    disk_tier.update(disk)
    return {"tiers": [{"kind": "host", "capacity": host_rows * row}, disk_tier]}


@pytest.fixture
def layout():
    kv, groups = per_layer_blocks_first()
    with Offloader(kv, groups) as probe:
        row = probe.caches.row_bytes(0)
    return kv, groups, row


def store_each(offloader, keys, blocks):
    for key, block in zip(keys, blocks, strict=True):
        assert offloader.store([key], [block]) is not None
        offloader.wait()
        offloader.wait_tiers()  # a row being copied down cannot be evicted yet


def promote(offloader, keys) -> int:
    """Look up until the promotions have landed; the hit count then."""
    offloader.lookup(keys)
    offloader.wait_tiers()
    return offloader.lookup(keys)


def test_write_through_spills_and_promotes_byte_exact(tmp_path, layout):
    kv, groups, row = layout
    with Offloader(kv, groups, config(tmp_path, 2, row, placement="write-through")) as offloader:
        keys = keys_for("wt", 4)
        originals = [offloader.caches.read_row(0, b) for b in range(4)]
        store_each(offloader, keys, range(4))
        offloader.wait_tiers()
        disk = offloader.manager.lower.tiers[0]
        assert all(disk.may_contain(key) for key in keys)
        assert offloader.lookup(keys[:2]) == 0  # evicted from the 2-row host tier...
        assert promote(offloader, keys[:2]) == 2  # ...and promoted back from disk
        scramble(kv)
        offloader.load(keys[:2], [8, 9])
        offloader.wait()
        assert [offloader.caches.read_row(0, b) for b in (8, 9)] == originals[:2]
        stats = offloader.stats()
        assert stats["lower"]["promotions_done"] == 2
        assert stats["lower"]["spills_done"] == 4


def test_a_prefix_is_promoted_in_one_request(tmp_path, layout):
    from offload.tier_engine import OpKind

    kv, groups, row = layout
    with Offloader(kv, groups, config(tmp_path, 8, row, placement="write-through")) as offloader:
        keys = keys_for("batch", 4)
        store_each(offloader, keys, range(4))
        assert offloader.manager.reset()
        engine = offloader.manager.lower.engine
        gets_before = engine.submitted[OpKind.GET]
        assert promote(offloader, keys) == 4
        assert engine.submitted[OpKind.GET] - gets_before == 1  # four rows, one request


def test_write_back_spills_victims_before_eviction(tmp_path, layout):
    kv, groups, row = layout
    cfg = config(tmp_path, 3, row, placement="write-back")
    with Offloader(kv, groups, cfg) as offloader:
        keys = keys_for("wb", 8)
        originals = [offloader.caches.read_row(0, b) for b in range(8)]
        store_each(offloader, keys, range(8))
        assert offloader.stats()["lower"]["dirty_dropped"] == 0
        assert promote(offloader, keys[:3]) == 3
        scramble(kv)
        offloader.load(keys[:3], [9, 10, 11])
        offloader.wait()
        assert [offloader.caches.read_row(0, b) for b in (9, 10, 11)] == originals[:3]


def test_restart_is_warm(tmp_path, layout):
    kv, groups, row = layout
    keys = keys_for("warm", 3)
    originals = [bytes(kv[name][0:3].view(torch.uint8).flatten().numpy()) for name in groups[0]]
    with Offloader(kv, groups, config(tmp_path, 4, row, placement="write-through")) as offloader:
        before = [offloader.caches.read_row(0, b) for b in range(3)]
        offloader.store(keys, [0, 1, 2])
        offloader.wait()
        offloader.wait_tiers()
    scramble(kv)
    assert [bytes(kv[name][0:3].view(torch.uint8).flatten().numpy()) for name in groups[0]] != originals
    with Offloader(kv, groups, config(tmp_path, 4, row, placement="write-through")) as restarted:
        assert promote(restarted, keys) == 3
        restarted.load(keys, [0, 1, 2])
        restarted.wait()
        assert [restarted.caches.read_row(0, b) for b in range(3)] == before


def test_seen_twice_admission_keeps_one_off_blocks_off_disk(tmp_path, layout):
    kv, groups, row = layout
    cfg = config(tmp_path, 2, row, placement="write-through", admission="seen-twice")
    with Offloader(kv, groups, cfg) as offloader:
        once, twice = keys_for("once", 1), keys_for("twice", 1)
        offloader.store(once + twice, [0, 1])
        offloader.wait()
        assert offloader.lookup(twice) == 1  # a hit: the second time it is asked for
        offloader.poll()
        offloader.store(keys_for("x", 2), [2, 3])  # evicts both from the host tier
        offloader.wait()
        offloader.wait_tiers()
        disk = offloader.manager.lower.tiers[0]
        assert not disk.may_contain(once[0])
        assert not disk.may_contain(twice[0])  # written through at store time: seen once then
        offloader.store(twice, [1])  # computed again: now seen twice, admitted
        offloader.wait()
        offloader.wait_tiers()
        assert disk.may_contain(twice[0])


def test_a_flipped_byte_on_disk_is_a_miss_and_loads_nothing(tmp_path, layout):
    kv, groups, row = layout
    keys = keys_for("bad", 1)
    with Offloader(kv, groups, config(tmp_path, 4, row, placement="write-through")) as offloader:
        stored_row = offloader.caches.read_row(0, 0)
        offloader.store(keys, [0])
        offloader.wait()
        offloader.wait_tiers()
    data_file = tmp_path / "disk" / ROWS_FILE
    data = bytearray(data_file.read_bytes())
    where = data.find(stored_row[:64])
    assert where >= 0 and data.count(stored_row[:64]) == 1
    data[where + len(stored_row) // 2] ^= 0x01  # bit rot in the middle of the row
    data_file.write_bytes(bytes(data))
    scramble(kv)
    device_before = bytes(kv["layer.0"][5].view(torch.uint8).flatten().numpy())
    with Offloader(kv, groups, config(tmp_path, 4, row, placement="write-through")) as offloader:
        assert promote(offloader, keys) == 0
        lower = offloader.stats()["lower"]
        assert (lower["promotions_started"], lower["promotions_failed"]) == (1, 1)
        assert offloader.stats()["tiers"]["disk"]["corrupt"] == 1
        assert offloader.lookup(keys) == 0  # deleted: no second promotion attempt
        assert offloader.stats()["lower"]["promotions_started"] == 1
        assert bytes(kv["layer.0"][5].view(torch.uint8).flatten().numpy()) == device_before


def test_another_tenant_or_layout_never_hits(tmp_path, layout):
    kv, groups, row = layout
    keys = keys_for("tenant", 2)
    with Offloader(kv, groups, config(tmp_path, 4, row, placement="write-through")) as offloader:
        offloader.store(keys, [0, 1])
        offloader.wait()
        offloader.wait_tiers()
    other_tenant = config(tmp_path, 4, row, placement="write-through")
    other_tenant["namespace"] = {"tenant": "someone-else"}
    with Offloader(kv, groups, other_tenant) as offloader:
        assert promote(offloader, keys) == 0
    with Offloader(
        kv, groups, config(tmp_path, 4, row, placement="write-through"), block_size=32
    ) as offloader:
        assert promote(offloader, keys) == 0


def test_a_locked_disk_tier_is_a_clear_error_at_start(tmp_path, layout):
    kv, groups, row = layout
    cfg = config(tmp_path, 4, row)
    with Offloader(kv, groups, cfg), pytest.raises(TierError, match="lock"):
        Offloader(kv, groups, cfg)


def failing_gets(tier) -> list[int]:
    """Make ``tier``'s reads fail from now on (as a flaky peer's would); counts the calls."""
    calls: list[int] = []

    async def get(rows, layouts=None) -> list[bool]:
        calls.append(len(rows))
        return [False] * len(rows)

    tier.get = get
    return calls


def test_a_failed_promotion_stays_a_miss_for_a_while_and_is_observed(tmp_path, layout):
    kv, groups, row = layout
    with Offloader(kv, groups, config(tmp_path, 2, row, placement="write-through")) as offloader:
        keys = keys_for("fail", 4)
        store_each(offloader, keys, range(4))
        manager = offloader.manager
        outcomes = []
        manager.observe_results(outcomes.append)
        disk = manager.lower.tiers[0]
        calls = failing_gets(disk)
        assert promote(offloader, keys[:1]) == 0
        assert [(o.tier, o.landed, o.failed) for o in outcomes] == [("disk", [], [keys[0]])]
        assert disk.may_contain(keys[0])  # still on disk: only the read failed
        for _ in range(3):  # not promoted again: a miss, so the engine recomputes it
            assert promote(offloader, keys[:1]) == 0
        assert calls == [1]
        assert offloader.stats()["lower"]["promotions_failed"] == 1
        manager.lower.retry_failed_s = 0.0  # the while is over: tried again
        assert promote(offloader, keys[:1]) == 0
        assert calls == [1, 1]


def test_a_failed_promotion_is_forgotten_once_the_block_is_stored_again(tmp_path, layout):
    kv, groups, row = layout
    with Offloader(kv, groups, config(tmp_path, 2, row, placement="write-through")) as offloader:
        keys = keys_for("again", 3)
        store_each(offloader, keys, range(3))
        disk = offloader.manager.lower.tiers[0]
        calls = failing_gets(disk)
        assert promote(offloader, keys[:1]) == 0
        del disk.get  # the tier reads again
        store_each(offloader, keys[:1], [0])  # the engine recomputed it
        store_each(offloader, keys[1:], [1, 2])  # evicts it again
        assert promote(offloader, keys[:1]) == 1  # promoted: the failure no longer counts
        assert calls == [1]


def test_front_end_verbs_in_flight_wait_idle_and_observed_results(tmp_path, layout):
    kv, groups, row = layout
    with Offloader(kv, groups, config(tmp_path, 2, row, placement="write-through")) as offloader:
        manager = offloader.manager
        keys = keys_for("verbs", 3)
        store_each(offloader, keys, range(3))  # keys[0]: on disk only
        outcomes = []
        manager.observe_results(outcomes.append)
        disk = manager.lower.tiers[0]
        release = threading.Event()
        read = disk.get

        async def slow_get(rows, layouts=None) -> list[bool]:
            await asyncio.to_thread(release.wait, 10)
            return await read(rows, layouts)

        disk.get = slow_get
        assert offloader.lookup(keys[:1]) == 0  # the promotion went out
        assert manager.inflight_below() == 1
        assert not manager.wait_idle(0.05)
        release.set()
        assert manager.wait_idle(10)
        assert manager.inflight_below() == 0
        assert outcomes == []  # finished, not applied yet: the next call applies it
        assert offloader.lookup(keys[:1]) == 1
        assert [(o.tier, o.landed, o.failed) for o in outcomes] == [("disk", [keys[0]], [])]
        # Held through wait_idle's 0.05 s timeout; a timed wait may end a hair early (0.049999...).
        assert outcomes[0].seconds >= 0.04
