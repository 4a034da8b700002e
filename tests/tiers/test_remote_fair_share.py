"""``TenantShares``: per tenant, transfers and bytes in flight bounded; waiters in order."""

from __future__ import annotations

import asyncio
import time

import pytest

from tiers.remote.fair_share import Busy, TenantShares


def soon(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


async def test_a_tenant_waits_behind_itself_only():
    shares = TenantShares(max_transfers=2, max_bytes=100)
    await shares.acquire("a", 1, 60, soon())
    await shares.acquire("a", 1, 40, soon())
    waiting = asyncio.create_task(shares.acquire("a", 1, 1, soon()))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # a's share is full (two transfers, 100 B)
    await shares.acquire("b", 1, 100, soon())  # b is not behind a
    assert shares.in_flight("b") == (1, 100)
    shares.release("a", 60)
    await asyncio.wait_for(waiting, 1.0)
    assert shares.in_flight("a") == (2, 41)


async def test_bytes_bound_and_a_larger_request_runs_alone():
    shares = TenantShares(max_transfers=8, max_bytes=100)
    await shares.acquire("a", 1, 250, soon())  # larger than a share: admitted with nothing in flight
    second = asyncio.create_task(shares.acquire("a", 1, 10, soon()))
    await asyncio.sleep(0.01)
    assert not second.done()
    shares.release("a", 250)
    await asyncio.wait_for(second, 1.0)
    shares.release("a", 10)
    assert shares.in_flight("a") == (0, 0)


async def test_waiters_are_admitted_in_order_and_a_late_one_is_busy():
    shares = TenantShares(max_transfers=1, max_bytes=1 << 20)
    await shares.acquire("a", 1, 1, soon())
    order: list[int] = []

    async def wait(i: int) -> None:
        await shares.acquire("a", 1, 1, soon())
        order.append(i)

    waiters = [asyncio.create_task(wait(i)) for i in range(3)]
    await asyncio.sleep(0.01)
    with pytest.raises(Busy, match="1 of 1 transfers"):
        await shares.acquire("a", 1, 1, soon(0.02))  # its deadline passes in the queue
    for i in range(3):
        shares.release("a", 1)
        await asyncio.wait_for(waiters[i], 1.0)
    assert order == [0, 1, 2]
    shares.release("a", 1)
    assert shares.in_flight("a") == (0, 0)


async def test_a_connection_that_ends_abandons_only_its_own_waiters():
    shares = TenantShares(max_transfers=1, max_bytes=10)
    await shares.acquire("a", 1, 10, soon())
    gone = asyncio.create_task(shares.acquire("a", 2, 5, soon()))
    stays = asyncio.create_task(shares.acquire("a", 3, 5, soon()))
    await asyncio.sleep(0.01)
    shares.abandon(2)
    with pytest.raises(Busy, match="connection ended"):
        await gone
    shares.release("a", 10)
    await asyncio.wait_for(stays, 1.0)
    assert shares.in_flight("a") == (1, 5)


async def test_a_cancelled_waiter_leaves_nothing_behind():
    shares = TenantShares(max_transfers=1, max_bytes=10)
    await shares.acquire("a", 1, 10, soon())
    first = asyncio.create_task(shares.acquire("a", 1, 10, soon()))
    second = asyncio.create_task(shares.acquire("a", 1, 1, soon()))
    await asyncio.sleep(0.01)
    first.cancel()  # its connection ended: it gives up its place
    shares.release("a", 10)
    await asyncio.wait_for(second, 1.0)
    assert first.cancelled() and shares.in_flight("a") == (1, 1)
    shares.release("a", 1)
    assert shares.in_flight("a") == (0, 0) and not shares._shares  # nothing kept per tenant
