"""``KVTierStorage`` over a real Mooncake Store (a ``mooncake_master`` on 127.0.0.1, each
backend mounting its own segment): pages round trip byte-exact, and a second server finds
what the first stored. Skips without the ``mooncake`` package, unless
``KVTIER_REQUIRE_MOONCAKE=1``."""

from __future__ import annotations

import pytest

pytest.importorskip("mooncake.store")

from bench.sglang_pool import make_pool
from tests.sglang.test_backend import keys
from tests.tiers.mooncake_fixtures import start_master


@pytest.fixture
def master(tmp_path):
    process = start_master(tmp_path)
    yield process
    process.close()


@pytest.mark.multiprocess
def test_pages_round_trip_through_mooncake_and_another_server_finds_them(master, backend):
    tier = {"kind": "mooncake", "master": master.address, "capacity": "32MiB", "local_hostname": "127.0.0.1"}
    writer_pool, reader_pool = make_pool("mha", "page_first_direct"), make_pool("mha", "page_first_direct")
    writer = backend(writer_pool, [tier])
    reader = backend(reader_pool, [tier])
    ks = keys(3)
    sent = [writer_pool.fill(p, seed=p) for p in range(3)]
    assert writer.batch_set_v1(ks, writer_pool.slots(0, 1, 2)) == [True] * 3
    assert reader.batch_exists(ks) == 3  # not in the reader's index: asked of the store
    assert reader.batch_get_v1(ks, reader_pool.slots(4, 5, 6)) == [True] * 3
    assert [reader_pool.page_bytes(p) for p in (4, 5, 6)] == sent
