"""Segmented LRU: a key must be hit once after it is stored before it is protected.

A KV block stored once and never read again (most blocks of a production chat trace) only
ever sits in the probation segment, so a burst of such blocks cannot push out the blocks
that were actually reused, which plain LRU lets happen.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from policies.base import Evictable, EvictionPolicy, Key, always_evictable, take_evictable
from policies.lru import move_each_to_end_within


def segmented_hit(key: Key, probation: OrderedDict, protected: OrderedDict, protected_cap: int) -> bool:
    """A hit in a segmented LRU: a protected key becomes most recent; a probation key moves
    up to protected, whose least recent key then drops back to probation if protected is
    over its cap. ``False`` if the key is in neither segment. (W-TinyLFU's main space is
    the same structure.)"""
    if key in protected:
        protected.move_to_end(key)
    elif key in probation:
        del probation[key]
        protected[key] = None
        if len(protected) > protected_cap:
            demoted, _ = protected.popitem(last=False)
            probation[demoted] = None
    else:
        return False
    return True


class SLRUPolicy(EvictionPolicy):
    """Two LRU segments: probation (new keys) and protected (keys hit since they arrived).

    A hit in probation promotes the key to protected; when protected outgrows its share
    of the capacity its least recent key is demoted back to probation (most recent end),
    so it gets one more chance before it leaves. Eviction takes probation's least recent
    keys first, then protected's. Every operation is an ``OrderedDict`` move: O(1).
    """

    name = "slru"

    def __init__(self, capacity: int, protected_fraction: float = 0.8) -> None:
        super().__init__(capacity)
        if not 0.0 <= protected_fraction < 1.0:
            raise ValueError(f"slru: protected_fraction must be in [0, 1), got {protected_fraction!r}")
        self.protected_fraction = protected_fraction
        self._protected_cap = int(capacity * protected_fraction)
        self._probation: OrderedDict[Key, None] = OrderedDict()
        self._protected: OrderedDict[Key, None] = OrderedDict()

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        if key in self._probation or key in self._protected:
            self.on_access(key)
            return
        self._probation[key] = None

    def on_access(self, key: Key) -> None:
        segmented_hit(key, self._probation, self._protected, self._protected_cap)

    def on_renew(self, keys: Sequence[Key]) -> None:
        move_each_to_end_within(self._protected, self._probation, keys)  # a renewal is no hit: no promotion

    def on_remove(self, key: Key) -> None:
        if key in self._probation:
            del self._probation[key]
        else:
            self._protected.pop(key, None)

    def evict(self, n: int, evictable: Evictable = always_evictable) -> list[Key] | None:
        if n <= 0:
            return []
        chosen = take_evictable(self, evictable, n)  # probation's least recent first, then protected's
        if len(chosen) < n:
            return None
        for key in chosen:
            self.on_remove(key)
        return chosen

    def __contains__(self, key: object) -> bool:
        return key in self._probation or key in self._protected

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __iter__(self) -> Iterator[Key]:
        yield from self._probation
        yield from self._protected

    def clear(self) -> None:
        self._probation.clear()
        self._protected.clear()
