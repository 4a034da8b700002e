"""The adapter's lookup: the manager's own host lookup while nothing else is needed."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


def adapter(tmp_path):
    from bench.scheduler_driver import factory_manager

    return factory_manager(4, "lru", str(tmp_path))


def key(i: int) -> bytes:
    from bench.vllm_baseline import offload_key

    return offload_key(i)


def test_host_only_lookups_answer_in_vllms_values(tmp_path):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    a = adapter(tmp_path)
    try:
        ctx = ReqContext(req_id="r")
        a.complete_store(a.prepare_store([key(1)], ctx).keys_to_store, ctx)
        a.prepare_store([key(2)], ctx)
        assert "lookup" in a.__dict__  # the manager's function, no frame of the adapter's
        found = [a.lookup(key(i), ctx) for i in (1, 2, 3)]
        assert found == [LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS]
        assert a.manager.stats.lookups == 3
    finally:
        a.shutdown()


def test_a_reset_takes_the_gated_lookup_until_its_jobs_are_flushed(tmp_path):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    a = adapter(tmp_path)
    try:
        ctx = ReqContext(req_id="r")
        a.complete_store(a.prepare_store([key(1)], ctx).keys_to_store, ctx)
        a.prepare_store([key(2)], ctx)  # in flight at the reset
        a.reset_cache()
        assert a._flush_pending and "lookup" not in a.__dict__
        assert a.lookup(key(1), ctx) is LookupResult.MISS  # emptied
        a.on_reset_flushed()
        assert "lookup" in a.__dict__
        a.complete_store(a.prepare_store([key(1)], ctx).keys_to_store, ctx)
        assert a.lookup(key(1), ctx) is LookupResult.HIT
    finally:
        a.shutdown()


def test_completing_loads_and_stores_records_their_host_latency(tmp_path):
    from vllm.v1.kv_offload.base import ReqContext

    a = adapter(tmp_path)
    try:
        ctx, other = ReqContext(req_id="r"), ReqContext(req_id="s")
        first = a.prepare_store([key(1), key(2)], ctx).keys_to_store
        second = a.prepare_store([key(3)], other).keys_to_store
        a.complete_store(second + first, ctx)  # one call completing both: one sample
        a.prepare_load([key(1)], ctx)
        a.complete_load([key(1)], ctx)
        histograms = a.latency.histograms
        assert histograms == {} and len(a._host_stores) == 1  # not recorded until asked
        assert 'kvtier_store_latency_seconds_count{tier="host"} 1' in a.metrics_text()
        assert histograms[("load", "host")].count == 1 and a._host_stores == []
        assert a._store_started == {} and a._load_started == {}
    finally:
        a.shutdown()


def test_a_completion_takes_the_earliest_start_of_the_calls_it_completes():
    from offload.vllm.manager_adapter import _pop_started

    started = {b"a": 2.0, b"c": 1.0, b"x": 0.5}
    assert _pop_started(started, [b"a", b"b", b"c"]) == 1.0  # its first key's, and another's
    assert started == {b"x": 0.5}
    assert _pop_started(started, [b"y"]) is None and started == {b"x": 0.5}
    assert _pop_started(started, (b"x",)) == 0.5 and started == {}
