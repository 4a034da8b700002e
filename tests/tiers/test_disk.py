"""The disk tier: round trips, restarts, namespaces, eviction, and its failures.

Failures are made for real: bytes flipped or cut in the rows file, index entries edited
through LMDB itself, a rows file too small for a batch, a file-size limit standing in for a
full disk, a directory locked by another process, and a writer process SIGKILLed in the
middle of its batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import itertools
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import pytest

from tests.tiers import disk_writer_child as child
from tiers.base import TierError
from tiers.disk import DiskTier
from tiers.disk.lmdb_store import INDEX_DB, PAGE, ROWS_FILE, SLOT_MAGIC, TRAILER_BYTES, Entry, LmdbStore
from tiers.row_format import RowHeader
from tiers.settings import DiskSettings

NS_A = b"A" * 16
NS_B = b"B" * 16
LAYOUT = b"L" * 16
OTHER_LAYOUT = b"M" * 16
REPO = Path(__file__).resolve().parents[2]


def key(i: int, group: int = 0) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "big")).digest() + group.to_bytes(4, "big")


def content(k: bytes, n: int) -> bytes:
    return hashlib.shake_128(k).digest(n)


def rows(keys: list[bytes], n: int) -> list[tuple[bytes, memoryview]]:
    return [(k, memoryview(content(k, n))) for k in keys]


def buffers(keys: list[bytes], n: int) -> list[tuple[bytes, memoryview]]:
    return [(k, memoryview(bytearray(n))) for k in keys]


def raw_keys(path: Path) -> set[bytes]:
    """The keys of the LMDB index, read without the tier (after it is closed)."""
    env = lmdb.open(str(path), max_dbs=3, readonly=True, lock=False)
    try:
        with env.begin(db=env.open_db(INDEX_DB, create=False)) as txn:
            return set(txn.cursor().iternext(values=False))
    finally:
        env.close()


def entry_of(path: Path, full_key: bytes) -> Entry:
    """Where the index says a row is (``namespace + key``), read without the tier."""
    env = lmdb.open(str(path), max_dbs=3, readonly=True, lock=False)
    try:
        with env.begin(db=env.open_db(INDEX_DB, create=False)) as txn:
            entry = Entry.unpack(txn.get(full_key))
    finally:
        env.close()
    assert entry is not None
    return entry


def set_entry(path: Path, full_key: bytes, entry: Entry) -> None:
    env = lmdb.open(str(path), max_dbs=3)
    try:
        with env.begin(write=True, db=env.open_db(INDEX_DB)) as txn:
            txn.put(full_key, entry.pack())
    finally:
        env.close()


def flip_byte(path: Path, offset: int) -> None:
    with open(path / ROWS_FILE, "r+b") as f:  # bit rot under the tier's feet
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


@contextlib.asynccontextmanager
async def opened(path: Path, namespace: bytes = NS_A, layout: bytes = LAYOUT, **kwargs):
    settings = DiskSettings(
        path=str(path),
        capacity_bytes=kwargs.pop("capacity", 64 << 20),
        eviction=kwargs.pop("eviction", "lru"),
    )
    tier = DiskTier(settings, namespace, layout, **kwargs)
    await tier.open()
    try:
        yield tier
    finally:
        await tier.close()


async def test_round_trip_is_byte_exact_for_every_size(tmp_path):
    sizes = [
        0,
        1,
        100,
        4032,
        4033,
        9000,
        300_000,
    ]  # empty, small, a page with its trailer and one byte more, many pages
    keys = [key(i, group) for group, _ in enumerate(sizes) for i in range(3)]
    async with opened(tmp_path / "t") as tier:
        for group, size in enumerate(sizes):
            batch = [k for k in keys if int.from_bytes(k[-4:], "big") == group]
            assert await tier.put(rows(batch, size)) == [True] * 3
        assert all(tier.may_contain(k) for k in keys)
        assert await tier.contains([*keys[:2], key(99)]) == [True, True, False]
        for group, size in enumerate(sizes):
            batch = [k for k in keys if int.from_bytes(k[-4:], "big") == group]
            out = buffers(batch, size)
            assert await tier.get(out) == [True] * 3
            assert [bytes(b) for _, b in out] == [content(k, size) for k in batch]
        missing = buffers([key(99)], 10)
        assert await tier.get(missing) == [False]
        stats = tier.stats()
    assert stats["hits"] == len(keys) and stats["misses"] == 1 and stats["rows"] == len(keys)
    assert stats["corrupt"] == stats["dropped"] == 0


async def test_restart_is_warm_and_keeps_insertion_order(tmp_path):
    path = tmp_path / "t"
    keys = [key(i) for i in range(10)]
    async with opened(path) as tier:
        for k in keys:  # one batch each: insertion order k0 .. k9
            assert await tier.put(rows([k], 5000)) == [True]
        used = tier.stats()["bytes"]
    # Room for exactly the ten rows: the next one must evict, and LRU's victim after a
    # restart is the first row inserted, because the index keeps insertion order.
    async with opened(path, capacity=used) as tier:
        assert tier.stats()["rows"] == 10 and tier.stats()["bytes"] == used
        assert all(tier.may_contain(k) for k in keys)  # known before any read
        assert await tier.put(rows([key(10)], 5000)) == [True]
        assert not tier.may_contain(keys[0])
        out = buffers([*keys[1:], key(10)], 5000)
        assert await tier.get(out) == [True] * 10
        assert all(bytes(b) == content(k, 5000) for k, b in out)


async def test_two_namespaces_in_one_file_never_see_each_other(tmp_path):
    path = tmp_path / "t"
    keys = [key(i) for i in range(4)]
    async with opened(path, NS_A) as tier:
        assert all(await tier.put(rows(keys, 3000)))
    async with opened(path, NS_B) as tier:
        assert not any(tier.may_contain(k) for k in keys)
        assert await tier.get(buffers(keys, 3000)) == [False] * 4  # not even a read
        assert tier.stats()["foreign_rows"] == 4 and tier.stats()["rows"] == 0
        other = [(k, memoryview(content(k + b"B", 3000))) for k in keys[:2]]
        assert all(await tier.put(other))
        out = buffers(keys[:2], 3000)
        assert all(await tier.get(out))
        assert [bytes(b) for _, b in out] == [content(k + b"B", 3000) for k in keys[:2]]
    async with opened(path, NS_A) as tier:
        out = buffers(keys, 3000)
        assert all(await tier.get(out))
        assert [bytes(b) for _, b in out] == [content(k, 3000) for k in keys]
        assert tier.stats()["foreign_rows"] == 2


async def test_a_row_of_another_layout_is_a_miss_and_is_kept(tmp_path):
    path = tmp_path / "t"
    async with opened(path) as tier:
        assert all(await tier.put(rows([key(1)], 3000)))
    async with opened(path, layout=OTHER_LAYOUT) as tier:
        assert await tier.get(buffers([key(1)], 3000)) == [False]
        assert tier.stats()["mismatched"] == 1 and tier.stats()["corrupt"] == 0
        assert await tier.get(buffers([key(1)], 2999)) == [False]  # nor into a buffer of another size
    async with opened(path) as tier:
        out = buffers([key(1)], 3000)
        assert await tier.get(out) == [True] and bytes(out[0][1]) == content(key(1), 3000)


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo", "tinylfu", "prefix:lru"])
async def test_eviction_keeps_the_file_within_capacity(tmp_path, policy):
    path = tmp_path / "t"
    async with opened(path, capacity=10 * 66_000, eviction=policy) as tier:
        for i in range(40):
            assert await tier.put(rows([key(i)], 60_000)) == [True]
            assert tier.stats()["bytes"] <= tier.capacity_bytes
            if i % 3 == 0:
                await tier.get(buffers([key(i)], 60_000))
        stats = tier.stats()
        resident = {k for k in (key(i) for i in range(40)) if tier.may_contain(k)}
    assert stats["rows"] == len(resident) == 40 - stats["evictions"] and stats["rows"] >= 8
    assert raw_keys(path) == {NS_A + k for k in resident}
    assert os.path.getsize(path / ROWS_FILE) <= stats["file_limit"]  # freed pages are reused


async def test_lru_eviction_follows_the_policy_and_spares_hits(tmp_path):
    async with opened(tmp_path / "t", capacity=4 * 66_000) as tier:
        for i in range(4):
            await tier.put(rows([key(i)], 60_000))
        assert all(await tier.get(buffers([key(0)], 60_000)))  # k0 is now the most recent
        await tier.put(rows([key(4), key(5)], 60_000))
        assert [tier.may_contain(key(i)) for i in range(6)] == [True, False, False, True, True, True]
        assert tier.stats()["evictions"] == 2


async def test_a_batch_larger_than_the_capacity_stores_what_fits(tmp_path):
    async with opened(tmp_path / "t", capacity=3 * 66_000) as tier:
        stored = await tier.put(rows([key(i) for i in range(5)], 60_000))
        assert stored == [True, True, True, False, False]  # a batch never evicts itself
        assert tier.stats()["dropped"] == 2 and tier.stats()["bytes"] <= tier.capacity_bytes
        out = buffers([key(i) for i in range(3)], 60_000)
        assert all(await tier.get(out))


async def test_rows_evicted_for_a_row_that_then_does_not_fit_are_deleted_too(tmp_path):
    path = tmp_path / "t"
    x, y, z, w = (key(i) for i in range(4))
    async with opened(path, capacity=3 * 66_000) as tier:
        for k in (x, y, z):
            await tier.put(rows([k], 60_000))
        # W needs X's and Y's room and Z's too, but Z is in the same batch: W is dropped.
        batch = [*rows([z], 60_000), (w, memoryview(content(w, 150_000)))]
        assert await tier.put(batch) == [True, False]
        assert [tier.may_contain(k) for k in (x, y, z, w)] == [False, False, True, False]
        assert tier.stats()["evictions"] == 2 and tier.stats()["dropped"] == 1
    assert raw_keys(path) == {NS_A + z}


async def test_random_operations_agree_with_a_model(tmp_path):
    """Whatever is served is the last row put under its key; the index is the file."""
    rng = random.Random(3)
    path = tmp_path / "t"
    sizes = [700, 5_000, 40_000]
    latest: dict[bytes, bytes] = {}  # key -> the last row put under it
    tier = DiskTier(DiskSettings(path=str(path), capacity_bytes=12 * 45_000, eviction="s3fifo"), NS_A, LAYOUT)
    await tier.open()
    for step in range(250):
        keys = [key(rng.randrange(60), rng.randrange(3)) for _ in range(rng.randint(1, 5))]
        action = rng.random()
        if action < 0.5:
            batch = []
            for k in keys:
                row = content(k + step.to_bytes(4, "big"), sizes[int.from_bytes(k[-4:], "big")])
                batch.append((k, memoryview(row)))
            stored = await tier.put(batch)
            for (k, row), ok in zip(batch, stored, strict=True):
                if ok:
                    latest[k] = bytes(row)
        elif action < 0.9:
            out = [(k, memoryview(bytearray(sizes[int.from_bytes(k[-4:], "big")]))) for k in keys]
            indexed = [tier.may_contain(k) for k in keys]
            hits = await tier.get(out)
            assert hits == indexed  # nothing runs concurrently here: the index is exact
            assert all(bytes(buf) == latest[k] for (k, buf), hit in zip(out, hits, strict=True) if hit)
        else:
            await tier.delete(keys)
            assert not any(tier.may_contain(k) for k in keys)
        assert tier.stats()["bytes"] <= tier.capacity_bytes
        if step == 125:  # a restart in the middle changes nothing
            await tier.close()
            tier = DiskTier(
                DiskSettings(path=str(path), capacity_bytes=12 * 45_000, eviction="s3fifo"), NS_A, LAYOUT
            )
            await tier.open()
    resident = {k for k in latest if tier.may_contain(k)}
    assert tier.stats()["rows"] == len(resident) > 0 and tier.stats()["corrupt"] == 0
    await tier.close()
    assert raw_keys(path) == {NS_A + k for k in resident}


@pytest.mark.parametrize("where", ["row", "header", "torn", "cut", "stale"])
async def test_a_corrupt_row_is_a_miss_and_is_deleted(tmp_path, where):
    path = tmp_path / "t"
    keys = [key(1), key(2)]
    async with opened(path) as tier:
        assert all(await tier.put(rows([key(3)], 20_000)))
    old = entry_of(path, NS_A + key(3))
    async with opened(path) as tier:
        assert all(await tier.put(rows(keys, 20_000)))
        await tier.delete([key(3)])  # its pages still hold its sound row, which no entry names
    entries = {k: entry_of(path, NS_A + k) for k in keys}
    bad = max(keys, key=lambda k: entries[k].runs[0])  # the last row of the file
    good = next(k for k in keys if k != bad)
    start = entries[bad].runs[0][0] * PAGE
    if where == "row":
        flip_byte(path, start + 12_345)
    elif where == "header":
        flip_byte(path, start + 20_000)  # the trailer's magic, behind the row
    elif where == "torn":  # a write cut short: the first half new, the rest the old row
        with open(path / ROWS_FILE, "r+b") as f:
            f.seek(start + 10_000)
            f.write(bytes(10_000 + TRAILER_BYTES))
    elif where == "cut":  # the file ends inside the row
        os.truncate(path / ROWS_FILE, start + 10_000)
    else:  # the entry names pages that hold another key's sound row (stale after an OS crash)
        set_entry(path, NS_A + bad, Entry(entries[bad].write_id, entries[bad].seq, 20_000, old.runs))
    async with opened(path) as tier:
        out = buffers(keys, 20_000)
        hits = await tier.get(out)
        assert hits == [k == good for k in keys]
        assert bytes(dict(out)[good]) == content(good, 20_000)
        stats = tier.stats()
        assert stats["corrupt"] == 1 and stats["rows"] == 1
        assert not tier.may_contain(bad) and await tier.contains([bad, good]) == [False, True]
        assert await tier.get(buffers([bad], 20_000)) == [False]
        assert tier.stats()["corrupt"] == 1  # counted once: the row is gone
        assert all(await tier.put(rows([key(4)], 20_000)))  # its pages are usable again
        out = buffers([good, key(4)], 20_000)
        assert all(await tier.get(out)) and bytes(out[1][1]) == content(key(4), 20_000)
    assert raw_keys(path) == {NS_A + good, NS_A + key(4)}


async def test_a_row_lies_in_its_pages_with_its_header_behind_it(tmp_path):
    path = tmp_path / "t"
    async with opened(path) as tier:
        await tier.put(rows([key(1)], 300_000) + rows([key(2)], 100))
    entry = entry_of(path, NS_A + key(1))
    assert entry.length == 300_000 and sum(n for _, n in entry.runs) == -(-(300_000 + TRAILER_BYTES) // PAGE)
    ((start, count),) = entry.runs  # rows of one batch land in one run each
    with open(path / ROWS_FILE, "rb") as f:
        f.seek(start * PAGE)
        slot = f.read(count * PAGE)
    assert slot[:300_000] == content(key(1), 300_000)  # page-aligned, as the host row
    header = RowHeader.unpack(slot[300_000:])
    assert header is not None and (header.layout_id, header.row_length) == (LAYOUT, 300_000)
    assert slot[300_000 + TRAILER_BYTES - 8 : 300_000 + TRAILER_BYTES] == SLOT_MAGIC
    assert slot[300_000 + TRAILER_BYTES :] == bytes(len(slot) - 300_000 - TRAILER_BYTES)  # whole pages


async def test_a_read_of_a_row_keeps_its_pages_from_reuse_until_it_ends(tmp_path, monkeypatch):
    """A row deleted (or evicted) while a read of it runs: its pages are not written over."""
    import threading

    path = tmp_path / "t"
    async with opened(path, read_threads=1) as tier:
        await tier.put(rows([key(1)], 50_000))
        store = type(tier._store)
        real = store._pread_fully
        reading, release = threading.Event(), threading.Event()

        def slow_read(self, offset, parts):
            reading.set()
            assert release.wait(10)
            return real(self, offset, parts)

        monkeypatch.setattr(store, "_pread_fully", slow_read)
        out = buffers([key(1)], 50_000)
        read = asyncio.ensure_future(tier.get(out))
        assert await asyncio.get_running_loop().run_in_executor(None, reading.wait, 10)
        await tier.delete([key(1)])
        await tier.put(rows([key(2)], 50_000))  # the same size: it would take those pages
        release.set()
        assert await read == [True] and bytes(out[0][1]) == content(key(1), 50_000)
        monkeypatch.setattr(store, "_pread_fully", real)
        await tier.put(rows([key(3)], 50_000))  # now they are free: reused
        got = buffers([key(2), key(3)], 50_000)
        assert await tier.get(got) == [True, True]
    first, second = entry_of(path, NS_A + key(2)).runs, entry_of(path, NS_A + key(3)).runs
    assert first[0][0] > 0 and second[0][0] == 0  # key(1)'s pages went to key(3), not key(2)


async def test_bytes_flipped_in_the_file_are_caught_by_the_checksum(tmp_path):
    path = tmp_path / "t"
    async with opened(path) as tier:
        await tier.put(rows([key(1), key(2)], 300_000))
    flip_byte(path, entry_of(path, NS_A + key(1)).runs[0][0] * PAGE + 123_456)
    async with opened(path) as tier:
        out = buffers([key(1), key(2)], 300_000)
        assert await tier.get(out) == [False, True]
        assert tier.stats()["corrupt"] == 1 and not tier.may_contain(key(1))
    assert raw_keys(path) == {NS_A + key(2)}


async def test_an_index_of_the_older_format_is_dropped_at_open(tmp_path):
    path = tmp_path / "t"
    path.mkdir()
    env = lmdb.open(str(path), max_dbs=2)
    for name in (b"rows", b"index"):
        with env.begin(write=True, db=env.open_db(name)) as txn:
            txn.put(NS_A + key(1), b"an old value")
    env.close()
    async with opened(path) as tier:
        assert tier.stats()["rows"] == 0
        assert all(await tier.put(rows([key(1)], 3000)))
    env = lmdb.open(str(path), max_dbs=3, readonly=True, lock=False)
    with env.begin() as txn:
        names = set(txn.cursor().iternext(values=False))
    env.close()
    assert names == {INDEX_DB}


async def test_a_full_rows_file_drops_the_batch_and_the_tier_goes_on(tmp_path):
    # A rows file with no margin: the first batch fits, but replacing all of it in one
    # commit needs the old and the new pages at once (the old are freed by that commit).
    async with opened(tmp_path / "t", capacity=1 << 20, file_margin_bytes=0) as tier:
        first = [key(i) for i in range(12)]
        assert all(await tier.put(rows(first, 64_000)))
        second = [key(i) for i in range(100, 112)]
        assert await tier.put(rows(second, 64_000)) == [False] * 12
        stats = tier.stats()
        assert stats["dropped"] == 12 and stats["write_errors"] == 1 and stats["evictions"] == 0
        out = buffers(first, 64_000)  # the would-be victims are all still there
        assert all(await tier.get(out)) and all(bytes(b) == content(k, 64_000) for k, b in out)
        assert await tier.put(rows([key(200)], 500)) == [True]
        out = buffers([key(200)], 500)
        assert all(await tier.get(out)) and bytes(out[0][1]) == content(key(200), 500)


@contextlib.contextmanager
def file_size_limit(limit: int):
    """A full disk, as the process sees it: writes past ``limit`` bytes fail (EFBIG)."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


