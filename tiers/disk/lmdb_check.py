"""Checks that make a damaged LMDB index, or a full filesystem, an error instead of a signal.

LMDB reads its data file through a memory map and keeps its reader table in a second,
shared, writable map (``lock.mdb``). Both turn file-system faults into signals, which kill
the whole engine inside ``lmdb.open`` or the first transaction, where Python cannot catch
anything:

- a ``data.mdb`` shorter than its meta page says (cut by a copy, a restore, a bad disk):
  the pages past the end of the file are still in the map, and touching one is SIGBUS
  (measured: 6 of 8 truncations killed the process);
- garbage inside the file: a branch page that names a page past the end (SIGBUS) or past
  the map;
- a full file system: ``lock.mdb`` is created sparse with ``ftruncate`` and written through
  its map, and a write fault that finds no free block is SIGBUS (tmpfs and ext4 alike).

So before ``lmdb.open`` the store (``LmdbStore.open``) first reserves the lock file's blocks
(``reserve_lock_file``: ``posix_fallocate``, so a full disk is ``ENOSPC`` here), then checks
the data file in two steps: ``header_problem`` reads both meta pages with ``pread`` (magic,
version, page size, and that the file holds every page the metas name), and
``walk_problem`` has a child process open the file read-only and read every index entry,
so a signal there kills the child, not the caller. Either problem makes the store set the
file aside and start an empty index (the disk tier is a cache: losing it costs misses).
Measured cost at open: the header check ~0.1 ms; the walk a Python start plus one read of
the index, 0.25 s for an index of 1,000,000 rows (146 MiB, in the page cache), where the
tier's own load of it takes 0.21 s.

Growing files need no such care: LMDB writes ``data.mdb`` with ``pwrite`` (the store never
sets ``writemap``, which would make its map writable and bring the fault back) and the rows
file is written with ``pwritev``, so a disk that fills while they grow fails that commit
with ``ENOSPC`` (a dropped batch, counted), measured on a full tmpfs.

Not covered: LMDB's free-page list is not walked (py-lmdb cannot reach it); its root page
is bounds-checked with the rest of the meta. A write transaction that meets garbage there
may still crash.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys

MDB_MAGIC = 0xBEEFC0DE
MDB_DATA_VERSION = 1  # LMDB 0.9's on-disk format
P_META = 0x08
P_INVALID = (1 << 64) - 1  # an empty tree's root
LOCK_FILE = "lock.mdb"
_PAGE_HEADER = struct.Struct("<QHH")  # page number, pad, flags
_META = struct.Struct("<IIQQ")  # magic, version, fixed address, map size (at byte 16 of the page)
_DB = struct.Struct(
    "<IHHQQQQQ"
)  # pad (the page size in FREE_DBI), flags, depth, branch/leaf/overflow pages, entries, root
_TAIL = struct.Struct("<QQ")  # last page used, transaction id
_META_AT, _DBS_AT, _TAIL_AT = 16, 40, 40 + 2 * _DB.size
_META_BYTES = _TAIL_AT + _TAIL.size
_READER_BYTES = 64  # sizeof(MDB_reader): one cache line per reader slot
_LOCK_HEADER_BYTES = 128  # sizeof(MDB_txninfo) less its reader array
WALK_TIMEOUT_S = 120.0


class CheckNotRun(OSError):
    """The child process of ``walk_problem`` could not run at all (says nothing of the file)."""


def lock_file_bytes(max_readers: int) -> int:
    """The size LMDB gives ``lock.mdb`` for ``max_readers`` reader slots (it keeps a larger file)."""
    return _LOCK_HEADER_BYTES + max_readers * _READER_BYTES


def reserve_lock_file(directory: str, max_readers: int) -> None:
    """Give ``lock.mdb`` real blocks before LMDB maps it; ``OSError`` (``ENOSPC``) if there are none.

    LMDB only grows the file when it is smaller than it needs, so the blocks reserved here
    are the ones its map writes to, and no write through the map can fault for space.
    """
    fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:  # a larger file (more reader slots) is used whole by LMDB: its holes are filled too
        os.posix_fallocate(fd, 0, max(lock_file_bytes(max_readers), os.fstat(fd).st_size))
    finally:
        os.close(fd)


def header_problem(data_path: str) -> str | None:
    """What is wrong with the meta pages of LMDB file ``data_path``, or ``None``.

    An absent or empty file is fine (LMDB starts a new one). Reads with ``pread`` only, so it
    cannot fault whatever the file holds.
    """
    try:
        fd = os.open(data_path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        first = os.pread(fd, _META_BYTES, 0)
        if len(first) < _META_BYTES:
            return f"{size} bytes: shorter than one meta page"
        page_size = _DB.unpack_from(first, _DBS_AT)[0]
        if page_size < 512 or page_size > 65536 or page_size & (page_size - 1):
            return f"meta page 0 gives page size {page_size}: not an LMDB file"
        if size < 2 * page_size:
            return f"{size} bytes: shorter than its two meta pages of {page_size} bytes"
        for number in (0, 1):
            page = os.pread(fd, _META_BYTES, number * page_size)
            problem = _meta_problem(page, number, page_size, size)
            if problem:
                return f"meta page {number}: {problem}"
        return None
    finally:
        os.close(fd)


def _meta_problem(page: bytes, number: int, page_size: int, file_size: int) -> str | None:
    if len(page) < _META_BYTES:
        return "cut short"
    _, _, flags = _PAGE_HEADER.unpack_from(page, 0)
    magic, version, _, _ = _META.unpack_from(page, _META_AT)
    if not flags & P_META or magic != MDB_MAGIC:
        return "not an LMDB meta page"
    if version != MDB_DATA_VERSION:
        return f"format version {version}, this LMDB reads {MDB_DATA_VERSION}"
    last_page, _ = _TAIL.unpack_from(page, _TAIL_AT)
    needed = (last_page + 1) * page_size
    if last_page < 1 or needed > file_size:
        return f"names pages up to {last_page}, {needed} bytes, but the file has {file_size}"
    for db in range(2):
        root = _DB.unpack_from(page, _DBS_AT + db * _DB.size)[-1]
        if root != P_INVALID and not 1 < root <= last_page:
            return f"a root page {root} outside pages 2..{last_page}"
    if number == 1 and _DB.unpack_from(page, _DBS_AT)[0] != page_size:
        return "page size differs from meta page 0's"
    return None


_WALK = r"""
import sys
import lmdb

