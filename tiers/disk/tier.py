"""The disk tier: rows in a local file, persistent across restarts, checksummed, bounded.

Files (``lmdb_store``): the rows in a plain rows file, each written with one ``pwritev``
straight from the host row and followed by its 64-byte trailer (the ``RowHeader``: format
version, layout id, row length, xxh3 checksum; then a random id of the write and a key
digest); an LMDB index, ``namespace + block key`` -> where the row is, committed after the
row is written. A row is served only when its trailer matches its index entry, its key
and a layout this tier reads, and its checksum matches the bytes copied out; a torn,
flipped, stale or foreign row is a miss, never garbage (a corrupt one is deleted and
counted).

Threading (see ``LowerTier``): the coroutines run on the tier engine's event loop; file and
LMDB work runs on executor threads the tier owns. Every write (a ``put`` batch, a
``delete``, the removal of a corrupt row) runs on **one** writer thread, in submission
order, so there is one commit at a time and the in-memory index changes in the order the
files do. Reads run on a small reader pool, each chunk of a ``get`` on its own thread; a
read never blocks the writer, and pages a commit frees are not reused while a read that
began before it runs. The bookkeeping (``DiskIndex``: key -> bytes, and the eviction
policy) is shared by those threads under one mutex, held only for bookkeeping, never across
I/O; ``may_contain`` and ``stats`` read without it.

A cancelled ``put``/``get``/``delete`` coroutine does not cancel the executor work it
started: a batch is committed (or not) and booked as a whole, and a ``get`` may still write
into its buffers until its read finishes, so the caller keeps those slots until then.

Capacity: ``capacity_bytes`` bounds the bytes this namespace's rows cost
(``lmdb_store.entry_bytes``: whole pages of the rows file, and the index entry estimated),
less any rows of other namespaces found in the files (they are never served, never evicted
by this tier, and counted in ``stats()``). The eviction policy (any of ``policies/``)
chooses victims; they are deleted in the same commit that stores the batch needing the room.

The rows file may span ``capacity + margin``. The margin holds the pages that are free but
not yet reusable: those of the rows a batch evicts (reused from the next batch on) and those
a running read still sees. The default, ``capacity // 16 + 64 MiB`` (1 GiB for a 15 GiB
tier), holds batches of a few hundred MiB; a batch that does not fit fails whole: its stores
are dropped and counted, nothing else changes. The LMDB index has a map of the same size.

Restart: the index is read at ``open`` (no row is read), so a restart is warm, and the
policy is re-populated in insertion order (hits are not persisted: that would cost a write
per hit). A damaged index (cut short, garbage) is set aside and the tier starts empty with a
warning; a file system too full to start LMDB is a ``TierError``; neither is ever a signal
(``lmdb_check``). A file system with less room than the files' limit is warned of at open.

Privacy (``own_files``): the directory is created ``0700`` and the files ``0600``; no file
in the directory is opened through a symbolic link, nor written if another user owns it
or it has another link (each a ``TierError`` at open naming the file); an existing
directory open to others is warned of.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import lmdb

from policies import make_policy
from tiers.base import LowerTier, Row, TierError, TierStats
from tiers.disk import own_files
from tiers.disk.dir_lock import DirLock
from tiers.disk.index import DiskIndex
from tiers.disk.lmdb_store import DATA_FILES, LmdbStore, Read, ReadOutcome, entry_bytes
from tiers.row_format import LAYOUT_ID_BYTES
from tiers.settings import DiskSettings
from tiers.shared import byte_view

log = logging.getLogger(__name__)

NAMESPACE_BYTES = 16
"""The namespace digest's length (``offload.namespace``); fixed, so no namespace's key range
can contain another's."""
OFFLOAD_KEY_BYTES = 36  # a block hash (32) + a KV-group index (4), to size the policy

_MiB = 1 << 20
_T = TypeVar("_T")
_MISMATCHED = (ReadOutcome.MISMATCH, ReadOutcome.WRONG_LENGTH)
STORE_ERRORS = (lmdb.Error, OSError)
"""What a call into the files can raise (the index, or a read or write of the rows file)."""
_Wanted = tuple[int, bytes, memoryview]  # a row of a get: its position, key and destination


