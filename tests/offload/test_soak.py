"""A randomised run of stores, lookups, promotions and loads through host + disk tiers.

Every block's bytes are derived from its key, so every load can be checked against what
must be there: across evictions, spills, promotions and slot reuse, a load either brings
back exactly the stored bytes or the key was not a hit.
"""

import random

import pytest
import torch

from offload.api import Offloader
from offload.keys import make_key
from tests.offload.layouts import NUM_BLOCKS, per_layer_blocks_first


def fill(kv: dict, block: int, key: bytes) -> None:
    """Write bytes derived from ``key`` into ``block`` of every layer."""
    seed = int.from_bytes(key[:8], "big") % (2**31)
    generator = torch.Generator().manual_seed(seed)
    for i, tensor in enumerate(kv.values()):
        tensor[block].view(torch.int16).copy_(
            torch.randint(-(2**15), 2**15, tensor[block].shape, generator=generator, dtype=torch.int16) + i
        )


def disk_tier(tmp_path, placement: str) -> dict:
    return {
        "kind": "disk",
        "path": str(tmp_path / "disk"),
        "capacity": "1MiB",
        "admission": "all",
        "placement": placement,
    }


@pytest.mark.parametrize("placement", ["write-through", "write-back"])
def test_random_workload_never_loads_wrong_bytes(tmp_path, placement):
    run_workload(tmp_path, [disk_tier(tmp_path, placement)])


@pytest.mark.multiprocess
def test_random_workload_over_disk_and_a_peer(tmp_path):
    from tests.tiers.peer_fixtures import start_peers

    (peer,) = start_peers(tmp_path, 1, capacity="1MiB", row_bytes="4KiB")
    try:
        remote = {"kind": "remote", "peers": [peer.address], "capacity": "1MiB", "placement": "write-through"}
        run_workload(tmp_path, [disk_tier(tmp_path, "write-back"), remote])
    finally:
        peer.close()


def run_workload(tmp_path, lower_tiers: list[dict]) -> None:
    rng = random.Random(7)
    kv, groups = per_layer_blocks_first()
    with Offloader(kv, groups) as probe:
        row = probe.caches.row_bytes(0)
    config = {"tiers": [{"kind": "host", "capacity": 6 * row}, *lower_tiers]}
    universe = [make_key(f"block-{i}".encode().ljust(16, b"."), 0) for i in range(24)]
    expected = {}  # key -> bytes of its row, computed once
    with Offloader(kv, groups, config) as offloader:
        for key in universe:
            fill(kv, 0, key)
            expected[key] = offloader.caches.read_row(0, 0)
        loads_checked = 0
        for _step in range(300):
            action = rng.random()
            keys = rng.sample(universe, rng.randint(1, 3))
            blocks = rng.sample(range(NUM_BLOCKS), len(keys))
            offloader.wait()  # an engine reuses a device block only once its copy has finished
            if action < 0.45:
                for key, block in zip(keys, blocks, strict=True):
                    fill(kv, block, key)
                offloader.store(keys, blocks)
            else:
                hits = offloader.lookup(keys)
                if hits:
                    for block in blocks[:hits]:
                        kv["layer.0"][block].view(torch.int16).fill_(0)
                    offloader.load(keys[:hits], blocks[:hits])
                    offloader.wait()
                    for key, block in zip(keys[:hits], blocks[:hits], strict=True):
                        assert offloader.caches.read_row(0, block) == expected[key]
                        loads_checked += 1
            if rng.random() < 0.3:
                offloader.wait_tiers()
            offloader.poll()
        stats = offloader.stats()
    assert loads_checked > 10  # the run exercised loads (each one checked above)
    assert stats["lower"]["promotions_done"] > 0
    assert stats["quarantined_slots"] == 0
