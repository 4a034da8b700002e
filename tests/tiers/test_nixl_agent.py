"""``AgentThread.transfer``: a call's parts as one job, each part's outcome, with real NIXL.

Two agents in this process (UCX moves the bytes by CMA, as between processes): the first
WRITEs and READs the second's registered buffer. Failures are real too: an agent name
that was never added, a deadline already passed. Every test runs with the parts' hooks on
a thread beside the agent's (the default) and on the agent's own thread.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from tiers.remote.nixl_agent import AgentThread, TransferError, TransferTimeout, descriptors

os.environ.setdefault("UCX_NET_DEVICES", "lo")

ROW = 64 << 10
ROWS = 6


@pytest.fixture(params=[True, False], ids=["after-thread", "inline"])
async def pair(request):
    """(local agent, remote agent's name in it, local rows, remote rows)."""
    local = AgentThread(f"test-local-{os.getpid()}", after_thread=request.param)
    remote = AgentThread(f"test-remote-{os.getpid()}")
    src = np.random.default_rng(0).integers(0, 256, ROWS * ROW, dtype=np.uint8)
    dst = np.zeros(ROWS * ROW, dtype=np.uint8)
    await local.start(30)
    await remote.start(30)
    progress = None
    try:
        for agent, buf in ((local, src), (remote, dst)):
            region = (buf.ctypes.data, buf.nbytes, 0, "")
            await agent.call(lambda a, r=region: a.register_memory([r], "DRAM"), 10)
        metadata = await remote.call(lambda a: a.get_agent_metadata(), 10)
        name = await local.call(lambda a: a.add_remote_agent(metadata), 10)
        progress = asyncio.create_task(serve(remote))
        yield local, name.decode() if isinstance(name, bytes) else name, src, dst
    finally:
        if progress is not None:
            progress.cancel()
        await asyncio.to_thread(local.close)
        await asyncio.to_thread(remote.close)


async def serve(agent: AgentThread) -> None:
    """Progress the target like ``kvtier peer`` does (no progress thread): the first transfer
    towards it needs it to answer the transport's wire-up."""
    while True:
        agent.submit(lambda a: a.get_new_notifs())
        await asyncio.sleep(0.001)


def rows_of(buf: np.ndarray, order: list[int]) -> np.ndarray:
    return descriptors([buf.ctypes.data + i * ROW for i in order], [ROW] * len(order))


async def settle(future) -> list:
    return await asyncio.wait_for(asyncio.wrap_future(future), 10)


async def test_parts_move_in_order_each_followed_by_its_hook(pair):
    agent, name, src, dst = pair
    order = [5, 0, 3, 1, 4, 2]  # rows land in other slots than they came from
    seen: list[int] = []

    def after(k: int) -> int:
        seen.append(k)
        return k * 10

    future = agent.transfer(
        "WRITE",
        rows_of(src, list(range(ROWS))),
        rows_of(dst, order),
        [2, 1, 3],
        name,
        time.monotonic() + 5,
        after=after,
    )
    assert await settle(future) == [0, 10, 20]
    assert sorted(seen) == [0, 1, 2]  # each once (two threads may run them)
    for i, slot in enumerate(order):
        assert np.array_equal(dst[slot * ROW : (slot + 1) * ROW], src[i * ROW : (i + 1) * ROW])

    src[:] = 0
    back = agent.transfer(
        "READ", rows_of(src, list(range(ROWS))), rows_of(dst, order), [6], name, time.monotonic() + 5
    )
    assert await settle(back) == [None]
    assert np.array_equal(src[:ROW], dst[5 * ROW : 6 * ROW])


async def test_a_failing_hook_fails_its_part_only(pair):
    agent, name, src, dst = pair

    def after(k: int) -> str:
        if k == 1:
            raise ValueError("bad part")
        return "ok"

    future = agent.transfer(
        "WRITE",
        rows_of(src, [0, 1, 2]),
        rows_of(dst, [0, 1, 2]),
        [1, 1, 1],
        name,
        time.monotonic() + 5,
        after=after,
    )
    first, second, third = await settle(future)
    assert first == third == "ok"
    assert isinstance(second, ValueError)


async def test_an_unknown_remote_agent_fails_every_part(pair):
    agent, _name, src, dst = pair
    future = agent.transfer(
        "WRITE", rows_of(src, [0, 1]), rows_of(dst, [0, 1]), [1, 1], "nobody", time.monotonic() + 5
    )
    outcomes = await settle(future)
    assert len(outcomes) == 2 and all(isinstance(o, TransferError) for o in outcomes)


async def test_a_passed_deadline_fails_every_part_with_a_timeout(pair):
    agent, name, src, dst = pair
    future = agent.transfer(
        "READ", rows_of(dst, [0, 1]), rows_of(src, [0, 1]), [1, 1], name, time.monotonic() - 1
    )
    outcomes = await settle(future)
    assert len(outcomes) == 2 and all(isinstance(o, TransferTimeout) for o in outcomes)


async def test_parts_must_cover_the_descriptors(pair):
    agent, name, src, dst = pair
    with pytest.raises(ValueError, match="parts of 3 descriptors"):
        agent.transfer(
            "WRITE", rows_of(src, [0, 1]), rows_of(dst, [0, 1]), [1, 2], name, time.monotonic() + 5
        )
    assert (
        await settle(agent.transfer("WRITE", rows_of(src, []), rows_of(dst, []), [], name, time.monotonic()))
        == []
    )


def write_each(agent: AgentThread, name: str, src, dst, rows: list[int], after, seconds: float = 5.0):
    """WRITE ``rows`` of ``src`` to the same rows of ``dst``, one part per row."""
    return agent.transfer(
        "WRITE",
        rows_of(src, rows),
        rows_of(dst, rows),
        [1] * len(rows),
        name,
        time.monotonic() + seconds,
        after=after,
    )


def recording_threads() -> tuple[list[str], Callable[[int], int]]:
    """A hook that returns its part's index, and the names of the threads it ran on."""
    threads: list[str] = []

    def after(k: int) -> int:
        threads.append(threading.current_thread().name)
        return k

    return threads, after


def beside(threads: list[str]) -> bool:
    return any(t.startswith("nixl-after-") for t in threads)


async def test_a_stuck_hook_thread_holds_no_call_up(pair):
    """While the thread beside the agent's is stuck in a hook (as if the scheduler had set it
    aside), every call still completes: the agent's thread runs the hooks of its parts, the
    stuck one's too (a hook is pure; a part's first outcome counts)."""
    agent, name, src, dst = pair
    if agent._after is None:
        pytest.skip("no thread beside the agent's")
    stuck, release = threading.Event(), threading.Event()

    def block_beside(k: int) -> str:
        if beside([threading.current_thread().name]):
            stuck.set()
            release.wait(10)
            return "beside"
        return "inline"

    try:
        for _ in range(50):  # until a hook lands on the thread beside (it may run inline)
            agent._serial_calls = 0  # offer parts, however crowded the last call found the cores
            first = write_each(agent, name, src, dst, list(range(ROWS)), block_beside, seconds=20)
            assert await settle(first) == ["inline"] * ROWS
            if await asyncio.to_thread(stuck.wait, 0.05):
                break
        assert stuck.is_set(), "no hook ever ran beside the agent's thread"
        threads, after = recording_threads()
        assert await settle(write_each(agent, name, src, dst, [1, 2, 3, 4], after)) == [0, 1, 2, 3]
        assert len(threads) == 4 and not beside(threads)
    finally:
        release.set()
    assert np.array_equal(dst, src)


async def test_calls_after_a_crowded_one_run_their_hooks_on_the_agent_thread(pair):
    """Once a call found no core free for the thread beside (``_serial_calls`` set), the
    next calls run every hook on the agent's thread, then the thread beside is tried again."""
    agent, name, src, dst = pair
    if agent._after is None:
        pytest.skip("no thread beside the agent's")
    agent._serial_calls = 2  # as set on the agent's thread after a crowded call
    for _ in range(2):
        threads, after = recording_threads()
        assert await settle(write_each(agent, name, src, dst, list(range(ROWS)), after)) == list(range(ROWS))
        assert len(threads) == ROWS and not beside(threads)
    assert agent._serial_calls == 0  # counted down (a call that offers nothing measures nothing)
    assert np.array_equal(dst, src)


async def test_crowded_calls_keep_hooks_on_the_agent_thread_for_longer_and_longer(pair, monkeypatch):
    """A call during which the agent's thread got no CPU time (as where no core is free
    beside it) sets the next calls to hash on it, twice as many each time; a call on a CPU
    all along starts over."""
    agent, name, src, dst = pair
    if agent._after is None:
        pytest.skip("no thread beside the agent's")

    async def offering_call_until(measured: Callable[[], bool]) -> None:
        # only a call whose parts all copied inside transfer() is measured; the first ones
        # towards a new remote agent wait for its wire-up (PROC)
        for _ in range(50):
            agent._serial_calls = 0
            _, after = recording_threads()
            assert await settle(write_each(agent, name, src, dst, list(range(ROWS)), after)) == list(
                range(ROWS)
            )
            await agent.call(lambda a: None, 5)  # the agent's thread is past that call's measure
            if measured():
                return
        raise AssertionError("no call was measured")

    monkeypatch.setattr(time, "thread_time", lambda: 0.0)  # never on a CPU
    await offering_call_until(lambda: agent._serial_calls > 0)
    assert (agent._serial_calls, agent._serial_span) == (8, 16)
    await offering_call_until(lambda: agent._serial_calls > 0)
    assert (agent._serial_calls, agent._serial_span) == (16, 32)
    monkeypatch.setattr(time, "thread_time", time.perf_counter)  # on a CPU all along
    await offering_call_until(lambda: agent._serial_span == 8)
    assert agent._serial_calls == 0
    assert np.array_equal(dst, src)
