"""S3-FIFO (Yang et al., SOSP'23): three FIFO queues and a 2-bit access counter.

Most blocks of a real KV trace are stored once and never read again. S3-FIFO sends every
new key through a small FIFO (10% of the capacity): keys not hit while they pass through it
leave early and are remembered in a ghost FIFO; keys that were hit, or that come back while
still remembered as ghosts, go to the main FIFO, where a hit buys another lap (a CLOCK with
up to three laps) instead of a reordering. All queue operations are O(1).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator

from policies.base import Evictable, EvictionPolicy, Key, always_evictable

_MAX_FREQ = 3


class S3FIFOPolicy(EvictionPolicy):
    """Small FIFO, main FIFO, ghost FIFO of keys evicted from the small one.

    - insert: into main if the key is a ghost, else into small; its counter starts at 0.
    - hit: the counter goes up, saturating at 3. Nothing moves.
    - renewal: ignored. The queues are in insertion order, which a renewal (order, not a
      use) does not change; a renewed key's counter is left alone for the same reason.
    - evict: while small holds at least ``small_fraction`` of the capacity, its oldest key
      either moves to main (counter >= ``move_threshold``) or is evicted into the ghost
      FIFO; otherwise main's oldest key is evicted if its counter is 0, else it goes back
      to main's tail with its counter decremented. A pinned key is skipped and keeps its
      place. The ghost FIFO holds at most ``capacity - small target`` keys.
    """

    name = "s3fifo"

    def __init__(self, capacity: int, small_fraction: float = 0.1, move_threshold: int = 1) -> None:
        super().__init__(capacity)
        if not 0.0 < small_fraction < 1.0:
            raise ValueError(f"s3fifo: small_fraction must be in (0, 1), got {small_fraction!r}")
        if not isinstance(move_threshold, int) or not 1 <= move_threshold <= _MAX_FREQ:
            raise ValueError(
                f"s3fifo: move_threshold must be an int in [1, {_MAX_FREQ}], got {move_threshold!r}"
            )
        self.move_threshold = move_threshold
        self._small_target = max(1, round(capacity * small_fraction))
        self._ghost_cap = max(1, capacity - self._small_target)
        self._small: OrderedDict[Key, None] = OrderedDict()
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._freq: dict[Key, int] = {}

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        if key in self._freq:
            self.on_access(key)
            return
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
        self._freq[key] = 0

    def on_access(self, key: Key) -> None:
        freq = self._freq.get(key)
        if freq is not None and freq < _MAX_FREQ:
            self._freq[key] = freq + 1

    def on_remove(self, key: Key) -> None:
        if self._freq.pop(key, None) is None:
            return
        if key in self._small:
            del self._small[key]
        else:
            del self._main[key]

    def evict(self, n: int, evictable: Evictable = always_evictable) -> list[Key] | None:
        if n <= 0:
            return []
        # Plan on a virtual copy of the queue state, then replay the plan: all-or-nothing.
        # Keys moved to main's tail during the plan (promotions, extra laps) queue in
        # `requeued` behind main's current keys, exactly where the replay will put them.
        plan: list[tuple[int, Key]] = []
        victims = 0
        small_iter = iter(self._small)
        main_iter = iter(self._main)
        requeued: deque[Key] = deque()
        laps: dict[Key, int] = {}
        small_left = len(self._small)
        freq = self._freq
        while victims < n:
            if small_left >= self._small_target or not (self._main or requeued):
                key = _next_evictable(small_iter, evictable)
                if key is not None:
                    small_left -= 1
                    if freq[key] >= self.move_threshold:
                        plan.append((_PROMOTE, key))
                        requeued.append(key)
                    else:
                        plan.append((_EVICT_SMALL, key))
                        victims += 1
                    continue
            key = _next_evictable(main_iter, evictable)
            if key is None and requeued:
                key = requeued.popleft()
            if key is None:
                key = _next_evictable(small_iter, evictable)
                if key is None:
                    return None
                small_left -= 1
                plan.append((_EVICT_SMALL, key))
                victims += 1
                continue
            left = laps.get(key, freq[key])
            if left > 0:
                laps[key] = left - 1
                plan.append((_LAP, key))
                requeued.append(key)
            else:
                plan.append((_EVICT_MAIN, key))
                victims += 1
        return self._apply(plan)

    def _apply(self, plan: list[tuple[int, Key]]) -> list[Key]:
        evicted: list[Key] = []
        for action, key in plan:
            if action == _PROMOTE:
                del self._small[key]
                self._main[key] = None
            elif action == _LAP:
                self._main.move_to_end(key)
                self._freq[key] -= 1
            else:
                if action == _EVICT_SMALL:
                    del self._small[key]
                    self._ghost[key] = None
                    if len(self._ghost) > self._ghost_cap:
                        self._ghost.popitem(last=False)
                else:
                    del self._main[key]
                del self._freq[key]
                evicted.append(key)
        return evicted

    def ghost_count(self) -> int:
        """Keys remembered after leaving the small FIFO; at most ``capacity``."""
        return len(self._ghost)

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def __len__(self) -> int:
        return len(self._freq)

    def __iter__(self) -> Iterator[Key]:
        yield from self._small
        yield from self._main

    def clear(self) -> None:
        for part in (self._small, self._main, self._ghost):
            part.clear()
        self._freq.clear()


_PROMOTE, _LAP, _EVICT_SMALL, _EVICT_MAIN = range(4)


def _next_evictable(keys: Iterator[Key], evictable: Evictable) -> Key | None:
    for key in keys:
        if evictable(key):
            return key
    return None
