"""kvtier's disk tier below the host tier, inside vLLM: spills, promotions, and a failed
promotion that must stay a miss (vLLM asserts every device transfer succeeds)."""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("vllm")

from tests.vllm.harness import BLOCK_SIZE
from tiers.disk.lmdb_store import ROWS_FILE

PREFIX = list(range(100, 260))  # 10 blocks


def tiers_toml(tmp_path, lower_tier: str, name: str = "tiers.toml") -> str:
    """A TOML file: the host tier, then ``lower_tier`` (a ``[[tiers]]`` body), written through."""
    path = tmp_path / name
    path.write_text(f"""
[[tiers]]
kind = "host"
eviction = "lru"

[[tiers]]
{lower_tier}
capacity = "64MiB"
placement = "write-through"
""")
    return str(path)


def disk_toml(tmp_path):
    return tiers_toml(tmp_path, f'kind = "disk"\npath = "{tmp_path / "disk"}"\nadmission = "all"')


def remote_toml(tmp_path, address, extra: str = "", name: str = "tiers.toml"):
    return tiers_toml(tmp_path, f'kind = "remote"\npeers = ["{address}"]\ndeadline_s = 1.0\n{extra}', name)


def stored_then_host_reset(make_engine, tmp_path, toml=None):
    """An engine whose first request's prompt is only below the host tier (host tier reset,
    device cache evicted and scrambled); on disk unless ``toml`` says otherwise."""
    engine = make_engine(kvtier_config=toml or disk_toml(tmp_path))
    first = engine.add(PREFIX + list(range(500, 540)))
    engine.run()
    manager = engine.manager.manager
    assert manager.lower.engine.wait_idle(10)
    manager.poll()
    assert manager.lower.stats.spills_done == manager.stats.stored_rows == 12
    assert engine.scheduler.reset_connector_cache()
    assert len(manager) == 0
    engine.evict_device_cache()
    engine.scramble()
    return engine, first


def test_a_prefix_on_disk_is_promoted_and_loaded_byte_exact(make_engine, tmp_path):
    engine, _ = stored_then_host_reset(make_engine, tmp_path)
    again = engine.add(PREFIX + list(range(600, 630)))
    engine.run()

    record = engine.requests[again]
    assert record.loaded == [(0, len(PREFIX))]
    assert not record.computed & set(range(len(PREFIX)))
    lower = engine.manager.manager.lower
    assert lower.stats.promotions_done >= len(PREFIX) // BLOCK_SIZE
    assert lower.stats.promotions_failed == 0
    text = engine.manager.metrics_text()
    assert 'kvtier_hits_total{tier="disk"}' in text
    assert 'kvtier_load_latency_seconds_count{tier="disk"}' in text
    with pytest.raises(ValueError, match="tiers below"):  # a host miss must be able to promote
        engine.manager.manager.host_lookup("hit", "miss", "pending")


def test_a_corrupt_row_on_disk_is_a_miss_and_the_prefix_before_it_still_loads(make_engine, tmp_path):
    engine, first = stored_then_host_reset(make_engine, tmp_path)
    bad_block = 4
    key = engine.requests[first].block_hashes[bad_block] + (0).to_bytes(4, "big")
    disk = engine.manager.manager.lower.tiers[0]
    assert disk.may_contain(key)
    flip_a_byte_of_the_row(tmp_path / "disk", engine, first, bad_block)

    again = engine.add(PREFIX + list(range(600, 630)))
    engine.run()  # vLLM would raise if a failed transfer reached a device load

    record = engine.requests[again]
    assert record.loaded == [(0, bad_block * BLOCK_SIZE)], "blocks before the corrupt one still load"
    assert set(range(bad_block * BLOCK_SIZE, len(PREFIX))) <= record.computed, "the rest is recomputed"
    assert engine.manager.manager.lower.stats.promotions_failed == 1
    assert disk.stats()["corrupt"] == 1
    # The request computed its blocks again and stored them: the key is whole once more.
    assert engine.manager.manager.contains(key)


def flip_a_byte_of_the_row(disk_dir, engine, req_id, block):
    """Corrupt the stored row of ``block`` in the disk tier's rows file (found by its bytes)."""
    tokens = engine.requests[req_id].prompt
    # The row starts with the first layer's page of that block: the model's bytes of its first token.
    probe = engine._expected("layer0", block * BLOCK_SIZE, tokens[block * BLOCK_SIZE])[0].numpy().tobytes()
    path = disk_dir / ROWS_FILE
    data = path.read_bytes()
    offset = data.find(probe)
    assert offset >= 0 and data.find(probe, offset + 1) < 0, "the probe must find exactly the one row"
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([data[offset + 5] ^ 0xFF]), offset + 5)
    finally:
        os.close(fd)


