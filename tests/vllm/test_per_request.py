"""Per-request control through vLLM's ``kv_transfer_params``, as vLLM's own tiers take it:
``max_offload_tokens`` (vLLM's scheduler stores no chunk past it: 0 stores nothing, in any
tier), ``max_load_tokens`` (nor loads one past it) and ``kv_load_tiers`` (kvtier's manager
promotes from, and asks, only the lower tiers it names; the host tier is always looked in).
Each check is paired with the same request without the parameter, which stores or loads."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import Locality, Medium, ReqContext, TierFilter, TierMatcher

from offload.vllm.tier_filter import lower_tiers_allowed
from tests.vllm.harness import BLOCK_SIZE
from tests.vllm.test_lower_tiers import PREFIX, disk_toml, remote_toml, stored_then_host_reset

PROMPT = PREFIX + list(range(500, 540))  # 200 tokens: 12 full blocks
FULL = len(PROMPT) // BLOCK_SIZE * BLOCK_SIZE
HOST_ONLY = {"kv_load_tiers": [{"medium": "CPU"}]}


def settled(engine):
    """The engine's manager once its lower-tier copies have finished and been applied."""
    manager = engine.manager.manager
    assert manager.wait_idle(10)
    manager.poll()
    return manager


def test_max_offload_tokens_zero_stores_the_prompt_in_no_tier(make_engine, tmp_path):
    engine = make_engine(kvtier_config=disk_toml(tmp_path))
    engine.add(PROMPT, kv_transfer_params={"max_offload_tokens": 0})
    engine.run()
    manager = settled(engine)
    assert manager.stats.stored_rows == 0
    assert len(manager) == 0
    assert manager.lower.stats.spills_started == 0
    assert manager.lower.tiers[0].stats().get("rows", 0) == 0

    # Not findable later: the same prompt again (device cache gone) misses kvtier.
    engine.evict_device_cache()
    again = engine.add(PROMPT)
    engine.run()
    assert engine.requests[again].loaded == []
    assert set(range(FULL)) <= engine.requests[again].computed

    # That request, without the parameter, stored it in both tiers; a third one loads it.
    manager = settled(engine)
    assert manager.stats.stored_rows == FULL // BLOCK_SIZE
    assert manager.lower.stats.spills_done == FULL // BLOCK_SIZE
    engine.evict_device_cache()
    third = engine.add(PROMPT)
    engine.run()
    assert engine.requests[third].loaded == [(0, FULL)]


def test_max_offload_tokens_caps_what_a_request_stores(make_engine):
    engine = make_engine()
    engine.add(PROMPT, kv_transfer_params={"max_offload_tokens": 4 * BLOCK_SIZE + 5})
    engine.run()
    manager = engine.manager.manager
    assert manager.stats.stored_rows == 4

    engine.evict_device_cache()
    again = engine.add(PROMPT)
    engine.run()
    assert engine.requests[again].loaded == [(0, 4 * BLOCK_SIZE)]  # the capped part only
    assert manager.stats.stored_rows == FULL // BLOCK_SIZE  # the rest, stored by this one


def test_max_load_tokens_caps_what_a_request_loads(make_engine):
    engine = make_engine()
    engine.add(PROMPT)
    engine.run()
    engine.evict_device_cache()
    capped = engine.add(PROMPT, kv_transfer_params={"max_load_tokens": 3 * BLOCK_SIZE})
    engine.run()
    assert engine.requests[capped].loaded == [(0, 3 * BLOCK_SIZE)]
    engine.evict_device_cache()
    again = engine.add(PROMPT)  # without the parameter: the whole prompt
    engine.run()
    assert engine.requests[again].loaded == [(0, FULL)]


