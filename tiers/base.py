"""The contract of a tier below the host tier (disk, remote peers, Mooncake Store).

A lower tier stores and fetches **rows of bytes by key**. It knows nothing of layers,
heads or engines: a row is the bytes of one host slot, a key is an ``OffloadKey``
(``bytes``). What it must guarantee is that a row it hands back is exactly a row that was
put under that key, in this namespace and layout, or a miss: never garbage, never another
tenant's row.

Threading: every coroutine runs on the tier engine's event loop (uvloop, in a background
thread of its own). Blocking work (an LMDB transaction, a NIXL transfer over CMA) goes to
an executor thread owned by the tier, so the loop never stalls. ``may_contain`` and
``stats`` are the only methods called from other threads (the scheduler's), and must
only read state that is safe to read there (a dict membership test is).

Call contract:

- ``open(host_buffer)`` once, before anything else. ``host_buffer`` is the whole host
  tier (a tier that moves bytes by address, like NIXL, registers it once); the rows given
  to ``put``/``get`` are slices of it. An unusable configuration (a path that cannot be
  written, a database locked by another process) raises ``TierError`` here.
- ``put(rows)`` stores ``(key, row)`` pairs; the result says per key whether the row is
  now stored (a full tier, a dead peer: ``False``, counted, never raised).
- ``get(rows, layouts=None)`` reads into the given buffers; per key ``True`` means the
  buffer now holds the verified row, ``False`` is a miss and the buffer's bytes are
  undefined (the caller never hands them to the engine). A tier serves rows whose header
  names its own layout id or one of the ``readable_layouts`` it was built with (layouts
  its owner converts from); when ``layouts`` is given it receives each hit's layout id.
- ``contains(keys)`` is the authoritative, possibly remote, check; ``may_contain(key)`` is
  a cheap local guess (exact for disk, "what this client put" for remote).
- Every call finishes within the tier's deadline (plus the slack the tier states); a
  ``get`` that cannot stop its transfer in time raises ``RowsAbandoned`` rather than wait;
  ``close()`` releases everything.
"""

from __future__ import annotations

import concurrent.futures
import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import ClassVar

Row = tuple[bytes, memoryview]
"""A key and the host-tier bytes of its row (read by ``put``, written by ``get``)."""


class TierError(RuntimeError):
    """A tier that cannot start (bad path, locked database, unreachable configuration)."""


class RowsAbandoned(TierError):
    """A call ended, but the tier may still write into (or read) the rows it did not finish:
    ``ok`` is the result per row, and the caller must never reuse the memory of a row whose
    ``ok`` is ``False`` (a remote get whose peer did not answer: its WRITE may still land; a
    Mooncake get held up by one storage host, whose store call nothing can stop). ``ended``,
    when the tier can tell, completes once that transfer has ended: the memory is the
    caller's again (the tier engine then reports ``OpKind.RELEASE``)."""

    def __init__(self, message: str, ok: list[bool], ended: concurrent.futures.Future | None = None) -> None:
        super().__init__(message)
        self.ok = ok
        self.ended = ended


@dataclass
class Stats(Mapping[str, float]):
    """Counters and levels as typed dataclass fields that also read as the mapping of field
    names to values, in declaration order (``stats["hits"]``, ``dict(stats)``): readers that
    predate the types (the metrics, ``Offloader.stats()``, the peer's STATS reply,
    benchmarks) keep working, and every writer names its field, so a typo is an error."""

    def _names(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self))

    def __getitem__(self, name: str) -> float:
        if name not in self._names():
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(fields(self))


@dataclass
class TierStats(Stats):
    """A lower tier's counters and levels (each tier subclasses it as a dataclass).

    Every tier reports at least ``REQUIRED`` (checked when a subclass is declared): ``hits``
    and ``misses`` (rows its ``get`` served / missed), ``stored`` and ``dropped`` (rows its
    ``put`` kept / did not) and ``corrupt`` (rows refused by their header or checksum); where
    it knows them, ``evictions``, ``rows`` and ``capacity_bytes``.
    """

    REQUIRED: ClassVar[tuple[str, ...]] = ("hits", "misses", "stored", "dropped", "corrupt")

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        annotations = inspect.get_annotations(cls)
        missing = [name for name in TierStats.REQUIRED if name not in annotations and not hasattr(cls, name)]
        if missing:
            raise TypeError(f"{cls.__name__} lacks the stats every tier reports: {missing}")


class LowerTier(ABC):
    kind: str = ""

    index_is_partial: bool = False
    """``may_contain`` knows only part of what the tier holds (a remote tier knows what this
    client put, not what other engines put): a miss there is worth a ``contains``."""

    @abstractmethod
    async def open(self, host_buffer: memoryview | None = None) -> None: ...

    @abstractmethod
    def may_contain(self, key: bytes) -> bool: ...

    @abstractmethod
    async def contains(self, keys: Sequence[bytes]) -> list[bool]: ...

    @abstractmethod
    async def put(self, rows: Sequence[Row]) -> list[bool]: ...

    @abstractmethod
    async def get(self, rows: Sequence[Row], layouts: list[bytes | None] | None = None) -> list[bool]: ...

    @abstractmethod
    async def delete(self, keys: Sequence[bytes]) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of the tier's counters and levels (see ``TierStats`` for the names every
        tier reports; the metrics read these names). Safe to call from another thread."""
