"""kvtier inside vLLM's real CPU engine: a prefix reset out of vLLM's device cache comes back
from kvtier, and the model's output is token- and logprob-exact.

The reference for "exact" is the same engine reusing its own device prefix cache for the
same prompt: the same KV attended, so the same logprobs to the last bit. A prefill from
scratch is a different computation (its logprobs differ in the third decimal), so a run
that recomputed instead of loading would not pass for a load; a run that loaded the wrong
bytes would not either: another document's output differs, which every test checks.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.engine.conftest import SLIDING_WINDOW, document

BLOCK = 32
DOC = document(1, 1200)
OTHER = document(2, 1200)
FULL_BLOCKS = (len(DOC) - 1) // BLOCK  # vLLM caches whole blocks, never the prompt's last token
ROWS = FULL_BLOCKS  # one host row per block (blocks_per_chunk = 1)


def lower_tier_config(kind: str, tmp_path: Path, **tier: Any) -> dict[str, Any]:
    """The host tier, then one lower tier written through (every stored row is spilled)."""
    lower = {"kind": kind, "capacity": "128MiB", "placement": "write-through", **tier}
    if kind == "disk":
        lower.setdefault("path", str(tmp_path / "disk"))
        lower.setdefault("admission", "all")
    return {"tiers": [{"kind": "host", "eviction": "lru"}, lower]}


def wait_spilled(engine: Any, rows: int, timeout_s: float = 30.0) -> dict[str, Any]:
    """Until ``rows`` rows have been spilled below the host tier (they spill in the background)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.kvtier_stats()
        if stats["lower"]["spills_done"] >= rows and stats["lower_inflight"] == 0:
            return stats
        assert time.monotonic() < deadline, f"rows not spilled in {timeout_s} s: {stats}"
        time.sleep(0.2)


def cold_and_reference(engine: Any) -> tuple[Any, Any]:
    """The document computed (kvtier stores it), then again from vLLM's own device cache."""
    cold = engine.generate([DOC])[0]
    assert cold.num_cached_tokens == 0
    reference = engine.generate([DOC])[0]
    assert reference.num_cached_tokens == FULL_BLOCKS * BLOCK
    assert reference.external_cached_tokens == 0, "the device prefix cache, not kvtier"
    return cold, reference


def assert_exact(actual: Any, expected: Any) -> None:
    assert actual.tokens == expected.tokens
    assert actual.logprobs == expected.logprobs


def assert_another_document_differs(engine: Any, reference: Any) -> None:
    """The check can fail: another document's output is not the document's."""
    other = engine.generate([OTHER])[0]
    assert other.tokens != reference.tokens


@pytest.fixture
def peer(tmp_path: Path):
    from tests.tiers.peer_fixtures import start_peers

    (process,) = start_peers(tmp_path, capacity="128MiB", row_bytes="128KiB")
    yield process
    process.close()


@pytest.fixture
def mooncake_master(tmp_path: Path):
    pytest.importorskip("mooncake.store")
    from tests.tiers.mooncake_fixtures import start_master

    master = start_master(tmp_path)
    yield master
    master.close()


def chain(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, Any] | None:
    if kind == "host":
        return None
    if kind == "disk":
        return lower_tier_config("disk", tmp_path)
    if kind == "remote":
        peer = request.getfixturevalue("peer")
        return lower_tier_config("remote", tmp_path, peers=[peer.address], deadline_s=2.0)
    master = request.getfixturevalue("mooncake_master")
    return lower_tier_config("mooncake", tmp_path, master=master.address, deadline_s=2.0)


FROM_PEERS = {"kv_load_tiers": [{"locality": "REMOTE"}]}
"""A request's ``kv_transfer_params`` that loads from the host tier and the remote tiers only
(vLLM's per-request tier filter): how one engine over a disk and a peer reads the peer."""


