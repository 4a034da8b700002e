"""The tier engine's lifecycle: ``close`` leaves no loop, thread or descriptor behind; and a
get its tier abandons (``RowsAbandoned``): reported abandoned, its host slot quarantined by
the manager until the tier says the transfer ended."""

from __future__ import annotations

import concurrent.futures
import sys
from collections.abc import Sequence

import pytest

from offload.keys import make_key
from offload.manager import HostTierManager, Lookup
from offload.tier_engine import GIL_SWITCH_INTERVAL_S, OpKind, TierEngine
from offload.tiering import LowerTierChain
from policies.lru import LRUPolicy
from policies.placement import Placement
from tiers.base import LowerTier, Row, RowsAbandoned, TierError


class FakeTier(LowerTier):
    kind = "fake"

    def __init__(self, fail_open: bool = False, abandon_gets: bool = False) -> None:
        self.fail_open = fail_open
        self.abandon_gets = abandon_gets
        self.closed = False
        self.transfer: concurrent.futures.Future = concurrent.futures.Future()  # an abandoned get's

    async def open(self, host_buffer: memoryview | None = None) -> None:
        if self.fail_open:
            raise TierError("cannot start")

    def may_contain(self, key: bytes) -> bool:
        return self.abandon_gets  # a tier that abandons gets claims every key: it gets asked

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [False] * len(keys)

    async def put(self, rows: Sequence[Row]) -> list[bool]:
        return [True] * len(rows)

    async def get(self, rows: Sequence[Row], layouts: list[bytes | None] | None = None) -> list[bool]:
        if self.abandon_gets:
            raise RowsAbandoned("the store's call still runs", [False] * len(rows), ended=self.transfer)
        return [False] * len(rows)

    async def delete(self, keys: Sequence[bytes]) -> None:
        return None

    async def close(self) -> None:
        self.closed = True

    def stats(self) -> dict[str, float]:
        return {}


def test_close_stops_and_closes_the_loop_and_ends_its_thread():
    tier = FakeTier()
    engine = TierEngine([tier])
    engine.start(None)
    assert engine.submit_put(1, 0, [(b"k", memoryview(b"row"))])
    assert engine.wait_idle(5)
    engine.close()
    assert tier.closed and engine._loop.is_closed() and not engine._thread.is_alive()
    engine.close()  # twice is harmless


def test_a_get_the_tier_abandons_is_reported_abandoned_then_released_when_its_transfer_ends():
    tier = FakeTier(abandon_gets=True)
    engine = TierEngine([tier])
    engine.start(None)
    try:
        assert engine.submit_get(7, 0, [(b"k1", memoryview(bytearray(3))), (b"k2", memoryview(bytearray(3)))])
        assert engine.wait_idle(5)
        (result,) = engine.drain()
        assert (result.op_id, result.kind, result.ok, result.abandoned) == (
            7,
            OpKind.GET,
            [False, False],
            True,
        )
        assert engine.drain() == []  # the transfer still runs: nothing to release yet
        tier.transfer.set_result(None)
        (release,) = engine.drain()
        assert (release.op_id, release.kind, release.keys) == (7, OpKind.RELEASE, [b"k1", b"k2"])
    finally:
        engine.close()


def test_an_abandoned_promotions_slot_is_out_of_use_until_its_transfer_ends():
    """The host tier has 4 slots. A promotion its tier abandons keeps one of them out of
    use (the late transfer may still write it): only 3 rows fit; once the tier says the
    transfer ended, all 4 do again."""
    tier = FakeTier(abandon_gets=True)
    engine = TierEngine([tier])
    host = bytearray(4 * 16)
    manager = HostTierManager(
        1,
        4,
        LRUPolicy,
        lower=LowerTierChain([tier], [Placement()], engine),
        host_row=lambda group, slot: memoryview(host)[slot * 16 : (slot + 1) * 16],
    )
    engine.start(memoryview(host))
    key = lambda n: make_key(n.to_bytes(8, "big"), 0)  # noqa: E731
    try:
        assert manager.lookup(key(99)) is Lookup.HIT_PENDING  # the tier claims it: promoted
        manager.poll()  # sends the promotion
        assert engine.wait_idle(5)
        manager.poll()  # applies its abandoned result
        assert manager.stats.quarantined_slots == 1
        assert manager.lookup(key(98)) is Lookup.HIT_PENDING  # another promotion, another slot
        manager.poll()
        assert engine.wait_idle(5)
        manager.poll()
        assert manager.stats.quarantined_slots == 2
        tier.transfer.set_result(None)  # both gets raised with the same transfer: both end now
        manager.poll()
        assert manager.stats.quarantined_slots == 0
        stored = manager.prepare_store([key(n) for n in range(4)])
        assert stored is not None and len(stored.keys_to_store) == 4 and not stored.evicted_keys
    finally:
        engine.close()


