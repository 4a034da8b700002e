"""W-TinyLFU (Einziger, Friedman, Manes; as in Caffeine): a small LRU window before an
SLRU main cache, with admission to the main cache decided by recent frequency.

The window lets a burst of new blocks (a long prompt being stored) live long enough to be
reused by the next turn; a block that leaves the window only displaces a main-cache block
when the frequency sketch says it was requested more often lately. A scan of one-off
blocks therefore never flushes the blocks that are reused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from policies.base import Evictable, EvictionPolicy, Key, always_evictable
from policies.sketch import FrequencySketch
from policies.slru import segmented_hit


class TinyLFUPolicy(EvictionPolicy):
    """Window LRU, main SLRU (probation + protected), frequency sketch with doorkeeper.

    - insert: the sketch records the key, which enters the window. While the main cache is
      below its share of the capacity, the window's overflow moves straight into
      probation (no eviction needed yet).
    - hit: the sketch records it; window keys move to its recent end, a probation key is
      promoted to protected (whose overflow is demoted to probation).
    - renewal: each key moves to the recent end of the segment it is in; the sketch records
      nothing and nothing is promoted (vLLM's end-of-request renewal is order, not a use).
    - evict: while the window is over its share, its least recent key (the candidate)
      contests the main cache's next victim (probation's least recent, then protected's):
      the one with the lower estimated frequency is evicted, the candidate moves to
      probation if it wins. Otherwise main-cache victims go first, window keys last.
    - memory: the sketch's counters and doorkeeper are a constant times ``capacity``.
    """

    name = "tinylfu"

    def __init__(
        self,
        capacity: int,
        window_fraction: float = 0.01,
        protected_fraction: float = 0.8,
        sample_factor: int = 10,
    ) -> None:
        super().__init__(capacity)
        if not 0.0 < window_fraction < 1.0:
            raise ValueError(f"tinylfu: window_fraction must be in (0, 1), got {window_fraction!r}")
        if not 0.0 <= protected_fraction < 1.0:
            raise ValueError(f"tinylfu: protected_fraction must be in [0, 1), got {protected_fraction!r}")
        if not isinstance(sample_factor, int) or sample_factor <= 0:
            raise ValueError(f"tinylfu: sample_factor must be a positive int, got {sample_factor!r}")
        self._window_cap = max(1, round(capacity * window_fraction))
        self._main_cap = max(0, capacity - self._window_cap)
        self._protected_cap = int(self._main_cap * protected_fraction)
        self._window: OrderedDict[Key, None] = OrderedDict()
        self._probation: OrderedDict[Key, None] = OrderedDict()
        self._protected: OrderedDict[Key, None] = OrderedDict()
        self.sketch = FrequencySketch(capacity, sample_factor=sample_factor)

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        if key in self:
            self.on_access(key)
            return
        self.sketch.record(key)
        self._window[key] = None
        while len(self._window) > self._window_cap and len(self._probation) + len(self._protected) < (
            self._main_cap
        ):
            moved, _ = self._window.popitem(last=False)
            self._probation[moved] = None

    def on_access(self, key: Key) -> None:
        self.sketch.record(key)
        if key in self._window:
            self._window.move_to_end(key)
        else:
            segmented_hit(key, self._probation, self._protected, self._protected_cap)

    def on_renew(self, keys: Sequence[Key]) -> None:
        for key in keys:
            segment = self._segment_of(key)
            if segment is not None:
                segment.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        segment = self._segment_of(key)
        if segment is not None:
            del segment[key]

    def _segment_of(self, key: Key) -> OrderedDict[Key, None] | None:
        """The window, probation or protected segment that holds ``key``, if any."""
        for segment in (self._window, self._probation, self._protected):
            if key in segment:
                return segment
        return None

    def evict(self, n: int, evictable: Evictable = always_evictable) -> list[Key] | None:
        if n <= 0:
            return []
        victims: list[Key] = []
        admitted: list[Key] = []
        window_iter = _Cursor(iter(self._window), evictable)
        main = _Cursor(_chain(iter(self._probation), iter(self._protected), admitted), evictable)
        window_left = len(self._window)
        frequency = self.sketch.frequency
        while len(victims) < n:
            if window_left > self._window_cap and (candidate := window_iter.take()) is not None:
                window_left -= 1
                victim = main.peek()
                if victim is not None and frequency(candidate) > frequency(victim):
                    victims.append(main.take())
                    admitted.append(candidate)
                else:
                    victims.append(candidate)
                continue
            key = main.take()
            if key is None:
                key = window_iter.take()
                if key is None:
                    return None
                window_left -= 1
            victims.append(key)
        for key in admitted:
            del self._window[key]
            self._probation[key] = None
        for key in victims:
            self.on_remove(key)
        return victims

    def __contains__(self, key: object) -> bool:
        return key in self._window or key in self._probation or key in self._protected

    def __len__(self) -> int:
        return len(self._window) + len(self._probation) + len(self._protected)

    def __iter__(self) -> Iterator[Key]:
        yield from self._probation
        yield from self._protected
        yield from self._window

    def clear(self) -> None:
        for segment in (self._window, self._probation, self._protected):
            segment.clear()
        self.sketch.clear()


def _chain(*parts: Iterator[Key] | list[Key]) -> Iterator[Key]:
    """Iterate the parts in turn; a list is read by index so items appended later are seen."""
    for part in parts:
        if isinstance(part, list):
            i = 0
            while i < len(part):
                yield part[i]
                i += 1
        else:
            yield from part


class _Cursor:
    """The next evictable key of an iterator, with one key of look-ahead."""

    __slots__ = ("_evictable", "_iter", "_peeked")

    def __init__(self, keys: Iterator[Key], evictable: Evictable) -> None:
        self._iter = keys
        self._evictable = evictable
        self._peeked: Key | None = None

    def peek(self) -> Key | None:
        if self._peeked is None:
            for key in self._iter:
                if self._evictable(key):
                    self._peeked = key
                    break
        return self._peeked

    def take(self) -> Key | None:
        key = self.peek()
        self._peeked = None
        return key
