"""A slow lower tier never slows the engine: a real disk tier whose writes or reads are held
(a test-local wrapper around its ``put`` / ``get``, released at the end), driven through the
manager's engine-facing calls. Every call returns while the tier is held (none waits on it),
copies down and promotions stay under their bounds, and what is dropped is counted."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from offload.api import Offloader
from offload.manager import Lookup
from tests.offload.test_tiering import config, keys_for, layout  # noqa: F401 - a fixture

HELD_S = 30.0  # a held call is released at the latest after this (never reached: released below)


class Held:
    """Holds ``tier.<verb>`` until ``release``; counts the calls that reached the tier."""

    def __init__(self, tier, verb: str) -> None:
        self.released = threading.Event()
        self.calls = 0
        original = getattr(tier, verb)

        async def held(*args, **kwargs):
            self.calls += 1
            await asyncio.to_thread(self.released.wait, HELD_S)
            return await original(*args, **kwargs)

        setattr(tier, verb, held)

    def release(self) -> None:
        self.released.set()


@pytest.fixture
def offloader_of(tmp_path, layout) -> Iterator:  # noqa: F811 - the fixture imported above
    made: list[Offloader] = []
    helds: list[Held] = []

    def make(host_rows: int, placement: str) -> tuple[Offloader, int]:
        kv, groups, row = layout
        offloader = Offloader(kv, groups, config(tmp_path, host_rows, row, placement=placement))
        made.append(offloader)
        return offloader, row

    make.helds = helds  # type: ignore[attr-defined]
    yield make
    for held in helds:
        held.release()  # whatever a failed test left held
    for offloader in made:
        offloader.close()


def hold(offloader_of, tier, verb: str) -> Held:
    held = Held(tier, verb)
    offloader_of.helds.append(held)
    return held


def store_one_by_one(offloader: Offloader, keys: list[bytes]) -> list[int | None]:
    """Store each key as an engine does (prepare, device copy, complete); never waits on tiers."""
    jobs = []
    for block, key in enumerate(keys):
        jobs.append(offloader.store([key], [block % 8]))
        offloader.wait()  # the device -> host copy only
    return jobs


def test_write_through_copies_past_the_bound_are_dropped_and_counted(offloader_of):
    offloader, _ = offloader_of(8, "write-through")
    manager = offloader.manager
    manager.max_spilling_rows = 3
    held = hold(offloader_of, manager.lower.tiers[0], "put")
    keys = keys_for("wt-slow", 16)
    jobs = store_one_by_one(offloader, keys)  # returns although every write is held
    assert not held.released.is_set()
    assert None not in jobs  # every store went into the host tier: none refused
    assert manager.stats.rejected_stores == 0
    assert len(manager._readers) <= 3  # host rows held by copies down: the bound
    assert manager.lower.stats.spills_dropped == 16 - 3
    assert manager.inflight_below() <= 3
    held.release()
    offloader.wait_tiers()
    assert manager.lower.stats.spills_done == 3
    assert manager.spilling_rows() == 0
    text = offloader.metrics_text()
    assert 'kvtier_spills_total{result="dropped"} 13' in text
    assert 'kvtier_inflight_rows_max{op="spill"} 3' in text


def test_write_back_rows_past_the_bound_stay_dirty_and_are_counted_when_evicted(offloader_of):
    offloader, _ = offloader_of(8, "write-back")
    manager = offloader.manager
    manager.max_spilling_rows = 2
    held = hold(offloader_of, manager.lower.tiers[0], "put")
    jobs = store_one_by_one(offloader, keys_for("wb-slow", 16))
    assert not held.released.is_set()
    assert None not in jobs and manager.stats.rejected_stores == 0
    assert len(manager._readers) <= 2
    dropped = manager.lower.stats.dirty_dropped
    assert dropped == 16 - 8  # every row evicted was dirty: none reached the held disk
    held.release()
    offloader.wait_tiers()
    assert f'kvtier_spills_total{{result="evicted_dirty"}} {dropped}' in offloader.metrics_text()


def test_promotions_from_a_slow_tier_are_bounded_and_the_rest_are_misses(offloader_of):
    offloader, _ = offloader_of(8, "write-through")
    manager = offloader.manager
    keys = keys_for("promo-slow", 16)
    store_one_by_one(offloader, keys[:8])
    offloader.wait_tiers()
    store_one_by_one(offloader, keys[8:])  # the first 8 now on disk only
    offloader.wait_tiers()
    assert not any(manager.contains(key) for key in keys[:8])
    manager.max_promoting_rows = 3
    held = hold(offloader_of, manager.lower.tiers[0], "get")
    # Eight requests, each looking up its own block (a step's waiting requests, as vLLM asks).
    found = [manager.lookup(key) for key in keys[:8]]
    manager.on_schedule_end()  # the promotions go out; returns although every read is held
    assert not held.released.is_set()
    assert found == [Lookup.HIT_PENDING] * 3 + [Lookup.MISS] * 5
    assert manager.promoting_rows() == 3
    assert len(manager._promoting) <= 3
    assert manager.lower.stats.promotions_refused == 5
    assert manager.stats.rejected_stores == 0
    text = offloader.metrics_text()
    assert 'kvtier_promotions_total{result="refused"} 5' in text
    assert 'kvtier_inflight_rows{op="promote"} 3' in text
    held.release()
    offloader.wait_tiers()
    assert [manager.lookup(key) for key in keys[:3]] == [Lookup.HIT] * 3
    assert manager.promoting_rows() == 0


def test_a_tier_slower_than_its_deadline_is_paused_and_its_lookups_miss(offloader_of):
    offloader, _ = offloader_of(4, "write-through")
    manager = offloader.manager
    keys = keys_for("pause", 8)
    store_one_by_one(offloader, keys)
    offloader.wait_tiers()  # keys[:4] on disk only
    disk = manager.lower.tiers[0]
    calls: list[int] = []

    async def failing_get(rows, layouts=None) -> list[bool]:  # as a tier past its deadline
        calls.append(len(rows))
        return [False] * len(rows)

    disk.get = failing_get
    manager.lower.slow_get_s = 0.0  # every whole failure counts as slow (no timed waits here)
    assert manager.lookup(keys[0]) is Lookup.HIT_PENDING
    manager.on_schedule_end()
    offloader.wait_tiers()
    assert calls == [1]
    assert manager.lower.stats.tier_pauses == 1
    refused = manager.lower.stats.promotions_refused
    assert manager.lookup(keys[1]) is Lookup.MISS  # not sent to the paused tier: computed
    manager.on_schedule_end()
    offloader.wait_tiers()
    assert calls == [1]
    assert manager.lower.stats.promotions_refused == refused + 1
    assert "kvtier_tier_pauses_total 1" in offloader.metrics_text()
    manager.lower.pause_s = 0.0
    manager.lower._paused_until.clear()  # the pause is over: promoted again
    assert manager.lookup(keys[1]) is Lookup.HIT_PENDING


def test_the_bounds_and_the_pause_are_the_host_tiers_keys(tmp_path, layout):  # noqa: F811 - the fixture
    kv, groups, row = layout
    settings = config(tmp_path / "defaults", 8, row)
    with Offloader(kv, groups, settings) as offloader:  # unset: a share of the 8 host rows, 10 s
        manager = offloader.manager
        assert (manager.max_promoting_rows, manager.max_spilling_rows, manager.lower.pause_s) == (8, 16, 10.0)
    settings = config(tmp_path / "set", 8, row)
    settings["tiers"][0].update(max_promoting_rows=3, max_spilling_rows=2, slow_tier_pause_s=0.5)
    with Offloader(kv, groups, settings) as offloader:
        manager = offloader.manager
        assert (manager.max_promoting_rows, manager.max_spilling_rows, manager.lower.pause_s) == (3, 2, 0.5)
        assert 'kvtier_inflight_rows_max{op="promote"} 3' in offloader.metrics_text()
