"""Two vLLM engines with other KV cache layouts share one stored prefix (issue #19).

Each pair runs through vLLM's real ``Scheduler`` and ``OffloadingConnector`` (``harness``):
the writer computes and stores a prompt below the host tier (a real LMDB disk tier, or a
real ``kvtier peer``), the reader, with another physical layout (NHD vs HND pages, packed
cross-layer vs a tensor per layer), asks for it. The harness checks every block the reader
loads against the bytes the model computes for it in the reader's own layout, so a row
used without conversion (or converted wrongly) fails the test. A model with other head
counts, or another dtype, must miss: never converted garbage.
"""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("vllm")

from tests.vllm.harness import BLOCK_SIZE, tiny_model_dir

PREFIX = list(range(100, 260))  # 160 tokens: 10 blocks
ROWS = len(PREFIX) // BLOCK_SIZE

PAIRS = [
    ("LBNHC", "LBHNC"),  # NHD -> HND, a tensor per layer
    ("BLHNC", "LBNHC"),  # packed cross-layer HND -> per-layer NHD
    ("LBHNC", "BLNHC"),  # per-layer HND -> packed NHD
    ("BLNHC", "BLHNC"),  # packed NHD -> packed HND
]


def converted(engine) -> int:
    """Rows rewritten into the engine's layout: on landing (scheduler) or on load (worker)."""
    return engine.manager.manager.lower.rows_converted + engine.spec._worker.worker.rows_converted


def toml(tmp_path, lower: str, name: str) -> str:
    """Host tier, then ``lower`` written through; one namespace model id for every engine
    (the engines below load the same model from different directories)."""
    path = tmp_path / name
    path.write_text(f"""
[namespace]
model = "tiny"

[[tiers]]
kind = "host"

[[tiers]]
{lower}
capacity = "64MiB"
placement = "write-through"
""")
    return str(path)


def disk(tmp_path, name: str = "tiers.toml") -> str:
    return toml(tmp_path, f'kind = "disk"\npath = "{tmp_path / "disk"}"\nadmission = "all"', name)


def store(engine, prefix: list[int] = PREFIX, rows: int = ROWS) -> None:
    """Compute ``prefix`` (and a tail) on ``engine`` and wait until its rows are below the host tier."""
    engine.add(prefix + list(range(5000, 5040)))
    engine.run()
    manager = engine.manager.manager
    assert manager.lower.engine.wait_idle(10)
    manager.poll()
    assert manager.lower.stats.spills_done >= rows


def ask(engine, prefix: list[int] = PREFIX) -> tuple[list[tuple[int, int]], set[int]]:
    """A request for ``prefix`` and another tail: (the token ranges loaded, positions computed)."""
    engine.scramble()  # a block kvtier did not write now holds noise
    req = engine.add(prefix + list(range(6000, 6030)))
    engine.run()  # verifies every loaded block against the model's bytes in this layout
    record = engine.requests[req]
    return record.loaded, record.computed


def share_through_disk(make_engine, tmp_path, writer: dict, reader: dict, prefix=PREFIX, rows=ROWS):
    writer_engine = make_engine(kvtier_config=disk(tmp_path, "writer.toml"), **writer)
    store(writer_engine, prefix, rows)
    writer_engine.shutdown()  # one process opens an LMDB environment once: the writer closes it
    writer_engine.shutdown = lambda: None
    reader_engine = make_engine(kvtier_config=disk(tmp_path, "reader.toml"), **reader)
    return reader_engine, *ask(reader_engine, prefix)


@pytest.mark.parametrize(("writer", "reader"), PAIRS)
def test_a_prefix_stored_in_one_layout_loads_converted_in_another_from_disk(
    make_engine, tmp_path, writer, reader
):
    engine, loaded, computed = share_through_disk(
        make_engine, tmp_path, {"layout": writer}, {"layout": reader}
    )
    assert loaded == [(0, len(PREFIX))], "the whole prefix must come from the writer's rows"
    assert not computed & set(range(len(PREFIX))), "no prefix token may be recomputed"
    assert converted(engine) == ROWS, "every row was in the writer's layout and had to convert"
    spec = engine.spec
    assert spec.row_layout is not None and spec.row_layout.groups[0].order == (
        "NHD" if "NH" in reader else "HND"
    )


@pytest.mark.parametrize("where", ["landing", "load"])
def test_rows_convert_on_landing_or_in_the_worker(make_engine, tmp_path, where):
    engine, loaded, _ = share_through_disk(
        make_engine,
        tmp_path,
        SMALL_NHD | TOKEN_KEYS,
        LARGE_HND | TOKEN_KEYS | {"extra": {"convert_on": where}},
        prefix=LONG,
        rows=4,
    )
    assert loaded == [(0, len(LONG))]  # and every loaded block held the model's bytes
    landed, by_worker = engine.manager.manager.lower.rows_converted, engine.spec._worker.worker.rows_converted
    assert (landed, by_worker) == ((4, 0) if where == "landing" else (0, 4))


