"""kvtier's disk tier and peers as secondary tiers of vLLM's own ``TieringOffloadingSpec``.

vLLM's CPU primary tier needs CUDA for its worker, so these tests drive vLLM's real
tiering manager (scheduler side) directly: stores cascade from vLLM's CPU tier into
kvtier's disk tier, and after a reset a lookup promotes the rows back, byte for byte.
"""

from __future__ import annotations

import time
import uuid
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from bench.scheduler_driver import one_worker
from offload.vllm.secondary import KVTierDiskTier, KVTierRemoteTier

END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def locked(manager: Any) -> AbstractContextManager[Any]:
    """The manager's step lock (vLLM 0.33); vLLM 0.32's managers have none."""
    return getattr(manager, "lock", None) or nullcontext()


def tiering_spec(tmp_path, tier=None, **tier_keys):
    if tier is None:
        tier = {
            "type": "KVTierDiskTier",
            "module_path": "offload.vllm.secondary",
            "path": str(tmp_path / "disk"),
        }
    tier = {"capacity": "64MiB", **tier, **tier_keys}
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layer0",), group_id=0),),
        worker_kv_bytes_per_block=8192,
        enable_kv_cache_events=True,
        extra_config={"cpu_bytes_to_use": 1 << 24, "secondary_tiers": [tier]},
        engine_id=f"kvtier-test-{uuid.uuid4().hex}",
        model=OffloadingModelConfig(name="tiny", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=one_worker(),
    )
    return TieringOffloadingSpec(config)


def settle(manager, done, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the tier did not finish in time"
        with locked(manager):
            manager.on_schedule_end(END)
        time.sleep(0.005)


@pytest.fixture(params=["disk", "remote"])
def secondary(request, tmp_path):
    """The tier entry of ``secondary_tiers``: kvtier's disk, or a real ``kvtier peer``."""
    if request.param == "disk":
        yield {
            "type": "KVTierDiskTier",
            "module_path": "offload.vllm.secondary",
            "path": str(tmp_path / "disk"),
        }
        return
    from tests.tiers.peer_fixtures import start_peers

    (peer,) = start_peers(tmp_path, 1, capacity="16MiB", row_bytes="64KiB")
    try:
        yield {"type": "KVTierRemoteTier", "module_path": "offload.vllm.secondary", "peers": [peer.address]}
    finally:
        peer.close()


def test_rows_cascade_to_kvtier_and_are_promoted_back_byte_exact(tmp_path, secondary):
    spec = tiering_spec(tmp_path, secondary)
    manager = spec.get_manager()
    try:
        (tier,) = manager.secondary_tiers
        assert isinstance(tier, KVTierDiskTier if secondary["type"] == "KVTierDiskTier" else KVTierRemoteTier)
        rows = manager.primary_tier.get_kv_memoryview().cast("B")
        row = tier.block_size_bytes
        keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(4)]
        written = store_rows(manager, keys, "first")
        stored = [k for e in manager.take_events() if e.ownership == tier.tier_type for k in e.keys]
        assert sorted(stored) == sorted(keys)

        with locked(manager):
            manager.reset_cache()
            if hasattr(manager, "on_reset_flushed"):  # vLLM 0.33 reports the flush
                manager.on_reset_flushed()
        rows[:] = bytes(len(rows))  # nothing of the old rows is left in the CPU tier

        ctx = ReqContext("second")
        with locked(manager):
            manager.on_new_request(ctx)
            assert manager.lookup(make_offload_key(b"\xee" * 32, 0), ctx) is LookupResult.MISS
            assert manager.lookup(keys[0], ctx) is LookupResult.HIT_PENDING

        def landed():
            with locked(manager):
                return manager.lookup(keys[0], ctx) is LookupResult.HIT

        settle(manager, landed)
        with locked(manager):
            spec_out = manager.prepare_load([keys[0]], ctx)
        chunk = int(spec_out.chunk_ids[0])
        assert bytes(rows[chunk * row : (chunk + 1) * row]) == written[keys[0]]
        assert tier.tier.stats()["hits"] >= 1
        with locked(manager):
            manager.complete_load([keys[0]], ctx)
            manager.on_request_finished(ctx)
    finally:
        manager.shutdown()


def test_tier_keys_are_validated_like_the_toml(tmp_path):
    from offload.config import ConfigError

    with pytest.raises(ConfigError, match=r"tiers\[1\]\.placment"):
        tiering_spec(tmp_path, placment="write-back").get_manager()


