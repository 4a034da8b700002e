"""ARC (Megiddo and Modha, FAST'03), driven by the owner instead of by a request stream.

ARC balances recency against frequency by remembering recently evicted keys (ghosts): a
miss on a key evicted from the recency list says that list was too small, a miss on one
evicted from the frequency list says the opposite. Here a "miss" is what the owner reports
as ``on_insert`` (the block was recomputed and stored again), which is the only moment a
tier learns that one of its past victims was wanted.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from policies.base import Evictable, EvictionPolicy, Key, always_evictable, take_evictable
from policies.lru import move_each_to_end_within


class ARCPolicy(EvictionPolicy):
    """T1 (seen once), T2 (seen again), their ghosts B1 and B2, and the T1 target ``p``.

    - insert: a key in B1 raises ``p`` (recency wanted more room) and enters T2, a key in
      B2 lowers ``p`` and enters T2, any other key enters T1.
    - hit: T1 -> T2, or to T2's most recent end.
    - evict: from T1 while ``|T1| > p`` (else T2), falling back to the other list when the
      chosen one has nothing evictable; victims become ghosts.
    - ghosts: after each eviction ``|T1| + |B1| <= capacity`` and all four lists together
      ``<= 2 * capacity``, the bounds of the original algorithm (only an eviction adds
      ghosts, so that is where they are trimmed): ghost memory is at most ``2 * capacity``.
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0.0
        self._t1: OrderedDict[Key, None] = OrderedDict()
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        if key in self._b1:
            self.p = min(float(self.capacity), self.p + max(1.0, len(self._b2) / len(self._b1)))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self.p = max(0.0, self.p - max(1.0, len(self._b1) / len(self._b2)))
            del self._b2[key]
            self._t2[key] = None
        elif key in self._t1 or key in self._t2:
            self.on_access(key)
        else:
            self._t1[key] = None

    def on_access(self, key: Key) -> None:
        if key in self._t2:
            self._t2.move_to_end(key)
        elif key in self._t1:
            del self._t1[key]
            self._t2[key] = None

    def on_renew(self, keys: Sequence[Key]) -> None:
        move_each_to_end_within(self._t2, self._t1, keys)  # a renewal is no hit: T1 -> T2 is not for it

    def on_remove(self, key: Key) -> None:
        if key in self._t1:
            del self._t1[key]
        else:
            self._t2.pop(key, None)

    def on_insert_run(self, keys: Sequence[Key], parent: Key | None = None) -> None:
        # ``on_insert`` for each key, tail first, in one loop: stores are most of a tier's
        # calls, and a run of new keys (the usual case) only appends to T1.
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        for i in range(len(keys) - 1, -1, -1):
            key = keys[i]
            if key in t1 or key in t2 or key in b1 or key in b2:
                self.on_insert(key)
            else:
                t1[key] = None

    def evict(self, n: int, evictable: Evictable = always_evictable) -> list[Key] | None:
        if n <= 0:
            return []
        # Victim by victim, ARC takes T1's least recent key while |T1| > p, else T2's, and
        # falls back to the other list when the chosen one has nothing evictable. Taking
        # from T2 leaves |T1| as it is, so that is three walks: T1 while |T1| > p, then
        # T2, then the rest of T1. All victims are chosen before anything changes
        # (all-or-nothing), and each list is walked once: O(n + skipped pinned keys).
        t1, t2 = self._t1, self._t2
        t1_iter = iter(t1)
        first = take_evictable(t1_iter, evictable, min(n, max(0, self._t1_victims_first())))
        from_t2 = take_evictable(t2, evictable, n - len(first))
        last = take_evictable(t1_iter, evictable, n - len(first) - len(from_t2))
        if len(first) + len(from_t2) + len(last) < n:
            return None
        b1, b2 = self._b1, self._b2
        for part in (first, last):
            for key in part:
                del t1[key]
                b1[key] = None
        for key in from_t2:
            del t2[key]
            b2[key] = None
        self._trim_ghosts()
        return first + from_t2 + last

    def _t1_victims_first(self) -> int:
        """How many victims T1 gives before T2 is asked: |T1| - k <= p after k keys from T1,
        so ceil(|T1| - p) at most."""
        return math.ceil(len(self._t1) - self.p)

    def _trim_ghosts(self) -> None:
        b1, b2 = self._b1, self._b2
        resident_t1 = len(self._t1)
        for _ in range(min(len(b1), resident_t1 + len(b1) - self.capacity)):
            b1.popitem(last=False)
        resident = resident_t1 + len(self._t2)
        for _ in range(min(len(b2), resident + len(b1) + len(b2) - 2 * self.capacity)):
            b2.popitem(last=False)
        for _ in range(min(len(b1), resident + len(b1) + len(b2) - 2 * self.capacity)):
            b1.popitem(last=False)

    def ghost_count(self) -> int:
        """Keys remembered after eviction (B1 and B2); bounded by ``2 * capacity``."""
        return len(self._b1) + len(self._b2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __iter__(self) -> Iterator[Key]:
        yield from self._t1
        yield from self._t2

    def clear(self) -> None:
        for part in (self._t1, self._t2, self._b1, self._b2):
            part.clear()
        self.p = 0.0


class VLLMARCPolicy(ARCPolicy):
    """ARC as vLLM 0.33's ``arc`` runs it, which differs from the paper in four places.

    - a key that comes back from a ghost list re-enters T1 (the paper: T2): only a hit
      makes a key frequent;
    - T1 gives the victim while ``|T1| >= int(p)`` (the paper: ``|T1| > p``);
    - each ghost list is bounded by ``capacity`` on its own (the paper bounds T1 + B1 by
      ``capacity`` and all four lists by ``2 * capacity``);
    - ``p`` moves for a store's ghost keys before the store evicts (``on_miss``, which the
      host tier calls as vLLM's manager calls its policy's ``on_store_miss``); an owner that
      does not call it gets the move at ``on_insert``, after its eviction.

    On some long-document QA traces (the wide variant, another seed) it is ahead of both
    the paper's ARC and LRU (docs/policies.md). Driven as vLLM drives a manager it holds
    what vLLM's ``arc`` holds after every request (``tests/policies/test_arc_vllm.py``):
    the benchmark's stand-in for vLLM's own, and a policy of its own.
    """

    name = "arc-vllm"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._told: set[Key] = set()  # ghosts whose miss ``on_miss`` has counted

    def _adapt(self, key: Key) -> None:
        """Move ``p`` toward the list ``key``'s ghost came from (vLLM's ghost-hit rule)."""
        self.p = ghost_target(self.p, key, self._b1, self._b2, self.capacity)

    def on_miss(self, keys: Sequence[Key]) -> None:
        if self._told:
            self._told = set()  # one store's ghosts: a store that was refused counts again
        self.p = count_store_ghosts(keys, self._b1, self._b2, self._told, self.p, self.capacity)

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        if key in self._t1 or key in self._t2:
            self.on_access(key)
            return
        if key in self._told:
            self._told.discard(key)
        else:
            self._adapt(key)
        self._t1[key] = None
        self._b1.pop(key, None)
        self._b2.pop(key, None)

    def on_insert_run(self, keys: Sequence[Key], parent: Key | None = None) -> None:
        # vLLM moves ``p`` for every ghost key of a store before any leaves its ghost
        # list, then inserts; tail first, as everywhere.
        t1, t2, b1, b2, told = self._t1, self._t2, self._b1, self._b2, self._told
        ghosts = [key for key in reversed(keys) if key in b1 or key in b2] if (b1 or b2) else []
        for key in ghosts:
            if key in told:
                told.discard(key)
            else:
                self._adapt(key)
        for i in range(len(keys) - 1, -1, -1):
            key = keys[i]
            if key in t1 or key in t2:
                self.on_access(key)
            else:
                t1[key] = None
        for key in ghosts:
            b1.pop(key, None)
            b2.pop(key, None)

    def _t1_victims_first(self) -> int:
        """vLLM's test: T1 gives victims while |T1| - k >= int(p), that is |T1| - int(p) + 1
        of them at most."""
        return len(self._t1) - int(self.p) + 1

    def _trim_ghosts(self) -> None:
        capacity = self.capacity
        for ghost in (self._b1, self._b2):
            for _ in range(len(ghost) - capacity):
                self._told.discard(ghost.popitem(last=False)[0])

    def clear(self) -> None:
        super().clear()
        self._told.clear()


def ghost_target(p: float, key: Key, b1: OrderedDict, b2: OrderedDict, capacity: int) -> float:
    """ARC's target ``p`` moved toward the ghost list ``key`` is in (as it is if in neither)."""
    if key in b1:
        return min(p + max(1.0, len(b2) / len(b1)), float(capacity))
    if key in b2:
        return max(p - max(1.0, len(b1) / len(b2)), 0.0)
    return p


def count_store_ghosts(
    keys: Sequence[Key], b1: OrderedDict, b2: OrderedDict, told: set[Key], p: float, capacity: int
) -> float:
    """vLLM's ``on_store_miss``: each of a store's keys found in a ghost list, tail first and
    once until the store is over (``told``, which it fills), moves ``p`` toward its list and
    becomes that list's most recent ghost; the target after them all."""
    if (not b1 or b1.keys().isdisjoint(keys)) and (not b2 or b2.keys().isdisjoint(keys)):
        return p
    for i in range(len(keys) - 1, -1, -1):
        key = keys[i]
        if key in told:
            continue
        ghost = b1 if key in b1 else b2 if key in b2 else None
        if ghost is not None:
            p = ghost_target(p, key, b1, b2, capacity)
            ghost.move_to_end(key)
            told.add(key)
    return p