def test_the_same_layout_loads_without_conversion(make_engine, tmp_path):
    engine, loaded, _ = share_through_disk(make_engine, tmp_path, {"layout": "BLHNC"}, {"layout": "LBHNC"})
    assert loaded == [(0, len(PREFIX))]
    assert converted(engine) == 0, "packed and per-layer rows are the same bytes"


def test_another_head_count_is_a_miss(make_engine, tmp_path):
    wide = tiny_model_dir(tmp_path, "tiny-4-heads", kv_heads=4)
    _, loaded, computed = share_through_disk(
        make_engine, tmp_path, {"layout": "LBNHC", "kv_heads": 4, "model_dir": wide}, {"layout": "LBHNC"}
    )
    assert loaded == [], "rows of a model with other head counts are another namespace"
    assert set(range(len(PREFIX))) <= computed


def test_another_dtype_is_a_miss(make_engine, tmp_path):
    _, loaded, computed = share_through_disk(
        make_engine, tmp_path, {"layout": "LBNHC", "dtype": "bfloat16"}, {"layout": "LBHNC"}
    )
    assert loaded == []
    assert set(range(len(PREFIX))) <= computed


@pytest.mark.parametrize(
    ("writer", "reader", "shared"), [("fp8_e4m3", "fp8_e5m2", False), ("fp8", "fp8", True)]
)
def test_a_quantised_kv_cache_shares_rows_only_with_its_own_dtype(
    make_engine, tmp_path, writer, reader, shared
):
    """e4m3 and e5m2 caches have the same bytes per block and layout, not the same meaning:
    the KV cache dtype (vLLM's ``--kv-cache-dtype``, which it hands the spec as the model's
    ``dtype``) is in the namespace. The same dtype in another page order shares them."""
    engine, loaded, computed = share_through_disk(
        make_engine,
        tmp_path,
        {"layout": "LBNHC", "kv_cache_dtype": writer},
        {"layout": "LBHNC", "kv_cache_dtype": reader},
    )
    if shared:
        assert loaded == [(0, len(PREFIX))] and converted(engine) == ROWS
    else:
        assert loaded == [], "an e5m2 engine must never read e4m3 rows"
        assert set(range(len(PREFIX))) <= computed
    assert engine.spec.config.model.dtype == reader
    assert engine.spec.row_layout is not None and engine.spec.row_layout.dtype == reader


def disk_namespaces(tmp_path) -> dict[bytes, int]:
    """The namespaces of the rows in the disk tier at ``tmp_path / "disk"`` (its LMDB index,
    read once the tier is closed), with each one's number of rows."""
    import lmdb

    from tiers.disk.lmdb_store import INDEX_DB
    from tiers.disk.tier import NAMESPACE_BYTES

    env = lmdb.open(str(tmp_path / "disk"), max_dbs=3, readonly=True, lock=False)
    try:
        with env.begin(db=env.open_db(INDEX_DB, create=False)) as txn:
            keys = list(txn.cursor().iternext(values=False))
    finally:
        env.close()
    return dict(Counter(key[:NAMESPACE_BYTES] for key in keys))


@pytest.mark.parametrize(("writer", "reader"), [("fp8", "auto"), ("auto", "fp8")])
def test_an_fp8_cache_and_one_of_the_models_dtype_never_share_a_row(make_engine, tmp_path, writer, reader):
    """An fp8 engine and an engine caching in the model's dtype (``auto``: float16 here),
    the same layout otherwise, over one disk: a miss for the reader, which stores the prefix
    again under a namespace of its own (the dtype is in it), beside the writer's rows."""
    engine, loaded, computed = share_through_disk(
        make_engine,
        tmp_path,
        {"layout": "LBNHC", "kv_cache_dtype": writer},
        {"layout": "LBNHC", "kv_cache_dtype": reader},
    )
    assert loaded == [], "a cache of another dtype must never read these rows"
    assert set(range(len(PREFIX))) <= computed
    assert engine.manager.manager.lower.engine.wait_idle(10)
    engine.shutdown()  # one process opens an LMDB environment once
    engine.shutdown = lambda: None
    namespaces = disk_namespaces(tmp_path)
    assert len(namespaces) == 2 and min(namespaces.values()) >= ROWS, "two namespaces, disjoint rows"


# -- other block sizes: rows keyed by their tokens (KVTierConnector) ------------------------

LONG = list(range(100, 356))  # 256 tokens: four 64-token rows
SMALL_NHD = {"layout": "LBNHC", "block_size": 16, "blocks_per_chunk": 4}  # four blocks a row
LARGE_HND = {"layout": "LBHNC", "block_size": 64}
TOKEN_KEYS = {"connector": "KVTierConnector"}