@dataclass
class DiskStats(TierStats):
    """The disk tier's counters (since ``open``) and, in a ``stats()`` snapshot, its levels."""

    hits: int = 0
    misses: int = 0
    stored: int = 0
    dropped: int = 0
    evictions: int = 0
    deleted: int = 0
    corrupt: int = 0
    mismatched: int = 0  # sound rows of another layout or length: misses, kept
    write_errors: int = 0  # batches whose commit failed (their rows dropped)
    read_errors: int = 0
    rows: int = 0
    bytes: int = 0  # used by this namespace's rows
    capacity_bytes: int = 0
    file_limit: int = 0  # the rows file's size limit (capacity + margin)
    foreign_rows: int = 0  # rows of other namespaces in the file (never served)
    foreign_bytes: int = 0


def default_file_margin(capacity_bytes: int) -> int:
    """The rows file's room beyond the capacity (see the module docstring)."""
    return capacity_bytes // 16 + 64 * _MiB


class DiskTier(LowerTier):
    """Rows of one namespace and layout in directory ``settings.path`` (rows file and LMDB
    index), bounded by ``settings.capacity_bytes``, evicted by ``settings.eviction``
    (with ``eviction_params``: any policy of ``policies/``, ``make_policy``). Placement and
    admission are the manager's business, not the tier's.

    ``sync``: whether each commit is flushed to the device (``fsync``) before ``put``
    returns (the rows file, then LMDB's commit). Either way a commit is atomic and a
    *process* crash (SIGKILL included) never loses a committed batch, nor leaves a partial
    one: the rows are in the kernel's page cache before the index names them. Only an OS
    crash or power loss can lose the batches committed since the last flush with
    ``sync=False``; what it leaves is still never served wrong (the trailer and checksum).

    ``file_margin_bytes``: the rows file's room beyond the capacity (default
    ``default_file_margin``).
    ``row_bytes``: the usual row size, to size the policy in rows from the start (ARC,
    S3-FIFO and W-TinyLFU size their segments from it); by default it is learned from the
    rows found at open, or the first row stored. ``read_threads``: the reader pool's size.
    """

    kind = "disk"

    def __init__(
        self,
        settings: DiskSettings,
        namespace: bytes,
        layout_id: bytes,
        *,
        sync: bool = False,
        file_margin_bytes: int | None = None,
        row_bytes: int | None = None,
        read_threads: int = 4,
        readable_layouts: Collection[bytes] = (),
    ) -> None:
        self.settings = settings
        path, capacity_bytes, eviction = settings.path, settings.capacity_bytes, settings.eviction
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"disk tier capacity must be a positive number of bytes, got {capacity_bytes!r}")
        if not isinstance(namespace, bytes) or len(namespace) != NAMESPACE_BYTES:
            raise ValueError(f"disk tier namespace must be {NAMESPACE_BYTES} bytes, got {namespace!r}")
        if not isinstance(layout_id, bytes) or len(layout_id) != LAYOUT_ID_BYTES:
            raise ValueError(f"disk tier layout id must be {LAYOUT_ID_BYTES} bytes, got {layout_id!r}")
        if read_threads < 1:
            raise ValueError(f"disk tier read_threads must be >= 1, got {read_threads!r}")
        margin = default_file_margin(capacity_bytes) if file_margin_bytes is None else file_margin_bytes
        if margin < 0:
            raise ValueError(f"disk tier file_margin_bytes must be >= 0, got {file_margin_bytes!r}")
        self.eviction = eviction
        self.eviction_params: dict[str, Any] = dict(settings.eviction_params)
        make_policy(eviction, 1, **self.eviction_params)  # a bad name or parameter fails here, not at open
        self.path = os.path.abspath(path)
        self.capacity_bytes = capacity_bytes
        self.namespace = namespace
        self.layout_id = layout_id
        self.layouts = frozenset({layout_id, *readable_layouts})  # what get may serve
        self.sync = sync
        self.row_bytes = row_bytes
        self.read_threads = read_threads
        self.file_limit = -(-(capacity_bytes + margin) // _MiB) * _MiB
        self._store = LmdbStore(self.path, self.file_limit, default_file_margin(capacity_bytes), sync=sync)
        self._dir_lock = DirLock(self.path)
        self._index = self._new_index()
        self._foreign_rows = 0
        self._foreign_bytes = 0
        self._stats = DiskStats()
        self._writer: ThreadPoolExecutor | None = None
        self._readers: ThreadPoolExecutor | None = None
        self._warned: set[str] = set()

    def _new_index(self) -> DiskIndex:
        row_entry = None
        if self.row_bytes is not None:
            row_entry = entry_bytes(NAMESPACE_BYTES + OFFLOAD_KEY_BYTES, self.row_bytes)
        return DiskIndex(self.capacity_bytes, self.eviction, self.eviction_params, row_entry)

    # -- lifecycle -----------------------------------------------------------------------

    async def open(self, host_buffer: memoryview | None = None) -> None:
        """Lock the directory, open LMDB, rebuild the index; ``TierError`` if unusable."""
        if self._writer is not None:
            raise TierError(f"disk tier at {self.path!r} is already open")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvtier-disk-write")
        self._readers = ThreadPoolExecutor(self.read_threads, thread_name_prefix="kvtier-disk-read")
        try:
            await self._on_writer(self._open_blocking)
        except BaseException:
            await asyncio.get_running_loop().run_in_executor(None, self._shutdown_blocking)
            raise

    def _open_blocking(self) -> None:
        own_files.make_private_dir(self.path)
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise TierError(f"disk tier at {self.path!r}: the directory is not writable by this process")
        self._dir_lock.acquire()
        self._store.open()
        own, self._foreign_rows, self._foreign_bytes = self._store.scan(self.namespace)
        index = self._new_index()  # a reopened tier starts from the file
        index.load([(entry.key, entry.size, entry.seq) for entry in own], self._foreign_bytes)
        self._index = index
        self._stats = DiskStats()
        if self._foreign_rows:
            log.warning(
                "disk tier at %s: %d rows (%.1f MiB) of other namespaces in the file; never served, "
                "and they reduce this namespace's capacity",
                self.path,
                self._foreign_rows,
                self._foreign_bytes / _MiB,
            )
        self._shrink_to_capacity()
        self._warn_if_short_of_space()
        log.info(
            "disk tier at %s: %d rows, %.1f of %.1f MiB, rows file up to %.1f MiB, sync=%s, eviction=%s",
            self.path,
            len(index),
            index.used / _MiB,
            self.capacity_bytes / _MiB,
            self.file_limit / _MiB,
            self.sync,
            self.eviction,
        )

    def _shrink_to_capacity(self) -> None:
        """Evict rows beyond the capacity found at open (the capacity was lowered)."""
        with self._index.mutex:
            victims = self._index.excess()
        if not victims:
            return
        try:
            self._store.write([self.namespace + key for key in victims], [], self.layout_id)
        except STORE_ERRORS as exc:
            raise TierError(f"disk tier at {self.path!r}: cannot shrink to the capacity: {exc}") from exc
        with self._index.mutex:
            self._index.book([], [], victims)
            self._stats.evictions += len(victims)
        log.info("disk tier at %s: evicted %d rows down to the capacity", self.path, len(victims))

    def _warn_if_short_of_space(self) -> None:
        """Say at open, not at the first dropped batch, that the file system cannot hold the
        tier's files at their limit: a full disk is then a run of dropped stores
        (``write_errors``), never a crash, but the capacity configured is not what is had."""
        try:
            fs = os.statvfs(self.path)
            held = sum(
                os.lstat(os.path.join(self.path, name)).st_blocks * 512
                for name in os.listdir(self.path)
                if name in DATA_FILES
            )
        except OSError:
            return
        room = fs.f_bavail * fs.f_frsize + held
        wanted = self.file_limit + self._store.index_map_size
        if room < wanted:
            log.warning(
                "disk tier at %s: the file system has room for %.1f MiB of this tier's files, which "
                "may grow to %.1f MiB; batches that do not fit will be dropped (write_errors)",
                self.path,
                room / _MiB,
                wanted / _MiB,
            )

    async def close(self) -> None:
        """Wait for work in flight, then release LMDB and the directory lock. On the calling
        thread, not an executor: vLLM closes its connector from a finaliser at interpreter
        exit, where no executor takes new work any more (the tier was left open there)."""
        if self._writer is None:
            return
        self._shutdown_blocking()

    def _shutdown_blocking(self) -> None:
        for pool in (self._writer, self._readers):
            if pool is not None:
                pool.shutdown(wait=True)  # no LMDB call may outlive the environment
        self._writer = self._readers = None
        self._store.close()
        self._dir_lock.release()

    # -- queries -------------------------------------------------------------------------

    def may_contain(self, key: bytes) -> bool:
        """Exact, from the index: no other process writes this file (the directory lock)."""
        return key in self._index

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """As ``may_contain``: the index is authoritative here (a row may still turn out
        corrupt when read, which is a miss then)."""
        return [key in self._index for key in keys]

    def stats(self) -> DiskStats:
        return replace(
            self._stats,
            rows=len(self._index),
            bytes=self._index.used,
            capacity_bytes=self.capacity_bytes,
            file_limit=self.file_limit,
            foreign_rows=self._foreign_rows,
            foreign_bytes=self._foreign_bytes,
        )

    # -- writes --------------------------------------------------------------------------

    async def put(self, rows: Sequence[Row]) -> list[bool]:
        """Store the rows in one transaction, evicting to stay within capacity.

        ``False`` for a row that was dropped: larger than the capacity, no evictable room,
        or its batch's commit failed (map full, disk full, I/O error). Never raises for
        those; they are counted in ``dropped``.
        """
        batch = [(key, byte_view(row)) for key, row in rows]
        return await self._on_writer(self._put_blocking, batch)

    def _put_blocking(self, rows: list[tuple[bytes, memoryview]]) -> list[bool]:
        max_key = self._store.env.max_key_size() - NAMESPACE_BYTES
        sizes = [
            (key, entry_bytes(NAMESPACE_BYTES + len(key), len(row)))
            for key, row in rows
            if 0 < len(key) <= max_key
        ]
        keys = [key for key, _ in sizes]
        views = [row for key, row in rows if 0 < len(key) <= max_key]
        with self._index.mutex:
            used_before = self._index.used
            planned, victims = self._index.plan(sizes)
        if planned or victims:  # victims of a row that did not fit after all go too
            try:
                self._store.write(
                    [self.namespace + key for key in victims],
                    [(self.namespace + keys[row.index], views[row.index], row.seq) for row in planned],
                    self.layout_id,
                )
            except STORE_ERRORS as exc:
                with self._index.mutex:
                    self._index.undo(victims, used_before)
                    self._stats.write_errors += 1
                self._warn_once(
                    type(exc).__name__, "disk tier at %s: a batch of %d rows dropped: %s", exc, len(planned)
                )
                planned = []
            else:
                with self._index.mutex:
                    self._index.book(keys, planned, victims)
                    self._stats.evictions += len(victims)
                    self._stats.stored += len(planned)
        stored = {keys[row.index] for row in planned}
        results = [key in stored for key, _ in rows]
        with self._index.mutex:
            self._stats.dropped += results.count(False)
        return results

    async def delete(self, keys: Sequence[bytes]) -> None:
        """Remove rows (absent keys are ignored); a failed delete is logged, never raised."""
        await self._on_writer(self._delete_blocking, list(keys))

    def _delete_blocking(self, keys: list[bytes]) -> None:
        present = [key for key in dict.fromkeys(keys) if key in self._index]
        if not present:
            return
        try:
            self._store.write([self.namespace + key for key in present], [], self.layout_id)
        except STORE_ERRORS as exc:
            with self._index.mutex:
                self._stats.write_errors += 1
            self._warn_once(
                type(exc).__name__, "disk tier at %s: a delete of %d rows failed: %s", exc, len(present)
            )
            return
        with self._index.mutex:
            self._index.forget(present)
            self._stats.deleted += len(present)

    # -- reads ---------------------------------------------------------------------------

    async def get(self, rows: Sequence[Row], layouts: list[bytes | None] | None = None) -> list[bool]:
        """Copy stored rows into the given buffers; ``True`` only for a verified row.

        A row is served when its header names this tier's layout or one of the
        ``readable_layouts``; ``layouts``, when given, receives each hit's layout id.

        Keys not in the index are misses without I/O. The rest are read in up to
        ``read_threads`` chunks at once, in file order (``_chunks``). A corrupt row is
        deleted (on the writer thread, re-checked there) before this returns.
        """
        results = [False] * len(rows)
        wanted = [
            (i, key, byte_view(dst, writable=True)) for i, (key, dst) in enumerate(rows) if key in self._index
        ]
        misses = len(rows) - len(wanted)
        if wanted:
            loop = asyncio.get_running_loop()
            readers = self._pool(self._readers)
            chunks = self._chunks(wanted)
            chunk_reads = await asyncio.gather(
                *(loop.run_in_executor(readers, self._read_blocking, chunk) for chunk in chunks)
            )
            corrupt: list[tuple[bytes, int]] = []
            for chunk, reads in zip(chunks, chunk_reads, strict=True):
                for (i, key, _), read in zip(chunk, reads, strict=True):
                    results[i] = read.outcome is ReadOutcome.HIT
                    if layouts is not None:
                        layouts[i] = read.layout_id
                    if read.outcome is ReadOutcome.CORRUPT and read.write_id is not None:
                        corrupt.append((key, read.write_id))
            if corrupt:
                await self._on_writer(self._drop_corrupt_blocking, corrupt)
        with self._index.mutex:
            self._stats.misses += misses
        return results

    def _chunks(self, wanted: list[_Wanted]) -> list[list[_Wanted]]:
        """``wanted`` in file order, cut into up to ``read_threads`` chunks read at once.

        Each chunk holds rows that lie together in the rows file, which ``read_into``
        coalesces into large reads; several chunks in flight keep the device's queue deep.
        """
        order = [wanted[at] for at in self._store.file_order([self.namespace + key for _, key, _ in wanted])]
        step = -(-len(order) // min(self.read_threads, len(order)))
        return [order[at : at + step] for at in range(0, len(order), step)]

    def _read_blocking(self, chunk: list[_Wanted]) -> list[Read]:
        try:
            reads = self._store.read_into(
                [(self.namespace + key, dst) for _, key, dst in chunk], self.layouts
            )
        except STORE_ERRORS as exc:
            with self._index.mutex:
                self._stats.read_errors += 1
                self._stats.misses += len(chunk)
            self._warn_once("read", "disk tier at %s: a read of %d rows failed: %s", exc, len(chunk))
            return [Read(ReadOutcome.ERROR)] * len(chunk)
        with self._index.mutex:
            hits = [key for (_, key, _), r in zip(chunk, reads, strict=True) if r.outcome is ReadOutcome.HIT]
            self._index.hit(reversed(hits))  # tail first, as the policy contract asks
            self._stats.hits += len(hits)
            for read in reads:
                if read.outcome is not ReadOutcome.HIT:
                    self._stats.misses += 1
                    self._stats.mismatched += read.outcome in _MISMATCHED
                    self._stats.read_errors += read.outcome is ReadOutcome.ERROR
        for (_, key, _), read in zip(chunk, reads, strict=True):
            if read.outcome is ReadOutcome.CORRUPT:
                log.warning(
                    "disk tier at %s: corrupt row %s (checksum or header), deleting it", self.path, key.hex()
                )
        return reads

    def _drop_corrupt_blocking(self, found: list[tuple[bytes, int]]) -> None:
        try:
            deleted = self._store.delete_corrupt(
                [(self.namespace + key, write_id) for key, write_id in found]
            )
        except STORE_ERRORS as exc:
            with self._index.mutex:
                self._stats.write_errors += 1
            self._warn_once(
                "corrupt", "disk tier at %s: deleting %d corrupt rows failed: %s", exc, len(found)
            )
            return
        with self._index.mutex:
            self._index.forget([key[NAMESPACE_BYTES:] for key in deleted])
            self._stats.corrupt += len(deleted)

    # -- helpers -------------------------------------------------------------------------

    def _pool(self, pool: ThreadPoolExecutor | None) -> ThreadPoolExecutor:
        if pool is None:
            raise TierError(f"disk tier at {self.path!r} is not open")
        return pool

    async def _on_writer(self, func: Callable[..., _T], *args: Any) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool(self._writer), func, *args)

    def _warn_once(self, kind: str, message: str, exc: BaseException, count: int) -> None:
        """A failing disk fails every batch: warn on the first, then only at debug level."""
        level = logging.DEBUG if kind in self._warned else logging.WARNING
        self._warned.add(kind)
        log.log(level, message, self.path, count, exc)
