"""Spill to and promotion from a real ``kvtier peer`` process over NIXL, through ``Offloader``."""

import time

import pytest

from offload.api import Offloader
from offload.keys import make_key
from offload.manager import Lookup
from tests.offload.layouts import per_layer_blocks_first, scramble
from tests.tiers.peer_fixtures import start_peers

pytestmark = pytest.mark.multiprocess

TOKEN = b"integration-secret"


def keys_for(prefix: str, n: int) -> list[bytes]:
    return [make_key(f"{prefix}{i}".encode().ljust(16, b"."), 0) for i in range(n)]


@pytest.fixture
def peer(tmp_path):
    (process,) = start_peers(tmp_path, 1, capacity="4MiB", row_bytes="4KiB", token=TOKEN)
    yield process
    process.close()


def config(tmp_path, peer, host_rows: int, row: int, **remote) -> dict:
    token_file = tmp_path / "token"
    token_file.write_bytes(TOKEN)
    tier = {
        "kind": "remote",
        "peers": [peer.address],
        "capacity": "4MiB",
        "token_file": str(token_file),
        "placement": "write-through",
        "deadline_s": 1.0,
    }
    tier.update(remote)
    return {"tiers": [{"kind": "host", "capacity": host_rows * row}, tier]}


def test_a_wrong_token_reads_nothing(tmp_path, peer):
    kv, groups = per_layer_blocks_first()
    with Offloader(kv, groups) as probe:
        row = probe.caches.row_bytes(0)
    cfg = config(tmp_path, peer, 1, row)
    (tmp_path / "token").write_bytes(b"not-the-secret")
    keys = keys_for("intruder", 2)
    with Offloader(kv, groups, cfg) as offloader:
        offloader.store(keys[:1], [0])
        offloader.wait()
        offloader.wait_tiers()
        assert offloader.store(keys[1:], [1]) is not None
        offloader.wait()
        offloader.wait_tiers()
        stats = offloader.stats()
        assert stats["lower"]["spills_done"] == 0
        assert offloader.lookup(keys[:1]) == 0  # evicted from the 1-row host tier, and not below
        offloader.wait_tiers()
        assert offloader.lookup(keys[:1]) == 0


def test_another_engine_finds_rows_a_first_engine_put(tmp_path, peer):
    kv_a, groups = per_layer_blocks_first()
    kv_b, _ = per_layer_blocks_first()  # engine B: its own KV cache, other bytes
    with Offloader(kv_a, groups) as probe:
        row = probe.caches.row_bytes(0)
    keys = keys_for("shared", 4)
    with Offloader(kv_a, groups, config(tmp_path, peer, 8, row)) as engine_a:
        computed = [engine_a.caches.read_row(0, b) for b in range(4)]
        engine_a.store(keys, [0, 1, 2, 3])
        engine_a.wait()
        engine_a.wait_tiers()
        assert engine_a.stats()["lower"]["spills_done"] == 4
    with Offloader(kv_b, groups, config(tmp_path, peer, 8, row)) as engine_b:
        assert engine_b.lookup(keys) == 0  # B never put them: a miss now, the peer asked in the background
        engine_b.wait_tiers()
        assert engine_b.lookup(keys) == 0  # now known below: promotions start
        engine_b.wait_tiers()
        assert engine_b.lookup(keys) == 4
        engine_b.load(keys, [6, 7, 8, 9])
        engine_b.wait()
        assert [engine_b.caches.read_row(0, b) for b in (6, 7, 8, 9)] == computed
        lower = engine_b.stats()["lower"]
        assert (lower["checks_found"], lower["promotions_done"]) == (4, 4)


def test_promotion_from_a_peer_and_a_dead_peer_is_a_miss(tmp_path, peer):
    kv, groups = per_layer_blocks_first()
    with Offloader(kv, groups) as probe:
        row = probe.caches.row_bytes(0)
    keys = keys_for("promo", 4)
    with Offloader(kv, groups, config(tmp_path, peer, 2, row)) as offloader:
        originals = [offloader.caches.read_row(0, b) for b in range(4)]
        for i, key in enumerate(keys):
            offloader.store([key], [i])
            offloader.wait()
            offloader.wait_tiers()
        assert offloader.lookup(keys[:2]) == 0  # evicted from the 2-row host tier
        offloader.wait_tiers()
        assert offloader.lookup(keys[:2]) == 2  # promoted back from the peer
        scramble(kv)
        offloader.load(keys[:2], [8, 9])
        offloader.wait()
        assert [offloader.caches.read_row(0, b) for b in (8, 9)] == originals[:2]

        peer.kill()
        device_before = [offloader.caches.read_row(0, b) for b in (10, 11)]
        assert offloader.lookup(keys[2:]) == 0  # evicted, and their peer is dead
        offloader.wait_tiers(timeout=10)
        assert offloader.lookup(keys[2:]) == 0
        assert offloader.stats()["lower"]["promotions_done"] == 2
        assert [offloader.caches.read_row(0, b) for b in (10, 11)] == device_before


