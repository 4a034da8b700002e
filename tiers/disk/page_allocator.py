"""Free pages of the disk tier's rows file: which runs of pages a new row may take.

Pure bookkeeping (no I/O), owned by the tier's writer thread. The file is a sequence of
4 KiB pages; a row takes a whole number of them, as one run when a free run is long enough
(the usual case: rows of one size replace rows of the same size), else as several runs, so
that a row fits whenever enough pages are free and fragmentation never drops a store.

``limit`` bounds the file: pages below ``end`` have been written at least once (used or
free); pages from ``end`` up to ``limit`` are taken by growing the file. Allocation prefers,
in order: the lowest free run long enough, a free run at the end of the file plus growth,
growth alone, and last the lowest free runs together.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

Run = tuple[int, int]
"""``(first page, page count)``."""


class PageAllocator:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.end = 0
        self.free_pages = 0  # below ``end``
        self._free: list[Run] = []  # sorted by first page, never adjacent (merged)

    def load(self, used: Iterable[Run], end: int) -> None:
        """Start from a file of ``end`` pages whose ``used`` runs hold rows (non-overlapping)."""
        self.end = max(end, max((start + count for start, count in used), default=0))
        self._free = []
        at = 0
        for start, count in sorted(used):
            if start > at:
                self._free.append((at, start - at))
            at = max(at, start + count)
        if self.end > at:
            self._free.append((at, self.end - at))
        self.free_pages = sum(count for _, count in self._free)

    def available(self) -> int:
        """Pages an ``allocate`` may hand out now."""
        return self.free_pages + max(0, self.limit - self.end)

    def allocate(self, pages: int) -> list[Run] | None:
        """Runs totalling ``pages`` pages, or ``None`` (nothing taken) if there is no room."""
        if pages <= 0:
            return []
        if pages > self.available():
            return None
        for i, (start, count) in enumerate(self._free):
            if count >= pages:
                self._take(i, pages)
                return [(start, pages)]
        if self._free and sum(self._free[-1]) == self.end:  # the last free run reaches the end
            start, count = self._free[-1]
            if count + self.limit - self.end >= pages:
                self._take(len(self._free) - 1, count)
                self.end += pages - count
                return [(start, pages)]
        if self.limit - self.end >= pages:
            self.end += pages
            return [(self.end - pages, pages)]
        runs: list[Run] = []
        while pages and self._free:
            start, count = self._free[0]
            take = min(count, pages)
            self._take(0, take)
            runs.append((start, take))
            pages -= take
        if pages:
            runs.append((self.end, pages))
            self.end += pages
        return runs

    def release(self, runs: Iterable[Run]) -> None:
        """Pages no row uses any more (and no reader is reading)."""
        for start, count in runs:
            if count <= 0:
                continue
            self.free_pages += count
            i = bisect.bisect_left(self._free, (start, 0))
            if i > 0 and sum(self._free[i - 1]) == start:  # merge with the run before
                i -= 1
                start, count = self._free[i][0], self._free[i][1] + count
                del self._free[i]
            if i < len(self._free) and start + count == self._free[i][0]:  # and the one after
                count += self._free[i][1]
                del self._free[i]
            self._free.insert(i, (start, count))

    def _take(self, i: int, pages: int) -> None:
        start, count = self._free[i]
        if pages == count:
            del self._free[i]
        else:
            self._free[i] = (start + pages, count - pages)
        self.free_pages -= pages
