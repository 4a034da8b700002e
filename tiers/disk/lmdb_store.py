"""The disk tier's files: rows in a plain rows file, and an LMDB index that says where they are.

Everything here blocks (it is what ``DiskTier`` runs on its executor threads) and knows
nothing of policies or capacity.

**Why not the rows inside LMDB.** A value of LMDB is written three times over: assembled
with its header (LMDB takes one buffer per value), copied into LMDB's dirty pages, copied
again by the kernel at the commit; where a plain file write copies the row once, into the
page cache. py-lmdb has no ``MDB_RESERVE``, and a writable map makes the kernel read every
page it first touches (the evicted, coldest rows) before it is overwritten. Measured on
2 MiB rows, that capped writes at ~0.25 of a plain ``pwritev``. So LMDB holds only the index
and the rows go to ``rows.dat`` with one ``pwritev`` each, straight from host memory.

**The rows file** (``ROWS_FILE``) is 4 KiB pages. A row takes ``pages_for(len(row))`` pages,
in one run of pages or a few (``PageAllocator``), laid out as: the row, then a 64-byte
trailer, then zeros to the end of the page (whole pages are written, so the kernel never
reads a page to merge a partial write). The trailer is the ``RowHeader`` of
``row_format`` (format version, layout id, row length, xxh3 checksum) followed by the
write's id (64 random bits), a digest of its key and a magic: the row's header and row, as
``DESIGN.md`` has them, with the header behind the row so the row lands page-aligned.

**The index** (LMDB database ``slots``): ``namespace + key`` -> the write's id, its insertion
sequence number, the row's length and its runs of pages. It is the only thing that makes a
row exist, and it is committed after the row's pages are written (and ``fdatasync``\\ed, with ``sync``):

- A process killed in a batch leaves the index of the last commit; the pages it was writing
  were free in that index, so no committed row is touched.
- Pages a commit frees (an evicted, deleted or replaced row) are not reused by the batch
  that frees them, nor while a read that could see the old index entry is running: frees
  wait for the readers of earlier epochs (the in-process analogue of LMDB's reader table;
  the directory lock makes this process the file's only user). The file therefore spans
  the capacity plus a batch or so: ``limit_bytes`` bounds it, and a batch that does not fit
  fails whole.
- Every read checks the trailer against the index entry and the key: magic, write id,
  key digest, length, format version and layout, then the checksum over the bytes
  copied into the caller's buffer. A torn row, flipped bytes, a page holding some other
  row (after an OS crash with ``sync=False``) or a foreign row is therefore never served.

At ``open`` the index is read whole into memory (a few dozen bytes a row); reads use that
copy, so a read is one ``preadv`` per run of pages, or per piece of rows that lie together
(``read_into``), and touches no LMDB page.

Space: a row costs its pages and its index entry; ``entry_bytes`` charges the pages exactly
and the B-tree entry twice, because B-tree pages run between half and completely full.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence, Set
from dataclasses import dataclass
from enum import Enum

import lmdb
import xxhash

from tiers.base import TierError
from tiers.buffer_address import buffer_address
from tiers.disk import lmdb_check, own_files
from tiers.disk.page_allocator import PageAllocator, Run
from tiers.fast_checksum import checksum_at
from tiers.row_format import HEADER_BYTES, VERSION, RowHeader

log = logging.getLogger(__name__)

ROWS_FILE = "rows.dat"
LMDB_FILE = "data.mdb"  # LMDB's own name for its file in the directory
DATA_FILES = (ROWS_FILE, LMDB_FILE)
INDEX_DB = b"slots"
PAGE = 4096
SLOT_MAGIC = b"KVTSLOT1"
_TAIL = struct.Struct("<QQ8s")  # after the RowHeader: write id, key digest, magic
TRAILER_BYTES = HEADER_BYTES + _TAIL.size
_ENTRY = struct.Struct("<QQQH")  # write id, insertion sequence number, row length, number of runs
_RUN = struct.Struct("<QI")  # first page, page count
_NODE_BYTES = 8 + 2  # LMDB's node header and its slot in the page's index
_OLD_DBS = (b"rows", b"index")  # the format that kept rows inside LMDB
_MAX_DBS = len(_OLD_DBS) + 1
_ZEROS = bytes(PAGE)
READ_PIECE_BYTES = 8 << 20
"""About what one coalesced ``preadv`` reads (``LmdbStore.read_into``): a piece takes rows
until it holds this much, so its rows are verified while the kernel reads ahead."""
try:
    _IOV_MAX = os.sysconf("SC_IOV_MAX")
except (AttributeError, ValueError, OSError):
    _IOV_MAX = 1024


class ReadOutcome(Enum):
    HIT = "hit"
    ABSENT = "absent"  # no row under the key
    CORRUPT = "corrupt"  # not the row the index names: torn, flipped, another key's, garbled
    MISMATCH = "mismatch"  # a sound row of another layout or format version: never served, kept
    WRONG_LENGTH = "wrong_length"  # a row whose length is not the caller's buffer's: not served, kept
    ERROR = "error"  # the read itself failed: a miss, nothing deleted


@dataclass(frozen=True)
class Read:
    outcome: ReadOutcome
    layout_id: bytes | None = None  # a hit's layout
    write_id: int | None = None  # the write read (to delete a corrupt row, and only that one)


@dataclass(frozen=True)
class Entry:
    """One index entry: where a row is, and which write put it there.

    ``write_id`` is random, so no other write (of any key, namespace or earlier life of the
    file) leaves a trailer that matches it; ``seq`` orders the policy at a restart.
    """

    write_id: int
    seq: int
    length: int
    runs: tuple[Run, ...]

    def pack(self) -> bytes:
        head = _ENTRY.pack(self.write_id, self.seq, self.length, len(self.runs))
        return head + b"".join(_RUN.pack(start, count) for start, count in self.runs)

    @classmethod
    def unpack(cls, value: bytes) -> Entry | None:
        if len(value) < _ENTRY.size:
            return None
        write_id, seq, length, n = _ENTRY.unpack_from(value)
        if len(value) != _ENTRY.size + n * _RUN.size:
            return None
        runs = tuple(_RUN.unpack_from(value, _ENTRY.size + i * _RUN.size) for i in range(n))
        if sum(count for _, count in runs) != pages_for(length):
            return None
        return cls(write_id, seq, length, runs)


@dataclass(frozen=True)
class IndexEntry:
    key: bytes  # without the namespace
    size: int  # entry_bytes of the row
    seq: int


class SpaceFull(OSError):
    """No room in the rows file for a batch (its limit, with the pages still being freed)."""

    def __init__(self, pages: int, available: int) -> None:
        super().__init__(errno.ENOSPC, f"rows file full: {pages} pages wanted, {available} free")


def pages_for(row_length: int) -> int:
    return -(-(row_length + TRAILER_BYTES) // PAGE)


def entry_bytes(key_len: int, row_length: int, runs: int = 1) -> int:
    """Bytes one row costs: its pages, and its index entry (see the module docstring)."""
    return pages_for(row_length) * PAGE + 2 * (_NODE_BYTES + key_len + _ENTRY.size + runs * _RUN.size)


def key_digest(key: bytes) -> int:
    return xxhash.xxh3_64_intdigest(key)


def _checksum(view: memoryview) -> int:
    """The row checksum, taken by address with the GIL released (``fast_checksum``)."""
    return checksum_at(view, buffer_address(view)) if len(view) else checksum_at(view, 0)


class LmdbStore:
    """Rows file and LMDB index in directory ``path``; every method blocks.

    ``write`` and ``delete_corrupt`` must come from one thread at a time (the writer);
    ``read_into`` may run on several threads at once, beside the writer.
    """

    def __init__(self, path: str, limit_bytes: int, index_map_size: int, *, sync: bool) -> None:
        self.path = path
        self.limit_bytes = limit_bytes
        self.index_map_size = index_map_size
        self.sync = sync
        self._env: lmdb.Environment | None = None
        self._db = None
        self._fd: int | None = None  # the writer's
        self._read_fds = threading.local()  # each reader thread's own (see read_into)
        self._all_read_fds: list[int] = []
        self._alloc = PageAllocator(limit_bytes // PAGE)
        self._lock = threading.Lock()  # _entries, _epoch, _readers
        self._entries: dict[bytes, Entry] = {}
        self._epoch = 0
        self._readers: Counter[int] = Counter()  # epoch -> reads running that began in it
        self._pending: list[tuple[int, list[Run]]] = []  # (epoch, runs) freed, not yet reusable

    @property
    def env(self) -> lmdb.Environment:
        if self._env is None:
            raise TierError(f"disk tier at {self.path!r} is not open")
        return self._env

    # -- open ----------------------------------------------------------------------------

    def open(self) -> None:
        """Open (or create) the index and the rows file; ``TierError`` if they cannot be used.

        Every file is opened as ``own_files`` has it: created ``0600``, never through a
        symbolic link, only this user's own (a ``TierError`` naming the file otherwise, and
        nothing written). ``data.mdb`` is made or checked that way before LMDB opens it by
        name, and after, that the name still holds the file checked. LMDB runs without its
        own lock file (``lock=False``): the directory lock (``DirLock``) keeps every other
        process out, and in this process only the writer thread calls LMDB, so its reader
        table had nothing to guard; without it there is no ``lock.mdb`` to reach through a
        link, nor one written through a shared map on a full disk (a SIGBUS).

        A damaged index (``lmdb_check``: cut short, garbage in a tree or in the free-page
        list, refused by LMDB) is set aside as ``data.mdb.corrupt`` and the tier starts
        empty, with a warning: it is a cache, mapping a damaged file would kill the process
        with SIGBUS, and a damaged free-page list fails every later commit.
        """
        os.close(own_files.open_own_file(self.path, LMDB_FILE, os.O_RDONLY))
        self._set_aside_if_damaged()
        data_fd = own_files.open_own_file(self.path, LMDB_FILE, os.O_RDONLY)  # a new one if set aside
        try:
            self._env = lmdb.open(
                self.path,
                map_size=self.index_map_size,
                subdir=True,
                sync=self.sync,
                metasync=self.sync,
                max_dbs=_MAX_DBS,
                lock=False,
                mode=own_files.FILE_MODE,
            )
            if not own_files.same_file(data_fd, os.path.join(self.path, LMDB_FILE)):
                raise TierError(f"disk tier at {self.path!r}: {LMDB_FILE} was replaced while it was opened")
            self._drop_old_format()
            self._db = self._env.open_db(INDEX_DB)
        except lmdb.Error as exc:
            self.close()
            raise TierError(f"disk tier at {self.path!r}: cannot open LMDB environment: {exc}") from exc
        except BaseException:
            self.close()
            raise
        finally:
            os.close(data_fd)
        try:
            self._fd = own_files.open_own_file(self.path, ROWS_FILE, os.O_WRONLY)
        except BaseException:
            self.close()
            raise
        self._load()

    def _set_aside_if_damaged(self) -> None:
        """Move a damaged ``data.mdb`` to ``data.mdb.corrupt`` (replacing an older one)."""
        data = os.path.join(self.path, LMDB_FILE)
        try:
            problem = lmdb_check.header_problem(data) or lmdb_check.free_list_problem(data)
            if problem is None and os.path.exists(data) and os.path.getsize(data):
                problem = lmdb_check.walk_problem(self.path, _MAX_DBS, [INDEX_DB, *_OLD_DBS])
        except lmdb_check.CheckNotRun as exc:
            # The header is sound; only the walk's own process failed to start (no usable
            # ``sys.executable``, say): go on as before the walk existed.
            log.warning("disk tier at %s: could not walk the LMDB index: %s", self.path, exc)
            return
        except OSError as exc:  # the file cannot be read, or the walk hung on the device
            raise TierError(f"disk tier at {self.path!r}: cannot check the LMDB index: {exc}") from exc
        if problem is None:
            return
        aside = data + ".corrupt"
        try:
            os.replace(data, aside)
        except OSError as exc:
            raise TierError(
                f"disk tier at {self.path!r}: the LMDB index is damaged ({problem}) and cannot be "
                f"moved aside: {exc}"
            ) from exc
        log.warning(
            "disk tier at %s: the LMDB index is damaged (%s); moved to %s, starting empty "
            "(the rows stored before are dropped)",
            self.path,
            problem,
            aside,
        )

    def _drop_old_format(self) -> None:
        """Rows stored inside LMDB by an earlier version: deleted (a cache, not a store)."""
        with self.env.begin(write=True) as txn:
            for name in _OLD_DBS:
                if txn.get(name) is not None:
                    txn.drop(self.env.open_db(name, txn=txn), delete=True)
                    log.warning("disk tier at %s: dropped %r, the rows of an older format", self.path, name)

    def _load(self) -> None:
        """Read the index; delete entries that are malformed or overlap another's pages."""
        entries: dict[bytes, Entry] = {}
        bad: list[bytes] = []
        with self.env.begin(db=self._db) as txn:
            for key, value in txn.cursor().iternext():
                entry = Entry.unpack(value)
                if entry is None:
                    bad.append(key)
                else:
                    entries[key] = entry
        owner: list[tuple[int, int, bytes]] = sorted(
            (start, count, key) for key, entry in entries.items() for start, count in entry.runs
        )
        end = 0
        for start, count, key in owner:
            if start < end and key in entries:
                bad.append(key)
                del entries[key]
            end = max(end, start + count)
        if bad:
            with self.env.begin(write=True, db=self._db) as txn:
                for key in bad:
                    txn.delete(key)
            log.warning(
                "disk tier at %s: %d malformed or overlapping index entries deleted", self.path, len(bad)
            )
        used = [run for entry in entries.values() for run in entry.runs]
        used_end = max((start + count for start, count in used), default=0)
        # Pages past the last row are kept (free, already on disk) up to the limit: cutting
        # them off would only have the next batches allocate blocks again, and on a device
        # mounted with ``discard`` the trim of the freed blocks stalls the reads that follow.
        file_pages = os.fstat(self._fd_or_raise()).st_size // PAGE
        keep = max(used_end, min(file_pages, self._alloc.limit))
        if file_pages > keep:
            os.ftruncate(self._fd_or_raise(), keep * PAGE)  # the limit was lowered
        self._alloc.load(used, keep)
        self._entries = entries

    def scan(self, prefix: bytes) -> tuple[list[IndexEntry], int, int]:
        """``(entries of prefix in insertion order, foreign rows, foreign bytes)``."""
        own: list[IndexEntry] = []
        foreign_rows = foreign_bytes = 0
        with self._lock:
            for key, entry in self._entries.items():
                size = entry_bytes(len(key), entry.length, len(entry.runs))
                if key.startswith(prefix):
                    own.append(IndexEntry(key[len(prefix) :], size, entry.seq))
                else:
                    foreign_rows += 1
                    foreign_bytes += size
        own.sort(key=lambda entry: entry.seq)
        return own, foreign_rows, foreign_bytes

    # -- writes --------------------------------------------------------------------------

    def write(
        self,
        deletes: Sequence[bytes],
        puts: Sequence[tuple[bytes, memoryview, int]],
        layout_id: bytes,
    ) -> None:
        """Delete keys and put ``(key, row, seq)`` as one commit: all, or nothing.

        Each row is written with one ``pwritev`` per run of pages, straight from its buffer,
        its checksum taken from the same buffer. Raises ``lmdb.Error`` or ``OSError``
        (``SpaceFull``, a full disk, an I/O error) with nothing committed.
        """
        self._reclaim()
        staged: list[tuple[bytes, Entry]] = []
        try:
            for key, row, seq in puts:
                pages = pages_for(len(row))
                runs = self._alloc.allocate(pages)
                if runs is None:
                    raise SpaceFull(pages, self._alloc.available())
                write_id = int.from_bytes(os.urandom(8), "little")
                staged.append((key, Entry(write_id, seq, len(row), tuple(runs))))
            for (key, entry), (_, row, _) in zip(staged, puts, strict=True):
                header = RowHeader(layout_id, len(row), _checksum(row)).pack()
                trailer = header + _TAIL.pack(entry.write_id, key_digest(key), SLOT_MAGIC)
                pad = _ZEROS[: -(len(row) + TRAILER_BYTES) % PAGE]
                self._write_runs(entry.runs, [row, trailer, pad])
            if self.sync and staged:
                os.fdatasync(self._fd_or_raise())
            with self.env.begin(write=True, db=self._db) as txn:
                for key in deletes:
                    txn.delete(key)
                for key, entry in staged:
                    txn.put(key, entry.pack())
        except BaseException:
            self._alloc.release(run for _, entry in staged for run in entry.runs)
            raise
        freed: list[Run] = []
        with self._lock:
            for key in deletes:
                old = self._entries.pop(key, None)
                if old is not None:
                    freed.extend(old.runs)
            for key, entry in staged:
                old = self._entries.get(key)
                if old is not None:
                    freed.extend(old.runs)
                self._entries[key] = entry
            if freed:
                self._pending.append((self._epoch, freed))
            self._epoch += 1

    def _reclaim(self) -> None:
        """Free the pages of commits that no running read began before."""
        with self._lock:
            oldest = min(self._readers, default=self._epoch)
        while self._pending and self._pending[0][0] < oldest:
            self._alloc.release(self._pending.pop(0)[1])

    def _write_runs(self, runs: Sequence[Run], buffers: list) -> None:
        fd = self._fd_or_raise()
        for offset, parts in _spans(runs, buffers):
            if not _vectored_fully(os.pwritev, fd, parts, offset):
                raise OSError(errno.ENOSPC, "short write to the rows file")

    def delete_corrupt(self, found: Sequence[tuple[bytes, int]]) -> list[bytes]:
        """Delete each ``(key, write id)`` still indexed as that write; the keys deleted.

        A key put again since the read that found it corrupt is another write, and its
        sound row is kept.
        """
        with self._lock:
            keys = [
                key
                for key, write_id in found
                if (e := self._entries.get(key)) is not None and e.write_id == write_id
            ]
        if keys:
            self.write(keys, [], b"")
        return keys

    # -- reads ---------------------------------------------------------------------------

    def file_order(self, keys: Sequence[bytes]) -> list[int]:
        """The positions of ``keys`` in the order of their rows in the rows file (keys not
        found last), so that ``DiskTier.get`` hands each reader thread rows that lie together
        and ``read_into`` can coalesce them."""
        with self._lock:
            found = [self._entries.get(key) for key in keys]
        return sorted(
            range(len(keys)), key=lambda at: (found[at] is None, found[at].runs[:1] if found[at] else ())
        )

    def read_into(self, items: Sequence[tuple[bytes, memoryview]], layouts: Set[bytes]) -> list[Read]:
        """Copy each stored row into its buffer; what was found, per key.

        ``layouts``: the layout ids the reader can use. Rows are read in file order through
        this thread's own read-only descriptor (the kernel keeps read-ahead per open file),
        rows that lie next to each other in the file (a batch written together, the usual
        case) coalesced into pieces of about ``READ_PIECE_BYTES``, one ``preadv`` each
        (``_plan_pieces``): a batch of 2 MiB rows split over 4 threads is 4 calls, not 16.
        Each piece's rows are verified as soon as it lands; the checksum is computed over
        the caller's buffer after the copy, so what is verified is what the caller will use.
        A piece that fails or ends early is read again row by row, so an I/O error or a cut
        file is a miss of the rows it touches, never of their neighbours.

        Measured (cold 2 MiB rows, batches of 16, ``kvtier bench disk --rounds 9`` on a
        shared 2-core VM with a virtio disk): the cold ratio to the plain ``readv`` stayed
        within 0.44-0.65 for every read path tried, this one and the row-by-row one before
        it alike; the device sets it there. A cold read of ``rows.dat`` in the bench runs
        either at the plain read's speed (2-2.5 GiB/s a batch) or drops to ~0.5 GiB/s for
        the rest of the pass, a plain ``preadv`` of the same extents from the same slot
        too, where ``plain.bin`` rarely does. Tried and not better: one thread per batch
        (requests of 3.2-3.7 MiB like the plain read's, where 4 threads that each restart
        the read-ahead get 1-1.6 MiB, but a shallower queue: 0.29-0.65; warm reads gained
        from checksums on a second thread, 0.74-1.0); 8 threads (0.44-0.65); ``WILLNEED``
        over the batch (it fills the cache in 4 KiB folios: 3.5x the requests);
        ``POSIX_FADV_SEQUENTIAL`` (0.30-0.56); ``O_DIRECT`` (no page-cache copy, a third of
        the CPU, but 0.9-1.0 GB/s where buffered reads got 1.5-2).
        """
        with self._lock:
            found = [self._entries.get(key) for key, _ in items]
            epoch = self._epoch
            self._readers[epoch] += 1
        try:
            present = sorted(
                (i for i, entry in enumerate(found) if entry is not None),
                key=lambda i: found[i].runs[0] if found[i].runs else (0, 0),  # type: ignore[union-attr]
            )
            reads = [Read(ReadOutcome.ABSENT)] * len(items)
            trailers = {i: bytearray(TRAILER_BYTES) for i in present}
            pieces, alone = _plan_pieces(
                [(i, found[i], items[i][1], trailers[i]) for i in present]  # type: ignore[misc]
            )
            for piece in pieces:
                try:
                    complete = self._pread_fully(piece.offset, piece.parts)
                except OSError as exc:
                    log.debug(
                        "disk tier at %s: a read of %d rows failed: %s", self.path, len(piece.rows), exc
                    )
                    complete = False
                for i in piece.rows:
                    key, dst = items[i]
                    if complete:
                        reads[i] = self._verify(key, found[i], dst, trailers[i], layouts)  # type: ignore[arg-type]
                    else:  # each row alone: an error or a short file is then that row's alone
                        reads[i] = self._read_one(key, found[i], dst, layouts)  # type: ignore[arg-type]
            for i in alone:
                key, dst = items[i]
                reads[i] = self._read_one(key, found[i], dst, layouts)  # type: ignore[arg-type]
            return reads
        finally:
            with self._lock:
                self._readers[epoch] -= 1
                if not self._readers[epoch]:
                    del self._readers[epoch]

    def _read_one(self, key: bytes, entry: Entry, dst: memoryview, layouts: Set[bytes]) -> Read:
        trailer = bytearray(TRAILER_BYTES)
        fits = entry.length == len(dst)
        try:
            complete = self._read_runs(
                entry.runs, [dst, trailer] if fits else [trailer], entry.length * (not fits)
            )
        except OSError as exc:
            log.warning("disk tier at %s: reading a row failed: %s", self.path, exc)
            return Read(ReadOutcome.ERROR, write_id=entry.write_id)
        if not complete:
            return Read(ReadOutcome.CORRUPT, write_id=entry.write_id)
        return self._verify(key, entry, dst, trailer, layouts)

    def _verify(
        self, key: bytes, entry: Entry, dst: memoryview, trailer: bytearray, layouts: Set[bytes]
    ) -> Read:
        """What a row read whole is: ``dst`` holds its bytes when its length fits, and
        ``trailer`` the trailer behind them."""
        header = RowHeader.unpack(trailer)
        write_id, digest, magic = _TAIL.unpack_from(trailer, HEADER_BYTES)
        if header is None or (magic, write_id, digest, header.row_length) != (
            SLOT_MAGIC,
            entry.write_id,
            key_digest(key),
            entry.length,
        ):
            return Read(ReadOutcome.CORRUPT, write_id=entry.write_id)
        if header.version != VERSION or header.layout_id not in layouts:
            return Read(ReadOutcome.MISMATCH, write_id=entry.write_id)
        if entry.length != len(dst):
            return Read(ReadOutcome.WRONG_LENGTH, write_id=entry.write_id)
        if _checksum(dst) != header.checksum:
            return Read(ReadOutcome.CORRUPT, write_id=entry.write_id)
        return Read(ReadOutcome.HIT, header.layout_id, entry.write_id)

    def _read_runs(self, runs: Sequence[Run], buffers: list, skip: int) -> bool:
        """Fill ``buffers`` from the row's bytes from ``skip`` on; ``False`` if the file ends first."""
        return all(self._pread_fully(offset, parts) for offset, parts in _spans(runs, buffers, skip))

    def _pread_fully(self, offset: int, parts: list[memoryview]) -> bool:
        """Fill ``parts`` from ``offset`` on; ``False`` if the file ends first."""
        return _vectored_fully(os.preadv, self._read_fd(), parts, offset)

    # -- close ---------------------------------------------------------------------------

    def _fd_or_raise(self) -> int:
        if self._fd is None:
            raise TierError(f"disk tier at {self.path!r} is not open")
        return self._fd

    def _read_fd(self) -> int:
        """This thread's read-only descriptor of the rows file, opened on first use."""
        fd = getattr(self._read_fds, "fd", None)
        if fd is None:
            flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK  # no link, no FIFO hang
            fd = os.open(os.path.join(self.path, ROWS_FILE), flags)
            held, opened = os.fstat(self._fd_or_raise()), os.fstat(fd)
            if (held.st_dev, held.st_ino) != (opened.st_dev, opened.st_ino):
                os.close(fd)  # the name no longer holds the rows file: a read error (a miss)
                raise OSError(errno.ESTALE, f"{ROWS_FILE} was replaced since the tier opened it")
            self._read_fds.fd = fd
            with self._lock:
                self._all_read_fds.append(fd)
        return fd

    def close(self) -> None:
        """Release everything; no read may be running (the tier's pools are shut down)."""
        self._db = None
        with self._lock:
            read_fds, self._all_read_fds = self._all_read_fds, []
        self._read_fds = threading.local()
        for fd in read_fds:
            os.close(fd)
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        if self._env is not None:
            env, self._env = self._env, None
            env.close()
        with self._lock:
            self._entries = {}
            self._pending = []