def test_a_promotion_a_stopped_peer_never_answers_quarantines_its_slots(tmp_path, peer):
    """The peer WRITEs promoted rows into host slots itself: a stopped peer that never answers
    may still write them later, so those slots are never handed out again (counted), and the
    keys stay misses. The control: the same promotion from a live peer lands, quarantining
    nothing."""
    kv, groups = per_layer_blocks_first()
    with Offloader(kv, groups) as probe:
        row = probe.caches.row_bytes(0)
    keys = keys_for("stopped", 4)
    with Offloader(kv, groups, config(tmp_path, peer, 2, row)) as offloader:
        for i, key in enumerate(keys):
            offloader.store([key], [i])
            offloader.wait()
            offloader.wait_tiers()
        assert offloader.lookup(keys[:1]) == 0  # evicted: promoted back from the live peer
        offloader.wait_tiers()
        assert offloader.lookup(keys[:1]) == 1
        assert offloader.stats()["quarantined_slots"] == 0
        peer.stop()
        try:
            assert offloader.lookup(keys[2:3]) == 0  # evicted; its promotion goes to a stopped peer
            offloader.wait_tiers(timeout=10)
            stats = offloader.stats()
            assert stats["quarantined_slots"] == 1
            assert stats["tiers"]["remote"]["abandoned"] == 1
            assert offloader.lookup(keys[2:3]) == 0  # still a miss
        finally:
            peer.cont()


def put_by_another_engine(tmp_path, peer, keys: list[bytes]) -> list:
    """Engine A puts ``keys`` at the peer and goes away; their rows' bytes."""
    kv_a, groups = per_layer_blocks_first()
    with Offloader(kv_a, groups) as probe:
        row = probe.caches.row_bytes(0)
    with Offloader(kv_a, groups, config(tmp_path, peer, 8, row)) as engine_a:
        rows = [engine_a.caches.read_row(0, b) for b in range(len(keys))]
        engine_a.store(keys, list(range(len(keys))))
        engine_a.wait()
        engine_a.wait_tiers()
        assert engine_a.stats()["lower"]["spills_done"] == len(keys)
    return rows


def lookups_until(manager, keys, wanted, timeout: float = 5.0) -> list:
    """Poll and look ``keys`` up again until every result is ``wanted`` (or time runs out)."""
    deadline = time.monotonic() + timeout
    while True:
        manager.poll()
        results = [manager.lookup(key) for key in keys]
        if all(r is wanted for r in results) or time.monotonic() > deadline:
            return results
        time.sleep(0.01)


def test_with_lookup_wait_a_lookup_retries_until_the_peer_answers_for_the_whole_prefix(tmp_path, peer):
    keys = keys_for("waited", 4)
    rows = put_by_another_engine(tmp_path, peer, keys)
    absent = keys_for("nowhere", 1)[0]
    kv_b, groups = per_layer_blocks_first()
    with Offloader(kv_b, groups) as probe:
        row = probe.caches.row_bytes(0)
    with Offloader(kv_b, groups, config(tmp_path, peer, 8, row, lookup_wait_s=2.0)) as engine_b:
        manager = engine_b.manager
        # As vLLM scans a prefix: every key, known or not, is "being asked", none is a miss.
        assert [manager.lookup(key) for key in [*keys, absent]] == [Lookup.RETRY] * 5
        assert manager.stats.retries == 5
        assert lookups_until(manager, keys, Lookup.HIT_PENDING) == [Lookup.HIT_PENDING] * 4
        assert manager.lookup(absent) is Lookup.MISS  # answered: nobody holds it
        lower = engine_b.stats()["lower"]
        assert (lower["checks_asked"], lower["checks_found"]) == (5, 4)  # one round trip for all five
        assert lookups_until(manager, keys, Lookup.HIT) == [Lookup.HIT] * 4
        manager.on_schedule_end()
        engine_b.load(keys, [6, 7, 8, 9])
        engine_b.wait()
        assert [engine_b.caches.read_row(0, b) for b in (6, 7, 8, 9)] == rows


def test_with_lookup_wait_a_dead_peer_is_waited_for_no_longer_than_the_wait(tmp_path, peer):
    keys = keys_for("orphan", 2)
    put_by_another_engine(tmp_path, peer, keys)
    peer.kill()
    kv, groups = per_layer_blocks_first()
    with Offloader(kv, groups) as probe:
        row = probe.caches.row_bytes(0)
    with Offloader(kv, groups, config(tmp_path, peer, 8, row, lookup_wait_s=0.5)) as engine:
        manager = engine.manager
        started = time.monotonic()
        assert [manager.lookup(key) for key in keys] == [Lookup.RETRY] * 2
        assert lookups_until(manager, keys, Lookup.MISS) == [Lookup.MISS] * 2
        assert time.monotonic() - started < 3.0
        # The standalone API never waits: a key being asked ends the prefix like a miss.
        assert engine.lookup(keys) == 0


def test_without_lookup_wait_a_miss_below_is_a_miss_at_once(tmp_path, peer):
    keys = keys_for("unwaited", 2)
    put_by_another_engine(tmp_path, peer, keys)
    kv, groups = per_layer_blocks_first()
    with Offloader(kv, groups) as probe:
        row = probe.caches.row_bytes(0)
    with Offloader(kv, groups, config(tmp_path, peer, 8, row)) as engine:
        assert [engine.manager.lookup(key) for key in keys] == [Lookup.MISS] * 2
        assert engine.manager.stats.retries == 0
