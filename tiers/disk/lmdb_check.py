"""Checks that make a damaged LMDB index, or a full filesystem, an error instead of a signal.

LMDB reads its data file through a memory map, which turns file-system faults into signals
that kill the whole engine inside ``lmdb.open`` or the first transaction, where Python
cannot catch anything:

- a ``data.mdb`` shorter than its meta page says (cut by a copy, a restore, a bad disk):
  the pages past the end of the file are still in the map, and touching one is SIGBUS
  (measured: 6 of 8 truncations killed the process);
- garbage inside the file: a branch page that names a page past the end (SIGBUS) or past
  the map.

So before ``lmdb.open`` the store (``LmdbStore.open``) checks the data file in three steps:
``header_problem`` reads both meta pages with ``pread`` (magic, version, page size, and
that the file holds every page the metas name); ``free_list_problem`` walks LMDB's
free-page list with ``pread`` (a tree no read reaches, which every commit reads: garbage
there passed the other checks and then failed later commits, up to every one); ``walk_problem`` has
a child process open the file read-only and read every index entry, so a signal there kills
the child, not the caller. Any problem makes the store set the file aside and start an
empty index (the disk tier is a cache: losing it costs misses). Measured cost at open: the
header check ~0.1 ms; the free-list walk 0.5 ms for the list of a 20,000-row index after
churn, 27 ms for the worst case of a 1,000,000-row index freed whole (it grows with the
pages free, not with the rows); the walk a Python start plus one read of the index, 0.25 s
for an index of 1,000,000 rows (146 MiB, in the page cache), where the tier's own load of
it takes 0.21 s.

The store runs LMDB without its lock file (``lock=False``), so the shared, writable map of
``lock.mdb`` (created sparse, written through the map: SIGBUS on a full file system) is
not there to fault. Growing files need no care either: LMDB writes ``data.mdb`` with
``pwrite`` (the store never sets ``writemap``, which would make its map writable and bring
the fault back) and the rows file is written with ``pwritev``, so a disk that fills while
they grow fails that commit with ``ENOSPC`` (a dropped batch, counted), measured on a full
tmpfs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import struct
import subprocess
import sys
from collections.abc import Iterator

MDB_MAGIC = 0xBEEFC0DE
MDB_DATA_VERSION = 1  # LMDB 0.9's on-disk format
P_META = 0x08
P_INVALID = (1 << 64) - 1  # an empty tree's root
_PAGE_HEADER = struct.Struct("<QHH")  # page number, pad, flags
_META = struct.Struct("<IIQQ")  # magic, version, fixed address, map size (at byte 16 of the page)
_DB = struct.Struct(
    "<IHHQQQQQ"
)  # pad (the page size in FREE_DBI), flags, depth, branch/leaf/overflow pages, entries, root
_TAIL = struct.Struct("<QQ")  # last page used, transaction id
_META_AT, _DBS_AT, _TAIL_AT = 16, 40, 40 + 2 * _DB.size
_META_BYTES = _TAIL_AT + _TAIL.size
WALK_TIMEOUT_S = 120.0


class CheckNotRun(OSError):
    """The child process of ``walk_problem`` could not run at all (says nothing of the file)."""


@contextlib.contextmanager
def _opened(data_path: str) -> Iterator[tuple[int, int] | None]:
    """``(fd, size)`` of LMDB file ``data_path``, opened read-only without following a link
    and closed after; ``None`` for an absent or empty file (LMDB starts a new one)."""
    try:
        fd = os.open(data_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        yield None
        return
    try:
        size = os.fstat(fd).st_size
        yield (fd, size) if size else None
    finally:
        os.close(fd)


def header_problem(data_path: str) -> str | None:
    """What is wrong with the meta pages of LMDB file ``data_path``, or ``None``.

    An absent or empty file is fine (LMDB starts a new one). Reads with ``pread`` only, so it
    cannot fault whatever the file holds.
    """
    with _opened(data_path) as opened:
        if opened is None:
            return None
        fd, size = opened
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


_PAGE_HEADER_BYTES = 16  # page number, pad, flags, then lower/upper (or an overflow's page count)
_BOUNDS = struct.Struct("<HH")  # lower, upper (at byte 12)
_NODE = struct.Struct("<HHHH")  # data size lo/hi (a branch: child page lo/hi), flags, key size
P_BRANCH, P_LEAF, P_OVERFLOW = 0x01, 0x02, 0x04
F_BIGDATA = 0x01  # a leaf's data lives in overflow pages
_MAX_DEPTH = 32  # far above any real tree (a 4 KiB-page B-tree of 2**64 entries is < 20 deep)


def free_list_problem(data_path: str) -> str | None:
    """What is wrong with the free-page list (LMDB's database 0) of ``data_path``, or ``None``.

    ``walk_problem`` cannot reach it (py-lmdb opens no handle on it), and LMDB reads it only
    to allocate pages for a write: garbage there passes every read and then fails (or may
    crash) every commit. So it is walked here, with ``pread`` only, from the meta page LMDB
    will use (the later transaction): every page in the file and numbered as its place,
    branch and leaf pages whose bounds and nodes lie inside them, keys (transaction ids)
    in order, each record a list of free pages in range, descending, none twice, and the
    page and entry counts the meta names. A sound list is a few pages: this costs
    microseconds.
    """
    with _opened(data_path) as opened:
        if opened is None:
            return None
        fd, _size = opened
        page_size = _DB.unpack_from(os.pread(fd, _META_BYTES, 0), _DBS_AT)[0]
        metas = [os.pread(fd, _META_BYTES, number * page_size) for number in (0, 1)]
        meta = max(metas, key=lambda page: _TAIL.unpack_from(page, _TAIL_AT)[1])  # LMDB's pick
        last_page = _TAIL.unpack_from(meta, _TAIL_AT)[0]
        _, _, depth, branches, leaves, overflows, entries, root = _DB.unpack_from(meta, _DBS_AT)
        counts = (branches, leaves, overflows, entries)
        if root == P_INVALID:
            empty = depth == 0 and counts == (0, 0, 0, 0)
            return None if empty else "the free-page list is empty but its counts are not"
        return _FreeListWalk(fd, page_size, last_page).problem(root, depth, counts)


class _FreeListWalk:
    """One walk of the free-page list's B-tree (``free_list_problem``)."""

    def __init__(self, fd: int, page_size: int, last_page: int) -> None:
        self.fd, self.page_size, self.last_page = fd, page_size, last_page
        self.seen: set[int] = set()  # pages of the tree, and pages it lists as free
        self.counts = [0, 0, 0, 0]  # branch, leaf, overflow pages, entries
        self.last_key = -1

    def problem(self, root: int, depth: int, counts: tuple[int, int, int, int]) -> str | None:
        if not 1 <= depth <= _MAX_DEPTH:
            return f"the free-page list has depth {depth}"
        try:
            self._walk(root, depth)
        except _Bad as exc:
            return f"the free-page list: {exc}"
        if tuple(self.counts) != counts:
            return f"the free-page list holds {tuple(self.counts)} pages and entries, its meta names {counts}"
        return None

    def _page(self, number: int) -> bytes:
        if not 1 < number <= self.last_page:
            raise _Bad(f"page {number} outside pages 2..{self.last_page}")
        if number in self.seen:
            raise _Bad(f"page {number} reached twice")
        self.seen.add(number)
        page = os.pread(self.fd, self.page_size, number * self.page_size)
        if len(page) < self.page_size:
            raise _Bad(f"page {number} past the end of the file")
        if _PAGE_HEADER.unpack_from(page, 0)[0] != number:
            raise _Bad(f"page {number} is numbered {_PAGE_HEADER.unpack_from(page, 0)[0]}")
        return page

    def _walk(self, number: int, depth: int) -> None:
        page = self._page(number)
        flags = _PAGE_HEADER.unpack_from(page, 0)[2]
        kind = P_BRANCH if depth > 1 else P_LEAF
        if flags != kind:
            raise _Bad(f"page {number} has flags 0x{flags:x}, expected 0x{kind:x}")
        lower, upper = _BOUNDS.unpack_from(page, 12)
        if not _PAGE_HEADER_BYTES <= lower <= upper <= self.page_size or lower % 2:
            raise _Bad(f"page {number} has bounds {lower}..{upper}")
        count = (lower - _PAGE_HEADER_BYTES) // 2
        if count == 0:
            raise _Bad(f"page {number} is empty")
        self.counts[0 if kind == P_BRANCH else 1] += 1
        for i in range(count):
            at = struct.unpack_from("<H", page, _PAGE_HEADER_BYTES + 2 * i)[0]
            if not upper <= at <= self.page_size - _NODE.size:
                raise _Bad(f"page {number}: node {i} at byte {at}, outside {upper}..{self.page_size}")
            lo, hi, node_flags, key_size = _NODE.unpack_from(page, at)
            key_at = at + _NODE.size
            if kind == P_BRANCH:
                if key_at + key_size > self.page_size or (i and key_size != 8):
                    raise _Bad(f"page {number}: branch node {i} has a key of {key_size} bytes")
                self._walk(lo | hi << 16 | node_flags << 32, depth - 1)
            else:
                self._leaf_node(number, i, page, key_at, key_size, lo | hi << 16, node_flags)

    def _leaf_node(
        self, number: int, i: int, page: bytes, key_at: int, key_size: int, data_size: int, flags: int
    ) -> None:
        data_at = key_at + key_size
        if key_size != 8:
            raise _Bad(f"page {number}: entry {i} has a key of {key_size} bytes, not a transaction id")
        key = struct.unpack_from("<Q", page, key_at)[0]
        if key <= self.last_key:
            raise _Bad(f"page {number}: transaction ids out of order ({key} after {self.last_key})")
        self.last_key = key
        self.counts[3] += 1
        if flags & ~F_BIGDATA:
            raise _Bad(f"page {number}: entry {i} has flags 0x{flags:x}")
        if flags & F_BIGDATA:
            if data_at + 8 > self.page_size:
                raise _Bad(f"page {number}: entry {i} runs past the page")
            data = self._overflow(struct.unpack_from("<Q", page, data_at)[0], data_size)
        else:
            if data_at + data_size > self.page_size:
                raise _Bad(f"page {number}: entry {i} runs past the page")
            data = page[data_at : data_at + data_size]
        self._free_pages(number, i, data)

    def _overflow(self, number: int, data_size: int) -> bytes:
        page = self._page(number)
        flags = _PAGE_HEADER.unpack_from(page, 0)[2]
        pages = struct.unpack_from("<I", page, 12)[0]
        needed = -(-(data_size + _PAGE_HEADER_BYTES) // self.page_size)
        if flags != P_OVERFLOW or pages != needed or number + pages - 1 > self.last_page:
            raise _Bad(f"overflow page {number}: flags 0x{flags:x}, {pages} pages for {data_size} bytes")
        for extra in range(number + 1, number + pages):
            if extra in self.seen:
                raise _Bad(f"page {extra} reached twice")
            self.seen.add(extra)
        self.counts[2] += pages
        end = _PAGE_HEADER_BYTES + data_size
        return os.pread(self.fd, end, number * self.page_size)[_PAGE_HEADER_BYTES:end]

    def _free_pages(self, number: int, i: int, data: bytes) -> None:
        if len(data) < 8 or len(data) % 8:
            raise _Bad(f"page {number}: entry {i} is {len(data)} bytes, not a list of pages")
        count = struct.unpack_from("<Q", data, 0)[0]
        if len(data) != 8 * (count + 1):
            raise _Bad(f"page {number}: entry {i} names {count} pages in {len(data)} bytes")
        free = struct.unpack_from(f"<{count}Q", data, 8)
        for at, page in enumerate(free):
            if not 1 < page <= self.last_page or (at and page >= free[at - 1]):
                raise _Bad(f"page {number}: entry {i} lists page {page} (out of range or order)")
            if page in self.seen:
                raise _Bad(f"page {page} listed free twice, or free and in use")
            self.seen.add(page)


class _Bad(Exception):
    """A fault of the free-page list (``_FreeListWalk``), said in words."""


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
