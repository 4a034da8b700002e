"""LRU or ARC, whichever is winning: the live expert's own lists, sampled shadows.

No single simple policy wins everywhere (``kvtier bench policy``): on chat traces whose old
turns never come back plain LRU beats ARC by up to 16%; on agentic and production traces at
small hosts, and wherever one-off scans pass through, ARC beats LRU by a quarter to a half.
This policy evicts as whichever of the two is doing better now.

Only the expert that evicts keeps lists (``AdaptivePolicy``), so a call costs about what
that expert costs alone; a switch rebuilds the other's lists. (Two earlier designs kept
every expert's order over one set of lists, one of them with vLLM's ARC variant as a third
expert: that bookkeeping was most of their time per call, and the third expert left the
worst case where it was: the referee could not tell it from the paper's ARC where it leads.)

The referee is two shadow caches (LRU and ARC) of ``capacity / 2 ** sample_bits`` rows that
see only the keys that fall in the sample (one in ``2 ** sample_bits``, by a byte of the
key's hash), the spatial sampling of SHARDS (Waldspurger et al., FAST'15): a sampled cache
of a scaled-down size has the hit ratio of the full one, within noise. Each request
(``on_insert``: missed; ``on_access``: hit) is replayed in both shadows, their hits decay
with a horizon of ``horizon`` times the shadow's size in sampled requests, and the policy
changes expert only when the other's lead is beyond the sampling noise (``SWITCH_Z``) and
a ``confirm`` times longer memory of the same hits agrees (``CONFIRM_Z``): following the
leader on noise, or on a lead that lasts a few capacities, made it switch often where the
two experts are close, and each switch costs the order the cache had built (the regret
argument of LeCaR and CACHEUS holds only when the experts' states do not depend on who
evicts). ARC taking over starts from its shadow's target, scaled.

``adaptive-ghosts`` (``SizedGhostsAdaptivePolicy``) sizes ARC's ghosts the same way: three
more shadows each run this policy's own ARC (``_ShadowLiveARC``) with ghost generations of
one of ``SIZED_GHOSTS`` capacities, on the same sampled requests, and the live ghosts take
the size of whichever leads the current one by ``SWITCH_Z`` (``_GhostReferee``). How long
an evicted key is remembered decides which returns count as frequent and move ARC's target,
and the best size differs by workload: a quarter of a capacity on agentic traces, two on
the production trace and on scans.

The shadows run compiled (``policies/_shadows.c``, built at install) where a C compiler was
found, else in Python (``_shadow_types``): the same decisions, ``tests/policies/test_shadows.py``.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from itertools import count, repeat

from policies.arc import ARCPolicy
from policies.base import Evictable, EvictionPolicy, Key, always_evictable, take_evictable
from policies.lru import LRUPolicy, move_each_to_end

logger = logging.getLogger(__name__)

SAMPLE_BITS = 5
"""One key in ``2 ** SAMPLE_BITS`` (by its hash) is replayed in the shadows, chosen on the
scheduler table's five traces: one in 32 was as good as one in 16 there, at half the
referee's cost. Measured again with the long memory (``CONFIRM``), on the table and the
held-out traces: one in 16 ends under vLLM's better policy in three table cells, by 1.8%
at worst, against two by 2.9%, for 3% of calls/s; one in 8 and every key (full-size
shadows) in four and five, so no rate gives zero regret (docs/policies.md). Shadows of a
fixed 256 to 512 rows, sampling large tiers more coarsely, moved no table cell but up, and
lost 5-12% held out, on scan-mix-heavy at 10 and 20%: a scan-heavy tier is large, and its
shadows then saw too few keys to leave LRU."""
HORIZON = 2.0
"""Shadow hits decay with a half-life of about this many capacities of sampled requests."""
SWITCH_Z = 2.0
"""The referee leaves its expert for the other when that one is ahead by this many standard
deviations of noise (a conventional two sigma, not fitted: 3 was better on the tuned
traces, worse held out)."""
SWITCH_Z2 = SWITCH_Z * SWITCH_Z
CONFIRM = 32.0
"""The referee's long memory, in short horizons: a switch also needs the other expert ahead
over this much longer a half-life. Chosen among 8, 32 and 128 on the table's five traces
and the held-out ones together (32 and 128 switched alike; 8 kept half the flapping)."""
CONFIRM_Z = 1.0
"""How far ahead, in standard deviations of its noise, the long memory must put the other
expert: one, as a confirmation, not a second test (two lost real-early 5%'s gain)."""
CONFIRM_Z2 = CONFIRM_Z * CONFIRM_Z
GHOST_SIZES = (0.5,)
"""The sizes of ARC's ghost generations, in capacities, that a ghost referee chooses among,
starting from the middle one; one size (the default: half a capacity) needs no referee."""
SIZED_GHOSTS = (0.25, 0.5, 2.0)
"""``adaptive-ghosts``' sizes (the host tier's default policy). Which keys count as back from
a ghost (frequent, and moving ARC's target) decides much of ARC's split, and no one size
wins: on ``kvtier bench policy``'s traces at host 10%, a quarter of a capacity gained 11%
over vLLM ``arc`` on agentic and lost 4% on the production trace, two capacities the
reverse (docs/policies.md). Chosen on the table's five traces and the held-out ones
together, among 0.25 / 0.5 / 1 and 0.25 / 0.5 / 2 (and two- and four-size sets): the
doubled ghost gained most on the production trace and scans without a cell lost. Its cost
is the ghosts kept (up to four capacities of keys) and the hits they win: 0.94-0.98x
``adaptive``'s calls/s on the production trace at host 10%, 2.05-2.12x vLLM ``arc``'s
there, since its referees are compiled (``policies/_shadows.c``)."""
MIN_SHADOW = 16
"""Shadow caches hold at least this many rows. The sample stays one key in ``2 **
sample_bits``, so a tier under ``MIN_SHADOW << sample_bits`` rows (512) has shadows that
model a larger cache than it is (long-doc QA at host 5% is 386 rows); every figure in
docs/policies.md was measured so, and sampling small tiers more finely instead was worse
held out (docs/policies.md#policy-adaptive)."""

LRU, ARC = 0, 1
"""The experts, as ``AdaptivePolicy.expert`` names them."""


def _sample_byte(key: Key) -> int:
    """What decides whether ``key`` is sampled, the same in every process: a kvtier key's
    last hash byte (before its 4-byte group index), an int key itself (the simulator's),
    else its hash (``bytes`` and ``str`` hashes are salted per process)."""
    if type(key) is bytes and len(key) > 4:
        return key[-5]
    if type(key) is int:
        return key
    return hash(key)


def _sampled(keys: Sequence[Key], mask: int) -> list[Key]:
    """The keys of ``keys`` in the sample, in order (a kvtier key is tested in C speed).
    A sequence, not an iterator: the general test must see the keys the first one did."""
    try:
        return [key for key in keys if not key[-5] & mask]  # type: ignore[index]
    except (TypeError, IndexError):  # int keys, short or str keys: the general test
        return [key for key in keys if not _sample_byte(key) & mask]


_END = (None, math.inf)


def _by_last_use(t1: OrderedDict[Key, int], t2: OrderedDict[Key, int]) -> Iterator[Key]:
    """The keys of both lists, least recently used first (a plan: nothing changes)."""
    if not t2:
        yield from t1
        return
    if not t1:
        yield from t2
        return
    i1, i2 = iter(t1.items()), iter(t2.items())
    k1, s1 = next(i1)
    k2, s2 = next(i2)
    while True:
        if s1 < s2:
            yield k1
            k1, s1 = next(i1, _END)
        elif k2 is not None:
            yield k2
            k2, s2 = next(i2, _END)
        else:
            return


def _generation_of(capacity: int, size: float) -> int:
    """Keys in one ghost generation of a tier of ``capacity`` rows, ``size`` capacities."""
    return max(1, int(capacity * size))


def _target_after_ghost(p: float, from_t2: bool, ghosts: int, b2: int, capacity: int) -> float:
    """ARC's target ``p`` after a key comes back from a ghost: down if it left T2 (by the
    ratio of T1's ghosts to T2's), up if it left T1. ``ghosts`` are left, ``b2`` of them T2's."""
    b1 = ghosts - b2
    if from_t2:
        return max(0.0, p - max(1.0, b1 / (b2 + 1)))
    return min(float(capacity), p + max(1.0, b2 / (b1 + 1)))


class AdaptivePolicy(EvictionPolicy):
    """The live expert's own lists, one set of ghosts, and the referees' shadows.

    Only the expert that evicts keeps its lists, so a call costs about what that expert
    costs alone (keeping every expert's order at once was most of the time per call of this
    policy's first designs, ``kvtier bench policy``):

    - under LRU, one list of the resident keys by last use, each marked ``True`` once
      frequent (hit since it came in, or back from a ghost: what would make it ARC's
      ``T2``);
    - under ARC, ``T1`` and ``T2`` as ``ARCPolicy`` keeps them, each key with the stamp of
      its last use, and the target ``p``.

    Either expert's victims become ghosts, marked with the list they left (``True``: ARC's
    ``B2``), in two generations of plain dicts: the younger takes victims, the older is
    dropped whole when the younger reaches the generation size (``ghost_size`` capacities:
    half of one, unless a ghost referee chooses), so there are two generations' worth of
    ghosts at most (four capacities at ``adaptive-ghosts``' largest) and remembering or
    forgetting one costs no Python call (ARC's ordered ghost lists, trimmed one key at a
    time, were a quarter of its time per call). A key back from a ghost is frequent; under
    ARC it moves ``p`` as ARC's ghost hits do, by the two kinds' counts. Without ghosts and
    marks under LRU, ARC taking over started from a worse split: 1.5-8% fewer hits on the
    scan and chat traces.

    A switch rebuilds the other expert's lists in O(resident keys): the marks split the
    LRU list into ``T1`` and ``T2``, the stamps merge them back into one list by last use.
    The referee switches rarely (0 to 13 times on each trace of ``kvtier bench policy``'s
    scheduler table), so a rebuild costs less than keeping both experts' lists on every
    call.
    """

    name = "adaptive"
    default_ghost_sizes: tuple[float, ...] = GHOST_SIZES
    """``ghost_sizes`` when none are given (a subclass's choice: ``adaptive-ghosts``)."""

    def __init__(
        self,
        capacity: int,
        sample_bits: int = SAMPLE_BITS,
        horizon: float = HORIZON,
        confirm: float = CONFIRM,
        ghost_sizes: Sequence[float] | None = None,
    ) -> None:
        super().__init__(capacity)
        if not 0 <= sample_bits <= 16:
            raise ValueError(f"sample_bits must be in [0, 16], got {sample_bits!r}")
        if horizon <= 0:
            raise ValueError(f"horizon must be positive, got {horizon!r}")
        if not confirm >= 1:
            raise ValueError(f"confirm must be at least 1 (the horizon), got {confirm!r}")
        ghost_sizes = tuple(self.default_ghost_sizes if ghost_sizes is None else ghost_sizes)
        if not ghost_sizes or not all(isinstance(m, int | float) and 0 < m <= 8 for m in ghost_sizes):
            raise ValueError(f"ghost_sizes must be capacities in (0, 8], at least one, got {ghost_sizes!r}")
        self._order: OrderedDict[Key, bool] = OrderedDict()  # under LRU
        self._t1: OrderedDict[Key, int] = OrderedDict()  # under ARC
        self._t2: OrderedDict[Key, int] = OrderedDict()
        self._clock = count()
        self.p = 0.0
        self._ghosts: dict[Key, bool] = {}  # key -> left T2 (or was marked): the younger generation
        self._ghosts_old: dict[Key, bool] = {}
        self._ghosts_b2 = 0  # how many of both generations are marked: kept under ARC only
        self._mask = (1 << sample_bits) - 1
        shadow = max(MIN_SHADOW, capacity >> sample_bits)
        referee, self._ghost_shadows_type = SHADOWS
        self._decay = 1.0 - 1.0 / (horizon * shadow)
        self._experts = referee(
            shadow, self._decay, 1.0 - 1.0 / (confirm * horizon * shadow), SWITCH_Z2, CONFIRM_Z2
        )
        self._ghost_sizes = ghost_sizes
        self._start_ghost_referee()
        self._scale = capacity / shadow
        self.expert = LRU  # LRU until the shadows say otherwise: vLLM's default

    # -- the referee -------------------------------------------------------------------

    def _referee(self, key: Key) -> None:
        """Replay one sampled request in the referees (``_ExpertReferee``, and the ghost
        shadows where there are several sizes); follow what they say now."""
        expert = self._experts.request(key)
        if expert is not None:
            self._take_over(expert)
        if self._ghost_shadows is not None:
            size = self._ghost_shadows.request(key, self._decay)
            if size is not None:
                self._ghost_index = size
                self._generation = _generation_of(self.capacity, self._ghost_sizes[size])

    @property
    def scores(self) -> list[float]:
        """The referee's decayed shadow hits, ``[LRU, ARC]`` (a copy)."""
        return list(self._experts.scores)

    def _start_ghost_referee(self) -> None:
        """Ghosts of the middle of ``ghost_sizes``, and shadows (one per size) that have seen
        nothing; none for one size."""
        sizes, shadow = self._ghost_sizes, self._experts.capacity
        self._ghost_index = start = len(sizes) // 2
        self._generation = _generation_of(self.capacity, sizes[start])
        self._ghost_shadows = (
            self._ghost_shadows_type(shadow, [_generation_of(shadow, m) for m in sizes], start, SWITCH_Z2)
            if len(sizes) > 1
            else None
        )

    @property
    def ghost_size(self) -> float:
        """The size of ARC's ghost generations now, in capacities (one of ``ghost_sizes``)."""
        return self._ghost_sizes[self._ghost_index]

    def _take_over(self, expert: int) -> None:
        """Make ``expert`` the one that evicts, its lists rebuilt from the other's.

        ARC starts from its shadow's target (scaled to this tier): a target learned from
        LRU's victims says little about how ARC would have run (on the production trace's
        second half it lagged the shadow's by thousands of rows).
        """
        if expert == self.expert:
            return
        if expert == ARC:
            t1, t2, clock = self._t1, self._t2, self._clock
            for key, frequent in self._order.items():  # stamped in the order of last use
                (t2 if frequent else t1)[key] = next(clock)
            self._order.clear()
            self._ghosts_b2 = sum(self._ghosts.values()) + sum(self._ghosts_old.values())
            self.p = self._experts.p * self._scale
        else:
            t1, t2 = self._t1, self._t2
            self._order = OrderedDict((key, key in t2) for key in _by_last_use(t1, t2))
            t1.clear()
            t2.clear()
        # Two copies: the referee tests the other expert against its own, and the policy
        # reads its own on every call (an attribute, not a getter into the C referee).
        self.expert = self._experts.expert = expert

    def _remember(self, victims: Sequence[Key], marks: Iterable[bool], marked: int) -> None:
        """ARC's victims become ghosts with their marks (``marked`` of them ``True``, which
        ARC's ghost rule counts); a full younger generation ages, the older is forgotten.
        (LRU's victims are remembered in ``evict``, uncounted: the count is taken when ARC
        takes over.)"""
        ghosts = self._ghosts
        ghosts.update(zip(victims, marks, strict=False))
        self._ghosts_b2 += marked
        if len(ghosts) >= self._generation:
            self._ghosts_b2 -= sum(self._ghosts_old.values())
            self._ghosts_old, self._ghosts = ghosts, {}

    # -- the contract ------------------------------------------------------------------

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        if key in self:
            self.on_access(key)
        else:
            self.on_insert_run((key,))

    def on_insert_run(self, keys: Sequence[Key], parent: Key | None = None) -> None:
        # ``keys`` are not resident (the contract: ``on_insert`` checks, a run does not).
        # A key back from a ghost is frequent (LRU marks it, ARC puts it in ``T2`` and moves
        # ``p`` toward the list it left), any other is new (``T1``); each ghost is forgotten.
        if self._ghosts.keys().isdisjoint(keys) and self._ghosts_old.keys().isdisjoint(keys):
            if self.expert == LRU:  # the usual store: new keys, none a ghost; in C
                self._order.update(zip(reversed(keys), repeat(False)))
            else:
                self._t1.update(zip(reversed(keys), self._clock, strict=False))
        elif self.expert == LRU:  # some back from a ghost: marked, and their ghosts forgotten
            young, old = self._ghosts.pop, self._ghosts_old.pop
            tail_first = keys[::-1]
            marked = [young(key, None) is not None or old(key, None) is not None for key in tail_first]
            self._order.update(zip(tail_first, marked, strict=True))
        else:
            self._insert_run_under_arc(keys)
        for key in reversed(_sampled(keys, self._mask)):
            self._referee(key)

    def _insert_run_under_arc(self, keys: Sequence[Key]) -> None:
        """``keys`` in, tail first, under ARC, where some are back from a ghost: the new ones
        go into ``T1`` in one call, each returning one moves ``p`` in turn (only
        the ghosts' counts move it) and goes into ``T2``, every key with the stamp of its
        place in the run."""
        ghosts, ghosts_old = self._ghosts, self._ghosts_old
        stamped = list(zip(reversed(keys), self._clock, strict=False))
        self._t1.update((key, stamp) for key, stamp in stamped if key not in ghosts and key not in ghosts_old)
        t2, b2, p, capacity = self._t2, self._ghosts_b2, self.p, self.capacity
        for key, stamp in stamped:
            mark = ghosts.pop(key, None)
            if mark is None:
                mark = ghosts_old.pop(key, None)
                if mark is None:
                    continue
            b2 -= mark
            p = _target_after_ghost(p, mark, len(ghosts) + len(ghosts_old), b2, capacity)
            t2[key] = stamp
        self._ghosts_b2, self.p = b2, p

    def on_access(self, key: Key) -> None:
        if self.expert == LRU:
            order = self._order
            try:
                order.move_to_end(key)
            except KeyError:  # not resident: nothing to record
                return
            order[key] = True
        else:
            t2 = self._t2
            if key in t2:
                t2.move_to_end(key)
                t2[key] = next(self._clock)
            elif self._t1.pop(key, None) is not None:
                t2[key] = next(self._clock)
            else:
                return
        try:
            sampled = not key[-5] & self._mask  # type: ignore[index]
        except (TypeError, IndexError):
            sampled = not _sample_byte(key) & self._mask
        if sampled:
            self._referee(key)

    def on_renew(self, keys: Sequence[Key]) -> None:
        # Order only: no mark, and no request for the shadows (the hit was replayed when it
        # came). The usual call (a loaded prefix, every key resident) in C.
        if self.expert == LRU:
            move_each_to_end(self._order, keys)
            return
        t1, t2, clock = self._t1, self._t2, self._clock
        if all(map(t2.__contains__, keys)):
            deque(map(t2.move_to_end, keys), 0)
            t2.update(zip(keys, clock, strict=False))  # their stamps, in their new order
            return
        for key in keys:
            if key in t2:
                t2.move_to_end(key)
                t2[key] = next(clock)
            elif key in t1:
                t1.move_to_end(key)
                t1[key] = next(clock)

    def on_remove(self, key: Key) -> None:
        if self.expert == LRU:
            self._order.pop(key, None)
        elif self._t1.pop(key, None) is None:
            self._t2.pop(key, None)

    def evict(self, n: int, evictable: Evictable = always_evictable) -> list[Key] | None:
        if n <= 0:
            return []
        if self.expert == LRU:
            chosen = take_evictable(self._order, evictable, n)
            if len(chosen) < n:
                return None
            ghosts = self._ghosts
            ghosts.update(zip(chosen, map(self._order.pop, chosen), strict=True))  # with their marks, in C
            if len(ghosts) >= self._generation:
                self._ghosts_old, self._ghosts = ghosts, {}
            return chosen
        # ``ARCPolicy.evict``: T1 while |T1| > p, then T2, then the rest of T1.
        t1, t2 = self._t1, self._t2
        t1_iter = iter(t1)
        from_t1 = take_evictable(t1_iter, evictable, min(n, max(0, math.ceil(len(t1) - self.p))))
        from_t2 = take_evictable(t2, evictable, n - len(from_t1)) if len(from_t1) < n else []
        chosen = from_t1 + from_t2
        if len(chosen) < n:
            chosen += take_evictable(t1_iter, evictable, n - len(chosen))
            if len(chosen) < n:
                return None
            from_t1 = [key for key in chosen if key in t1]
        if from_t1:
            deque(map(t1.pop, from_t1), 0)
            self._remember(from_t1, repeat(False), 0)
        if from_t2:
            deque(map(t2.pop, from_t2), 0)
            self._remember(from_t2, repeat(True), len(from_t2))
        return chosen

    def ghost_count(self) -> int:
        """Keys remembered after eviction: two ghost generations (``2 * ghost_size``
        capacities) and one store's victims at most."""
        return len(self._ghosts) + len(self._ghosts_old)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._t1 or key in self._t2

    def __len__(self) -> int:
        return len(self._order) + len(self._t1) + len(self._t2)

    def __iter__(self) -> Iterator[Key]:
        """Resident keys in the live expert's order of last use, least recent first."""
        return iter(self._order) if self.expert == LRU else _by_last_use(self._t1, self._t2)

    def clear(self) -> None:
        for part in (self._order, self._t1, self._t2, self._ghosts, self._ghosts_old):
            part.clear()
        self._ghosts_b2 = 0
        self.p = 0.0
        self._experts.clear()
        self._start_ghost_referee()
        self.expert = LRU


class SizedGhostsAdaptivePolicy(AdaptivePolicy):
    """``adaptive`` that also chooses the size of ARC's ghosts among ``SIZED_GHOSTS`` by three
    more sampled shadows, the host tier's default: more hits where ARC leads (``kvtier bench
    policy``: +11% over vLLM ``arc`` on agentic at host 10% where ``adaptive`` gets +7.5%,
    +6.6% on the production trace where it gets +3.8%), a few percent slower."""

    name = "adaptive-ghosts"
    default_ghost_sizes = SIZED_GHOSTS


class _ShadowLRU(LRUPolicy):
    """The referee's LRU: ``request`` is a whole request (hit, or miss and insert)."""

    def request(self, key: Key) -> bool:
        """``on_access`` on a hit; else ``evict(1)`` when full and ``on_insert``. Hit or not."""
        order = self._order
        if key in order:
            order.move_to_end(key)
            return True
        if len(order) >= self.capacity:
            order.popitem(last=False)  # evict(1): nothing is pinned in a shadow
        order[key] = None
        return False


def _shadow_arc_hit(t1: OrderedDict[Key, None], t2: OrderedDict[Key, None], key: Key) -> bool:
    """An ARC shadow's hit: a key in ``T2`` moves to its end, one in ``T1`` into ``T2``.
    Whether ``key`` was resident."""
    if key in t2:
        t2.move_to_end(key)
        return True
    if key in t1:
        del t1[key]
        t2[key] = None
        return True
    return False


class _ShadowARC(ARCPolicy):
    """The referee's ARC: ``request`` makes ARC's decisions in one call per request."""

    def request(self, key: Key) -> bool:
        """``on_access`` on a hit; else ``evict(1)`` when full and ``on_insert``. Hit or not.

        ``ARCPolicy``'s decisions, inlined (a sampled request of every kind passes here): one
        eviction adds one ghost, so each of ARC's ghost bounds is over by one at most. Calling
        ``_trim_ghosts`` and ``on_insert`` instead made the same decisions 2% slower on the
        production trace at host 10% (when this class was the shadow that ran; it is now the
        reference and the fallback of ``policies/_shadows.c``);
        ``tests/policies/test_adaptive.py`` holds the two in lockstep.
        """
        t1, t2 = self._t1, self._t2
        if _shadow_arc_hit(t1, t2, key):
            return True
        b1, b2, capacity = self._b1, self._b2, self.capacity
        if len(t1) + len(t2) >= capacity:
            if t1 and (len(t1) > self.p or not t2):
                b1[t1.popitem(last=False)[0]] = None
            else:
                b2[t2.popitem(last=False)[0]] = None
            if b1 and len(t1) + len(b1) > capacity:
                b1.popitem(last=False)
            if len(t1) + len(t2) + len(b1) + len(b2) > 2 * capacity:
                (b2 if b2 else b1).popitem(last=False)
        if key in b1:
            self.p = min(float(capacity), self.p + max(1.0, len(b2) / len(b1)))
            del b1[key]
            t2[key] = None
        elif key in b2:
            self.p = max(0.0, self.p - max(1.0, len(b1) / len(b2)))
            del b2[key]
            t2[key] = None
        else:
            t1[key] = None
        return False


class _ExpertReferee:
    """The two experts' shadows (``_ShadowLRU``, ``_ShadowARC``) of ``capacity`` keys and the
    switch test between them: ``request`` replays one sampled request in both and returns
    the expert to take over now, if any.

    Scores are decayed hit counts (``decay`` per sampled request); beside them the decayed
    count of requests on which exactly one of the two hit. The scores' difference is a sum
    of those +-1 disagreements, so its noise is about the square root of their count: the
    referee leaves ``expert`` for the other when the other's score is ahead by ``SWITCH_Z``
    of those and the same counts with the longer memory (``long_decay``) put it ahead by
    ``CONFIRM_Z``. The reference for the compiled ``ExpertReferee``, which decides alike.
    """

    __slots__ = (
        "apart",
        "arc",
        "confirm_z2",
        "decay",
        "expert",
        "long_apart",
        "long_decay",
        "long_scores",
        "lru",
        "scores",
        "switch_z2",
    )

    def __init__(
        self, capacity: int, decay: float, long_decay: float, switch_z2: float, confirm_z2: float
    ) -> None:
        self.lru, self.arc = _ShadowLRU(capacity), _ShadowARC(capacity)
        self.decay, self.long_decay = decay, long_decay
        self.switch_z2, self.confirm_z2 = switch_z2, confirm_z2
        self.clear()

    @property
    def capacity(self) -> int:
        return self.lru.capacity

    @property
    def p(self) -> float:
        """The ARC shadow's target size of ``T1``."""
        return self.arc.p

    def request(self, key: Key) -> int | None:
        """Replay one sampled request; the expert to take over now, else ``None``."""
        decay, scores, long_decay, long_scores = self.decay, self.scores, self.long_decay, self.long_scores
        hit_lru, hit_arc = self.lru.request(key), self.arc.request(key)
        scores[LRU] = scores[LRU] * decay + hit_lru
        scores[ARC] = scores[ARC] * decay + hit_arc
        long_scores[LRU] = long_scores[LRU] * long_decay + hit_lru
        long_scores[ARC] = long_scores[ARC] * long_decay + hit_arc
        differ = hit_lru != hit_arc
        self.apart = apart = self.apart * decay + differ
        self.long_apart = long_apart = self.long_apart * long_decay + differ
        other = ARC if self.expert == LRU else LRU
        ahead = scores[other] - scores[self.expert]
        if ahead > 0 and ahead * ahead > self.switch_z2 * apart:
            ahead = long_scores[other] - long_scores[self.expert]
            if ahead > 0 and ahead * ahead > self.confirm_z2 * long_apart:
                self.expert = other
                return other
        return None

    def state(self) -> tuple:
        """As the compiled ``ExpertReferee.state``: the counts, then each shadow's lists."""
        arc = self.arc
        return (
            self.expert,
            tuple(self.scores),
            self.apart,
            tuple(self.long_scores),
            self.long_apart,
            list(self.lru._order),
            (list(arc._t1), list(arc._t2), list(arc._b1), list(arc._b2)),
            arc.p,
        )

    def clear(self) -> None:
        """Forget every key and count; LRU again."""
        self.lru.clear()
        self.arc.clear()
        self.scores = [0.0, 0.0]
        self.long_scores = [0.0, 0.0]
        self.apart = self.long_apart = 0.0
        self.expert = LRU


class _ShadowLiveARC:
    """``AdaptivePolicy``'s own ARC at a shadow's size, with ghost generations of
    ``generation`` keys: what the live expert would hit with that ghost size.

    ``request`` is a whole request (hit; or evict one when full, then insert), with the live
    expert's rules: a victim from ``T1`` while ``|T1| > p`` (else ``T2``) becomes a ghost
    marked with its list; a full younger generation ages and the older is forgotten; a key
    back from a ghost is frequent and moves ``p`` by the ghost counts.
    ``tests/policies/test_adaptive.py`` holds it in lockstep with ``AdaptivePolicy``.
    """

    __slots__ = ("_b2", "_generation", "_ghosts", "_ghosts_old", "_t1", "_t2", "capacity", "p")

    def __init__(self, capacity: int, generation: int) -> None:
        self.capacity = capacity
        self._generation = generation
        self._t1: OrderedDict[Key, None] = OrderedDict()
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._ghosts: dict[Key, bool] = {}
        self._ghosts_old: dict[Key, bool] = {}
        self._b2 = 0  # marked ghosts (left T2), both generations
        self.p = 0.0

    def request(self, key: Key) -> bool:
        """Replay one request; whether it hit."""
        t1, t2 = self._t1, self._t2
        if _shadow_arc_hit(t1, t2, key):
            return True
        ghosts = self._ghosts
        if len(t1) + len(t2) >= self.capacity:
            if t1 and (len(t1) > self.p or not t2):
                ghosts[t1.popitem(last=False)[0]] = False
            else:
                ghosts[t2.popitem(last=False)[0]] = True
                self._b2 += 1
            if len(ghosts) >= self._generation:
                self._b2 -= sum(self._ghosts_old.values())
                self._ghosts_old, self._ghosts = ghosts, {}
                ghosts = self._ghosts
        mark = ghosts.pop(key, None)
        if mark is None:
            mark = self._ghosts_old.pop(key, None)
            if mark is None:
                t1[key] = None
                return False
        b2 = self._b2 = self._b2 - mark
        self.p = _target_after_ghost(self.p, mark, len(ghosts) + len(self._ghosts_old), b2, self.capacity)
        t2[key] = None
        return False

    def clear(self) -> None:
        for part in (self._t1, self._t2, self._ghosts, self._ghosts_old):
            part.clear()
        self._b2 = 0
        self.p = 0.0


class _GhostReferee:
    """Which of ``n`` ghost shadows to follow: a switch when another's decayed hits lead the
    current one's by ``SWITCH_Z`` standard deviations of their disagreements.

    Only where the shadows disagree does anything but the decay change, so the decay is
    applied lazily: the counts are kept multiplied by ``scale`` (which grows by ``1 /
    decay`` a request) and a request on which every shadow hit, or none did, costs one
    multiplication. ``leads[i]``: shadow ``i``'s hits minus the current one's;
    ``apart[i]``: requests on which the two differed (both scaled, and kept since the last
    switch, when the evidence starts over).
    """

    __slots__ = ("apart", "current", "leads", "scale", "switch_z2")

    def __init__(self, n: int, current: int, switch_z2: float = SWITCH_Z2) -> None:
        self.current = current
        self.switch_z2 = switch_z2
        self.leads = [0.0] * n
        self.apart = [0.0] * n
        self.scale = 1.0

    def request(self, hits: list[bool], decay: float) -> int | None:
        """Count one request's hits (one per shadow); the shadow to follow now, if it changed."""
        self.scale = scale = self.scale / decay
        if scale > 1e100:  # fold it back into the counts before it overflows
            self.leads = [lead / scale for lead in self.leads]
            self.apart = [a / scale for a in self.apart]
            self.scale = scale = 1.0
        hit = hits[self.current]
        if all(hits) if hit else not any(hits):
            return None
        leads, apart, best, best_lead = self.leads, self.apart, None, 0.0
        for i, other in enumerate(hits):
            if other != hit:
                apart[i] += scale
                leads[i] += scale if other else -scale
                lead = leads[i]
                if other and lead > best_lead and lead * lead > self.switch_z2 * apart[i] * scale:
                    best, best_lead = i, lead
        if best is None:
            return None
        self.current = best
        self.leads = [lead - best_lead for lead in leads]
        self.apart = [0.0] * len(hits)
        return best


class _GhostShadows:
    """``adaptive``'s own ARC at each ghost generation size (``_ShadowLiveARC``) and the
    referee choosing among them (``_GhostReferee``): ``request`` replays one sampled request
    in every shadow and returns the shadow to follow now, if that changed."""

    __slots__ = ("referee", "shadows")

    def __init__(self, capacity: int, generations: Sequence[int], current: int, switch_z2: float) -> None:
        self.shadows = tuple(_ShadowLiveARC(capacity, generation) for generation in generations)
        self.referee = _GhostReferee(len(self.shadows), current, switch_z2)

    @property
    def current(self) -> int:
        return self.referee.current

    def request(self, key: Key, decay: float) -> int | None:
        return self.referee.request([shadow.request(key) for shadow in self.shadows], decay)

    def state(self) -> tuple:
        """As the compiled ``GhostShadows.state``: the referee's counts, each shadow's parts."""
        referee = self.referee
        shadows = [
            (
                (list(s._t1), list(s._t2), list(s._ghosts.items()), list(s._ghosts_old.items())),
                s.p,
            )
            for s in self.shadows
        ]
        return referee.current, referee.scale, list(referee.leads), list(referee.apart), shadows


def _shadow_types() -> tuple[type, type]:
    """The referees' types: compiled (``policies/_shadows.c``, built at install where a C
    compiler is found) or, where that module was not built, the Python ones above, which
    make the same decisions (``tests/policies/test_shadows.py``) at several times the cost
    per sampled request."""
    try:
        from policies import _shadows
    except ImportError:
        logger.info("policies._shadows is not built: the adaptive policies' shadows run in Python (slower)")
        return _ExpertReferee, _GhostShadows
    return _shadows.ExpertReferee, _shadows.GhostShadows


SHADOWS = _shadow_types()
"""``(experts' referee, ghost shadows)`` types, as ``_shadow_types`` chose them at import."""