async def test_a_full_disk_drops_stores_and_nothing_crashes(tmp_path):
    path = tmp_path / "t"
    async with opened(path) as tier:
        assert all(await tier.put(rows([key(0)], 1000)))
        with file_size_limit(os.path.getsize(path / ROWS_FILE)):
            stored = await tier.put(rows([key(i) for i in range(1, 9)], 64_000))
        assert stored == [False] * 8
        assert tier.stats()["dropped"] == 8 and tier.stats()["write_errors"] == 1
        assert not tier.may_contain(key(1))
        assert all(await tier.put(rows([key(1)], 64_000)))  # room again: it works
        out = buffers([key(0)], 1000) + buffers([key(1)], 64_000)
        assert await tier.get(out[:1]) == [True] and await tier.get(out[1:]) == [True]
        assert bytes(out[1][1]) == content(key(1), 64_000)


async def test_delete_removes_rows_from_index_and_file(tmp_path):
    path = tmp_path / "t"
    keys = [key(i) for i in range(3)]
    async with opened(path) as tier:
        await tier.put(rows(keys, 5000))
        await tier.delete([keys[0], keys[2], key(99)])
        assert [tier.may_contain(k) for k in keys] == [False, True, False]
        assert await tier.get(buffers(keys, 5000)) == [False, True, False]
        assert tier.stats()["deleted"] == 2 and tier.stats()["rows"] == 1
    assert raw_keys(path) == {NS_A + keys[1]}


