"""Least recently used: the baseline every other policy is measured against."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence

from policies.base import Evictable, EvictionPolicy, Key, always_evictable, take_evictable


def move_each_to_end(order: OrderedDict, keys: Sequence[Key]) -> None:
    """``order.move_to_end`` of each key of ``keys`` that ``order`` holds, in order: in C
    when every key is there (a renewed prefix, the usual call)."""
    try:
        deque(map(order.move_to_end, keys), 0)
    except KeyError:  # one was not: again, key by key (moving a key twice leaves one order)
        for key in keys:
            if key in order:
                order.move_to_end(key)


def move_each_to_end_within(frequent: OrderedDict, once: OrderedDict, keys: Sequence[Key]) -> None:
    """``move_to_end`` of each key of ``keys``, in order, within whichever of two lists holds
    it (a renewal of ARC's T2 / T1 or SLRU's segments: not a hit, so no key changes list).
    In C when ``frequent`` holds every key (a renewed prefix, the usual call)."""
    if all(map(frequent.__contains__, keys)):
        deque(map(frequent.move_to_end, keys), 0)
        return
    for key in keys:
        if key in frequent:
            frequent.move_to_end(key)
        elif key in once:
            once.move_to_end(key)


class LRUPolicy(EvictionPolicy):
    """Evicts the key whose last insert or hit is oldest.

    An ``OrderedDict`` keeps recency (oldest first); ``move_to_end`` and deletion are O(1).
    Eviction walks from the oldest key and skips keys the owner will not give up (pinned or
    in flight), which are usually few and recent.
    """

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_insert_run(self, keys: Sequence[Key], parent: Key | None = None) -> None:
        order = self._order
        for i in range(len(keys) - 1, -1, -1):  # tail first, as the base class does
            key = keys[i]
            if key in order:
                order.move_to_end(key)
            else:
                order[key] = None

    def on_access(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_renew(self, keys: Sequence[Key]) -> None:
        move_each_to_end(self._order, keys)

    def on_remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, evictable: Evictable = always_evictable) -> list[Key] | None:
        if n <= 0:
            return []
        chosen = take_evictable(self._order, evictable, n)
        if len(chosen) < n:
            return None
        for key in chosen:
            del self._order[key]
        return chosen

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[Key]:
        return iter(self._order)

    def clear(self) -> None:
        self._order.clear()
