"""W-TinyLFU whose window size climbs to where the hit ratio is best (Caffeine's adaptive policy).

W-TinyLFU's fixed 1% window suits workloads where frequency predicts reuse; on prefix
caches, where most blocks are seen once and a conversation's next turn comes minutes
later, a new chain must survive in the window until then, and a 1% window drops it. No
single size fits both (Einziger et al., "Adaptive Software Cache Management",
Middleware'18), so the window is sized by hill climbing on the tier's own hit ratio, as
Caffeine does: every sample of ``sample`` events (a hit is ``on_access``, a miss is the
``on_insert`` of a new key), move the window by a step in the direction that last paid
off, reverse when the hit ratio fell, shrink the step as it settles, and start over with
a full step when the hit ratio jumps (the workload changed).
"""

from __future__ import annotations

from policies.base import Evictable, Key, always_evictable
from policies.tinylfu import TinyLFUPolicy


class HillClimber:
    """Caffeine's window climber: ``record`` each hit or miss; it returns the window change
    (in rows, may be negative) at the end of every sample, else 0.

    - step: starts at ``step_fraction * capacity``, toward a larger window.
    - after each sample: keep the step's direction if the hit ratio did not fall, else
      reverse it; a change of ``restart`` or more in hit ratio restarts at a full step,
      otherwise the step decays by ``decay``.
    - ``blocked()``: the window could not move that way (it is at its smallest or largest),
      so the next step goes the other way; otherwise a flat hit ratio (nothing hits at
      either size) would keep it pressed against the bound for good.
    """

    def __init__(
        self,
        capacity: int,
        sample: int,
        step_fraction: float = 0.0625,
        decay: float = 0.98,
        restart: float = 0.05,
    ) -> None:
        if not isinstance(sample, int) or sample < 1:
            raise ValueError(f"hill climber: sample must be an int >= 1, got {sample!r}")
        if not 0.0 < step_fraction <= 1.0:
            raise ValueError(f"hill climber: step_fraction must be in (0, 1], got {step_fraction!r}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"hill climber: decay must be in (0, 1], got {decay!r}")
        self.sample = sample
        self.full_step = step_fraction * capacity
        self.decay = decay
        self.restart = restart
        self.step = self.full_step
        self.previous = 0.0
        self._hits = 0
        self._events = 0

    def record(self, hit: bool) -> int:
        self._hits += hit
        self._events += 1
        if self._events < self.sample:
            return 0
        rate = self._hits / self._events
        self._hits = self._events = 0
        change = rate - self.previous
        self.previous = rate
        amount = self.step if change >= 0 else -self.step
        sign = 1.0 if amount >= 0 else -1.0
        self.step = sign * self.full_step if abs(change) >= self.restart else self.decay * amount
        return round(amount)

    def blocked(self) -> None:
        """The last change could not be applied: turn the next step around."""
        self.step = -self.step


class AdaptiveTinyLFUPolicy(TinyLFUPolicy):
    """``TinyLFUPolicy`` with its window resized by a ``HillClimber`` (window in ``[1, capacity - 1]``).

    A shrunk window hands its least recent keys to probation at once (they were admitted
    under the larger window, so they skip the frequency contest); a grown window takes its
    room from the main cache as the main cache's keys are evicted. Either way one resize
    costs at most one step of moves, once per sample: O(1) amortised. Climbing starts
    at the first eviction: before the tier is full every size has the same hit ratio.
    """

    name = "tinylfu-adaptive"

    def __init__(
        self,
        capacity: int,
        window_fraction: float = 0.01,
        protected_fraction: float = 0.8,
        sample_factor: int = 10,
        climb_sample: float = 1.0,
        step_fraction: float = 0.0625,
    ) -> None:
        super().__init__(capacity, window_fraction, protected_fraction, sample_factor)
        if not isinstance(climb_sample, int | float) or climb_sample <= 0:
            raise ValueError(
                f"tinylfu-adaptive: climb_sample must be > 0 (a multiple of capacity), got {climb_sample!r}"
            )
        self._protected_fraction = protected_fraction
        self.climber = HillClimber(capacity, max(1, round(climb_sample * capacity)), step_fraction)
        self._full = False  # set at the first eviction

    @property
    def window_size(self) -> int:
        """The window's current share of the capacity, in rows."""
        return self._window_cap

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        if key not in self:  # a resident key is a hit, counted by on_access
            self._observe(False)
        super().on_insert(key, parent)

    def on_access(self, key: Key) -> None:
        self._observe(True)
        super().on_access(key)

    def evict(self, n: int, evictable: Evictable = always_evictable) -> list[Key] | None:
        if n > 0:  # asked for nothing, the tier may not be full: one evict(0) must not start the climb
            self._full = True
        return super().evict(n, evictable)

    def _observe(self, hit: bool) -> None:
        if not self._full:
            return
        change = self.climber.record(hit)
        if change:
            before = self._window_cap
            self._resize(before + change)
            if self._window_cap == before:
                self.climber.blocked()

    def _resize(self, window: int) -> None:
        self._window_cap = min(max(1, window), self.capacity - 1) if self.capacity > 1 else 1
        self._main_cap = self.capacity - self._window_cap
        self._protected_cap = int(self._main_cap * self._protected_fraction)
        window_keys, probation = self._window, self._probation
        while len(window_keys) > self._window_cap:
            moved, _ = window_keys.popitem(last=False)
            probation[moved] = None