def test_an_fp8_kv_cache_comes_back_exact_from_the_host_the_disk_and_a_peer(peer, make_engine, tmp_path):
    """vLLM 0.32's CPU engine runs ``kv_cache_dtype="fp8"`` (one byte an element); kvtier
    keys its rows by the fingerprint, the dtype named in the start log, and loads them exact
    from each tier: one engine over the host tier, a disk and a ``kvtier peer``, both written
    through; the prefix comes from the host tier, then (the host tier reset) from disk, then
    (reset again, the request loading from remote tiers only) from the peer."""
    config = lower_tier_config("disk", tmp_path)
    config["tiers"].append(
        lower_tier_config("remote", tmp_path, peers=[peer.address], deadline_s=2.0)["tiers"][1]
    )
    engine = make_engine(kv_cache_dtype="fp8", kvtier_config=config)
    _cold, reference = cold_and_reference(engine)
    assert engine.reset_prefix_cache()

    from_host = engine.generate([DOC])[0]

    assert from_host.external_cached_tokens == FULL_BLOCKS * BLOCK, "the whole prefix from kvtier"
    assert_exact(from_host, reference)
    assert engine.kvtier_stats()["loaded_rows_by_tier"] == {"host": ROWS}
    wait_spilled(engine, 2 * ROWS)  # to the disk and to the peer
    loaded = {"host": ROWS}
    for tier, params in (("disk", None), ("remote", FROM_PEERS)):
        assert engine.reset_prefix_cache(connector=True)
        again = engine.generate([DOC], kv_transfer_params=params)[0]
        assert again.external_cached_tokens == FULL_BLOCKS * BLOCK, f"the whole prefix from {tier}"
        assert_exact(again, reference)
        loaded[tier] = ROWS
        assert engine.kvtier_stats()["loaded_rows_by_tier"] == loaded
    assert_another_document_differs(engine, reference)
    log = engine.log_path.read_text(errors="replace")
    assert "fingerprint only: KV cache dtype 'fp8' (a quantised cache)" in log
    assert "of 32768 B" in log, "4 layers x 2 KV heads x 32 tokens x (K + V) 64 dims x 1 B a block"


@pytest.mark.parametrize("kind", ["host", "disk", "remote", "mooncake"])
def test_a_reset_prefix_comes_back_from_kvtier_token_and_logprob_exact(kind, make_engine, tmp_path, request):
    engine = make_engine(kvtier_config=chain(kind, tmp_path, request))
    _cold, reference = cold_and_reference(engine)
    if kind != "host":
        wait_spilled(engine, ROWS)
    # The device prefix cache is emptied; below the host tier, kvtier's host tier too.
    assert engine.reset_prefix_cache(connector=kind != "host")

    again = engine.generate([DOC])[0]

    assert again.external_cached_tokens == FULL_BLOCKS * BLOCK, "the whole prefix from kvtier"
    assert_exact(again, reference)
    assert engine.kvtier_stats()["loaded_rows_by_tier"] == {kind: ROWS}
    assert_another_document_differs(engine, reference)
    engine.close()  # vLLM closes its connector at exit: every tier closes cleanly there
    assert "tier failed" not in engine.log_path.read_text(errors="replace")


def test_without_kvtier_the_reset_prefix_is_recomputed(make_engine):
    """The control: vLLM alone recomputes the prefix, and its output is the cold run's, not
    the reference's (so the exact check above tells a load from a recompute)."""
    engine = make_engine(kvtier=False)
    cold, reference = cold_and_reference(engine)
    assert engine.reset_prefix_cache()
    again = engine.generate([DOC])[0]
    assert again.num_cached_tokens == 0
    assert_exact(again, cold)
    assert again.logprobs != reference.logprobs


def test_tensor_parallel_workers_share_the_host_tier_with_the_scheduler(make_engine):
    engine = make_engine(tensor_parallel_size=2)
    _cold, reference = cold_and_reference(engine)
    assert engine.reset_prefix_cache()
    again = engine.generate([DOC])[0]
    assert again.external_cached_tokens == FULL_BLOCKS * BLOCK
    assert_exact(again, reference)
    assert_another_document_differs(engine, reference)


