"""Every model family vLLM's CPU engine runs, with kvtier: a reset prefix comes back exact
from the host tier, then from the disk tier (and for some, from a peer or Mooncake).

One engine per family (starts are the slow part), with kvtier's host tier and a disk tier
written through; each family's tiny checkpoint is built here (``bench.tiny_families``).
The prefix is reset out of vLLM's device cache and comes back from kvtier's host tier;
then the host tier is reset too and it comes back from disk. Qwen3-MoE's engine has a
``kvtier peer`` below the disk, Gemma-2's a Mooncake Store (``NETWORK``): the host tier
reset again, a request that loads from remote tiers only (``kv_load_tiers``) gets the
prefix from there. For the hybrids, the recurrent-state row is then corrupted on disk
(its attention rows intact): a miss for the whole prefix. "Exact" is as in
``test_real_engine``: greedy tokens and logprobs equal the engine's own device-cache run
(the same KV attended), and another document's output differs (the check can fail).

The families and what kvtier carries for each (rows per block and KV group):

- ``qwen3-moe``: attention as a Llama's, MoE MLPs (one group);
- ``gemma2``: sliding-window and global layers (two groups; the sliding group's window only);
- ``qwen3-next``: gated delta-net layers and attention (an attention group and a recurrent
  state group: vLLM sets 288-token blocks so both groups' pages are equal);
- ``nemotron-h``, ``granite-4-h``: Mamba-2 layers and attention (the same, with 160-token
  blocks);
- ``deepseek-v2-mla``: MLA, one 576-wide latent per token and layer. vLLM's CPU engine turns
  its own prefix cache off for MLA, so kvtier is the only prefix cache there, and the
  reference is the cold run: the same greedy tokens, but logprobs only close, since vLLM
  computes the prompt's last tokens on another path when the rest was loaded (attention
  over the cached latents, not one prefill over the whole prompt). Disk loads are then
  checked bit for bit against host loads.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lmdb
import pytest

from bench.tiny_families import FAMILIES, SLIDING_WINDOW, write_family
from offload.keys import key_group
from tests.engine.conftest import document
from tests.engine.test_real_engine import (  # noqa: F401 (mooncake_master: a fixture)
    FROM_PEERS,
    assert_exact,
    chain,
    lower_tier_config,
    mooncake_master,
    wait_spilled,
)

DOC = document(1, 450)  # no family's block size divides it: the last partial block stays computed
OTHER = document(2, 450)
MAX_MODEL_LEN = 1024  # two groups share an 80-block device cache: 1,280 tokens each


def blocks(block: int) -> int:
    """Full blocks of ``DOC`` vLLM caches (never the prompt's last token)."""
    return (len(DOC) - 1) // block


# family: (vLLM's block size for it, rows kvtier loads for DOC's prefix)
EXPECTED: dict[str, tuple[int, int]] = {
    "qwen3-moe": (32, blocks(32)),
    # the global group's whole prefix, the sliding group's window (as vLLM's connector asks)
    "gemma2": (32, blocks(32) + math.ceil(SLIDING_WINDOW / 32)),
    # the attention group's blocks, and the recurrent state at the prefix's end only
    "qwen3-next": (288, blocks(288) + 1),
    "nemotron-h": (160, blocks(160) + 1),
    "granite-4-h": (160, blocks(160) + 1),
    "deepseek-v2-mla": (16, blocks(16)),
}
MLA = {"deepseek-v2-mla"}
NOT_DESCRIBED = {
    "qwen3-next": "MambaSpec",
    "nemotron-h": "MambaSpec",
    "granite-4-h": "MambaSpec",
}
"""Families whose rows no ``RowLayout`` describes (``offload/vllm/row_layout.py``): they are
keyed by the engine's configuration fingerprint, never converted for other engines. (MLA
rows are described: one latent a token, so engines of other block sizes convert them.)"""
NETWORK = {"qwen3-moe": "remote", "gemma2": "mooncake"}
"""The tier below the disk the family test also loads from, for the families whose rows are
attention rows (the hybrids and MLA go over the network in their own tests, below): one
engine for the host tier, the disk and the network, instead of an engine per tier."""
MLA_LOGPROB_TOLERANCE = 0.5
"""How far an MLA load's logprobs may sit from the cold run's (measured: up to 0.17, on the
first token; the tokens are equal)."""


@pytest.fixture
def peer(tmp_path: Path):
    """A ``kvtier peer`` whose rows take the largest family's (Qwen3-Next: 144 KiB a block)."""
    from tests.tiers.peer_fixtures import start_peers

    (process,) = start_peers(tmp_path, capacity="128MiB", row_bytes="256KiB")
    yield process
    process.close()


@pytest.fixture
def network_config(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, Any] | None:
    """kvtier's configuration with a peer or a Mooncake Store below the host tier. A test
    asks for it before ``make_engine``, so its engine is closed before the peer or the
    master stops (closed after, the Mooncake client retries a gone master for ~20 s)."""
    return chain(kind, tmp_path, request)


@pytest.fixture
def tiers_config(name: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    """The host tier, a disk, and for a family in ``NETWORK`` its peer or Mooncake Store,
    all written through (asked for before ``make_engine``, as ``network_config``)."""
    config = lower_tier_config("disk", tmp_path)
    if name in NETWORK:
        network = chain(NETWORK[name], tmp_path, request)
        assert network is not None
        config["tiers"].append(network["tiers"][1])
    return config


@pytest.fixture(scope="session")
def families_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families")


def start(name: str, make_engine: Any, families_dir: Path, kvtier_config: Any) -> Any:
    family = FAMILIES[name]
    return make_engine(
        model_dir=str(write_family(families_dir, family)),
        kvtier_config=kvtier_config,
        max_model_len=MAX_MODEL_LEN,
        **family.engine,
    )


def corrupt_rows(disk: Path, group: int) -> int:
    """Flip every byte of each row of kvtier's KV group ``group`` in the disk tier at
    ``disk`` (found through its LMDB index, read beside the running tier), their index entries
    and trailers kept: the tier finds the rows, and each read fails its checksum. The number
    of rows corrupted."""
    from tiers.disk.lmdb_store import INDEX_DB, PAGE, ROWS_FILE, Entry

    rows_file = next(disk.rglob(ROWS_FILE))
    env = lmdb.open(str(rows_file.parent), max_dbs=3, readonly=True, lock=False)
    try:
        with env.begin(db=env.open_db(INDEX_DB, create=False)) as txn:
            entries = [Entry.unpack(value) for key, value in txn.cursor() if key_group(key) == group]
    finally:
        env.close()
    with rows_file.open("r+b") as handle:
        for entry in entries:
            assert entry is not None
            left = entry.length
            for first, count in entry.runs:
                handle.seek(first * PAGE)
                data = handle.read(min(left, count * PAGE))
                handle.seek(first * PAGE)
                handle.write(bytes(b ^ 0x5A for b in data))
                left -= len(data)
    return len(entries)


def assert_a_corrupt_state_row_is_a_miss_for_the_whole_prefix(engine: Any, disk: Path, cold: Any) -> None:
    """A hybrid's state row corrupted on disk, its attention rows there intact, kvtier's host
    tier empty: the state row fails its promotion (the disk tier's checksum), so vLLM finds
    no position to resume from and recomputes the whole prefix, as the cold run did."""
    (state_group,) = engine.groups("MambaSpec")
    assert corrupt_rows(disk, state_group) == 1, "the document's state row (one document stored)"
    assert engine.reset_prefix_cache(connector=True)
    before = engine.kvtier_stats()

    again = engine.generate([DOC])[0]

    assert again.num_cached_tokens == 0 and again.external_cached_tokens == 0
    assert_exact(again, cold)
    stats = engine.kvtier_stats()
    assert stats["loaded_rows_by_tier"] == before["loaded_rows_by_tier"], "no row loaded"
    assert stats["lower"]["promotions_failed"] == before["lower"]["promotions_failed"] + 1
    assert "corrupt row" in engine.log_path.read_text(errors="replace")


def from_device_then_host(engine: Any, prefix: int) -> tuple[Any, Any]:
    """``(cold, reference)``: ``DOC`` computed, answered again from vLLM's device
    prefix cache (the reference), then, that cache reset, with its ``prefix`` loaded whole
    from kvtier's host tier, token- and logprob-exact against the reference."""
    cold = engine.generate([DOC])[0]
    assert cold.num_cached_tokens == 0
    reference = engine.generate([DOC])[0]
    assert reference.num_cached_tokens == prefix
    assert reference.external_cached_tokens == 0, "the device prefix cache, not kvtier"
    assert engine.reset_prefix_cache()
    from_host = engine.generate([DOC])[0]
    assert from_host.external_cached_tokens == prefix, "the whole prefix from kvtier's host tier"
    assert_exact(from_host, reference)
    return cold, reference


def assert_close(actual: Any, expected: Any) -> None:
    assert actual.tokens == expected.tokens
    assert max(abs(a - b) for a, b in zip(actual.logprobs, expected.logprobs, strict=True)) < (
        MLA_LOGPROB_TOLERANCE
    )


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_family_comes_back_exact_from_the_host_then_the_disk_tier(
    name, tiers_config, make_engine, families_dir, tmp_path
):
    block, rows = EXPECTED[name]
    prefix = blocks(block) * block
    engine = start(name, make_engine, families_dir, tiers_config)

    if name in MLA:
        cold = engine.generate([DOC])[0]
        assert cold.num_cached_tokens == 0
        # No device prefix cache: the second run's prefix is kvtier's host tier already.
        reference = engine.generate([DOC])[0]
        assert reference.external_cached_tokens == prefix, "the whole prefix from kvtier's host tier"
        assert_close(reference, cold)
    else:
        cold, reference = from_device_then_host(engine, prefix)
    assert engine.kvtier_stats()["loaded_rows_by_tier"] == {"host": rows}

    lower_tiers = len(tiers_config["tiers"]) - 1
    wait_spilled(engine, lower_tiers * engine.kvtier_stats()["stored_rows"])
    assert engine.reset_prefix_cache(connector=True)  # the device cache and kvtier's host tier
    from_disk = engine.generate([DOC])[0]

    assert from_disk.external_cached_tokens == prefix, "the whole prefix from the disk tier"
    assert_exact(from_disk, reference)
    assert engine.kvtier_stats()["loaded_rows_by_tier"] == {"host": rows, "disk": rows}
    if name in NETWORK:
        assert engine.reset_prefix_cache(connector=True)
        from_network = engine.generate([DOC], kv_transfer_params=FROM_PEERS)[0]
        assert from_network.external_cached_tokens == prefix, f"the whole prefix from {NETWORK[name]}"
        assert_exact(from_network, reference)
        loaded = {"host": rows, "disk": rows, NETWORK[name]: rows}
        assert engine.kvtier_stats()["loaded_rows_by_tier"] == loaded
    if name in NOT_DESCRIBED:  # the hybrids
        assert_a_corrupt_state_row_is_a_miss_for_the_whole_prefix(engine, tmp_path / "disk", cold)
    other = engine.generate([OTHER])[0]
    assert other.tokens != reference.tokens
    log = engine.log_path.read_text(errors="replace")
    if name in NOT_DESCRIBED:
        assert "fingerprint only: " in log and NOT_DESCRIBED[name] in log
    else:
        assert "described: rows of other layouts convert" in log


@pytest.mark.parametrize("name", ["qwen3-next", "nemotron-h"])
def test_attention_rows_without_their_state_row_are_a_miss_for_the_whole_prefix(
    name, make_engine, families_dir
):
    """A hybrid's prefix is its attention rows and the recurrent state at the prefix's end.
    With the state row gone from kvtier (the host tier alone: nothing below to promote it
    from) and every attention row still there, vLLM finds no position to resume from: the
    whole prefix is recomputed and the output is the cold run's, never a load of attention
    rows over a missing state."""
    family = FAMILIES[name]
    engine = make_engine(
        model_dir=str(write_family(families_dir, family)), max_model_len=MAX_MODEL_LEN, **family.engine
    )
    cold = engine.generate([DOC])[0]
    engine.generate([DOC])  # from the device cache
    assert engine.reset_prefix_cache()
    stats = engine.kvtier_stats()
    _block, rows = EXPECTED[name]
    assert stats["host_rows"] == rows

    assert engine.drop_rows("MambaSpec") == 1  # the state row; the attention rows stay

    assert engine.kvtier_stats()["host_rows"] == rows - 1
    again = engine.generate([DOC])[0]
    assert again.num_cached_tokens == 0 and again.external_cached_tokens == 0
    assert_exact(again, cold)
    assert engine.kvtier_stats()["loaded_rows_by_tier"] == {}


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("qwen3-next", "remote"),
        ("qwen3-next", "mooncake"),
        ("nemotron-h", "remote"),  # its state rows travel as Qwen3-Next's do: Mooncake once is enough
        ("deepseek-v2-mla", "remote"),
        ("deepseek-v2-mla", "mooncake"),
    ],
)
def test_a_family_comes_back_exact_from_a_peer_or_mooncake(
    name, kind, network_config, make_engine, families_dir
):
    """The families whose rows are not K and V heads (recurrent states, MLA latents), over
    the network: a real ``kvtier peer`` (NIXL) or a Mooncake Store, written through. (MoE
    and Gemma-2, attention rows, go over the network in the family test's engine: ``NETWORK``.)"""
    block, rows = EXPECTED[name]
    prefix = blocks(block) * block
    engine = start(name, make_engine, families_dir, network_config)
    cold = engine.generate([DOC])[0]
    reference = engine.generate([DOC])[0]  # the device cache's; for MLA kvtier's host tier's
    if name in MLA:
        assert_close(reference, cold)
    else:
        assert reference.external_cached_tokens == 0
    wait_spilled(engine, engine.kvtier_stats()["stored_rows"])
    assert engine.reset_prefix_cache(connector=True)

    again = engine.generate([DOC])[0]

    assert again.external_cached_tokens == prefix
    assert_exact(again, reference)
    assert engine.kvtier_stats()["loaded_rows_by_tier"].get(kind) == rows