@dataclass
class _Piece:
    """Rows next to each other in the rows file, read by one ``preadv``."""

    offset: int
    end: int
    parts: list[memoryview]
    rows: list[int]


def _plan_pieces(
    rows: Sequence[tuple[int, Entry, memoryview, bytearray]],
) -> tuple[list[_Piece], list[int]]:
    """``(pieces, rows to read alone)`` for ``(id, entry, destination, trailer)`` in file order.

    A row of one run whose length fits its destination joins the piece before it when it
    starts at the page after that piece's last row: the rest of that page (behind the
    trailer) is read into a scratch buffer, so the piece is one extent of the file. A
    piece takes rows until it holds ``READ_PIECE_BYTES`` or ``IOV_MAX`` parts. Other rows (several
    runs, or a length that does not fit, where only the trailer is read) are read alone.
    """
    pieces: list[_Piece] = []
    alone: list[int] = []
    scratch = memoryview(bytearray(PAGE))
    for i, entry, dst, trailer in rows:
        if len(entry.runs) != 1 or entry.length != len(dst):
            alone.append(i)
            continue
        offset = entry.runs[0][0] * PAGE
        end = offset + entry.length + TRAILER_BYTES
        last = pieces[-1] if pieces else None
        if (
            last is not None
            and 0 <= offset - last.end < PAGE
            and last.end - last.offset < READ_PIECE_BYTES
            and len(last.parts) + 3 <= _IOV_MAX
        ):
            if offset > last.end:
                last.parts.append(scratch[: offset - last.end])
            last.parts += [dst, memoryview(trailer)]
            last.rows.append(i)
            last.end = end
        else:
            pieces.append(_Piece(offset, end, [dst, memoryview(trailer)], [i]))
    return pieces, alone