path, max_dbs, names = sys.argv[1], int(sys.argv[2]), [bytes.fromhex(n) for n in sys.argv[3:]]
try:
    env = lmdb.open(path, readonly=True, lock=False, subdir=True, max_dbs=max_dbs)
    with env.begin() as txn:
        found = [key for key, _ in txn.cursor()]
        for name in names:
            if name in found:
                for _ in txn.cursor(env.open_db(name, txn=txn, create=False)):
                    pass
    env.close()
except lmdb.Error as exc:
    print(exc, end="")
    sys.exit(3)
"""


def walk_problem(directory: str, max_dbs: int, databases: list[bytes]) -> str | None:
    """Read every entry of the named databases in a child process; what went wrong, or ``None``.

    A page that is garbage may send LMDB past the end of its map (a signal); in the child,
    that is a failed check. Costs a Python start (~0.1 s) and one read of the index.
    ``TimeoutError`` if the walk does not end in ``WALK_TIMEOUT_S`` (a hung device),
    ``CheckNotRun`` if the child could not start or import lmdb.
    """
    argv = [sys.executable, "-c", _WALK, directory, str(max_dbs), *(name.hex() for name in databases)]
    try:
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=WALK_TIMEOUT_S,
            check=False,
        )
    except OSError as exc:
        raise CheckNotRun(f"cannot start {sys.executable!r}: {exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise TimeoutError(f"checking the LMDB index took more than {WALK_TIMEOUT_S:.0f} s") from exc
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        return f"reading it killed the checking process with {signal.Signals(-done.returncode).name}"
    if done.returncode == 3:
        return f"LMDB refused it: {done.stdout.strip()}"
    raise CheckNotRun(f"the LMDB check could not run (exit {done.returncode}): {done.stderr.strip()[-300:]}")