def test_an_engine_never_started_or_failing_to_start_closes_its_loop():
    idle = TierEngine([FakeTier()])
    idle.close()
    assert idle._loop.is_closed()
    failing = TierEngine([FakeTier(fail_open=True)])
    with pytest.raises(TierError, match="cannot start"):
        failing.start(None)
    assert failing._loop.is_closed() and not failing._thread.is_alive()


@pytest.mark.parametrize(("before", "after"), [(0.005, GIL_SWITCH_INTERVAL_S), (0.0001, 0.0001)])
def test_starting_shortens_the_gil_switch_interval_and_never_lengthens_it(before, after):
    """A promotion's GIL hand-offs must not each wait Python's 5 ms while the engine's loop
    spins (vLLM's engine core does); a host's shorter setting is kept."""
    saved = sys.getswitchinterval()
    try:
        sys.setswitchinterval(before)
        engine = TierEngine([FakeTier()])
        engine.start(None)
        engine.close()
        assert sys.getswitchinterval() == pytest.approx(after)
    finally:
        sys.setswitchinterval(saved)


class AbandoningTier(FakeTier):
    """A get that lands the first row and gives the rest up while they may still be written."""

    async def get(self, rows: Sequence[Row], layouts: list[bytes | None] | None = None) -> list[bool]:
        raise RowsAbandoned("no answer from the peer", [True] + [False] * (len(rows) - 1))


@pytest.mark.parametrize(
    "tier, abandoned, ok", [(FakeTier(), False, [False] * 3), (AbandoningTier(), True, [True, False, False])]
)
def test_an_abandoned_get_keeps_its_hits_and_says_the_rest_may_still_be_written(tier, abandoned, ok):
    """``RowsAbandoned`` is a result, not a failure of every key: the rows that landed stay
    hits, and the op is marked abandoned so the manager never reuses the others' slots. The
    control: a plain miss is not abandoned."""
    engine = TierEngine([tier])
    engine.start(None)
    try:
        rows = [(b"k%d" % i, memoryview(bytearray(8))) for i in range(3)]
        assert engine.submit_get(7, 0, rows)
        assert engine.wait_idle(5)
        (result,) = engine.drain()
        assert (result.op_id, result.abandoned, result.ok) == (7, abandoned, ok)
    finally:
        engine.close()


def test_call_verbs_return_each_result_in_a_future_never_in_the_queue():
    tier = FakeTier(abandon_gets=True)
    engine = TierEngine([tier], max_inflight=1)
    engine.start(None)
    try:
        put = engine.call_put(0, [(b"k", memoryview(b"row"))]).result(5)
        assert (put.kind, put.ok, put.abandoned, put.ended) == (OpKind.PUT, [True], False, None)
        got = engine.call_get(0, [(b"k", memoryview(bytearray(3)))]).result(5)
        assert (got.kind, got.ok, got.abandoned) == (OpKind.GET, [False], True)
        assert got.ended is tier.transfer  # the caller's to wait for: no RELEASE is queued
        assert engine.call_contains(0, [b"k"]).result(5).ok == [False]
        assert engine.call_delete(0, [b"k"]).result(5).ok == [True]
        tier.transfer.set_result(None)
        assert engine.wait_idle(5) and engine.drain() == []
        assert engine._take_slot(OpKind.PUT, 0)  # the one slot taken: a saturated tier
        refused = engine.call_put(0, [(b"k", memoryview(b"row"))]).result(0)
        assert refused.ok == [False] and not refused.abandoned
        engine._inflight[0] -= 1  # the slot taken by hand, given back
    finally:
        engine.close()
