"""kvtier as vLLM's offloading spec, through vLLM's real Scheduler and OffloadingConnector.

Every test runs requests through ``harness.Engine`` (KV caches as CPU tensors) and checks
the KV bytes themselves: a prefix that comes back from kvtier must hold exactly what the
model computed for it, in every layer of every group.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.vllm.harness import BLOCK_SIZE, Engine

PREFIX = list(range(100, 260))  # 160 tokens: 10 blocks
LAYOUTS = ["LBHNC", "BLHNC"]  # a region per layer / every layer a view of one block-major tensor


def loaded_rows(engine: Engine) -> int:
    return engine.manager.manager.stats.loaded_rows


@pytest.mark.parametrize("layout", LAYOUTS)
def test_repeated_prefix_comes_back_from_kvtier_byte_exact(make_engine, layout):
    engine = make_engine(layout=layout, num_gpu_blocks=32)
    first = engine.add(PREFIX + list(range(500, 540)))
    engine.run()
    # Other requests push the first one's blocks out of the device prefix cache.
    for filler in range(3):
        engine.add([2000 + 200 * filler + i for i in range(200)])
        engine.run()
    engine.scramble()  # a block that kvtier did not write back now holds noise

    again = engine.add(PREFIX + list(range(600, 630)))
    engine.run()

    record = engine.requests[again]
    assert record.loaded == [(0, len(PREFIX))], "the shared prefix must come from kvtier, all of it"
    assert not record.computed & set(range(len(PREFIX))), "no prefix token may be recomputed"
    assert min(record.computed) == len(PREFIX)
    assert loaded_rows(engine) == len(PREFIX) // BLOCK_SIZE
    assert engine.requests[first].finished and record.finished
    # vLLM handed a packed layout as one full-row tensor per group: one segment per block.
    caches = engine.spec._worker.worker.caches
    assert caches.segments_per_block(0) == (1 if layout == "BLHNC" else 4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_attention_and_sliding_window_groups_both_come_back(make_engine, layout):
    engine = make_engine(layout=layout, hybrid=True)
    engine.add(PREFIX)
    engine.run()
    engine.evict_device_cache()
    engine.scramble()

    again = engine.add(PREFIX + list(range(600, 640)))
    engine.run()

    record = engine.requests[again]
    (start, end) = record.loaded[0]
    assert (start, end) == (0, 144)  # the last chunk of the prompt is never stored (see vLLM's store rule)
    full_blocks = end // BLOCK_SIZE
    window_blocks = 48 // BLOCK_SIZE  # the sliding-window group loads only what attention reaches
    assert loaded_rows(engine) == full_blocks + window_blocks
    groups = {key[-4:] for key in engine.manager.manager._slots}
    assert groups == {(0).to_bytes(4, "big"), (1).to_bytes(4, "big")}


def test_blocks_per_chunk_2_loads_from_the_middle_of_a_chunk(make_engine):
    engine = make_engine(blocks_per_chunk=2)
    engine.add(PREFIX)  # 10 blocks: 5 chunks of 2
    engine.run()
    engine.evict_device_cache()
    engine.scramble()
    # A request sharing 3 blocks loads chunk 0 and computes block 2: the device cache then
    # holds blocks 0-2, so the next load starts at block 3, the second half of chunk 1.
    short = engine.add(PREFIX[: 3 * BLOCK_SIZE] + list(range(900, 920)))
    engine.run()
    assert engine.requests[short].loaded == [(0, 2 * BLOCK_SIZE)]

    starts = []
    submit_load = engine.spec._worker.worker.submit_load

    def recording(job_id, blocks, slots, *, first_sub_rows=None):
        starts.append(list(first_sub_rows))
        return submit_load(job_id, blocks, slots, first_sub_rows=first_sub_rows)

    engine.spec._worker.worker.submit_load = recording
    again = engine.add(PREFIX + list(range(600, 620)))
    engine.run()

    assert starts == [[1]]
    record = engine.requests[again]
    assert record.loaded == [(0, len(PREFIX))]  # blocks 0-2 from the device cache, 3-9 from kvtier
    assert not record.computed & set(range(len(PREFIX)))


def test_a_preempted_request_reloads_its_prompt_from_kvtier(make_engine):
    engine = make_engine(num_gpu_blocks=24)
    first = engine.add(PREFIX, max_tokens=100)
    second = engine.add([3000 + i for i in range(160)], max_tokens=100)
    engine.run()

    records = [engine.requests[first], engine.requests[second]]
    assert all(r.finished for r in records)
    preempted = [r for r in records if r.preempted]
    assert preempted, "the two requests cannot both fit: one must be preempted"
    assert any(r.loaded for r in preempted), "a resumed request loads its stored prompt back"
    for record in preempted:
        for start, end in record.loaded:
            assert end >= BLOCK_SIZE and start == 0


def test_reset_cache_empties_the_host_tier_and_later_requests_store_again(make_engine):
    engine = make_engine(enable_events=True)
    published = []
    engine.scheduler.kv_event_publisher.publish = published.append
    engine.add(PREFIX)
    engine.step()  # prefill: its store jobs are created now and run during the next step
    assert engine.manager.manager.stats.stored_rows == 0

    assert engine.scheduler.reset_connector_cache()  # with those stores still in flight
    adapter = engine.manager
    assert len(adapter.manager) == 0 and adapter.manager.held_by_caller() == ({}, [])
    engine.run()  # the stale jobs finish and are skipped; nothing is left pinned or pending
    assert len(adapter.manager) == 0
    assert not adapter._flush_pending and not adapter._reset_pending

    engine.evict_device_cache()
    again = engine.add(PREFIX + list(range(600, 620)))
    engine.run()
    assert engine.requests[again].loaded == []  # nothing survived the reset
    assert len(adapter.manager) > 0  # and the new request's blocks were stored

    host_events = [e for batch in published for e in batch.events if getattr(e, "medium", None) == "CPU"]
    stored = [h for e in host_events if type(e).__name__ == "BlockStored" for h in e.block_hashes]
    assert len(stored) == engine.manager.manager.stats.stored_rows > 0


def test_host_evictions_are_events_and_metrics(make_engine):
    engine = make_engine(enable_events=True, cpu_bytes_to_use=12 * 4096)  # 12 rows
    published = []
    engine.scheduler.kv_event_publisher.publish = published.append
    payloads = []
    get_stats = engine.manager.get_stats

    def recording_get_stats():
        stats = get_stats()
        payloads.append(stats)
        return stats

    engine.manager.get_stats = recording_get_stats
    for request in range(3):
        engine.add([5000 + 300 * request + i for i in range(160)])
        engine.run()
    engine.evict_device_cache()
    engine.add([5600 + i for i in range(160)] + [1])
    engine.run()

    events = [e for batch in published for e in batch.events if getattr(e, "medium", None) == "CPU"]
    removed = [h for e in events if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]
    stored = [h for e in events if type(e).__name__ == "BlockStored" for h in e.block_hashes]
    stats = engine.manager.manager.stats
    assert len(removed) == stats.evictions > 0
    assert len(stored) == stats.stored_rows
    assert engine.requests[f"req-{3}"].loaded, "the most recent request's prefix is still in the host tier"

    totals: dict = {}
    for payload in payloads:
        for name, values in payload.data["data"].items():
            if payload.data["types"][name] == "counter":
                for labels, value in values.items():
                    totals[name, labels] = totals.get((name, labels), 0) + value
    row = engine.manager.row_bytes
    assert totals["vllm:kv_offload_kvtier_evictions", ("host",)] == stats.evictions
    assert totals["vllm:kv_offload_kvtier_hits", ("host",)] == stats.hits
    assert totals["vllm:kv_offload_kvtier_written_bytes", ("host",)] == stats.stored_rows * row
    assert totals["vllm:kv_offload_kvtier_read_bytes", ("host",)] == stats.loaded_rows * row
    latencies = [
        value
        for payload in payloads
        for name, values in payload.data["data"].items()
        if name.endswith("latency_seconds")
        for value in values.values()
    ]
    assert latencies and all(isinstance(v, list) and v for v in latencies)

    text = engine.manager.metrics_text()
    assert f'kvtier_evictions_total{{tier="host"}} {stats.evictions}' in text
    assert 'kvtier_store_latency_seconds_count{tier="host"}' in text


def test_declared_metrics_cover_every_reported_name():
    from offload.vllm import KVTierOffloadingSpec

    definitions = KVTierOffloadingSpec.build_metric_definitions({})
    assert "vllm:kv_offload_kvtier_hits" in definitions
    assert definitions["vllm:kv_offload_kvtier_hits"].labelnames == ("tier",)
    assert KVTierOffloadingSpec.config_info_keys({}) == (
        "kvtier_tiers",
        "kvtier_host_slots",
        "kvtier_row_bytes",
        "kvtier_blocks_per_chunk",
    )


@pytest.mark.parametrize("shutdown", [True, False], ids=["shut-down", "never-shut-down"])
def test_a_manager_whose_workers_never_map_the_host_file_leaves_nothing_at_exit(tmp_path, shutdown):
    """Issue 36: the scheduler side built through vLLM's factory, no worker ever maps the shared
    host file, and the process exits normally (with or without a shutdown): the shm dir is empty."""
    code = (
        "import os, sys; from bench.scheduler_driver import factory_manager; "
        "manager = factory_manager(1000, 'lru', sys.argv[1]); "
        "assert len(os.listdir(sys.argv[1])) == 1, 'the file waits for its workers'; "
        + ("manager.shutdown()" if shutdown else "")
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert os.listdir(tmp_path) == []
