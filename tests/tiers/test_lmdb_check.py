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

import pytest

from tests.tiers import disk_writer_child as child
from tiers.disk import lmdb_check as lmdb_check
from tiers.disk.lmdb_store import LMDB_FILE

REPO = Path(__file__).resolve().parents[2]
PAGE = 4096


def open_in_child(path: Path) -> dict:
    """What ``disk_writer_child open`` reports for ``path``; fails the test on a signal."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.tiers.disk_writer_child", "open", str(path)],
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
        report = open_in_child(data.parent)
        assert report["outcome"] == "opened", report
        assert report["wrong"] == 0 and report["hits"] == report["rows"] <= child.KEYS, report
        assert report["stored"] == 5, report  # and the tier goes on
        outcomes.append(report["rows"])
    assert outcomes[:2] == [0, 0]  # an unreadable header: set aside


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