@pytest.mark.parametrize(
    ("writer", "reader"), [(SMALL_NHD, LARGE_HND), (LARGE_HND, SMALL_NHD)], ids=["16NHD-64HND", "64HND-16NHD"]
)
def test_engines_with_other_block_sizes_share_a_prefix_through_disk(make_engine, tmp_path, writer, reader):
    engine, loaded, computed = share_through_disk(
        make_engine, tmp_path, writer | TOKEN_KEYS, reader | TOKEN_KEYS, prefix=LONG, rows=4
    )
    assert loaded == [(0, len(LONG))], "the whole prefix must come from the writer's rows"
    assert not computed & set(range(len(LONG)))
    assert converted(engine) == 4
    assert engine.connector.token_keys.translated > 0


def test_without_token_keys_other_block_sizes_do_not_share(make_engine, tmp_path):
    """What ``KVTierConnector`` is for: vLLM's block hashes differ with the block size."""
    _, loaded, computed = share_through_disk(make_engine, tmp_path, SMALL_NHD, LARGE_HND, prefix=LONG, rows=4)
    assert loaded == []
    assert set(range(len(LONG))) <= computed


def test_token_keys_serve_only_the_rows_before_a_changed_token(make_engine, tmp_path):
    engine, loaded, _ = share_through_disk(
        make_engine, tmp_path, SMALL_NHD | TOKEN_KEYS, LARGE_HND | TOKEN_KEYS, prefix=LONG, rows=4
    )
    assert loaded == [(0, len(LONG))]
    # The same tokens but one in the third row: from that row on, it is another document.
    changed = list(LONG)
    changed[130] += 1
    engine.evict_device_cache()
    engine.scramble()
    other = engine.add([*changed, 7000])
    engine.run()
    record = engine.requests[other]
    assert record.loaded == [(0, 128)], "the two rows before the changed token are the same document's"
    assert set(range(128, len(LONG))) <= record.computed


def test_token_keys_keep_a_cache_salt_apart(make_engine, tmp_path):
    """A salted prompt's rows are found only by requests with the same salt (vLLM's own
    keys hold the salt; the token keys must too)."""
    writer = make_engine(kvtier_config=disk(tmp_path, "writer.toml"), **SMALL_NHD, **TOKEN_KEYS)
    writer.add([*LONG, 7000], cache_salt="tenant-a")
    writer.run()
    assert writer.manager.manager.lower.engine.wait_idle(10)
    writer.manager.manager.poll()
    writer.shutdown()
    writer.shutdown = lambda: None
    reader = make_engine(kvtier_config=disk(tmp_path, "reader.toml"), **LARGE_HND, **TOKEN_KEYS)
    other_salt = reader.add([*LONG, 7001], cache_salt="tenant-b")
    no_salt = reader.add([*LONG, 7002])
    reader.run()
    assert reader.requests[other_salt].loaded == [] and reader.requests[no_salt].loaded == []
    reader.evict_device_cache()
    same_salt = reader.add([*LONG, 7003], cache_salt="tenant-a")
    reader.run()
    assert reader.requests[same_salt].loaded == [(0, len(LONG))]


@pytest.fixture
def peer(tmp_path):
    from tests.tiers.peer_fixtures import start_peers

    (process,) = start_peers(tmp_path, 1, capacity="64MiB", row_bytes="1MiB")
    yield process
    process.close()


PEER_PAIRS = [
    ({"layout": "LBNHC"}, {"layout": "LBHNC"}, PREFIX, ROWS),
    ({"layout": "BLHNC"}, {"layout": "LBNHC"}, PREFIX, ROWS),
    (LARGE_HND | TOKEN_KEYS, SMALL_NHD | TOKEN_KEYS, LONG, 4),
    (SMALL_NHD | {"layout": "BLNHC"} | TOKEN_KEYS, LARGE_HND | TOKEN_KEYS, LONG, 4),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("writer", "reader", "prefix", "rows"),
    PEER_PAIRS,
    ids=["NHD-HND", "packed-NHD", "64HND-16NHD", "16packed-64HND"],
)
def test_a_prefix_put_at_a_peer_in_one_layout_loads_converted_in_another(
    make_engine, tmp_path, peer, writer, reader, prefix, rows
):
    remote = f'kind = "remote"\npeers = ["{peer.address}"]\ndeadline_s = 1.0\nlookup_wait_s = 4.0'
    writer_engine = make_engine(kvtier_config=toml(tmp_path, remote, "writer.toml"), **writer)
    store(writer_engine, prefix, rows)
    reader_engine = make_engine(kvtier_config=toml(tmp_path, remote, "reader.toml"), **reader)
    loaded, computed = ask(reader_engine, prefix)
    assert loaded == [(0, len(prefix))]
    assert not computed & set(range(len(prefix)))
    assert converted(reader_engine) == rows
    # A document nobody stored is not served from the writer's rows.
    other = reader_engine.add([9000 + i for i in range(len(prefix))])
    reader_engine.run()
    assert reader_engine.requests[other].loaded == []
