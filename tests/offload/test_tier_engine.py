"""The tier engine's lifecycle: ``close`` leaves no loop, thread or descriptor behind."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import pytest

from offload.tier_engine import GIL_SWITCH_INTERVAL_S, TierEngine
from tiers.base import AbandonedRows, LowerTier, Row, TierError


class FakeTier(LowerTier):
    kind = "fake"

    def __init__(self, fail_open: bool = False, abandon_gets: bool = False) -> None:
        self.fail_open = fail_open
        self.abandon_gets = abandon_gets
        self.closed = False

    async def open(self, host_buffer: memoryview | None = None) -> None:
        if self.fail_open:
            raise TierError("cannot start")

    def may_contain(self, key: bytes) -> bool:
        return False

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [False] * len(keys)

    async def put(self, rows: Sequence[Row]) -> list[bool]:
        return [True] * len(rows)

    async def get(self, rows: Sequence[Row], layouts: list[bytes | None] | None = None) -> list[bool]:
        if self.abandon_gets:
            raise AbandonedRows("the store's call still runs")
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


def test_a_get_the_tier_abandons_is_reported_abandoned_so_its_slots_are_never_reused():
    engine = TierEngine([FakeTier(abandon_gets=True)])
    engine.start(None)
    try:
        assert engine.submit_get(7, 0, [(b"k1", memoryview(bytearray(3))), (b"k2", memoryview(bytearray(3)))])
        assert engine.wait_idle(5)
        (result,) = engine.drain()
        assert (result.op_id, result.ok, result.abandoned) == (7, [False, False], True)
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
