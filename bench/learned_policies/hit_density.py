"""Least hit density (after Beckmann, Chen, Cidon: LHD, NSDI'18), for prefix chains.

Recency (LRU, ARC) is a proxy for "will this block be hit soon?". LHD learns the answer
from the tier's own history instead: for each class of block and each age (time since its
last use), how often blocks were hit, and how long they sat before a hit or an eviction.
A block's *hit density* is its expected hits per slot-time from its current age on; the
block with the lowest goes. That adapts to whatever the workload's reuse looks like: agent
steps that come back after a few seconds (evict what was just used, as OPT does on a
loop), chats whose next turn comes minutes later, blocks nobody asks for again.

Prefix chains are built in, not wrapped on: candidates are only chain *tails* (resident
blocks no resident block follows), sampled at random, so a chain always shrinks from its
deep end and no sample is wasted on a block that cannot go. A block whose predecessor
left the tier (the owner removed it) is an orphan and goes before any sampling.

Classes, learned separately (at most ``2 * reuse_classes``):

- reuse: hits since the block was stored, capped (``reuse_classes - 1``); a run that
  extends a resident chain's tail starts with its predecessor's count (``inherit``): the
  next turn of a long conversation is likely to be wanted again, a new branch is not;
- run tail (``tail_class``): the deepest block of a stored run, until it is hit. Whether
  such blocks are reused is learned, not assumed (in the production trace the last block
  of a prompt is partial and almost never is).

Costs: an access or insert is O(1); an eviction samples ``samples`` tails (O(1)); every
``period`` events the densities are recomputed in O(classes * ages), a constant. Memory:
per resident block a few dict entries; the statistics are fixed-size arrays.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterator, Sequence
from itertools import islice

from policies.base import Evictable, EvictionPolicy, Key, always_evictable
from policies.prefix_forest import PrefixForest, orphans_first


class HitDensityPolicy(EvictionPolicy):
    """Evicts the sampled chain tail with the least expected hits per slot-time."""

    name = "lhd"

    def __init__(
        self,
        capacity: int,
        samples: int = 8,
        reuse_classes: int = 4,
        ages: int = 256,
        age_width: int | None = None,
        decay: float = 0.9,
        period: int | None = None,
        inherit: bool = True,
        tail_class: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(capacity)
        counts = (("samples", samples, 1), ("reuse_classes", reuse_classes, 1), ("ages", ages, 2))
        for label, value, low in counts:
            if not isinstance(value, int) or value < low:
                raise ValueError(f"lhd: {label} must be an int >= {low}, got {value!r}")
        if age_width is not None and (not isinstance(age_width, int) or age_width < 1):
            raise ValueError(f"lhd: age_width must be an int >= 1, got {age_width!r}")
        if period is not None and (not isinstance(period, int) or period < 1):
            raise ValueError(f"lhd: period must be an int >= 1, got {period!r}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"lhd: decay must be in [0, 1), got {decay!r}")
        self.samples = samples
        self._reuse = reuse_classes
        self._tail_offset = reuse_classes if tail_class else 0
        self._classes = 2 * reuse_classes if tail_class else reuse_classes
        self._ages = ages
        self._width = age_width or max(1, capacity // 16)
        self._decay = decay
        self._period = period or max(1024, capacity)
        self._inherit = inherit
        self._rng = random.Random(seed)
        self._seed = seed
        # Per resident key: class, time of last use, predecessor.
        self._class: dict[Key, int] = {}
        self._last: dict[Key, int] = {}
        # Chains: tails are the eviction candidates.
        self._forest = PrefixForest(track_tails=True)
        self._tails: list[Key] = self._forest.tails  # type: ignore[assignment]
        self._reset_statistics()

    def _reset_statistics(self) -> None:
        self._clock = 0
        self._since = 0
        self._hits = [[0.0] * self._ages for _ in range(self._classes)]
        self._evictions = [[0.0] * self._ages for _ in range(self._classes)]
        # Until something is learned: older is worse (LRU among the samples).
        self._density = [[-float(age) for age in range(self._ages)] for _ in range(self._classes)]

    # -- the learned model -------------------------------------------------------------

    def _age(self, key: Key) -> int:
        age = (self._clock - self._last[key]) // self._width
        return age if age < self._ages else self._ages - 1

    def _tick(self) -> None:
        self._clock += 1
        self._since += 1
        if self._since >= self._period:
            self._since = 0
            self._learn()

    def _learn(self) -> None:
        """density[a] = hits after age a / slot-time spent after age a (suffix sums), then
        age the counters so the model follows a changing workload."""
        decay = self._decay
        for hits, evictions, density in zip(self._hits, self._evictions, self._density, strict=True):
            hits_after = events_after = slot_time = 0.0
            for age in range(self._ages - 1, -1, -1):
                hits_after += hits[age]
                events_after += hits[age] + evictions[age]
                slot_time += events_after
                density[age] = hits_after / slot_time if slot_time else 0.0
                hits[age] *= decay
                evictions[age] *= decay

    def density(self, key: Key) -> float:
        """The current hit density of a resident ``key`` (for tests and inspection)."""
        return self._density[self._class[key]][self._age(key)]

    # -- chain bookkeeping ---------------------------------------------------------------

    def _link(self, key: Key, parent: Key | None, cls: int) -> None:
        self._class[key] = cls
        self._last[key] = self._clock
        self._forest.link(key, parent)
        self._tick()

    def _unlink(self, key: Key) -> None:
        del self._class[key]
        del self._last[key]
        self._forest.unlink(key)

    # -- the policy contract ---------------------------------------------------------------

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        if key in self._class:
            self.on_access(key)
            return
        self._link(key, parent, 0)

    def on_insert_run(self, keys: Sequence[Key], parent: Key | None = None) -> None:
        if not keys:
            return
        if any(key in self._class for key in keys):
            EvictionPolicy.on_insert_run(self, keys, parent)
            return
        reuse = 0
        extends = parent is not None and parent in self._class and parent not in self._forest.children
        if self._inherit and extends:
            reuse = self._class[parent] % self._reuse
        last = len(keys) - 1
        for i in range(last, -1, -1):
            self._link(keys[i], keys[i - 1] if i else parent, reuse + (self._tail_offset if i == last else 0))

    def on_access(self, key: Key) -> None:
        cls = self._class.get(key)
        if cls is None:
            return
        self._hits[cls][self._age(key)] += 1.0
        self._class[key] = min(cls % self._reuse + 1, self._reuse - 1)
        self._last[key] = self._clock
        self._tick()

    def on_remove(self, key: Key) -> None:
        if key in self._class:
            self._unlink(key)

    def evict(self, n: int, evictable: Evictable = always_evictable) -> list[Key] | None:
        if n <= 0:
            return []
        # All-or-nothing: check that n keys can go before taking any (O(n + pinned)).
        if sum(1 for _ in islice(filter(evictable, self._class), n)) < n:
            return None
        victims: list[Key] = []
        # Samples not taken stay candidates for the next victim of the same call (ages do
        # not change within a call), so a batch needs far fewer fresh samples per victim.
        pool = _Pool()
        fresh = self.samples
        while len(victims) < n:
            key = self._next_victim(evictable, pool, fresh)
            fresh = max(2, self.samples // 4)
            self._count_eviction(key)
            parent = self._forest.parent[key]
            self._unlink(key)
            victims.append(key)
            # Its predecessor may now be a tail: the next candidate of the same chain.
            if parent is not None and self._forest.is_tail(parent) and evictable(parent):
                pool.add(self.density(parent), parent)
        return victims

    def _count_eviction(self, key: Key) -> None:
        """Learn from a victim, just before it is unlinked: an eviction at its age."""
        self._evictions[self._class[key]][self._age(key)] += 1.0

    def _next_victim(self, evictable: Evictable, pool: _Pool, fresh: int) -> Key:
        for key in self._forest.orphans:
            if evictable(key):
                return key
        tails = self._tails
        if tails:
            rand, count, density = self._rng.random, len(tails), self.density
            for _ in range(fresh):
                key = tails[int(rand() * count)]
                if key not in pool.keys and evictable(key):
                    pool.add(density(key), key)
            pool.trim(4 * self.samples, self.samples)
        key = pool.pop()
        if key is not None:
            return key
        # Every sampled tail is pinned: any evictable tail, else any evictable key (its
        # children become orphans and go next).
        for key in tails:
            if evictable(key):
                return key
        return next(key for key in self._class if evictable(key))

    def __contains__(self, key: object) -> bool:
        return key in self._class

    def __len__(self) -> int:
        return len(self._class)

    def __iter__(self) -> Iterator[Key]:
        return orphans_first(self._forest.orphans, self._class)

    def clear(self) -> None:
        self._class.clear()
        self._last.clear()
        self._forest.clear()
        self._rng = random.Random(self._seed)
        self._reset_statistics()


class _Pool:
    """Eviction candidates of one ``evict`` call: a min-heap on density."""

    __slots__ = ("_heap", "_order", "keys")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Key]] = []
        self._order = 0  # ties go to the earlier sample; keys themselves are never compared
        self.keys: set[Key] = set()

    def add(self, density: float, key: Key) -> None:
        if key not in self.keys:
            self.keys.add(key)
            self._order += 1
            heapq.heappush(self._heap, (density, self._order, key))

    def trim(self, high: int, keep: int) -> None:
        if len(self._heap) > high:
            self._heap = heapq.nsmallest(keep, self._heap)
            self.keys = {key for _, _, key in self._heap}

    def pop(self) -> Key | None:
        if not self._heap:
            return None
        key = heapq.heappop(self._heap)[2]
        self.keys.discard(key)
        return key