async def test_concurrent_puts_gets_and_deletes_stay_consistent(tmp_path):
    keys = [key(i) for i in range(40)]
    async with opened(tmp_path / "t", capacity=30 * 12_000, read_threads=3) as tier:
        await tier.put(rows(keys[:20], 10_000))
        outs = [buffers(keys[i : i + 10], 10_000) for i in range(0, 40, 10)]
        results = await asyncio.gather(
            tier.put(rows(keys[20:30], 10_000)),
            *(tier.get(out) for out in outs),
            tier.delete(keys[5:8]),
            tier.put(rows(keys[30:], 10_000)),
        )
        for out, hits in zip(outs, results[1:5], strict=True):
            for (k, b), hit in zip(out, hits, strict=True):
                assert not hit or bytes(b) == content(k, 10_000)
        assert tier.stats()["bytes"] <= tier.capacity_bytes and tier.stats()["corrupt"] == 0
        final = buffers(keys, 10_000)
        hits = await tier.get(final)
        assert hits == [tier.may_contain(k) for k in keys]
        assert all(bytes(b) == content(k, 10_000) for (k, b), hit in zip(final, hits, strict=True) if hit)


async def test_an_unusable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(TierError, match=r"a-file/disk.*cannot create the directory"):
        await DiskTier(DiskSettings(path=str(blocker / "disk"), capacity_bytes=1 << 20), NS_A, LAYOUT).open()


