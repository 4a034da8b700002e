"""The rows every page passes through between SGLang's host pool and kvtier's tiers.

A tier reads and writes rows of one contiguous buffer it registers once (NIXL, Mooncake):
SGLang's pages are several regions each, anywhere in its pool, so each call gathers its
pages into staging rows (``batch_set_v1``) or reads rows here and copies into a page only
once the tier verified them (``batch_get_v1``). That is also what makes a set safe against
the pool changing after it returns (the tier has the rows' bytes by then) and a corrupt or
foreign row a miss that leaves the page as it was.

Threads: SGLang calls from its prefetch, IO and backup threads at once; each call takes
rows (at most half of them while there are two or more, so a long get never shuts a set
out), uses them and gives them back. A row a tier may still write into (an abandoned get:
``tiers.base.RowsAbandoned``) is held until that transfer has ended, or for good when the
tier cannot tell.

The rows are taken last-in first-out: the same few rows serve call after call, warm in the
caches and in memory, while the rest of the buffer is never touched (and never costs RAM) until
calls run side by side.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Iterable

import numpy as np

log = logging.getLogger(__name__)

_ALIGN = 4096


class StagingRows:
    """``rows`` rows of ``row_bytes`` each in one page-aligned buffer (``view``: what the
    tiers register at open)."""

    def __init__(self, row_bytes: int, rows: int) -> None:
        if row_bytes <= 0 or rows <= 0:
            raise ValueError(f"staging needs rows of positive size, got {rows} rows of {row_bytes} B")
        self.row_bytes = row_bytes
        self.rows = rows
        raw = np.zeros(row_bytes * rows + _ALIGN, dtype=np.uint8)
        start = -raw.ctypes.data % _ALIGN
        self._array = raw[start : start + row_bytes * rows]
        self.view = memoryview(self._array)
        self.address = int(self._array.ctypes.data)
        self._free = list(range(rows))
        self._cond = threading.Condition()
        self.held = 0  # rows a tier may still write into

    def row(self, slot: int) -> memoryview:
        return self.view[slot * self.row_bytes : (slot + 1) * self.row_bytes]

    def row_address(self, slot: int) -> int:
        return self.address + slot * self.row_bytes

    def take(self, wanted: int, timeout: float) -> list[int]:
        """Up to ``wanted`` free rows (at most half of all while there are two or more);
        waits up to ``timeout`` for one, ``[]`` if none came free."""
        share = max(1, self.rows // 2)
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout):
                return []
            n = min(wanted, share, len(self._free))
            taken, self._free = self._free[-n:], self._free[:-n]  # a stack: the rows used last
            return taken

    def give_back(self, slots: Iterable[int]) -> None:
        slots = list(slots)
        if not slots:
            return
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()

    def hold(self, slots: Iterable[int], ended: concurrent.futures.Future | None) -> None:
        """Keep ``slots`` out of use until ``ended`` completes (``None``: for good)."""
        slots = list(slots)
        if not slots:
            return
        with self._cond:
            self.held += len(slots)
        if ended is None:
            log.warning(
                "kvtier sglang backend: %d staging rows a tier may still write into are set aside", len(slots)
            )
            return

        def release(_future: concurrent.futures.Future) -> None:
            with self._cond:
                self.held -= len(slots)
            self.give_back(slots)

        ended.add_done_callback(release)
