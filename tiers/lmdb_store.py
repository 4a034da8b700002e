"""The LMDB side of the disk tier: rows stored as header + bytes, and a small index beside them.

Everything here blocks (it is what ``DiskTier`` runs on its executor threads) and knows
nothing of policies or capacity: it opens the environment, scans the index, writes one
batch per transaction, and reads rows into caller buffers, classifying what it finds.

Two named databases, always changed in the same transaction:

- ``rows``: ``namespace + key`` -> ``RowHeader`` + row (the format of ``row_format``).
- ``index``: ``namespace + key`` -> the value's length and an insertion sequence number.
  It exists because py-lmdb touches every page of a value it returns (its "preload", done
  without the GIL so a later copy does not fault with it held): listing the rows' sizes
  from ``rows`` at start would read the whole tier from disk. The index is a few dozen
  bytes per row, so a restart reads only it; the sequence numbers let the eviction policy
  be re-populated in insertion order.

How LMDB is used, and why:

- **LMDB's own write path** (``writemap=False``): a commit ``pwrite``\\s whole pages. A
  writable map would save one copy, but writing into a page of the map that is not in the
  page cache makes the kernel *read* it first, and in a full disk tier the pages being
  reused are the evicted, coldest ones: every stored row would be read back from disk
  before being overwritten. A writable map over a sparse file also turns a full disk into
  a SIGBUS; this way a full disk fails a commit, the batch is dropped, nothing crashes.
- **No read-ahead on the map** (``MADV_RANDOM``): LMDB reads the first page of a value it
  frees (to learn its page count) and the B-tree pages it copies; with read-ahead each such
  fault on a cold page reads ``read_ahead_kb`` around it, so evicting a cold 2 MiB row
  would read much of it back.
- **Rows are read with ``preadv`` at their file offset**, not through the map: one kernel
  copy into the caller's buffer, the whole row in one request, the GIL released; through
  the map (``MADV_RANDOM``) it would be a synchronous 4 KiB read per page. A value larger
  than about half a page lives in a run of contiguous "overflow" pages, whose first page
  number is stored in the key's B-tree node right after the key. A cursor positioned on
  the key (which does not touch the value) gives the key's address in its leaf page, and
  so the node: its header (flags, key size, value size) and that page number. The read
  then takes the overflow page's own header along with the row and checks both (flags,
  page number, page count); anything unexpected falls back to reading through LMDB. The
  read transaction stays open meanwhile, and LMDB reuses no page a live reader can see.
  Small rows (inside the leaf page) are read through LMDB as usual.

Space: a row costs its overflow pages (the value plus a 16-byte page header, rounded up to
whole pages), a leaf node in ``rows`` and an entry in ``index``. ``entry_bytes`` charges
the overflow pages exactly and the B-tree entries twice, because B-tree pages run between
half and completely full.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Sequence, Set
from dataclasses import dataclass
from enum import Enum

import lmdb

from tiers.base import TierError
from tiers.buffer_address import peek
from tiers.row_format import HEADER_BYTES, VERSION, RowHeader, checksum, verify

log = logging.getLogger(__name__)

DATA_FILE = "data.mdb"
ROWS_DB = b"rows"
INDEX_DB = b"index"
_INDEX = struct.Struct(">QQ")  # value length, insertion sequence
_NODE = struct.Struct("=HHHH")  # LMDB's MDB_node header: size low, size high, flags, key size
_PAGE = struct.Struct("=QHHI")  # LMDB's MDB_page header: pgno, pad, flags, overflow page count
_PGNO = struct.Struct("=Q")
_F_BIGDATA = 0x01
_P_OVERFLOW = 0x04
_PAGE_HEADER = 16
_NODE_HEADER = 8
_PGNO_BYTES = 8


class ReadOutcome(Enum):
    HIT = "hit"
    ABSENT = "absent"  # no value under the key
    CORRUPT = "corrupt"  # a value that is not a whole row of ours: torn, flipped, garbled
    MISMATCH = "mismatch"  # a sound row of another layout or format version: never served, kept
    WRONG_LENGTH = "wrong_length"  # a row whose length is not the caller's buffer's: not served, kept
    ERROR = "error"  # the read itself failed: a miss, nothing deleted


@dataclass(frozen=True)
class IndexEntry:
    key: bytes  # without the namespace
    size: int  # entry_bytes of the row
    seq: int


def entry_bytes(key_len: int, value_len: int, page_size: int) -> int:
    """Bytes of the data file one row occupies (see the module docstring)."""
    node = _NODE_HEADER + key_len + 2  # + its 2-byte slot in the page's index
    index_entry = 2 * (node + _INDEX.size)
    if node + value_len <= _node_max(page_size):
        return index_entry + 2 * (node + value_len)
    pages = -(-(_PAGE_HEADER + value_len) // page_size)
    return index_entry + 2 * (node + _PGNO_BYTES) + pages * page_size


def _node_max(page_size: int) -> int:
    """LMDB's largest in-leaf node (``me_nodemax``); a larger value goes to overflow pages."""
    return (((page_size - _PAGE_HEADER) // 2) & -2) - 2


def check_header(
    head: memoryview | bytes, value_len: int, layouts: Set[bytes]
) -> tuple[ReadOutcome, RowHeader | None]:
    """What a stored value is, from its header and length (the checksum comes after the copy).

    ``layouts``: the layout ids the reader can use.
    """
    header = RowHeader.unpack(head)
    if header is None or header.row_length != value_len - HEADER_BYTES:
        return ReadOutcome.CORRUPT, header
    if header.version != VERSION or header.layout_id not in layouts:
        return ReadOutcome.MISMATCH, header
    return ReadOutcome.HIT, header


class LmdbStore:
    """One LMDB environment in directory ``path``; every method blocks.

    Writes must come from one thread at a time (LMDB allows one write transaction);
    ``read_into`` may run on several threads at once, each with its own read transaction.
    """

    def __init__(self, path: str, map_size: int, *, sync: bool) -> None:
        self.path = path
        self.map_size = map_size
        self.sync = sync
        self.page_size = 4096
        self._env: lmdb.Environment | None = None
        self._rows = None
        self._index = None
        self._fd: int | None = None  # the data file, for preadv

    @property
    def env(self) -> lmdb.Environment:
        if self._env is None:
            raise TierError(f"disk tier at {self.path!r} is not open")
        return self._env

    def open(self) -> None:
        try:
            self._env = lmdb.open(
                self.path,
                map_size=self.map_size,
                subdir=True,
                sync=self.sync,
                metasync=self.sync,
                writemap=False,
                readahead=False,
                max_dbs=2,
                max_readers=126,
            )
            self._rows = self._env.open_db(ROWS_DB)
            self._index = self._env.open_db(INDEX_DB)
        except lmdb.Error as exc:
            self.close()
            raise TierError(f"disk tier at {self.path!r}: cannot open LMDB environment: {exc}") from exc
        stale = self._env.reader_check()  # reader slots of dead processes (a SIGKILLed tier)
        if stale:
            log.info("disk tier at %s: cleared %d stale LMDB reader slots", self.path, stale)
        self.page_size = self._env.stat()["psize"]
        self._fd = os.open(os.path.join(self.path, DATA_FILE), os.O_RDONLY | os.O_CLOEXEC)
        self._reconcile()

    def _reconcile(self) -> None:
        """Make ``rows`` and ``index`` name the same keys (they always do, unless edited outside)."""
        with self.env.begin() as txn:
            rows, index = txn.stat(self._rows)["entries"], txn.stat(self._index)["entries"]
        if rows == index:
            return
        with self.env.begin(write=True) as txn:
            row_keys = set(txn.cursor(self._rows).iternext(values=False))  # keys only: no row is read
            index_keys = set(txn.cursor(self._index).iternext(values=False))
            for key in row_keys - index_keys:
                txn.delete(key, db=self._rows)
            for key in index_keys - row_keys:
                txn.delete(key, db=self._index)
        log.warning(
            "disk tier at %s: %d rows without an index entry and %d index entries without a row, deleted",
            self.path,
            len(row_keys - index_keys),
            len(index_keys - row_keys),
        )

    def scan(self, prefix: bytes) -> tuple[list[IndexEntry], int, int]:
        """``(entries of prefix in insertion order, foreign rows, foreign bytes)``, from the index."""
        own: list[IndexEntry] = []
        foreign_rows = foreign_bytes = 0
        with self.env.begin() as txn:
            for key, value in txn.cursor(self._index).iternext():
                length, seq = _INDEX.unpack(value)
                size = entry_bytes(len(key), length, self.page_size)
                if key.startswith(prefix):
                    own.append(IndexEntry(key[len(prefix) :], size, seq))
                else:
                    foreign_rows += 1
                    foreign_bytes += size
        own.sort(key=lambda entry: entry.seq)
        return own, foreign_rows, foreign_bytes

    def write(
        self,
        deletes: Sequence[bytes],
        puts: Sequence[tuple[bytes, memoryview, int]],
        layout_id: bytes,
    ) -> None:
        """Delete keys and put ``(key, row, seq)`` in one write transaction: all, or nothing.

        Each value is assembled in a scratch buffer (LMDB takes one buffer per value) and
        its checksum is taken from there: the row is read from host memory once, and the
        checksum and LMDB's own copy read the scratch while it is still in the CPU cache.
        Raises ``lmdb.Error`` (``MapFullError``, a disk error) with nothing committed.
        """
        scratch = bytearray(HEADER_BYTES + max((len(row) for _, row, _ in puts), default=0))
        view = memoryview(scratch)
        with self.env.begin(write=True) as txn:
            for key in deletes:
                txn.delete(key, db=self._rows)
                txn.delete(key, db=self._index)
            for key, row, seq in puts:
                end = HEADER_BYTES + len(row)
                body = view[HEADER_BYTES:end]
                body[:] = row
                view[:HEADER_BYTES] = RowHeader(layout_id, len(row), checksum(body)).pack()
                txn.put(key, view[:end], db=self._rows)  # LMDB copies the value; the scratch is reused
                txn.put(key, _INDEX.pack(end, seq), db=self._index)

    def read_into(
        self,
        items: Sequence[tuple[bytes, memoryview]],
        layouts: Set[bytes],
        served: list[bytes | None] | None = None,
    ) -> list[ReadOutcome]:
        """Copy each stored row into its buffer (one read transaction); the outcome per key.

        ``layouts``: the layout ids the reader can use; ``served``, when given, receives
        each hit's layout id (the row's bytes are in that layout).

        Rows are located first and their reads announced to the kernel (``WILLNEED``), so
        the whole batch is read from the device at once rather than row after row. The
        checksum is computed over the buffer after the copy, so what is verified is exactly
        what the caller will use.
        """
        outcomes: list[ReadOutcome] = [ReadOutcome.ABSENT] * len(items)
        head = bytearray(HEADER_BYTES)
        with self.env.begin(db=self._rows, buffers=True) as txn:
            cursor = txn.cursor()
            found = [(i, self._find(cursor, key)) for i, (key, _) in enumerate(items)]
            present = sorted(
                ((i, where) for i, where in found if where is not None),
                key=lambda item: item[1][1] or 0,  # in file order
            )
            for _, (length, overflow) in present:
                if overflow is not None and self._fd is not None:
                    start = overflow * self.page_size
                    os.posix_fadvise(self._fd, start, _PAGE.size + length, os.POSIX_FADV_WILLNEED)
            for i, (length, overflow) in present:
                key, dst = items[i]
                parts = [head, dst] if length == HEADER_BYTES + len(dst) else [head]
                if not self._copy(cursor, key, overflow, length, parts):
                    outcomes[i] = ReadOutcome.ERROR
                    continue
                outcome, header = check_header(head, length, layouts)
                if outcome is ReadOutcome.HIT and len(parts) == 1:
                    outcome = ReadOutcome.WRONG_LENGTH
                elif outcome is ReadOutcome.HIT and verify(header, layouts, dst) is not None:
                    outcome = ReadOutcome.CORRUPT
                outcomes[i] = outcome
                if served is not None and outcome is ReadOutcome.HIT and header is not None:
                    served[i] = header.layout_id
        return outcomes

    def _find(self, cursor: lmdb.Cursor, key: bytes) -> tuple[int, int | None] | None:
        """``(value length, first overflow page or None)``, or ``None`` if ``key`` is absent."""
        if not cursor.set_key(key):
            return None
        length, overflow = self._locate(cursor.key())
        if length is None:  # a node not understood: LMDB will tell the length
            return len(cursor.value()), None
        return length, overflow

    def _locate(self, key: memoryview) -> tuple[int | None, int | None]:
        """``(value length, first overflow page)`` from the B-tree node holding ``key``.

        ``(length, None)`` for a value inside the leaf page; ``(None, None)`` when the
        bytes before the key are not a node of that key (a py-lmdb that copies keys).
        """
        size_lo, size_hi, flags, key_size = _NODE.unpack(peek(key, -_NODE.size, _NODE.size))
        if key_size != len(key):
            return None, None
        length = size_lo | size_hi << 16
        if not flags & _F_BIGDATA:
            return length, None
        (pgno,) = _PGNO.unpack(peek(key, len(key), _PGNO.size))
        return length, pgno

    def _copy(self, cursor: lmdb.Cursor, key: bytes, overflow: int | None, length: int, parts: list) -> bool:
        """Fill ``parts`` from the start of the value: from its overflow pages, else via LMDB."""
        if overflow is not None and self._fd is not None:
            page = bytearray(_PAGE.size)
            want = _PAGE.size + sum(len(part) for part in parts)
            try:
                got = os.preadv(self._fd, [page, *parts], overflow * self.page_size)
            except OSError as exc:
                log.warning("disk tier at %s: reading a row failed: %s", self.path, exc)
                return False
            pgno, _pad, flags, pages = _PAGE.unpack(page)
            expected_pages = -(-(_PAGE.size + length) // self.page_size)
            if got == want and pgno == overflow and flags & _P_OVERFLOW and pages == expected_pages:
                return True
            log.warning(
                "disk tier at %s: unexpected overflow page %d; reading through LMDB", self.path, overflow
            )
        if not cursor.set_key(key):
            return False
        value = cursor.value()
        want = sum(len(part) for part in parts)
        if len(value) < want:
            return False
        at = 0
        for part in parts:
            part[:] = value[at : at + len(part)]
            at += len(part)
        return True

    def delete_corrupt(self, keys: Sequence[bytes], layouts: Set[bytes]) -> list[bytes]:
        """Delete those ``keys`` whose stored value is still corrupt; the keys deleted.

        Re-checked inside the write transaction, so a sound row put since the read that
        found the corruption is not lost.
        """
        deleted: list[bytes] = []
        with self.env.begin(write=True, buffers=True) as txn:
            for key in keys:
                value = txn.get(key, db=self._rows)
                if value is None:
                    continue
                outcome, header = check_header(value[:HEADER_BYTES], len(value), layouts)
                if outcome is ReadOutcome.HIT and header is not None:
                    if checksum(value[HEADER_BYTES:]) == header.checksum:
                        continue
                elif outcome is not ReadOutcome.CORRUPT:
                    continue
                txn.delete(key, db=self._rows)
                txn.delete(key, db=self._index)
                deleted.append(key)
        return deleted

    def close(self) -> None:
        self._rows = self._index = None
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        if self._env is not None:
            env, self._env = self._env, None
            env.close()