@pytest.mark.parametrize(
    ("load_tiers", "from_disk"),
    [
        ([{"medium": "CPU"}], False),
        ([], False),  # vLLM: an explicit empty list names no lower tier
        ([{"locality": "REMOTE"}], False),
        ([{"medium": "storage", "locality": "local"}], True),
    ],
)
def test_kv_load_tiers_chooses_the_lower_tiers_a_request_loads_from(
    make_engine, tmp_path, load_tiers, from_disk
):
    engine, _ = stored_then_host_reset(make_engine, tmp_path)  # PREFIX is on disk only
    prompt = PREFIX + list(range(600, 630))
    filtered = engine.add(prompt, kv_transfer_params={"kv_load_tiers": load_tiers})
    engine.run()
    lower = engine.manager.manager.lower
    if from_disk:
        assert engine.requests[filtered].loaded == [(0, len(PREFIX))]
        assert lower.stats.promotions_done >= len(PREFIX) // BLOCK_SIZE
        return
    assert engine.requests[filtered].loaded == []
    assert set(range(len(PREFIX))) <= engine.requests[filtered].computed
    assert lower.stats.promotions_started == 0

    # The same request without the parameter, the host tier emptied again, loads from disk
    # (the whole prompt: the filtered request, which computed it, stored it there too).
    assert engine.scheduler.reset_connector_cache()
    engine.evict_device_cache()
    engine.scramble()
    again = engine.add(prompt)
    engine.run()
    assert engine.requests[again].loaded == [(0, len(prompt) // BLOCK_SIZE * BLOCK_SIZE)]
    assert lower.stats.promotions_done >= len(PREFIX) // BLOCK_SIZE


def test_kv_load_tiers_host_only_still_loads_from_the_host_tier(make_engine, tmp_path):
    engine = make_engine(kvtier_config=disk_toml(tmp_path))
    engine.add(PROMPT)
    engine.run()
    engine.evict_device_cache()
    engine.scramble()
    again = engine.add(PROMPT, kv_transfer_params=HOST_ONLY)
    engine.run()
    assert engine.requests[again].loaded == [(0, FULL)]
    assert engine.manager.loads_by_tier == {"host": FULL // BLOCK_SIZE}


def test_the_filter_is_read_once_per_request_by_medium_and_locality():
    kinds = ["disk", "remote", "mooncake"]
    cases = {
        TierFilter.ALL: {0, 1, 2},
        TierFilter(()): set(),
        TierFilter((TierMatcher(Medium.CPU),)): set(),
        TierFilter((TierMatcher(Medium.STORAGE),)): {0, 1, 2},
        TierFilter((TierMatcher(locality=Locality.LOCAL),)): {0},
        TierFilter((TierMatcher(Medium.STORAGE, Locality.REMOTE),)): {1, 2},
    }
    for load_filter, allowed in cases.items():
        ctx = ReqContext("r", load_tier_filter=load_filter)
        assert lower_tiers_allowed(ctx, kinds) == allowed
        assert lower_tiers_allowed(ctx, []) == allowed  # kept: read once per request
        assert lower_tiers_allowed(ReqContext("s", load_tier_filter=load_filter), []) == frozenset()


@pytest.fixture
def peer(tmp_path):
    from tests.tiers.peer_fixtures import start_peers

    (process,) = start_peers(tmp_path, 1, capacity="64MiB", row_bytes="1MiB")
    yield process
    process.close()


@pytest.mark.multiprocess
def test_kv_load_tiers_local_does_not_ask_the_peers(make_engine, tmp_path, peer):
    writer = make_engine(kvtier_config=remote_toml(tmp_path, peer.address))
    writer.add(PROMPT)
    writer.run()
    assert settled(writer).lower.stats.spills_done == FULL // BLOCK_SIZE

    reader = make_engine(
        kvtier_config=remote_toml(tmp_path, peer.address, "lookup_wait_s = 8.0", name="wait.toml")
    )
    local = reader.add(PROMPT, kv_transfer_params={"kv_load_tiers": [{"locality": "LOCAL"}]})
    reader.run()
    lower = reader.manager.manager.lower
    assert reader.requests[local].loaded == []
    assert lower.stats.checks_asked == 0  # no key of it went to a peer

    assert reader.scheduler.reset_connector_cache()
    reader.evict_device_cache()
    reader.scramble()
    again = reader.add(PROMPT)  # without the parameter: promoted from the peer
    reader.run()
    assert reader.requests[again].loaded == [(0, FULL)]
    assert lower.stats.promotions_done == FULL // BLOCK_SIZE
