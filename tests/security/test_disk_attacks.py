"""Issue 36's attacks on the disk tier's directory, by a local user who can write into it.

Each test plants what the attacker would (a symbolic link in place of one of the tier's
files, a hard link, a file of another user, a FIFO) and asserts that the tier refuses with
a ``TierError`` naming the file and that nothing outside the directory is written or
created; or checks that what the tier creates is private (files ``0600``, its directory
``0700``) under the usual ``umask`` of ``022``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiers.base import TierError
from tiers.disk import DiskTier
from tiers.disk.dir_lock import LOCK_NAME
from tiers.disk.lmdb_store import LMDB_FILE, ROWS_FILE
from tiers.settings import DiskSettings

NAMESPACE = b"attacked-namespa"
LAYOUT = b"attacked-layout!"
ROW = 9_000
SECRET = b"the attacker's target: must stay as it is\n"
OTHER_UID = 54_321  # a user who is not this process's


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "big")).digest() + bytes(4)


def make_tier(path: Path) -> DiskTier:
    return DiskTier(DiskSettings(path=str(path), capacity_bytes=16 << 20), NAMESPACE, LAYOUT)


async def store_and_read(path: Path, n: int = 4) -> int:
    """Open the tier, store ``n`` rows, read them back; the hits."""
    tier = make_tier(path)
    await tier.open()
    try:
        rows = [(key(i), memoryview(hashlib.shake_128(key(i)).digest(ROW))) for i in range(n)]
        assert all(await tier.put(rows))
        got = await tier.get([(k, memoryview(bytearray(ROW))) for k, _ in rows])
        return sum(got)
    finally:
        await tier.close()


def open_refused(path: Path) -> str:
    """Open the tier at ``path``, which must fail; the message."""
    with pytest.raises(TierError) as caught:
        asyncio.run(store_and_read(path))
    return str(caught.value)


@pytest.fixture(autouse=True)
def usual_umask() -> Iterator[None]:
    """``022``, the umask under which the old tier's files were world-readable."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the tier's, holding a file the attacker points links at."""
    where = tmp_path / "outside"
    where.mkdir()
    (where / "target").write_bytes(SECRET)
    return where


@pytest.mark.parametrize("name", [ROWS_FILE, LMDB_FILE, LOCK_NAME])
def test_a_link_planted_as_a_file_of_the_tier_is_refused_and_its_target_untouched(tmp_path, outside, name):
    tier_dir = tmp_path / "tier"
    tier_dir.mkdir()
    (tier_dir / name).symlink_to(outside / "target")
    message = open_refused(tier_dir)
    assert name in message and "symbolic link" in message
    assert (outside / "target").read_bytes() == SECRET  # not overwritten with rows


@pytest.mark.parametrize("name", [ROWS_FILE, LMDB_FILE, LOCK_NAME, "lock.mdb"])
def test_a_dangling_link_never_creates_its_target(tmp_path, outside, name):
    tier_dir = tmp_path / "tier"
    tier_dir.mkdir()
    (tier_dir / name).symlink_to(outside / "created-by-the-tier")
    if name == "lock.mdb":  # LMDB's lock file: the tier no longer has one, so the link is ignored
        assert asyncio.run(store_and_read(tier_dir)) == 4
    else:
        assert "symbolic link" in open_refused(tier_dir)
    assert not (outside / "created-by-the-tier").exists()
    assert os.listdir(outside) == ["target"]


def test_a_link_to_a_populated_tier_file_elsewhere_is_not_followed_on_a_reopen(tmp_path, outside):
    """A tier that ran once, whose rows file is then swapped for a link: refused at the next open."""
    tier_dir = tmp_path / "tier"
    assert asyncio.run(store_and_read(tier_dir)) == 4
    (tier_dir / ROWS_FILE).unlink()
    (tier_dir / ROWS_FILE).symlink_to(outside / "target")
    assert "symbolic link" in open_refused(tier_dir)
    assert (outside / "target").read_bytes() == SECRET


def test_a_hard_link_planted_as_the_rows_file_is_refused(tmp_path, outside):
    tier_dir = tmp_path / "tier"
    tier_dir.mkdir()
    os.link(outside / "target", tier_dir / ROWS_FILE)
    assert "links" in open_refused(tier_dir)
    assert (outside / "target").read_bytes() == SECRET


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
@pytest.mark.parametrize("name", [ROWS_FILE, LMDB_FILE, LOCK_NAME])
def test_a_file_of_another_user_is_never_written(tmp_path, name):
    """The other user made the file world-writable, to read what the tier puts in it."""
    tier_dir = tmp_path / "tier"
    tier_dir.mkdir()
    planted = tier_dir / name
    planted.write_bytes(b"")
    planted.chmod(0o666)
    os.chown(planted, OTHER_UID, OTHER_UID)
    message = open_refused(tier_dir)
    assert name in message and f"uid {OTHER_UID}" in message
    assert planted.stat().st_size == 0 and planted.stat().st_uid == OTHER_UID


def test_a_fifo_planted_as_the_rows_file_is_refused_without_hanging(tmp_path):
    """Opened on a thread with a deadline: a tier that opened the FIFO would block there (for
    a writer that never comes), and the test must fail, not hang the suite."""
    tier_dir = tmp_path / "tier"
    tier_dir.mkdir()
    os.mkfifo(tier_dir / ROWS_FILE)
    outcome: list[str] = []
    opener = threading.Thread(target=lambda: outcome.append(open_refused(tier_dir)), daemon=True)
    opener.start()
    opener.join(20.0)
    if opener.is_alive():
        os.close(os.open(tier_dir / ROWS_FILE, os.O_RDWR | os.O_NONBLOCK))  # release a blocked open
        pytest.fail("opening the tier blocked on the FIFO")
    assert outcome and "not a regular file" in outcome[0]


def test_the_tier_creates_a_private_directory_and_private_files(tmp_path):
    tier_dir = tmp_path / "a" / "tier"
    assert asyncio.run(store_and_read(tier_dir)) == 4
    assert stat.S_IMODE(tier_dir.stat().st_mode) == 0o700
    names = sorted(os.listdir(tier_dir))
    assert names == sorted([ROWS_FILE, LMDB_FILE, LOCK_NAME])  # no lock.mdb any more
    for name in names:
        assert stat.S_IMODE((tier_dir / name).stat().st_mode) == 0o600, name


def test_files_an_older_tier_left_world_readable_are_made_private(tmp_path):
    tier_dir = tmp_path / "tier"
    assert asyncio.run(store_and_read(tier_dir)) == 4
    for name in os.listdir(tier_dir):
        (tier_dir / name).chmod(0o644)
    assert asyncio.run(store_and_read(tier_dir)) == 4
    for name in os.listdir(tier_dir):
        assert stat.S_IMODE((tier_dir / name).stat().st_mode) == 0o600, name


def test_an_existing_directory_open_to_others_is_warned_of(tmp_path, caplog):
    tier_dir = tmp_path / "tier"
    tier_dir.mkdir(mode=0o755)
    tier_dir.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="tiers.disk"):
        assert asyncio.run(store_and_read(tier_dir)) == 4  # a warning, not an error
    assert "open to group or others" in caplog.text and "chmod 700" in caplog.text
    caplog.clear()
    tier_dir.chmod(0o700)
    with caplog.at_level(logging.WARNING, logger="tiers.disk"):
        asyncio.run(store_and_read(tier_dir))
    assert "open to group or others" not in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_directory_of_another_user_is_warned_of(tmp_path, caplog):
    tier_dir = tmp_path / "tier"
    tier_dir.mkdir(mode=0o700)
    os.chown(tier_dir, OTHER_UID, OTHER_UID)
    with caplog.at_level(logging.WARNING, logger="tiers.disk"):
        assert asyncio.run(store_and_read(tier_dir)) == 4  # root may still write it
    assert f"belongs to uid {OTHER_UID}" in caplog.text


def test_a_rows_file_swapped_for_a_link_while_open_is_a_miss_never_a_read_of_the_target(tmp_path, outside):
    """The name is replaced under a running tier: its reads refuse the new name (misses)."""

    async def run() -> tuple[int, int]:
        tier = make_tier(tmp_path / "tier")
        await tier.open()
        try:
            rows = [(key(i), memoryview(hashlib.shake_128(key(i)).digest(ROW))) for i in range(4)]
            assert all(await tier.put(rows))
            (tmp_path / "tier" / ROWS_FILE).rename(outside / "moved")
            (tmp_path / "tier" / ROWS_FILE).symlink_to(outside / "target")
            got = await tier.get([(k, memoryview(bytearray(ROW))) for k, _ in rows])
            return sum(got), tier.stats()["read_errors"]
        finally:
            await tier.close()

    hits, errors = asyncio.run(run())
    assert hits == 0 and errors >= 1
    assert (outside / "target").read_bytes() == SECRET
