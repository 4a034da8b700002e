"""Reuse hazard: hit density learned from the whole key stream, ghosts included.

LHD (``policies.hit_density``) learns "how often is a block of this class and age hit?"
from the tier's own history, so it only ever sees a block come back while the tier still
holds it: a block it evicted at age 300 that the next turn asked for at age 400 counts as
an eviction, never as a hit at 400. In chat traffic that is the case that matters: the
next turn comes after a think time (minutes in the production trace, rarely under 30 s), a
cache keeps only part of that span, and what decides the hit ratio is which chains it
holds on through it. This policy learns the *stream's* answer instead:

- every use of a key (a store or a hit) is an event of a class; the next event of the
  same key, resident or not, is a return at its age (time since the last event), counted
  for the class of the earlier event. Evicted keys are remembered in a bounded ghost
  (``ghost`` times ``capacity`` keys, FIFO) with their class and last event, so returns
  after an eviction are counted too, up to the ghost's horizon; a key that never returns
  counts as dead;
- from those counts, for each class and age, the best expected returns per slot-time over
  any horizon from that age on (LHD's "hit density", with a horizon, because a block no
  one returns to would otherwise stay forever): ``max_h P(return in (a, a+h]) /
  E[slot-time up to a+h]``; the sampled chain tail with the least goes.

Classes (learned separately, ``use_classes * 6 * 2`` of them): how many events the key has
had (capped at ``use_classes``: a block of a conversation's old context has been read
several times, a fresh prompt's block once), the length of the run it was stored in
(six buckets: a short new message and a long pasted document come back differently),
and whether it was the run's last block (in the production trace a prompt's last block is
partial and almost never read again). None of them is assumed to matter: a class whose
blocks do not come back learns a low density.

Chains leave from the tail as in LHD (this is a subclass: candidates are chain tails,
orphans first). Time is the count of events, as in LHD.

Costs: an insert or access is O(1); an eviction samples ``samples`` tails; every
``period`` events the densities are recomputed in O(classes * ages^2), a constant.
Memory: per resident key a few dict entries, ``ghost * capacity`` ghost entries, and
fixed-size statistics.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

from policies.base import EvictionPolicy, Key
from policies.hit_density import HitDensityPolicy

RUN_CLASSES = 6
"""Run-length buckets: < 4, < 8, < 16, < 32, < 64, >= 64 blocks."""

BINS_PER_DOUBLING = 3
"""Age bins are logarithmic: three per doubling of the age, from ``capacity / 64`` events."""


def run_class(length: int) -> int:
    """The bucket of a stored run's length (see ``RUN_CLASSES``)."""
    bucket = 0
    limit = 4
    while length >= limit and bucket < RUN_CLASSES - 1:
        bucket += 1
        limit *= 2
    return bucket


