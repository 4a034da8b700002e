"""Reuse hazard: hit density learned from the whole key stream, ghosts included.

LHD (``bench.learned_policies.hit_density``) learns "how often is a block of this class and age hit?"
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

Classes (``use_classes * 6 * turn_classes * 2`` of them): how many events the key has had
(capped at ``use_classes``: a block of a conversation's old context has been read several
times, a fresh prompt's block once), the length of the run it was stored in (six buckets:
a short new message and a long pasted document come back differently), the turn of the
request that last used it (capped at ``turn_classes``: a run stored as the extension of a
key this tier knows, resident or ghost, is one turn deeper than the request that stored
that key, and the blocks a request reads take its turn; after a long chat another turn is
likelier), and whether it was the run's last block (in the production trace a prompt's
last block is partial and almost never read again). None of them is assumed to matter: a
class whose blocks do not come back learns a low density. With this many classes most
see few events, so each class's counts are shrunk toward those of its group (the classes
with its use count and last-block flag): ``shrink`` pseudo-events shaped like the group's
histogram are added to the class's own, and a class speaks for itself only once it has
seen many more events than that.

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

from bench.learned_policies.hit_density import HitDensityPolicy
from policies.base import EvictionPolicy, Key

RUN_CLASSES = 6
"""Run-length buckets: < 4, < 8, < 16, < 32, < 64, >= 64 blocks."""

_Meta = tuple[int, int, int, int]
"""Per key: events so far, run class, turn of the request that last used it (its class),
turn of the request that stored it (a run that extends it is one turn deeper)."""

BINS_PER_DOUBLING = 3
"""Age bins are logarithmic: three per doubling of the age, from ``capacity / 64`` events."""


def _finite(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


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
        samples: int = 64,
        use_classes: int = 4,
        turn_classes: int = 3,
        shrink: float = 1000.0,
        ages: int = 40,
        ghost: float = 4.0,
        decay: float = 0.9,
        period: int | None = None,
        seed: int = 0,
    ) -> None:
        for label, value in (("use_classes", use_classes), ("turn_classes", turn_classes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"hazard: {label} must be an int >= 1, got {value!r}")
        if not _finite(ghost) or not ghost > 0:
            raise ValueError(f"hazard: ghost must be a finite number > 0, got {ghost!r}")
        if not _finite(shrink) or not shrink >= 0:
            raise ValueError(f"hazard: shrink must be a finite number >= 0, got {shrink!r}")
        self._uses_cap = use_classes
        self._turn_cap = turn_classes
        self._shrink = float(shrink)
        # Per resident key: its _Meta. Per ghost: (class, last event, _Meta), oldest
        # eviction first.
        self._meta: dict[Key, _Meta] = {}
        self._ghost: OrderedDict[Key, tuple[int, int, _Meta]] = OrderedDict()
        # The run whose parent the request's reads start from, and the request's turn.
        self._pending: tuple[Key | None, int] | None = None
        self._reading: int | None = None
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
        self._classes = self._uses_cap * RUN_CLASSES * self._turn_cap * 2
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

    def density(self, key: Key) -> float:
        """The current hit density of a resident ``key`` (``_age`` inlined: eviction asks
        this of every sampled tail)."""
        b = int(math.log2(1.0 + (self._clock - self._last[key]) / self._unit) * BINS_PER_DOUBLING)
        return self._density[self._class[key]][b if b < self._ages else self._ages - 1]

    def _class_of(self, meta: _Meta, tail: bool) -> int:
        uses, run, turn, _depth = meta
        kind = run * self._turn_cap + min(turn, self._turn_cap) - 1
        return ((min(uses, self._uses_cap) - 1) * RUN_CLASSES * self._turn_cap + kind) * 2 + tail

    def _shrunk(self) -> tuple[list[list[float]], list[float]]:
        """Each class's counts plus ``shrink`` pseudo-events shaped like its group's (the
        classes with the same uses and last-block flag: ``c // 2 // kinds`` and ``c % 2``)."""
        kinds = RUN_CLASSES * self._turn_cap
        groups = self._classes // kinds
        group_of = [c // 2 // kinds * 2 + c % 2 for c in range(self._classes)]
        totals = [0.0] * groups
        pooled = [[0.0] * self._ages for _ in range(groups)]
        for c, g in enumerate(group_of):
            totals[g] += self._events[c]
            row = pooled[g]
            for b, h in enumerate(self._hits[c]):
                row[b] += h
        hits: list[list[float]] = []
        events: list[float] = []
        for c, g in enumerate(group_of):
            scale = self._shrink / totals[g] if totals[g] > 0 else 0.0
            hits.append([h + scale * p for h, p in zip(self._hits[c], pooled[g], strict=True)])
            events.append(self._events[c] + (self._shrink if totals[g] > 0 else 0.0))
        return hits, events

    def _learn(self) -> None:
        """density[c][a] = max over horizons h of returns in (a, a+h] / slot-time up to a+h,
        where a key that has not returned (dead, or not yet) holds its slot to a+h; then
        age the counters so the model follows a changing workload."""
        ages, decay, unit = self._ages, self._decay, self._unit
        edges = [unit * (2.0 ** (b / BINS_PER_DOUBLING) - 1.0) for b in range(ages + 1)]
        mids = [(edges[b] + edges[b + 1]) / 2 for b in range(ages)]
        shrunk_hits, shrunk_events = self._shrunk()
        for c, (hits, density) in enumerate(zip(shrunk_hits, self._density, strict=True)):
            dead = max(0.0, shrunk_events[c] - sum(hits))
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
        for row in self._hits:
            for b in range(ages):
                row[b] *= decay
        self._events = [e * decay for e in self._events]

    def _returned(self, key: Key) -> int:
        """Count a ghost's return at its age and forget it; the events it had before (0 if none)."""
        past = self._ghost.pop(key, None)
        if past is None:
            return 0
        cls, last, meta = past
        self._hits[cls][self._bin(self._clock - last)] += 1.0
        return meta[0]

    def _turn_of(self, key: Key | None) -> int:
        """The turn of the request that stored ``key`` (0 if this tier does not know it)."""
        meta = self._meta.get(key)
        if meta is None:
            past = self._ghost.get(key)
            return past[2][3] if past is not None else 0
        return meta[3]

    # -- the policy contract ---------------------------------------------------------------

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        if key in self._class:
            self.on_access(key)
            return
        self.on_insert_run((key,), parent)

    def on_insert_run(self, keys: Sequence[Key], parent: Key | None = None) -> None:
        if not keys:
            return
        turn = self._turn_of(parent) + 1 if parent is not None else 1
        # A request stores its new blocks, then reads (accesses) its old ones from the
        # deepest: the first read of the run's parent starts the request's reads.
        self._pending = (parent, turn)
        self._reading = None
        if any(key in self._class for key in keys):
            EvictionPolicy.on_insert_run(self, keys, parent)
            return
        run = run_class(len(keys))
        last = len(keys) - 1
        for i in range(last, -1, -1):
            key = keys[i]
            meta = (self._returned(key) + 1, run, turn, turn)
            cls = self._class_of(meta, i == last)
            self._meta[key] = meta
            self._events[cls] += 1.0
            self._link(key, keys[i - 1] if i else parent, cls)

    def on_access(self, key: Key) -> None:
        cls = self._class.get(key)
        if cls is None:
            return
        if self._pending is not None and key == self._pending[0]:
            self._reading = self._pending[1]
            self._pending = None
        self._hits[cls][self._age(key)] += 1.0
        uses, run, turn, depth = self._meta[key]
        meta = (uses + 1, run, turn if self._reading is None else self._reading, depth)
        self._meta[key] = meta
        cls = self._class_of(meta, False)
        self._class[key] = cls
        self._events[cls] += 1.0
        self._last[key] = self._clock
        self._tick()

    def _count_eviction(self, key: Key) -> None:
        """An evicted key becomes a ghost: if it comes back, that is a return at its age."""
        self._ghost[key] = (self._class[key], self._last[key], self._meta[key])
        if len(self._ghost) > self._ghost_limit:
            self._ghost.popitem(last=False)

    def _unlink(self, key: Key) -> None:
        del self._meta[key]
        super()._unlink(key)

    def clear(self) -> None:
        self._meta.clear()
        self._ghost.clear()
        self._pending = self._reading = None
        super().clear()