def test_a_corrupt_disk_row_is_recomputed_never_loaded(make_engine, tmp_path):
    from tiers.disk.lmdb_store import ROWS_FILE

    engine = make_engine(kvtier_config=lower_tier_config("disk", tmp_path))
    cold, _reference = cold_and_reference(engine)
    wait_spilled(engine, ROWS)
    rows_file = next((tmp_path / "disk").rglob(ROWS_FILE))
    with rows_file.open("r+b") as handle:  # every row's bytes flipped, the file's size kept
        data = bytearray(handle.read())
        handle.seek(0)
        handle.write(bytes(b ^ 0x5A for b in data))
    assert engine.reset_prefix_cache(connector=True)

    again = engine.generate([DOC])[0]

    assert again.external_cached_tokens == 0
    assert_exact(again, cold)  # recomputed from scratch, as the cold run was
    stats = engine.kvtier_stats()
    assert stats["lower"]["promotions_failed"] >= 1
    assert stats["loaded_rows_by_tier"].get("disk", 0) == 0


def test_a_killed_peer_means_a_recompute_not_a_hang(make_engine, tmp_path, peer):
    engine = make_engine(
        kvtier_config=lower_tier_config("remote", tmp_path, peers=[peer.address], deadline_s=2.0)
    )
    cold, _reference = cold_and_reference(engine)
    wait_spilled(engine, ROWS)
    peer.kill()
    assert engine.reset_prefix_cache(connector=True)

    started = time.monotonic()
    again = engine.generate([DOC])[0]

    assert time.monotonic() - started < 60
    assert again.external_cached_tokens == 0
    assert_exact(again, cold)


def test_an_engine_restarted_over_the_same_disk_finds_the_prefix(make_engine, tmp_path):
    config = lower_tier_config("disk", tmp_path)
    first = make_engine(kvtier_config=config)
    _cold, reference = cold_and_reference(first)
    wait_spilled(first, ROWS)
    first.close()

    second = make_engine(kvtier_config=config)
    again = second.generate([DOC])[0]

    assert again.external_cached_tokens == FULL_BLOCKS * BLOCK
    assert_exact(again, reference)
    assert second.kvtier_stats()["loaded_rows_by_tier"] == {"disk": ROWS}


def test_preemption_under_a_small_device_cache_finishes_every_request(make_engine):
    """Four requests whose decodes outgrow an 80-block device cache: vLLM preempts some, and
    each comes back (its prefix from kvtier); every request finishes, with the tokens it has
    when it runs alone."""
    engine = make_engine()
    prompts = [document(10 + i, 600) for i in range(4)]
    alone = [engine.generate([p], max_tokens=64)[0] for p in prompts]
    assert engine.reset_prefix_cache()

    together = engine.generate(prompts, max_tokens=64)

    assert [len(c.tokens) for c in together] == [64] * 4
    assert sum(c.preemptions for c in together) >= 1
    for batch, single in zip(together, alone, strict=True):
        assert batch.tokens[:8] == single.tokens[:8]
    assert engine.kvtier_stats()["loaded_rows_by_tier"].get("host", 0) > 0


def test_a_killed_engine_leaves_no_shared_memory(make_engine, shm_dir):
    """SIGKILL gives nobody a chance to clean up: the host-tier file's name is already gone
    once the scheduler and the worker have mapped it (the fixture checks ``shm_dir``)."""
    engine = make_engine(tensor_parallel_size=2)
    assert engine.generate([DOC[:100]])[0].tokens
    assert list(shm_dir.iterdir()) == []
    engine.kill()


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_a_hybrid_model_with_sliding_window_layers_comes_back_exact(
    kind, make_engine, hybrid_model_dir, tmp_path, request
):
    """Two KV-cache groups (full attention, a 256-token sliding window): kvtier keeps a row per
    group and block, and a hit loads the full group's whole prefix but the sliding group's
    window only, as vLLM asks."""
    engine = make_engine(
        model_dir=hybrid_model_dir, kvtier_config=chain(kind, tmp_path, request), device_blocks=200
    )
    _cold, reference = cold_and_reference(engine)
    if kind != "host":
        wait_spilled(engine, FULL_BLOCKS)
    assert engine.reset_prefix_cache(connector=kind != "host")

    again = engine.generate([DOC])[0]

    assert again.external_cached_tokens == FULL_BLOCKS * BLOCK
    assert_exact(again, reference)
    loaded = engine.kvtier_stats()["loaded_rows_by_tier"][kind]
    window_blocks = SLIDING_WINDOW // BLOCK
    assert FULL_BLOCKS + window_blocks <= loaded < 2 * FULL_BLOCKS
    assert_another_document_differs(engine, reference)