class ReuseHazardPolicy(HitDensityPolicy):
    """Evicts the sampled chain tail whose class and age the stream says returns least."""

    name = "hazard"

    def __init__(
        self,
        capacity: int,
        samples: int = 128,
        use_classes: int = 4,
        ages: int = 40,
        ghost: float = 4.0,
        decay: float = 0.9,
        period: int | None = None,
        seed: int = 0,
    ) -> None:
        if not isinstance(use_classes, int) or use_classes < 1:
            raise ValueError(f"hazard: use_classes must be an int >= 1, got {use_classes!r}")
        if isinstance(ghost, bool) or not isinstance(ghost, int | float) or not ghost > 0:
            raise ValueError(f"hazard: ghost must be a number > 0, got {ghost!r}")
        self._uses_cap = use_classes
        # Per resident key: (events so far, run class). Per ghost: (class, last event,
        # events so far, run class), oldest eviction first.
        self._meta: dict[Key, tuple[int, int]] = {}
        self._ghost: OrderedDict[Key, tuple[int, int, int, int]] = OrderedDict()
        super().__init__(
            capacity,
            samples=samples,
            reuse_classes=use_classes,
            ages=ages,
            decay=decay,
            period=period if period is not None else max(1024, capacity // 2),
            inherit=False,
            seed=seed,
        )
        self._unit = max(1.0, capacity / 64)
        self._ghost_limit = max(1, math.ceil(ghost * capacity))

    # -- the learned model -------------------------------------------------------------

    def _reset_statistics(self) -> None:
        self._classes = self._uses_cap * RUN_CLASSES * 2
        self._clock = 0
        self._since = 0
        self._hits = [[0.0] * self._ages for _ in range(self._classes)]
        self._events = [0.0] * self._classes
        self._evictions = []  # not used: an eviction is not an end here, a ghost is
        # Until something is learned: older is worse (LRU among the samples).
        self._density = [[-float(age) for age in range(self._ages)] for _ in range(self._classes)]

    def _bin(self, age: int) -> int:
        b = int(math.log2(1.0 + age / self._unit) * BINS_PER_DOUBLING)
        return b if b < self._ages else self._ages - 1

    def _age(self, key: Key) -> int:
        return self._bin(self._clock - self._last[key])

    def _class_of(self, uses: int, run: int, tail: bool) -> int:
        return ((min(uses, self._uses_cap) - 1) * RUN_CLASSES + run) * 2 + tail

    def _learn(self) -> None:
        """density[c][a] = max over horizons h of returns in (a, a+h] / slot-time up to a+h,
        where a key that has not returned (dead, or not yet) holds its slot to a+h; then
        age the counters so the model follows a changing workload."""
        ages, decay, unit = self._ages, self._decay, self._unit
        edges = [unit * (2.0 ** (b / BINS_PER_DOUBLING) - 1.0) for b in range(ages + 1)]
        mids = [(edges[b] + edges[b + 1]) / 2 for b in range(ages)]
        for c, (hits, density) in enumerate(zip(self._hits, self._density, strict=True)):
            dead = max(0.0, self._events[c] - sum(hits))
            alive = dead + sum(hits)
            for a in range(ages):
                best = returned = held = 0.0
                if alive > 0:
                    for b in range(a, ages):
                        returned += hits[b]
                        held += hits[b] * max(1.0, mids[b] - edges[a])
                        slot_time = held + (alive - returned) * (edges[b + 1] - edges[a])
                        if slot_time > 0 and returned > best * slot_time:
                            best = returned / slot_time
                density[a] = best
                alive -= hits[a]
                hits[a] *= decay
            self._events[c] *= decay

    def _returned(self, key: Key) -> int:
        """Count a ghost's return at its age and forget it; the events it had before (0 if none)."""
        past = self._ghost.pop(key, None)
        if past is None:
            return 0
        cls, last, uses, _run = past
        self._hits[cls][self._bin(self._clock - last)] += 1.0
        return uses

    # -- the policy contract ---------------------------------------------------------------

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        if key in self._class:
            self.on_access(key)
            return
        self.on_insert_run((key,), parent)

    def on_insert_run(self, keys: Sequence[Key], parent: Key | None = None) -> None:
        if not keys:
            return
        if any(key in self._class for key in keys):
            EvictionPolicy.on_insert_run(self, keys, parent)
            return
        run = run_class(len(keys))
        last = len(keys) - 1
        for i in range(last, -1, -1):
            key = keys[i]
            uses = self._returned(key) + 1
            cls = self._class_of(uses, run, i == last)
            self._meta[key] = (uses, run)
            self._events[cls] += 1.0
            self._link(key, keys[i - 1] if i else parent, cls)

    def on_access(self, key: Key) -> None:
        cls = self._class.get(key)
        if cls is None:
            return
        self._hits[cls][self._age(key)] += 1.0
        uses, run = self._meta[key]
        uses += 1
        self._meta[key] = (uses, run)
        cls = self._class_of(uses, run, False)
        self._class[key] = cls
        self._events[cls] += 1.0
        self._last[key] = self._clock
        self._tick()

    def _count_eviction(self, key: Key) -> None:
        """An evicted key becomes a ghost: if it comes back, that is a return at its age."""
        uses, run = self._meta[key]
        self._ghost[key] = (self._class[key], self._last[key], uses, run)
        if len(self._ghost) > self._ghost_limit:
            self._ghost.popitem(last=False)

    def _unlink(self, key: Key) -> None:
        del self._meta[key]
        super()._unlink(key)

    def clear(self) -> None:
        self._meta.clear()
        self._ghost.clear()
        super().clear()