def store_rows(manager, keys, req_id: str) -> dict:
    """Store ``keys`` through vLLM's CPU tier (cascading to the secondary tier); their bytes."""
    (tier,) = manager.secondary_tiers
    rows = manager.primary_tier.get_kv_memoryview().cast("B")
    row = tier.block_size_bytes
    ctx = ReqContext(req_id)
    with locked(manager):
        manager.on_new_request(ctx)
        out = manager.prepare_store(keys, ctx)
    written = {}
    for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
        data = bytes((i * 5 + key[0]) % 256 for i in range(row))
        rows[int(chunk) * row : (int(chunk) + 1) * row] = data
        written[key] = data
    with locked(manager):
        manager.complete_store(keys, ctx)
        manager.on_request_finished(ctx)
    settle(manager, lambda: all(tier.tier.may_contain(k) for k in keys) and not manager.has_pending_work())
    return written


@pytest.mark.multiprocess
@pytest.mark.parametrize("wait", [0.0, 2.0])
def test_a_peer_row_another_engine_put_is_found_and_promoted(tmp_path, wait):
    from tests.tiers.peer_fixtures import start_peers

    (peer,) = start_peers(tmp_path, 1, capacity="16MiB", row_bytes="64KiB")
    remote = {"type": "KVTierRemoteTier", "module_path": "offload.vllm.secondary", "peers": [peer.address]}
    writer = tiering_spec(tmp_path, remote).get_manager()
    reader = tiering_spec(tmp_path, remote, lookup_wait_s=wait).get_manager()
    try:
        keys = [make_offload_key(bytes([40 + i]) * 32, 0) for i in range(3)]
        written = store_rows(writer, keys, "writer")
        (tier,) = reader.secondary_tiers
        assert not any(tier.tier.may_contain(k) for k in keys)  # the reader never put them
        ctx = ReqContext("reader")
        with locked(reader):
            reader.on_new_request(ctx)
            first = [reader.lookup(key, ctx) for key in keys]
        # Without a wait the first lookup is a miss (the peer is asked in the background);
        # with one, vLLM is told to come back while the peer answers.
        assert first[0] is (LookupResult.RETRY if wait else LookupResult.MISS)

        def promoted():
            with locked(reader):
                return all(reader.lookup(key, ctx) is LookupResult.HIT for key in keys)

        settle(reader, promoted)
        rows = reader.primary_tier.get_kv_memoryview().cast("B")
        with locked(reader):
            spec_out = reader.prepare_load(keys, ctx)
        size = tier.block_size_bytes
        for key, chunk in zip(keys, spec_out.chunk_ids, strict=True):
            assert bytes(rows[int(chunk) * size : (int(chunk) + 1) * size]) == written[key]
    finally:
        for manager in (reader, writer):
            manager.shutdown()
        peer.close()


def test_kv_load_tiers_matches_a_kvtier_tier_by_its_locality(tmp_path):
    """vLLM's tiering manager filters secondary tiers by medium and locality: kvtier's disk is
    ``STORAGE``/``LOCAL`` (a ``locality`` key overrides it), so a request that loads only from
    remote tiers does not promote from it, and one that loads from local ones does."""
    from vllm.v1.kv_offload.base import Locality, Medium, TierFilter, TierMatcher

    from offload.config import ConfigError

    with pytest.raises(ConfigError, match="locality"):
        tiering_spec(tmp_path, locality="nearby").get_manager()
    spec = tiering_spec(tmp_path)
    manager = spec.get_manager()
    try:
        (tier,) = manager.secondary_tiers
        assert (tier.medium, tier.locality) == (Medium.STORAGE, Locality.LOCAL)
        keys = [make_offload_key(bytes([60 + i]) * 32, 0) for i in range(2)]
        store_rows(manager, keys, "first")
        with locked(manager):
            manager.reset_cache()
            if hasattr(manager, "on_reset_flushed"):
                manager.on_reset_flushed()
        remote_only = ReqContext("remote", load_tier_filter=TierFilter((TierMatcher(None, Locality.REMOTE),)))
        local = ReqContext(
            "local", load_tier_filter=TierFilter((TierMatcher(Medium.STORAGE, Locality.LOCAL),))
        )
        with locked(manager):
            for ctx in (remote_only, local):
                manager.on_new_request(ctx)
            assert manager.lookup(keys[0], remote_only) is LookupResult.MISS
            assert manager.lookup(keys[0], local) is LookupResult.HIT_PENDING
            for ctx in (remote_only, local):
                manager.on_request_finished(ctx)
        settle(manager, lambda: not manager.has_pending_work())
    finally:
        manager.shutdown()
    shared = tiering_spec(tmp_path, locality="remote", path=str(tmp_path / "nfs")).get_manager()
    try:
        assert shared.secondary_tiers[0].locality is Locality.REMOTE  # a disk on a network share
    finally:
        shared.shutdown()
