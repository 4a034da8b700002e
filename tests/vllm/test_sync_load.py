"""A kvtier host-tier hit loaded synchronously (vLLM 0.33's ``sync_load_budget_bytes``) costs
no engine step more than a hit of vLLM's own device cache; loaded asynchronously (vLLM's
default) it costs at least one. Through vLLM's real Scheduler and OffloadingConnector
(``harness.Engine``), the loaded bytes checked."""

from __future__ import annotations

import importlib
import inspect

import pytest

pytest.importorskip("vllm")

from tests.vllm.harness import BLOCK_SIZE, Engine

PREFIX = list(range(300, 460))  # 160 tokens: 10 blocks


def _has_sync_loads() -> bool:
    scheduler = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler")
    return "sync_load_budget_bytes" in inspect.getsource(scheduler)


def steps_to_first_token(engine: Engine, prompt: list[int]) -> tuple[int, int]:
    """Engine steps from a request's arrival until it has its first token, and how many of
    its prompt's token slots then hold the bytes the model computed for them."""
    req_id = engine.add(prompt, max_tokens=2)
    start = engine.steps
    for _ in range(200):
        engine.step()
        request = engine.scheduler.requests.get(req_id)
        if request is not None and request.num_output_tokens >= 1:
            return engine.steps - start, engine.verify(req_id, 0, len(PREFIX))
    raise AssertionError("no first token in 200 steps")


def device_and_host_hit_steps(engine: Engine) -> tuple[int, int]:
    steps_to_first_token(engine, [*PREFIX, 1])
    engine.run()
    device, _ = steps_to_first_token(engine, [*PREFIX, 2])
    engine.run()
    engine.evict_device_cache()
    engine.scramble()  # only a load can bring the prefix's bytes back
    loaded = engine.manager.manager.stats.loaded_rows
    host, checked = steps_to_first_token(engine, [*PREFIX, 3])
    engine.run()
    assert engine.manager.manager.stats.loaded_rows - loaded == len(PREFIX) // BLOCK_SIZE
    assert checked > 0  # the slots checked held the bytes the model computed
    return device, host


@pytest.mark.skipif(not _has_sync_loads(), reason="this vLLM has no sync_load_budget_bytes (0.33 has)")
def test_a_host_hit_takes_the_steps_of_a_device_hit_by_default(make_engine):
    """kvtier's spec opts into vLLM's sync loads (``SYNC_LOAD_BUDGET_BYTES``)."""
    device, host = device_and_host_hit_steps(make_engine(sync_loads=True))
    assert host == device


def test_an_async_loaded_host_hit_takes_at_least_one_step_more(make_engine):
    """What a hit costs without sync loads: the user turned them off (0), or vLLM lacks them."""
    device, host = device_and_host_hit_steps(make_engine(sync_loads=False))
    assert host >= device + 1
