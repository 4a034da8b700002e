"""``KVTierStorage`` over real ``kvtier peer`` processes: pages round trip through a peer,
MLA ranks share them there while MHA ranks do not, and a stopped peer is a miss within its
deadline (multi-process: each test starts its peers)."""

from __future__ import annotations

import time

import pytest

from bench.sglang_pool import make_pool
from tests.sglang.test_backend import keys

multiprocess = pytest.mark.multiprocess
DEADLINE_S = 0.5


def remote(peers) -> dict:
    return {
        "kind": "remote",
        "peers": [p.address for p in peers],
        "capacity": "16MiB",
        "deadline_s": DEADLINE_S,
    }


@multiprocess
def test_pages_round_trip_through_a_peer_and_mla_ranks_share_them(backend, spawn_peers, tmp_path):
    peers = spawn_peers(1)
    pool0, pool1 = make_pool("mla", "page_first"), make_pool("mla", "page_first")
    rank0 = backend(pool0, [remote(peers)], mla=True, tp_rank=0, tp_size=2)
    rank1 = backend(pool1, [remote(peers)], mla=True, tp_rank=1, tp_size=2)
    ks = keys(3)
    sent = [pool0.fill(p, seed=p) for p in range(3)]
    assert rank0.batch_set_v1(ks, pool0.slots(0, 1, 2)) == [True] * 3
    assert rank1.batch_exists(ks) == 3  # not in rank 1's own index: asked of the peer
    assert rank1.batch_get_v1(ks, pool1.slots(5, 6, 7)) == [True] * 3
    assert [pool1.page_bytes(p) for p in (5, 6, 7)] == sent
    mha = make_pool("mha", "layer_first")
    mha_rank0 = backend(mha, [remote(peers)], tp_rank=0, tp_size=2)
    mha_rank1 = backend(make_pool("mha", "layer_first"), [remote(peers)], tp_rank=1, tp_size=2)
    mha.fill(0, seed=9)
    assert mha_rank0.batch_set_v1(ks[:1], mha.slots(0)) == [True]
    assert mha_rank1.batch_exists(ks[:1]) == 0  # another rank's heads


@multiprocess
def test_a_stopped_peer_is_a_miss_within_its_deadline(backend, spawn_peers, tmp_path):
    peers = spawn_peers(1)
    pool = make_pool()
    storage = backend(pool, [remote(peers)])
    other = backend(make_pool(), [remote(peers)], tp_rank=0, tp_size=1, tenant="other")
    ks = keys(2)
    pool.fill(0, seed=1)
    pool.fill(1, seed=2)
    assert storage.batch_set_v1(ks, pool.slots(0, 1)) == [True, True]
    peers[0].stop()
    try:
        pool.wipe(4, 0x33)
        before = pool.page_bytes(4)
        began = time.monotonic()
        got = storage.batch_get_v1(ks[:1], pool.slots(4))
        assert got == [False]
        assert pool.page_bytes(4) == before  # a late write lands in staging, never here
        assert other.batch_exists(ks) == 0  # asked of the stopped peer: no answer, a miss
        assert other.batch_set_v1(keys(1, salt="x"), pool.slots(1)) == [False]
        # each call ended by its deadline (the engine's safety net is 2 * deadline + 1 s)
        assert time.monotonic() - began < 3 * (2 * DEADLINE_S + 1.0)
        assert storage.stats()["faults"] == 0 and other.stats()["faults"] == 0
        # the peer may still write into its row, and cannot say when it no longer will
        assert storage.stats()["staging_held"] == 1
    finally:
        peers[0].cont()


@multiprocess
def test_exists_counts_pages_split_between_the_disk_and_a_peer(backend, spawn_peers, tmp_path):
    peers = spawn_peers(1)
    pool = make_pool()
    ks = keys(3)
    for page in range(3):
        pool.fill(page, seed=page)
    disk_only = backend(pool, [{"kind": "disk", "path": str(tmp_path / "d"), "capacity": "16MiB"}])
    assert disk_only.batch_set_v1([ks[0], ks[2]], pool.slots(0, 2)) == [True, True]
    disk_only.close()
    peer_only = backend(make_pool(), [remote(peers)])
    other = peer_only.mem_pool_host
    other.fill(1, seed=1)
    assert peer_only.batch_set_v1([ks[1]], other.slots(1)) == [True]
    both = backend(pool, [{"kind": "disk", "path": str(tmp_path / "d"), "capacity": "16MiB"}, remote(peers)])
    assert both.batch_exists(ks) == 3  # page 0 and 2 on the disk, page 1 at the peer
    for page in (5, 6, 7):
        pool.wipe(page)
    assert both.batch_get_v1(ks, pool.slots(5, 6, 7)) == [True] * 3
    assert [pool.page_bytes(p) for p in (5, 6, 7)] == [
        pool.page_bytes(0),
        other.page_bytes(1),
        pool.page_bytes(2),
    ]