@pytest.fixture
def peer(tmp_path):
    from tests.tiers.peer_fixtures import start_peers

    (process,) = start_peers(tmp_path, 1, capacity="64MiB", row_bytes="1MiB")
    yield process
    process.close()


def stored_at_a_peer_then_host_reset(make_engine, tmp_path, peer):
    return stored_then_host_reset(make_engine, tmp_path, remote_toml(tmp_path, peer.address))


@pytest.mark.multiprocess
def test_a_prefix_at_a_peer_is_promoted_and_loaded_byte_exact(make_engine, tmp_path, peer):
    engine, _ = stored_at_a_peer_then_host_reset(make_engine, tmp_path, peer)
    again = engine.add(PREFIX + list(range(600, 630)))
    engine.run()  # the harness checks every loaded block's bytes against the model's
    record = engine.requests[again]
    assert record.loaded == [(0, len(PREFIX))]
    assert engine.manager.manager.lower.stats.promotions_done >= len(PREFIX) // BLOCK_SIZE


@pytest.mark.multiprocess
def test_a_dead_peer_is_a_miss_and_the_request_recomputes(make_engine, tmp_path, peer):
    engine, _ = stored_at_a_peer_then_host_reset(make_engine, tmp_path, peer)
    peer.kill()
    again = engine.add(PREFIX + list(range(600, 630)))
    engine.run()  # vLLM would raise if a failed promotion reached a device load
    record = engine.requests[again]
    assert record.loaded == []
    assert set(range(len(PREFIX))) <= record.computed
    lower = engine.manager.manager.lower
    assert lower.stats.promotions_done == 0
    assert lower.stats.promotions_failed >= 1


@pytest.mark.multiprocess
def test_with_lookup_wait_a_prefix_another_engine_put_loads_on_the_first_request(make_engine, tmp_path, peer):
    writer = make_engine(kvtier_config=remote_toml(tmp_path, peer.address))
    writer.add(PREFIX + list(range(500, 540)))
    writer.run()
    put = writer.manager.manager
    assert put.lower.engine.wait_idle(10)
    put.poll()
    assert put.lower.stats.spills_done == 12

    # Without a wait, vLLM stops at the first block it does not hold: the first request
    # recomputes the prefix, and only asks the peer about that block.
    unwaiting = make_engine(kvtier_config=remote_toml(tmp_path, peer.address, name="nowait.toml"))
    cold = unwaiting.add(PREFIX + list(range(600, 630)))
    unwaiting.run()
    assert unwaiting.requests[cold].loaded == []
    assert unwaiting.manager.manager.lower.stats.checks_asked == 1

    # With one, the request waits a step or two while the peer is asked about all of it.
    waiting = make_engine(
        kvtier_config=remote_toml(tmp_path, peer.address, "lookup_wait_s = 8.0", name="wait.toml")
    )
    warm = waiting.add(PREFIX + list(range(600, 630)))
    waiting.run()  # the harness checks every loaded block's bytes against the model's
    record = waiting.requests[warm]
    # Every full block: the prefix the writer put, and the block after it, which the
    # unwaiting engine computed for the same prompt and put there too.
    full = len(record.prompt) // BLOCK_SIZE * BLOCK_SIZE
    assert record.loaded == [(0, full)]
    assert not record.computed & set(range(full))
    manager = waiting.manager.manager
    assert manager.stats.retries >= full // BLOCK_SIZE
    assert manager.lower.stats.promotions_done == full // BLOCK_SIZE
    assert "kvtier_lookup_retries_total" in waiting.manager.metrics_text()

    # A prompt nobody holds waits for the peers' answer, not for the whole wait: the
    # request is deferred at least a step, and computed long before 8 s have passed.
    for engine in (unwaiting, waiting):
        cold = engine.add(list(range(2000, 2160)))
        steps, started = 0, time.monotonic()
        while not engine.requests[cold].computed:
            engine.step()
            steps += 1
        if engine is waiting:
            assert steps >= 2 and time.monotonic() - started < 8.0
        else:
            assert steps == 1
        engine.run()


def test_the_host_tiers_in_flight_bounds_reach_the_manager_from_kvtier_config(make_engine, tmp_path):
    path = tmp_path / "bounds.toml"
    path.write_text(f"""
[[tiers]]
kind = "host"
max_promoting_rows = 5
max_spilling_rows = 3
slow_tier_pause_s = 2.5

[[tiers]]
kind = "disk"
path = "{tmp_path / "disk"}"
capacity = "64MiB"
""")
    manager = make_engine(kvtier_config=str(path)).manager.manager
    assert (manager.max_promoting_rows, manager.max_spilling_rows, manager.lower.pause_s) == (5, 3, 2.5)
