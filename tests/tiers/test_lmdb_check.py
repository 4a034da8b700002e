"""Damaged LMDB files and full file systems at a disk tier's open: an error or an empty tier, never a signal.

Each damaged directory is opened by a child process (``disk_writer_child open``), so a SIGBUS
inside ``lmdb.open`` shows as the child's negative return code, a test failure, instead of
killing pytest. Before ``tiers.disk.lmdb_check`` existed, most of these trials died with SIGBUS.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest

from tests.tiers import disk_writer_child as child
from tiers.disk import lmdb_check as lmdb_check
from tiers.disk.lmdb_store import LMDB_FILE

REPO = Path(__file__).resolve().parents[2]
PAGE = 4096


def open_in_child(path: Path, commits: int = 0) -> dict:
    """What ``disk_writer_child open`` reports for ``path`` (``commits``: new rows put one
    commit each, else 5 in one); fails the test on a signal."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    more = [str(commits)] if commits else []
    done = subprocess.run(
        [sys.executable, "-m", "tests.tiers.disk_writer_child", "open", str(path), *more],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode < 0:
        pytest.fail(f"opening {path} killed the process with {signal.Signals(-done.returncode).name}")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


async def fill(path: Path) -> None:
    tier = child.make_tier(str(path))
    await tier.open()
    try:
        keys = [child.key_of(i) for i in range(child.KEYS)]
        for at in range(0, len(keys), 10):  # many commits: both meta pages, a free list
            batch = keys[at : at + 10]
            assert all(await tier.put([(key, memoryview(child.expected_row(key))) for key in batch]))
    finally:
        await tier.close()


@pytest.fixture(scope="module")
def sound(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tier directory holding every key of ``disk_writer_child``, closed."""
    path = tmp_path_factory.mktemp("sound") / "tier"
    asyncio.run(fill(path))
    return path


def damaged_copy(sound: Path, to: Path) -> Path:
    shutil.copytree(sound, to)
    return to / LMDB_FILE


def test_a_sound_index_passes_both_checks_and_opens_whole(sound, tmp_path):
    assert lmdb_check.header_problem(str(sound / LMDB_FILE)) is None
    assert lmdb_check.walk_problem(str(sound), 3, [b"slots"]) is None
    assert open_in_child(damaged_copy(sound, tmp_path / "t").parent) == {
        "outcome": "opened",
        "rows": child.KEYS,
        "hits": child.KEYS,
        "wrong": 0,
        "stored": 5,
    }
    assert not (tmp_path / "t" / f"{LMDB_FILE}.corrupt").exists()


@pytest.mark.multiprocess
def test_multiprocess_an_index_cut_anywhere_is_set_aside_and_the_tier_starts_empty(sound, tmp_path):
    size = (sound / LMDB_FILE).stat().st_size
    assert size > 4 * PAGE
    cuts = [1, 100, PAGE, 2 * PAGE, 2 * PAGE + 1, 3 * PAGE, size // 2, size - PAGE, size - 1]
    for trial, cut in enumerate(cuts):
        data = damaged_copy(sound, tmp_path / f"cut{trial}")
        os.truncate(data, cut)
        report = open_in_child(data.parent)
        assert report == {"outcome": "opened", "rows": 0, "hits": 0, "wrong": 0, "stored": 5}, f"cut at {cut}"
        assert (data.parent / f"{LMDB_FILE}.corrupt").stat().st_size == cut  # kept to look at


@pytest.mark.multiprocess
def test_multiprocess_garbage_in_the_index_is_a_miss_or_an_empty_tier_never_a_signal(sound, tmp_path):
    size = (sound / LMDB_FILE).stat().st_size
    outcomes = []
    for seed in range(8):
        rng = random.Random(seed)
        data = damaged_copy(sound, tmp_path / f"g{seed}")
        with open(data, "r+b") as file:
            if seed == 0:  # the whole file
                file.write(rng.randbytes(size))
            elif seed == 1:  # the first meta page
                file.write(rng.randbytes(PAGE))
            else:  # a few runs of bytes past the meta pages
                for _ in range(3):
                    file.seek(rng.randrange(2 * PAGE, size))
                    file.write(rng.randbytes(rng.randrange(8, PAGE)))
        report = open_in_child(data.parent, 64)
        assert report["outcome"] == "opened", report
        assert report["wrong"] == 0 and report["hits"] == report["rows"] <= child.KEYS, report
        assert report["stored"] == 64, report  # and the tier goes on: every later commit
        outcomes.append(report["rows"])
    assert outcomes[:2] == [0, 0]  # an unreadable header: set aside


def free_list_root(data: Path) -> int:
    """The root page of LMDB's free-page list, as the meta page LMDB uses names it."""
    raw = data.read_bytes()
    metas = [raw[n * PAGE : (n + 1) * PAGE] for n in (0, 1)]
    meta = max(metas, key=lambda page: struct.unpack_from("<Q", page, 144)[0])  # the later txn id
    return struct.unpack_from("<Q", meta, 80)[0]  # dbs[0] (the free list): its root


@pytest.mark.multiprocess
def test_multiprocess_garbage_in_the_free_page_list_is_set_aside_and_every_later_store_succeeds(
    sound, tmp_path
):
    """Issue 36: garbage in the free-page list passed the header check and the walk (no read
    reaches that tree), then failed the later commits that allocate pages: 56 of 64 stores
    dropped in the issue's trial; this garbage killed the tier of before with SIGBUS."""
    data = damaged_copy(sound, tmp_path / "t")
    root = free_list_root(data)
    assert 1 < root < data.stat().st_size // PAGE, "the sound index has a free-page list"
    with open(data, "r+b") as file:
        file.seek(root * PAGE + 16)  # the page's body, behind its header
        file.write(random.Random(36).randbytes(PAGE // 2))
    assert lmdb_check.header_problem(str(data)) is None  # what the checks before saw: sound
    assert lmdb_check.walk_problem(str(data.parent), 3, [b"slots"]) is None
    assert "free-page list" in (lmdb_check.free_list_problem(str(data)) or "")
    report = open_in_child(data.parent, 64)
    # The index is set aside: its rows are misses (never wrong), and every new row is stored.
    assert report == {"outcome": "opened", "rows": 0, "hits": 0, "wrong": 0, "stored": 64}, report
    assert (data.parent / f"{LMDB_FILE}.corrupt").exists()
    assert lmdb_check.free_list_problem(str(data)) is None  # the new index's list is sound


def test_the_free_page_list_of_a_sound_index_passes_however_large(tmp_path):
    """Rows put and deleted over many commits: lists of one page, then of overflow pages (a
    commit that frees more pages than one page can list), all sound."""
    env = lmdb.open(str(tmp_path), map_size=256 << 20, max_dbs=3, lock=False)
    try:
        db = env.open_db(b"slots")
        for step in range(6):
            with env.begin(write=True, db=db) as txn:
                for i in range(step * 10_000, (step + 1) * 10_000):
                    txn.put(i.to_bytes(8, "big") * 6, bytes(40))
            with env.begin(write=True, db=db) as txn:
                for i in range(step * 10_000, step * 10_000 + 9_000, 2 + step % 3):
                    txn.delete(i.to_bytes(8, "big") * 6)
            env.sync(True)
            assert lmdb_check.free_list_problem(str(tmp_path / LMDB_FILE)) is None, step
        with env.begin(write=True) as txn:
            txn.drop(db, delete=False)  # thousands of pages freed by one commit
    finally:
        env.close()
    raw = (tmp_path / LMDB_FILE).read_bytes()
    metas = [raw[n * PAGE : (n + 1) * PAGE] for n in (0, 1)]
    meta = max(metas, key=lambda page: struct.unpack_from("<Q", page, 144)[0])
    assert struct.unpack_from("<Q", meta, 64)[0] > 0  # the list has overflow pages
    assert lmdb_check.free_list_problem(str(tmp_path / LMDB_FILE)) is None


def test_a_meta_page_of_another_format_or_page_size_is_named(sound, tmp_path):
    data = damaged_copy(sound, tmp_path / "t")
    raw = bytearray(data.read_bytes())
    struct.pack_into("<I", raw, 20, 999)  # the format version of meta page 0
    data.write_bytes(raw)
    assert "format version 999" in (lmdb_check.header_problem(str(data)) or "")
    struct.pack_into("<I", raw, 20, 1)
    struct.pack_into("<I", raw, 40, 3000)  # its page size
    data.write_bytes(raw)
    assert "page size 3000" in (lmdb_check.header_problem(str(data)) or "")
    assert lmdb_check.header_problem(str(tmp_path / "absent.mdb")) is None


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` for the test (root only), unmounted after."""
    where.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
        )
    except OSError as exc:  # no mount(8) at all
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if done.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here (needs root and mount rights): {done.stderr.decode().strip()}"
        )
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=True)


def fill_leaving(mount: Path, free_bytes: int) -> None:
    """Fill the file system at ``mount``, then give back ``free_bytes``."""
    fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = 0
        block = bytes(PAGE)
        while True:
            try:
                written += os.write(fd, block)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
        os.ftruncate(fd, max(0, written - free_bytes))
    finally:
        os.close(fd)


@pytest.mark.multiprocess
def test_multiprocess_a_full_file_system_is_a_tier_error_or_dropped_stores_never_a_signal(tmp_path):
    with small_tmpfs(tmp_path / "mnt", "1m") as mount:
        errors = 0
        for free in (0, PAGE, 2 * PAGE, 3 * PAGE, 4 * PAGE, 6 * PAGE, 8 * PAGE, 16 * PAGE):
            for name in os.listdir(mount):
                shutil.rmtree(mount / name) if (mount / name).is_dir() else os.unlink(mount / name)
            (mount / "tier").mkdir()
            fill_leaving(mount, free)
            report = open_in_child(mount / "tier")
            if report["outcome"] == "error":
                errors += 1
                assert "No space left on device" in report["message"], report
            else:  # it started: stores are dropped while the disk is full, never a crash
                assert report["wrong"] == 0 and report["stored"] in range(6), report
        assert errors >= 3  # the fullest ones cannot start LMDB at all
        # A sound tier whose file system fills up later still opens and serves its rows.
        for name in os.listdir(mount):
            shutil.rmtree(mount / name) if (mount / name).is_dir() else os.unlink(mount / name)
        asyncio.run(fill_some(mount / "tier"))
        fill_leaving(mount, 0)
        assert open_in_child(mount / "tier") == {
            "outcome": "opened",
            "rows": 10,
            "hits": 10,
            "wrong": 0,
            "stored": 0,  # no room: dropped, counted, not a crash
        }


async def fill_some(path: Path) -> None:
    tier = child.make_tier(str(path))
    await tier.open()
    try:
        keys = [child.key_of(i) for i in range(10)]
        assert all(await tier.put([(key, memoryview(child.expected_row(key))) for key in keys]))
    finally:
        await tier.close()


def test_a_file_system_smaller_than_the_tier_is_warned_of_at_open(tmp_path, caplog):
    with small_tmpfs(tmp_path / "mnt", "1m") as mount:
        asyncio.run(fill_some(mount / "tier"))  # a 64 MiB tier on a 1 MiB file system
    assert "the file system has room for" in caplog.text and "may grow to" in caplog.text
    caplog.clear()
    asyncio.run(fill_some(tmp_path / "roomy"))
    assert "the file system has room for" not in caplog.text
