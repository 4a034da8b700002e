"""The backend as SGLang builds and wraps it: sglang 0.5.23's ``StorageBackendFactory``
(``dynamic`` path), its ``HiCacheStorage`` base and ``StorageMetrics``, and its failure
injector (``SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY`` / ``_FAILURE``).

Skipped where SGLang does not import (it needs ``triton`` and a few pure-Python packages
beside kvtier's torch: ``tests/sglang/requirements.txt``), unless ``KVTIER_REQUIRE_SGLANG=1``.
The host pool here is the stand-in of ``bench.sglang_pool``; SGLang's own cache controller
and host pools are driven in ``test_controller.py``.
"""

from __future__ import annotations

import os

import pytest

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
except Exception as exc:  # not installed, or its imports fail on this machine
    if os.environ.get("KVTIER_REQUIRE_SGLANG") == "1":
        raise
    pytest.skip(f"sglang does not import here: {exc!r}", allow_module_level=True)

from bench.sglang_pool import dynamic_config, make_pool
from offload.config import ConfigError
from offload.sglang import KVTierStorage
from tests.sglang.conftest import disk
from tests.sglang.test_backend import keys


def sglang_config(extra: dict, *, mla: bool = False, metrics: bool = False) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=True,
        model_name="test/tiny-model",
        extra_config=extra,
    )


@pytest.fixture
def attach(tmp_path):
    """``attach(pool, **extra)``: what ``HiCacheController.attach_storage_backend`` does with
    the ``dynamic`` backend: the factory, then the host pool's registration."""
    made = []

    def make(pool, *, metrics: bool = False, **extra):
        config = sglang_config(dynamic_config([disk(tmp_path / "disk")], **extra), metrics=metrics)
        storage = StorageBackendFactory.create_backend("dynamic", config, pool)
        made.append(storage)
        storage.register_mem_pool_host(pool)
        storage.on_host_pools_registered()
        return storage

    yield make
    for storage in made:
        storage.close()


def test_the_factory_builds_kvtier_from_the_dynamic_config(attach):
    pool = make_pool("mha", "page_first")
    storage = attach(pool, metrics=True)
    assert isinstance(storage, KVTierStorage) and isinstance(storage, HiCacheStorage)
    ks = keys(3)
    sent = [pool.fill(p, seed=p) for p in range(3)]
    assert storage.batch_set_v1(ks, pool.slots(0, 1, 2)) == [True] * 3
    assert storage.batch_exists(ks) == 3
    assert storage.batch_get_v1(ks, pool.slots(4, 5, 6)) == [True] * 3
    assert [pool.page_bytes(p) for p in (4, 5, 6)] == sent


def test_get_stats_gives_sglangs_storage_metrics(attach):
    from tests.sglang.without_torchvision import import_sglang_configs

    try:
        import_sglang_configs()  # the metrics module imports SGLang's model configs
        from sglang.srt.observability.metrics_collector import StorageMetrics
    except Exception as exc:
        if os.environ.get("KVTIER_REQUIRE_SGLANG") == "1":
            raise
        pytest.skip(f"SGLang's metrics module does not import here: {exc!r}")
    pool = make_pool()
    storage = attach(pool, metrics=True)
    ks = keys(3)
    storage.batch_set_v1(ks, pool.slots(0, 1, 2))
    storage.batch_get_v1(ks, pool.slots(4, 5, 6))
    metrics = storage.get_stats()  # what SGLang's metrics collector asserts it gets
    assert isinstance(metrics, StorageMetrics)
    assert metrics.backup_pgs == [3] and metrics.prefetch_pgs == [3]
    assert storage.get_stats().backup_pgs == []  # drained, as SGLang's own backends do


def test_a_bad_extra_config_fails_the_attach_with_the_key_named(tmp_path):
    config = sglang_config({**dynamic_config([disk(tmp_path / "d")]), "interface_v1": 0})
    with pytest.raises(ConfigError, match="interface_v1"):
        StorageBackendFactory.create_backend("dynamic", config, make_pool())


def test_sglangs_failure_injector_never_leaves_a_wrong_page(attach, monkeypatch):
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.002")
    pool = make_pool("mla", "layer_first", pages=24)
    storage = attach(pool)
    assert type(storage).__name__ == "HiCacheStorageFailureInjector"
    ks = keys(4)
    sent = [pool.fill(p, seed=p) for p in range(4)]
    hits = 0
    for attempt in range(12):
        storage.batch_set_v1(ks, pool.slots(0, 1, 2, 3))
        n = storage.batch_exists(ks)
        assert 0 <= n <= 4
        dst = [8 + 4 * (attempt % 4) + i for i in range(4)]
        for page in dst:
            pool.wipe(page)
        wiped = pool.page_bytes(dst[0])
        got = storage.batch_get_v1(ks, pool.slots(*dst))
        lead = got.index(False) if False in got else 4
        hits += lead
        for i, page in enumerate(dst):  # copied pages exact, the rest untouched
            assert pool.page_bytes(page) == (sent[i] if i < lead else wiped)
    assert hits > 0
