"""``offload.sglang.KVTierStorage`` over a disk tier and a host pool with sglang 0.5.23's page
geometry (``bench.sglang_pool``): the call contract of SGLang's cache controller, without SGLang."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from bench.sglang_pool import LAYOUTS, dynamic_config, make_pool, storage_config
from offload.config import ConfigError
from offload.sglang import KVTierStorage, page_key
from tests.sglang.conftest import disk
from tests.tiers.test_disk import file_size_limit
from tiers.disk.lmdb_store import ROWS_FILE


def keys(n: int, salt: str = "") -> list[str]:
    """SGLang-shaped page keys: SHA-256 hex strings."""
    import hashlib

    return [hashlib.sha256(f"{salt}page-{i}".encode()).hexdigest() for i in range(n)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_pages_round_trip_bit_exact_through_disk(backend, kind, layout):
    pool = make_pool(kind, layout)
    storage = backend(pool, mla=kind == "mla")
    ks = keys(4)
    sent = [pool.fill(page, seed=page) for page in (1, 5, 2, 9)]
    assert storage.batch_set_v1(ks, pool.slots(1, 5, 2, 9)) == [True] * 4
    assert storage.batch_exists(ks) == 4
    for page in (3, 4, 7, 8):
        pool.wipe(page)
    untouched = pool.page_bytes(6)
    assert storage.batch_get_v1(ks, pool.slots(3, 4, 7, 8)) == [True] * 4
    assert [pool.page_bytes(p) for p in (3, 4, 7, 8)] == sent
    assert pool.page_bytes(6) == untouched


def test_a_hole_at_page_k_stops_exists_and_get_at_k(backend):
    pool = make_pool()
    storage = backend(pool)
    ks = keys(5)
    for page in range(5):
        pool.fill(page, seed=page)
    stored = [0, 1, 3, 4]  # page 2 is missing
    assert storage.batch_set_v1([ks[i] for i in stored], pool.slots(*stored)) == [True] * 4
    assert storage.batch_exists(ks) == 2
    for page in range(8, 13):
        pool.wipe(page, 0x11)
    wiped = pool.page_bytes(8)
    got = storage.batch_get_v1(ks, pool.slots(8, 9, 10, 11, 12))
    assert got == [True, True, False, False, False]
    assert pool.page_bytes(8) == pool.page_bytes(0) and pool.page_bytes(9) == pool.page_bytes(1)
    assert [pool.page_bytes(p) for p in (10, 11, 12)] == [wiped] * 3  # nothing past the hole


@pytest.mark.parametrize(
    "other",
    [
        {"layout": "page_first_direct"},  # the same bytes per page, in another order
        {"dtype": torch.bfloat16},  # the same size, another meaning
        {"page_size": 8, "pages": 8},
    ],
)
def test_a_dtype_layout_or_page_size_change_misses(tmp_path, other):
    ks = keys(3)
    pool = make_pool("mha", "page_first")
    first = _open(tmp_path, pool)
    for page in range(3):
        pool.fill(page, seed=page)
    assert first.batch_set_v1(ks, pool.slots(0, 1, 2)) == [True] * 3
    first.close()
    changed = make_pool("mha", **{"layout": "page_first", **other})
    second = _open(tmp_path, changed)
    try:
        assert second.batch_exists(ks) == 0
        changed.wipe(3, 0x5A)
        before = changed.page_bytes(3)
        assert second.batch_get_v1(ks[:1], changed.slots(3)) == [False]
        assert changed.page_bytes(3) == before
    finally:
        second.close()
    again = _open(tmp_path, make_pool("mha", "page_first"))  # the first pool's shape still hits
    try:
        assert again.batch_exists(ks) == 3
    finally:
        again.close()


@pytest.mark.parametrize("mla", [False, True])
def test_mha_ranks_are_kept_apart_mla_ranks_share(tmp_path, mla):
    kind = "mla" if mla else "mha"
    ks = keys(2)
    pool = make_pool(kind)
    rank0 = _open(tmp_path, pool, mla=mla, tp_rank=0, tp_size=2)
    pool.fill(0, seed=1)
    pool.fill(1, seed=2)
    assert rank0.batch_set_v1(ks, pool.slots(0, 1)) == [True, True]
    rank0.close()
    other = make_pool(kind)
    rank1 = _open(tmp_path, other, mla=mla, tp_rank=1, tp_size=2)
    try:
        assert rank1.batch_exists(ks) == (2 if mla else 0)
        assert rank1.batch_get_v1(ks, other.slots(4, 5)) == [mla, mla]
        if mla:
            assert other.page_bytes(4) == pool.page_bytes(0) and other.page_bytes(5) == pool.page_bytes(1)
    finally:
        rank1.close()


def test_the_host_page_changed_after_set_returns_changes_nothing_stored(backend):
    pool = make_pool()
    storage = backend(pool)
    ks = keys(2)
    sent = [pool.fill(0, seed=10), pool.fill(1, seed=11)]
    assert storage.batch_set_v1(ks, pool.slots(0, 1)) == [True, True]
    pool.fill(0, seed=99)  # SGLang frees and reuses the page once set returned
    pool.wipe(1)
    assert storage.batch_get_v1(ks, pool.slots(2, 3)) == [True, True]
    assert [pool.page_bytes(2), pool.page_bytes(3)] == sent


def test_set_is_idempotent_and_a_key_twice_in_a_batch_is_stored_once(backend):
    pool = make_pool()
    storage = backend(pool)
    ks = keys(2)
    sent = pool.fill(0, seed=1)
    pool.fill(1, seed=2)
    assert storage.batch_set_v1([ks[0], ks[0]], pool.slots(0, 0)) == [True, True]
    assert storage.batch_set_v1(ks, pool.slots(0, 1)) == [True, True]
    stats = storage.stats()
    assert stats["set_stored"] == 2 and stats["set_present"] == 1
    assert stats["tiers"]["disk"]["stored"] == 2
    assert storage.batch_get_v1(ks[:1], pool.slots(5)) == [True] and pool.page_bytes(5) == sent


def test_pages_persist_across_a_reopen(tmp_path):
    pool = make_pool("mla", "layer_first")
    ks = keys(3)
    sent = [pool.fill(p, seed=p) for p in range(3)]
    first = _open(tmp_path, pool, mla=True)
    assert first.batch_set_v1(ks, pool.slots(0, 1, 2)) == [True] * 3
    first.close()
    fresh = make_pool("mla", "layer_first")
    second = _open(tmp_path, fresh, mla=True)
    try:
        assert second.batch_exists(ks) == 3
        assert second.batch_get_v1(ks, fresh.slots(7, 8, 9)) == [True] * 3
        assert [fresh.page_bytes(p) for p in (7, 8, 9)] == sent
    finally:
        second.close()


def test_a_corrupt_row_is_a_miss_that_leaves_the_host_page_untouched(tmp_path):
    pool = make_pool()
    ks = keys(2)
    pool.fill(0, seed=1)
    pool.fill(1, seed=2)
    first = _open(tmp_path, pool)
    assert first.batch_set_v1(ks, pool.slots(0, 1)) == [True, True]
    first.close()
    rows = tmp_path / "disk" / ROWS_FILE
    data = bytearray(rows.read_bytes())
    data[10] ^= 0xFF  # a flipped bit inside the first row (the rows file starts with it)
    rows.write_bytes(bytes(data))
    second = _open(tmp_path, pool)
    try:
        pool.wipe(4, 0x77)
        before = pool.page_bytes(4)
        assert second.batch_get_v1(ks[:1], pool.slots(4)) == [False]
        assert pool.page_bytes(4) == before
        assert second.stats()["tiers"]["disk"]["corrupt"] == 1
    finally:
        second.close()


def test_a_full_disk_is_a_miss_not_an_exception(backend, tmp_path):
    pool = make_pool()
    storage = backend(pool)
    ks = keys(6)
    for page in range(6):
        pool.fill(page, seed=page)
    assert storage.batch_set_v1(ks[:1], pool.slots(0)) == [True]
    with file_size_limit(os.path.getsize(tmp_path / "disk" / ROWS_FILE)):
        assert storage.batch_set_v1(ks[1:], pool.slots(1, 2, 3, 4, 5)) == [False] * 5
    assert storage.batch_exists(ks) == 1
    assert storage.stats()["faults"] == 0
    assert storage.batch_set_v1(ks[1:], pool.slots(1, 2, 3, 4, 5)) == [True] * 5  # room again


def test_concurrent_exists_get_and_set_lose_and_mix_up_nothing(backend):
    pool = make_pool(pages=48)
    storage = backend(pool, staging="4KiB")  # few staging rows: the threads share them
    groups = [keys(4, salt=f"t{t}") for t in range(3)]
    sent = {t: [pool.fill(t * 4 + i, seed=100 * t + i) for i in range(4)] for t in range(3)}
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            src = pool.slots(*range(t * 4, t * 4 + 4))
            dst = pool.slots(*range(24 + t * 4, 24 + t * 4 + 4))
            for _ in range(5):
                assert storage.batch_set_v1(groups[t], src) == [True] * 4
                assert storage.batch_exists(groups[t]) == 4
                assert storage.batch_get_v1(groups[t], dst) == [True] * 4
                assert [pool.page_bytes(24 + t * 4 + i) for i in range(4)] == sent[t]
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert storage.stats()["faults"] == 0


def test_host_indices_that_do_not_match_the_pages_are_refused(backend):
    pool = make_pool()
    storage = backend(pool)
    ks = keys(2)
    short = pool.slots(0, 1)[:-1]  # not whole pages
    assert storage.batch_set_v1(ks, short) == [False, False]
    assert storage.batch_get_v1(ks, short) == [False, False]
    assert storage.stats()["refused_calls"] == 2 and storage.stats()["faults"] == 0


def test_a_fault_is_a_logged_miss_never_an_exception(backend, monkeypatch, caplog):
    storage = backend()
    pool = storage.mem_pool_host

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(pool, "get_page_buffer_meta", broken)
    assert storage.batch_set_v1(keys(2), pool.slots(0, 1)) == [False, False]
    assert storage.batch_get_v1(keys(2), pool.slots(0, 1)) == [False, False]
    monkeypatch.setattr(storage.tiers[0], "may_contain", broken)
    assert storage.batch_exists(keys(2)) == 0
    assert storage.stats()["faults"] == 3
    assert "batch_set_v1 failed" in caplog.text


def test_clear_deletes_what_this_backend_stored(backend):
    pool = make_pool()
    storage = backend(pool)
    ks = keys(3)
    assert storage.batch_set_v1(ks, pool.slots(0, 1, 2)) == [True] * 3
    storage.clear()
    assert storage.batch_exists(ks) == 0
    assert storage.batch_set_v1(ks, pool.slots(0, 1, 2)) == [True] * 3
    assert storage.stats()["set_stored"] == 6


def test_the_copying_interface_is_a_miss_and_exists_is_batch_exists(backend):
    pool = make_pool()
    storage = backend(pool)
    ks = keys(1)
    assert storage.batch_set_v1(ks, pool.slots(0)) == [True]
    assert storage.exists(ks[0]) and not storage.exists(keys(2)[1])
    assert storage.get(ks[0]) is None and storage.batch_get(ks) == [None]
    assert storage.set(ks[0]) is False and storage.batch_set(ks) is False


def test_page_keys_are_the_hash_bytes_and_other_schemes_are_digested():
    k = keys(1)[0]
    assert page_key(k) == bytes.fromhex(k) + b"\0\0\0\0"
    other = page_key("a-key_of_another_scheme")
    assert len(other) == 36 and other != page_key("a-key_of_another_scheme2")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"interface_v1": 0}, "interface_v1"),
        ({"tiers": []}, "non-empty list"),
        ({"tierz": []}, "tierz"),
        ({"kvtier_config": "/nonexistent.toml"}, "exactly one"),
        (
            {"tiers": [{"kind": "disk", "path": "/tmp/x", "capacity": "1GiB", "admission": "all"}]},
            "admission",
        ),
        ({"tiers": [{"kind": "host", "capacity": "1GiB"}]}, "host pool is the host tier"),
        ({"staging": "lots"}, "staging"),
    ],
)
def test_bad_extra_config_is_a_clear_error(tmp_path, extra, message):
    config = dynamic_config([disk(tmp_path / "d")])
    config.update(extra)
    with pytest.raises(ConfigError, match=message):
        KVTierStorage(storage_config(config), {})


def test_a_kvtier_toml_names_the_tiers_and_the_namespace(tmp_path):
    toml = tmp_path / "tiers.toml"
    toml.write_text(
        '[namespace]\nmodel = "team/model"\ntenant = "a"\n'
        '[[tiers]]\nkind = "host"\ncapacity = "1GiB"\n'
        f'[[tiers]]\nkind = "disk"\npath = "{tmp_path / "disk"}"\ncapacity = "64MiB"\n'
    )
    extra = {k: v for k, v in dynamic_config([]).items() if k != "tiers"}
    pool = make_pool()
    ks = keys(1)
    pool.fill(0, seed=3)
    storages = []
    for tenant in (None, "b"):
        config = {**extra, "kvtier_config": str(toml)}
        if tenant:
            config["tenant"] = tenant
        storage = KVTierStorage(storage_config(config, model=None), {})
        assert storage.model == "team/model"
        storage.register_mem_pool_host(pool)
        storages.append(storage)
        if tenant is None:
            assert storage.batch_set_v1(ks, pool.slots(0)) == [True]
        else:  # another tenant never sees the row
            assert storage.batch_exists(ks) == 0
        storage.close()


def test_sglang_storage_metrics_are_recorded_when_enabled(backend):
    storage = backend(metrics=True)
    pool = storage.mem_pool_host
    storage.batch_set_v1(keys(2), pool.slots(0, 1))
    storage.batch_get_v1(keys(2), pool.slots(2, 3))
    assert storage._metrics["backup_pgs"] == [2] and storage._metrics["prefetch_pgs"] == [2]


def _open(tmp_path: Path, pool, **kwargs) -> KVTierStorage:
    config = storage_config(dynamic_config([disk(tmp_path / "disk")]), **kwargs)
    storage = KVTierStorage(config, {})
    storage.register_mem_pool_host(pool)
    return storage
