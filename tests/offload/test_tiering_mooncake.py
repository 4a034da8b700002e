"""Spill to and promotion from Mooncake Store (a real ``mooncake_master`` on 127.0.0.1),
through ``Offloader``: byte-exact rows, and a second engine finding a first engine's rows."""

import pytest

pytest.importorskip("mooncake.store")

from offload.api import Offloader
from offload.keys import make_key
from tests.offload.layouts import per_layer_blocks_first, scramble
from tests.tiers.mooncake_fixtures import MasterProcess, start_master

pytestmark = pytest.mark.multiprocess


def keys_for(prefix: str, n: int) -> list[bytes]:
    return [make_key(f"{prefix}{i}".encode().ljust(16, b"."), 0) for i in range(n)]


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    process = start_master(tmp_path_factory.mktemp("mooncake-offload"))
    yield process
    process.close()


def config(master: MasterProcess, host_rows: int, row: int, tenant: str = "") -> dict:
    tier = {
        "kind": "mooncake",
        "master": master.address,
        "capacity": "32MiB",
        "placement": "write-through",
        "deadline_s": 2.0,
    }
    return {"namespace": {"tenant": tenant}, "tiers": [{"kind": "host", "capacity": host_rows * row}, tier]}


def row_bytes() -> int:
    kv, groups = per_layer_blocks_first()
    with Offloader(kv, groups) as probe:
        return probe.caches.row_bytes(0)


def test_spill_and_promotion_are_byte_exact(master):
    kv, groups = per_layer_blocks_first()
    keys = keys_for("promo", 4)
    with Offloader(kv, groups, config(master, 2, row_bytes())) as offloader:
        originals = [offloader.caches.read_row(0, b) for b in range(4)]
        for i, key in enumerate(keys):
            offloader.store([key], [i])
            offloader.wait()
            offloader.wait_tiers()
        assert offloader.stats()["lower"]["spills_done"] == 4
        assert offloader.lookup(keys[:2]) == 0  # evicted from the 2-row host tier
        offloader.wait_tiers()
        assert offloader.lookup(keys[:2]) == 2  # promoted back from the store
        scramble(kv)
        offloader.load(keys[:2], [8, 9])
        offloader.wait()
        assert [offloader.caches.read_row(0, b) for b in (8, 9)] == originals[:2]
        assert offloader.stats()["lower"]["promotions_done"] == 2


def test_another_engine_finds_rows_and_another_tenant_does_not(master):
    kv_a, groups = per_layer_blocks_first()
    kv_b, _ = per_layer_blocks_first()  # engine B: its own KV cache, other bytes
    row = row_bytes()
    keys = keys_for("shared", 3)
    with Offloader(kv_a, groups, config(master, 8, row)) as engine_a:
        computed = [engine_a.caches.read_row(0, b) for b in range(3)]
        engine_a.store(keys, [0, 1, 2])
        engine_a.wait()
        engine_a.wait_tiers()
        with Offloader(kv_b, groups, config(master, 8, row, tenant="other")) as stranger:
            assert stranger.lookup(keys) == 0
            stranger.wait_tiers()
            assert stranger.lookup(keys) == 0  # asked the store: nothing in its namespace
            assert stranger.stats()["lower"]["checks_found"] == 0
        with Offloader(kv_b, groups, config(master, 8, row)) as engine_b:
            assert engine_b.lookup(keys) == 0  # B never put them: the store is asked in the background
            engine_b.wait_tiers()
            assert engine_b.lookup(keys) == 0  # now known below: promotions start
            engine_b.wait_tiers()
            assert engine_b.lookup(keys) == 3
            engine_b.load(keys, [6, 7, 8])
            engine_b.wait()
            assert [engine_b.caches.read_row(0, b) for b in (6, 7, 8)] == computed


def test_rows_a_spill_could_not_place_are_counted_in_the_offloaders_stats(tmp_path):
    """No drop is silent: with the master gone, every spilled row is counted dropped, and
    the reasons' counters are in ``Offloader.stats()``."""
    master = start_master(tmp_path)
    kv, groups = per_layer_blocks_first()
    keys = keys_for("lost", 3)
    try:
        with Offloader(kv, groups, config(master, 4, row_bytes())) as offloader:
            master.kill()
            for i, key in enumerate(keys):
                offloader.store([key], [i])
                offloader.wait()
                offloader.wait_tiers()
            tier = offloader.stats()["tiers"]["mooncake"]
            assert (tier["stored"], tier["dropped"]) == (0, 3), tier
            assert {"full", "unreachable", "timeouts", "skipped_down", "host_faults"} <= tier.keys()
    finally:
        master.close()