async def test_a_read_only_directory_is_a_clear_error(tmp_path):
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() == 0:  # root ignores permission bits, not the immutable flag
        if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
            pytest.skip("running as root and chattr +i is not available here")
        undo = ["chattr", "-i", str(path)]
    else:
        path.chmod(0o555)
        undo = ["chmod", "755", str(path)]
    try:
        with pytest.raises(TierError, match=r"ro'.*not writable"):
            await DiskTier(DiskSettings(path=str(path), capacity_bytes=1 << 20), NS_A, LAYOUT).open()
    finally:
        subprocess.run(undo, check=True)


async def test_a_second_open_in_this_process_is_refused(tmp_path):
    async with opened(tmp_path / "t"):
        with pytest.raises(TierError, match=f"locked by process {os.getpid()}"):
            await DiskTier(
                DiskSettings(path=str(tmp_path / "t"), capacity_bytes=1 << 20), NS_B, LAYOUT
            ).open()


def spawn_child(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "tests.tiers.disk_writer_child", *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, **kwargs)


@pytest.mark.multiprocess
async def test_multiprocess_a_directory_locked_by_another_process_is_a_clear_error(tmp_path):
    path = tmp_path / "t"
    holder = spawn_child("hold", str(path), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        with pytest.raises(TierError, match=f"{path}.*locked by process {holder.pid}"):
            await child.make_tier(str(path)).open()
    finally:
        holder.kill()
        holder.wait()
    tier = child.make_tier(str(path))  # a dead holder's lock dies with it
    await tier.open()
    await tier.close()


def committed_keys(report: Path) -> set[bytes]:
    """Keys on complete lines of the child's report: each line was written after a commit."""
    text = report.read_text() if report.exists() else ""
    lines = text.split("\n")[:-1]  # a line cut by the kill has no newline: not counted
    return {bytes.fromhex(word) for line in lines for word in line.split()}


@pytest.mark.multiprocess
async def test_multiprocess_sigkill_in_a_write_storm_loses_no_commit_and_tears_no_row(tmp_path):
    path, report = tmp_path / "t", tmp_path / "report"
    rng = random.Random(7)
    all_keys = [child.key_of(i) for i in range(child.KEYS)]
    rounds, killed_mid_run = 20, 0
    for round_ in range(rounds):
        before = report.stat().st_size if report.exists() else 0
        writer = spawn_child("storm", str(path), str(report), str(round_), str(round_ % 2))
        deadline = time.monotonic() + 30
        while (not report.exists() or report.stat().st_size == before) and writer.poll() is None:
            assert time.monotonic() < deadline, "the writer never committed a batch"
            await asyncio.sleep(0.005)
        await asyncio.sleep(rng.uniform(0, 0.05))  # kill at a random moment of the storm
        writer.send_signal(signal.SIGKILL)
        killed_mid_run += writer.wait() == -signal.SIGKILL
        committed = committed_keys(report)
        tier = child.make_tier(str(path))
        await tier.open()
        try:
            present = [k for k in all_keys if tier.may_contain(k)]
            assert committed <= set(present), f"round {round_}: committed rows lost"
            out = [(k, memoryview(bytearray(child.row_bytes(k)))) for k in all_keys]
            hits = await tier.get(out)
            assert hits == [k in present for k in all_keys], f"round {round_}: an indexed row did not read"
            for (k, buf), hit in zip(out, hits, strict=True):
                assert not hit or bytes(buf) == child.expected_row(k), f"round {round_}: a row is not exact"
            assert tier.stats()["corrupt"] == 0
        finally:
            await tier.close()
        assert raw_keys(path) == {child.NAMESPACE + k for k in present}  # the index is the file's
    assert killed_mid_run == rounds  # every child died of the SIGKILL, mid-storm
    assert len(committed_keys(report)) > child.KEYS // 2  # the storms did write


# -- coalesced reads -------------------------------------------------------------------


def count_reads(monkeypatch) -> list[int]:
    """The ``preadv`` pieces the store reads from now on (each as its number of buffers)."""
    calls: list[int] = []
    real = LmdbStore._pread_fully

    def counting(self, offset, parts):
        calls.append(len(parts))
        return real(self, offset, parts)

    monkeypatch.setattr(LmdbStore, "_pread_fully", counting)
    return calls


async def test_rows_that_lie_together_are_read_together_and_a_corrupt_one_is_the_only_miss(
    tmp_path, monkeypatch
):
    path = tmp_path / "t"
    keys = [key(i) for i in range(8)]
    async with opened(path) as tier:
        assert all(await tier.put(rows(keys, 100_000)))
    entries = {k: entry_of(path, NS_A + k) for k in keys}
    in_file = sorted(keys, key=lambda k: entries[k].runs[0])
    for before, after in itertools.pairwise(in_file):  # one batch: one extent of the file
        assert entries[after].runs[0][0] == sum(entries[before].runs[0])
    bad = in_file[3]
    flip_byte(path, entries[bad].runs[0][0] * PAGE + 54_321)
    calls = count_reads(monkeypatch)
    shuffled = random.Random(4).sample(keys, len(keys))
    async with opened(path, read_threads=2) as tier:
        out = buffers(shuffled, 100_000)
        hits = await tier.get(out)
        assert hits == [k != bad for k in shuffled]
        assert all(bytes(b) == content(k, 100_000) for k, b in out if k != bad)
        assert tier.stats()["corrupt"] == 1 and not tier.may_contain(bad)
    # two threads, each given four rows that lie together (file order, whatever the order
    # asked in): one preadv each, of the rows, their trailers and the pages' tails between
    assert calls == [4 * 3 - 1] * 2


async def test_a_piece_that_cannot_be_read_is_read_again_row_by_row(tmp_path, monkeypatch):
    """An I/O error is a miss of the row it hits, never of the rows read with it."""
    path = tmp_path / "t"
    keys = [key(i) for i in range(4)]
    async with opened(path) as tier:
        assert all(await tier.put(rows(keys, 30_000)))
    bad = keys[2]
    bad_offset = entry_of(path, NS_A + bad).runs[0][0] * PAGE
    real = LmdbStore._pread_fully

    def failing(self, offset, parts):
        if len(parts) > 2 or offset == bad_offset:  # the whole piece, then that row alone
            raise OSError(errno.EIO, "injected I/O error")
        return real(self, offset, parts)

    monkeypatch.setattr(LmdbStore, "_pread_fully", failing)
    async with opened(path, read_threads=1) as tier:
        out = buffers(keys, 30_000)
        assert await tier.get(out) == [k != bad for k in keys]
        assert all(bytes(b) == content(k, 30_000) for k, b in out if k != bad)
        stats = tier.stats()
        assert stats["read_errors"] == 1 and stats["corrupt"] == 0
        assert tier.may_contain(bad)  # an error is not corruption: the row is kept
    monkeypatch.setattr(LmdbStore, "_pread_fully", real)
    async with opened(path) as tier:
        out = buffers([bad], 30_000)
        assert await tier.get(out) == [True] and bytes(out[0][1]) == content(bad, 30_000)


async def test_a_buffer_of_another_length_among_rows_read_together_misses_alone(tmp_path, monkeypatch):
    path = tmp_path / "t"
    keys = [key(i) for i in range(5)]
    async with opened(path) as tier:
        assert all(await tier.put(rows(keys, 40_000)))
    calls = count_reads(monkeypatch)
    odd = keys[2]
    async with opened(path, read_threads=1) as tier:
        out = [(k, memoryview(bytearray(40_000 if k != odd else 39_999))) for k in keys]
        assert await tier.get(out) == [k != odd for k in keys]
        assert all(bytes(b) == content(k, 40_000) for k, b in out if k != odd)
        assert tier.stats()["mismatched"] == 1 and tier.may_contain(odd)  # kept: sound, just not this size
    # the rows before and after it read as two pieces; its trailer alone
    assert sorted(calls) == [1, 2 * 3 - 1, 2 * 3 - 1]