def _spans(runs: Sequence[Run], buffers: list, skip: int = 0) -> Iterator[tuple[int, list[memoryview]]]:
    """``(file offset, slices of buffers)`` per run: ``buffers`` laid over the row's pages
    from byte ``skip`` of the row on."""
    views = [memoryview(buffer).cast("B") for buffer in buffers if len(buffer)]
    at = 0  # into views[0]
    for start, count in runs:
        offset, room = start * PAGE, count * PAGE
        if skip >= room:
            skip -= room
            continue
        offset, room, skip = offset + skip, room - skip, 0
        parts: list[memoryview] = []
        while room and views:
            take = min(room, len(views[0]) - at)
            parts.append(views[0][at : at + take])
            room -= take
            at += take
            if at == len(views[0]):
                views.pop(0)
                at = 0
        if parts:
            yield offset, parts
        if not views:
            return


def _vectored_fully(
    call: Callable[[int, list[memoryview], int], int], fd: int, parts: list[memoryview], offset: int
) -> bool:
    """``os.preadv`` or ``os.pwritev`` until every byte of ``parts`` moved; ``False`` if a
    call moves nothing (the file ends, or the disk is full)."""
    total = sum(len(part) for part in parts)
    while total:
        done = call(fd, parts, offset)
        if done <= 0:
            return False
        offset, total = offset + done, total - done
        parts = _advance(parts, done)
    return True


def _advance(parts: list[memoryview], done: int) -> list[memoryview]:
    """``parts`` less their first ``done`` bytes (after a short read or write)."""
    while parts and done >= len(parts[0]):
        done -= len(parts[0])
        parts = parts[1:]
    if parts and done:
        parts = [parts[0][done:], *parts[1:]]
    return parts
