"""One stored prefix, served to engines with other layouts and block sizes (across processes).

Engine A (a child process, ``hetero_writer``) stores a 3-row prompt for each layout in
``ENGINES`` through the disk tier and a real ``kvtier peer``. Engine B (this process), in
each layout in turn, looks up 4 rows, loads what it finds and compares, token by token,
with what A computed: NHD <-> HND, packed <-> per-layer, K/V together <-> apart and
16 <-> 64-token blocks, each both ways. Rows of another model, dtype or head count are
misses, never converted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.engine_layouts import EngineLayout
from offload.api import Offloader
from tests.offload.hetero_writer import prompt_keys
from tests.offload.kv_engines import ENGINES, ROW_TOKENS, blocks_per_key, engine, logical_kv
from tests.tiers.peer_fixtures import start_peers

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]
STORED_ROWS = 3
MODEL = "test/model"
MISFITS = [  # same keys scheme, but not the same model: never served to B
    {"writer": "w-bf16", "kind": "nhd", "block_tokens": 64, "dtype": "bfloat16"},
    {"writer": "w-model", "kind": "nhd", "block_tokens": 64, "model": "another/model"},
    {"writer": "w-heads", "kind": "nhd", "block_tokens": 64, "heads": 4},
]


def writer_name(spec: EngineLayout) -> str:
    return f"w-{spec.name}"


def tier_configs(tmp: Path, peer_address: str) -> dict[str, dict]:
    common = {"capacity": "8MiB", "placement": "write-through", "admission": "all"}
    return {
        "disk": {"kind": "disk", "path": str(tmp / "lmdb"), **common},
        "peer": {"kind": "remote", "peers": [peer_address], "deadline_s": 2.0, **common},
    }


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A peer, and an LMDB folder, holding every writer's prompt (written by a child process)."""
    tmp = tmp_path_factory.mktemp("hetero")
    (peer,) = start_peers(tmp, 1, capacity="4MiB", row_bytes="16KiB")
    tiers = tier_configs(tmp, peer.address)
    writers = [
        {"writer": writer_name(spec), "kind": spec.kind, "block_tokens": spec.block_tokens}
        for spec in ENGINES
    ] + MISFITS
    for seed, entry in enumerate(writers):
        entry.update(seed=seed, rows=STORED_ROWS)
    job = {
        "model": MODEL,
        "writers": writers,
        "config": {"tiers": [{"kind": "host", "capacity": "1MiB"}, *tiers.values()]},
    }
    job_path = tmp / "job.json"
    job_path.write_text(json.dumps(job))
    env = {**os.environ, "NIXL_LOG_LEVEL": "WARN"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.offload.hetero_writer", str(job_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    yield tiers, {entry["writer"]: entry["seed"] for entry in writers}
    peer.close()


def found_prefix(engine: Offloader, keys: list[bytes]) -> int:
    """Look ``keys`` up as an engine would, step after step, until promotions settle: a peer
    is asked in the background after a miss, the rows it holds are promoted after the next
    lookup, and count once they have landed."""
    for _ in range(3):
        engine.lookup(keys)
        engine.wait_tiers()
    return engine.lookup(keys)


@pytest.mark.parametrize(
    ("tier", "convert_on_load"),
    [("disk", False), ("peer", False), ("disk", True)],
    ids=["disk-convert-on-landing", "peer-convert-on-landing", "disk-convert-in-worker"],
)
@pytest.mark.parametrize("reader", ENGINES, ids=lambda spec: spec.name)
def test_every_layout_loads_every_other_layouts_prefix(stored, tier, convert_on_load, reader: EngineLayout):
    """Rows land in the host tier converted (the CPU path), or as written and are converted
    by the worker as it loads them (the device path; here on CPU tensors)."""
    tiers, seeds = stored
    config = {
        "namespace": {"model": MODEL},
        "tiers": [{"kind": "host", "capacity": "1MiB"}, tiers[tier]],
    }
    bpk = blocks_per_key(reader)
    engine, kv = reader.offloader(config, STORED_ROWS * bpk + 3, ROW_TOKENS, convert_on_load=convert_on_load)
    with engine:
        for writer in ENGINES:
            keys = prompt_keys(writer_name(writer), STORED_ROWS + 1)  # the 4th row was never stored
            assert found_prefix(engine, keys) == STORED_ROWS, f"{writer.name} -> {reader.name}"
            block_ids = list(range(STORED_ROWS * bpk, 0, -1))  # any free blocks, in any order
            engine.load(keys[:STORED_ROWS], block_ids)
            assert all(result.success for result in engine.wait())
            expected = logical_kv(seeds[writer_name(writer)], STORED_ROWS)
            got = reader.read(kv, block_ids)
            assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), (
                f"{writer.name} -> {reader.name}: bytes differ"
            )
        converted = engine.stats()["lower"]["rows_converted"]  # type: ignore[index]
        same = [w for w in ENGINES if w.kind == reader.kind and w.block_tokens == reader.block_tokens]
        assert converted >= STORED_ROWS * (len(ENGINES) - len(same) - 1)  # NHD<->HND-only pairs may share ids
        # Each path converts alone: the worker on load, or the tier engine as rows land.
        assert (engine.worker.rows_converted == converted) is convert_on_load


@pytest.mark.parametrize("tier", ["disk", "peer"])
def test_another_model_dtype_or_head_count_is_a_miss(stored, tier):
    tiers, _ = stored
    reader = engine("nhd", 64)
    config = {"namespace": {"model": MODEL}, "tiers": [{"kind": "host", "capacity": "1MiB"}, tiers[tier]]}
    kv, groups = reader.make(8)
    with Offloader(kv, groups, config, block_size=64) as offloader:
        for misfit in MISFITS:
            assert found_prefix(offloader, prompt_keys(misfit["writer"], STORED_ROWS)) == 0, misfit["writer"]
        assert offloader.stats()["lower"]["rows_converted"] == 0  # type: ignore[index]
