"""LRU, ARC or vLLM's ARC, whichever is winning: three experts over one set of lists.

No single simple policy wins everywhere (``kvtier bench policy``): on chat traces whose old
turns never come back plain LRU beats ARC; on agentic and production traces at small hosts
the original ARC (a key back from a ghost list enters the frequency list) beats LRU by a
quarter; on some long-document QA traces vLLM's ARC variant (a key back from a ghost list
re-enters the recency list) beats both. This policy keeps the three orders over the same resident keys
and evicts by the one that is doing better now.

One set of lists serves all three. Every resident key sits in exactly one of

- ``A``: inserted, not hit since, and not back from the original ARC's ghost lists;
- ``G``: back from the original ARC's ghost lists, not hit since;
- ``H``: hit since it was inserted;

each ordered by its last use (a stamp). Then the original ARC's T1 is ``A`` and its T2 is
``G`` and ``H`` merged by stamp; vLLM's T1 is ``A`` and ``G`` merged, its T2 is ``H``; LRU
is all three merged. A use moves one key in one list whichever expert evicts (one list
update, not three); each ARC keeps its own ghost lists and target ``p`` and learns from
every eviction, whoever chose the victim.

The referee is three shadow caches (one per expert) of ``capacity / 2 ** sample_bits`` rows
that see only the keys that fall in the sample (one in ``2 ** sample_bits``, by a byte of
the key's hash), the spatial sampling of SHARDS (Waldspurger et al., FAST'15): a sampled
cache of a scaled-down size has the hit ratio of the full one, within noise. Each request
(``on_insert``: missed; ``on_access``: hit) is replayed in the shadows, each shadow's hits
decay with a horizon of ``horizon`` times its size in sampled requests, and the policy
moves to another expert only when that one's lead is beyond the sampling noise
(``SWITCH_Z``): following the leader on noise made it switch often among close experts,
and each switch costs the order the cache had built (the regret argument of LeCaR and
CACHEUS holds only when the experts' states do not depend on who evicts). An ARC that takes
over starts from its shadow's target, scaled: the real lists' target learned from another
expert's victims.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from policies.arc import ARCPolicy, VLLMARCPolicy, count_store_ghosts, ghost_target
from policies.base import Evictable, EvictionPolicy, Key, always_evictable, take_evictable
from policies.lru import LRUPolicy

SAMPLE_BITS = 4
"""One key in ``2 ** SAMPLE_BITS`` (by its hash) is replayed in the shadows."""
HORIZON = 2.0
"""Shadow hits decay with a half-life of about this many capacities of sampled requests."""
SWITCH_Z = 2.0
"""The referee leaves its expert for one ahead by this many standard deviations of noise
(a conventional two sigma, not fitted: 3 was better on the tuned traces, worse held out)."""
SWITCH_Z2 = SWITCH_Z * SWITCH_Z
MIN_SHADOW = 16
"""Shadow caches hold at least this many rows (a tiny tier is sampled more coarsely)."""

LRU, ARC, VLLM_ARC = 0, 1, 2
EXPERTS = ("lru", "arc", "arc-vllm")
"""The experts' policy names by index: ``AdaptivePolicy.expert`` is one of the indices."""
_PAIR = ((-1, 0, 1), (0, -1, 2), (1, 2, -1))
"""``_PAIR[i][j]``: the index of the pair ``(i, j)`` in ``AdaptivePolicy.apart``."""


def _sample_byte(key: Key) -> int:
    """What decides whether ``key`` is sampled, the same in every process: a kvtier key's
    last hash byte (before its 4-byte group index), an int key itself (the simulator's),
    else its hash (``bytes`` and ``str`` hashes are salted per process)."""
    if type(key) is bytes and len(key) > 4:
        return key[-5]
    if type(key) is int:
        return key
    return hash(key)


def _sampled(keys: Iterable[Key], mask: int) -> list[Key]:
    """The keys of ``keys`` in the sample, in order (a kvtier key is tested in C speed)."""
    try:
        return [key for key in keys if not key[-5] & mask]  # type: ignore[index]
    except (TypeError, IndexError):  # int keys, short or str keys: the general test
        return [key for key in keys if not _sample_byte(key) & mask]


_END = (None, float("inf"))


def _merged(x: OrderedDict[Key, int], y: OrderedDict[Key, int]) -> Iterator[Key]:
    """The keys of two lists each ordered by stamp, oldest first (a plan: nothing changes)."""
    if not y:
        yield from x
        return
    if not x:
        yield from y
        return
    ix, iy = iter(x.items()), iter(y.items())
    kx, sx = next(ix)
    ky, sy = next(iy)
    while True:
        if sx < sy:
            yield kx
            kx, sx = next(ix, _END)
        elif ky is not None:
            yield ky
            ky, sy = next(iy, _END)
        else:
            return


def _merged3(x: OrderedDict[Key, int], y: OrderedDict[Key, int], z: OrderedDict[Key, int]) -> Iterator[Key]:
    """``_merged`` of three lists (stamps are distinct: only the end markers tie)."""
    if not z:
        yield from _merged(x, y)
        return
    ix, iy, iz = iter(x.items()), iter(y.items()), iter(z.items())
    kx, sx = next(ix, _END)
    ky, sy = next(iy, _END)
    kz, sz = next(iz)
    while True:
        if sx < sy:
            if sx < sz:
                yield kx
                kx, sx = next(ix, _END)
                continue
        elif sy < sz:
            yield ky
            ky, sy = next(iy, _END)
            continue
        if kz is None:
            return
        yield kz
        kz, sz = next(iz, _END)


class AdaptivePolicy(EvictionPolicy):
    """Lists ``A``, ``G``, ``H`` (see the module), two ARCs' ghosts and ``p``; three shadows."""

    name = "adaptive"

    def __init__(self, capacity: int, sample_bits: int = SAMPLE_BITS, horizon: float = HORIZON) -> None:
        super().__init__(capacity)
        if not 0 <= sample_bits <= 16:
            raise ValueError(f"sample_bits must be in [0, 16], got {sample_bits!r}")
        if horizon <= 0:
            raise ValueError(f"horizon must be positive, got {horizon!r}")
        self._a: OrderedDict[Key, int] = OrderedDict()
        self._g: OrderedDict[Key, int] = OrderedDict()
        self._h: OrderedDict[Key, int] = OrderedDict()
        self._stamp = 0
        # the original ARC's ghosts and target (T1 = A): a key back from them is frequent (G)
        self.p = 0.0
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()
        # vLLM's ARC's ghosts and target (T1 = A + G)
        self.p_vllm = 0.0
        self._v1: OrderedDict[Key, None] = OrderedDict()
        self._v2: OrderedDict[Key, None] = OrderedDict()
        self._told: set[Key] = set()  # ghosts whose miss ``on_miss`` has counted
        self._mask = (1 << sample_bits) - 1
        shadow = max(MIN_SHADOW, capacity >> sample_bits)
        self._shadows = (_ShadowLRU(shadow), _ShadowARC(shadow), _ShadowVLLMARC(shadow))
        self._decay = 1.0 - 1.0 / (horizon * shadow)
        self._scale = capacity / shadow
        self.scores = [0.0, 0.0, 0.0]
        self.apart = [0.0, 0.0, 0.0]
        self.expert = LRU  # LRU until the shadows say otherwise: vLLM's default

    # -- the referee -------------------------------------------------------------------

    def _referee(self, key: Key) -> None:
        """Replay one sampled request in the shadows; change expert only on significant evidence.

        Scores are decayed hit counts; beside them, for each pair of experts, the decayed
        count of requests on which exactly one of the two hit. Their difference is a sum of
        those +-1 disagreements, so its noise is about the square root of their count: the
        policy leaves its expert for one whose score is ahead by ``SWITCH_Z`` of those, and
        among such, for the best. Close experts therefore do not make it switch back and forth
        on sampling noise, each switch costing the cache the order it had built.
        """
        decay, scores, apart = self._decay, self.scores, self.apart
        lru, arc, vllm_arc = self._shadows
        h0, h1, h2 = lru.request(key), arc.request(key), vllm_arc.request(key)
        scores[0] = scores[0] * decay + h0
        scores[1] = scores[1] * decay + h1
        scores[2] = scores[2] * decay + h2
        apart[0] = apart[0] * decay + (h0 != h1)  # LRU - ARC
        apart[1] = apart[1] * decay + (h0 != h2)  # LRU - vLLM ARC
        apart[2] = apart[2] * decay + (h1 != h2)  # ARC - vLLM ARC
        current = self.expert
        best, lead = current, 0.0
        for other in (LRU, ARC, VLLM_ARC):
            if other == current:
                continue
            ahead = scores[other] - scores[current]
            noise = apart[_PAIR[current][other]]
            if ahead > 0 and ahead * ahead > SWITCH_Z2 * noise and scores[other] > lead:
                best, lead = other, scores[other]
        if best != current:
            self._take_over(best)

    def _take_over(self, expert: int) -> None:
        """Make ``expert`` the one that evicts. An ARC taking over starts from its shadow's
        target (scaled to this tier): the real lists' target learned from another expert's
        victims, which says little about how this ARC would have run (on the production
        trace's second half it lagged the shadow's by thousands of rows)."""
        if expert == ARC:
            self.p = self._shadows[ARC].p * self._scale
        elif expert == VLLM_ARC:
            self.p_vllm = self._shadows[VLLM_ARC].p * self._scale
        self.expert = expert

    # -- the contract ------------------------------------------------------------------

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        if key in self._a or key in self._g or key in self._h:
            self.on_access(key)
            return
        self._insert_one(key)
        if not _sample_byte(key) & self._mask:
            self._referee(key)

    def on_miss(self, keys: Sequence[Key]) -> None:
        """vLLM's ARC moves its target for a store's ghosts before the store evicts (as
        ``VLLMARCPolicy.on_miss``)."""
        if self._told:
            self._told = set()  # one store's ghosts: a store that was refused counts again
        self.p_vllm = count_store_ghosts(keys, self._v1, self._v2, self._told, self.p_vllm, self.capacity)

    def _adapt_vllm(self, key: Key) -> None:
        """vLLM's ARC's ghost-hit rule for ``key``, a ghost of ``V1`` or ``V2``."""
        self.p_vllm = ghost_target(self.p_vllm, key, self._v1, self._v2, self.capacity)

    def _insert_one(self, key: Key) -> None:
        """A new resident key: both ARCs' ghost rules, then ``G`` if the original ARC
        remembers it, else ``A``."""
        v1, v2 = self._v1, self._v2
        if key in self._told:
            self._told.discard(key)
        elif key in v1 or key in v2:
            self._adapt_vllm(key)
        v1.pop(key, None)
        v2.pop(key, None)
        b1, b2 = self._b1, self._b2
        stamp = self._stamp = self._stamp + 1
        if key in b1:
            self.p = min(float(self.capacity), self.p + max(1.0, len(b2) / len(b1)))
            del b1[key]
            self._g[key] = stamp
        elif key in b2:
            self.p = max(0.0, self.p - max(1.0, len(b1) / len(b2)))
            del b2[key]
            self._g[key] = stamp
        else:
            self._a[key] = stamp

    def on_insert_run(self, keys: Sequence[Key], parent: Key | None = None) -> None:
        a, g, h = self._a, self._g, self._h
        if (
            self._b1.keys().isdisjoint(keys)
            and self._b2.keys().isdisjoint(keys)
            and self._v1.keys().isdisjoint(keys)
            and self._v2.keys().isdisjoint(keys)
            and g.keys().isdisjoint(keys)
            and h.keys().isdisjoint(keys)
            and a.keys().isdisjoint(keys)
        ):
            # The usual store: new keys, none a ghost. Tail first, one stamp each, in C.
            start = self._stamp + 1
            self._stamp += len(keys)
            a.update(zip(reversed(keys), range(start, self._stamp + 1), strict=True))
            for key in _sampled(reversed(keys), self._mask):
                self._referee(key)
            return
        for i in range(len(keys) - 1, -1, -1):
            self.on_insert(keys[i])

    def on_access(self, key: Key) -> None:
        h = self._h
        stamp = self._stamp = self._stamp + 1
        if key in h:
            h.move_to_end(key)
            h[key] = stamp
        elif self._a.pop(key, None) is not None or self._g.pop(key, None) is not None:
            h[key] = stamp
        else:
            return
        try:
            sampled = not key[-5] & self._mask  # type: ignore[index]
        except (TypeError, IndexError):
            sampled = not _sample_byte(key) & self._mask
        if sampled:
            self._referee(key)

    def on_remove(self, key: Key) -> None:
        if self._a.pop(key, None) is None and self._g.pop(key, None) is None:
            self._h.pop(key, None)

    def evict(self, n: int, evictable: Evictable = always_evictable) -> list[Key] | None:
        if n <= 0:
            return []
        a, g, h = self._a, self._g, self._h
        if self.expert == LRU:
            chosen = take_evictable(_merged3(a, g, h), evictable, n)
        elif self.expert == ARC:
            # The original ARC (``ARCPolicy.evict``): T1 = A while |T1| > p, then T2 = G + H,
            # then the rest of T1.
            t1 = iter(a)
            chosen = take_evictable(t1, evictable, min(n, max(0, math.ceil(len(a) - self.p))))
            chosen += take_evictable(_merged(g, h), evictable, n - len(chosen))
            chosen += take_evictable(t1, evictable, n - len(chosen))
        else:
            # vLLM's ARC (``VLLMARCPolicy.evict``): T1 = A + G while |T1| >= int(p), then
            # T2 = H, then the rest of T1.
            t1 = _merged(a, g)
            chosen = take_evictable(t1, evictable, min(n, max(0, len(a) + len(g) - int(self.p_vllm) + 1)))
            chosen += take_evictable(h, evictable, n - len(chosen))
            chosen += take_evictable(t1, evictable, n - len(chosen))
        if len(chosen) < n:
            return None
        b1, b2, v1, v2 = self._b1, self._b2, self._v1, self._v2
        for key in chosen:
            if a.pop(key, None) is not None:
                b1[key] = None
                v1[key] = None
            elif g.pop(key, None) is not None:
                b2[key] = None
                v1[key] = None
            else:
                del h[key]
                b2[key] = None
                v2[key] = None
        self._trim_ghosts()
        return chosen

    def _trim_ghosts(self) -> None:
        """The original ARC's bounds on ``B1``/``B2``; vLLM's (each ghost list ``capacity``)."""
        b1, b2, capacity = self._b1, self._b2, self.capacity
        resident_t1 = len(self._a)
        for _ in range(min(len(b1), resident_t1 + len(b1) - capacity)):
            b1.popitem(last=False)
        resident = resident_t1 + len(self._g) + len(self._h)
        for _ in range(min(len(b2), resident + len(b1) + len(b2) - 2 * capacity)):
            b2.popitem(last=False)
        for _ in range(min(len(b1), resident + len(b1) + len(b2) - 2 * capacity)):
            b1.popitem(last=False)
        for ghost in (self._v1, self._v2):
            for _ in range(len(ghost) - capacity):
                self._told.discard(ghost.popitem(last=False)[0])

    def ghost_count(self) -> int:
        """Keys remembered after eviction by either ARC; bounded by ``4 * capacity``."""
        return len(self._b1) + len(self._b2) + len(self._v1) + len(self._v2)

    def __contains__(self, key: object) -> bool:
        return key in self._a or key in self._h or key in self._g

    def __len__(self) -> int:
        return len(self._a) + len(self._g) + len(self._h)

    def __iter__(self) -> Iterator[Key]:
        """Resident keys, least recently used first (whichever expert evicts next)."""
        return _merged3(self._a, self._g, self._h)

    def clear(self) -> None:
        for part in (self._a, self._g, self._h, self._b1, self._b2, self._v1, self._v2):
            part.clear()
        self._told.clear()
        self.p = self.p_vllm = 0.0
        self._stamp = 0
        for shadow in self._shadows:
            shadow.clear()
        self.scores = [0.0, 0.0, 0.0]
        self.apart = [0.0, 0.0, 0.0]
        self.expert = LRU


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


def _arc_hit(t1: OrderedDict, t2: OrderedDict, key: Key) -> bool:
    """A shadow ARC's hit, if ``key`` is resident: T1 -> T2, or T2's most recent end."""
    if key in t2:
        t2.move_to_end(key)
        return True
    if key in t1:
        del t1[key]
        t2[key] = None
        return True
    return False


def _evict_one(shadow: ARCPolicy) -> None:
    """A full shadow's ``evict(1)`` with nothing pinned: T1's oldest while its ARC's test lets
    T1 give a victim (``_t1_victims_first``), else T2's, else T1's."""
    t1, t2 = shadow._t1, shadow._t2
    if t1 and (shadow._t1_victims_first() > 0 or not t2):
        shadow._b1[t1.popitem(last=False)[0]] = None
    else:
        shadow._b2[t2.popitem(last=False)[0]] = None
    shadow._trim_ghosts()


class _ShadowARC(ARCPolicy):
    """The referee's original ARC: ``request`` makes ARC's decisions in one call per request."""

    def request(self, key: Key) -> bool:
        """``on_access`` on a hit; else ``evict(1)`` when full and ``on_insert``. Hit or not."""
        t1, t2 = self._t1, self._t2
        if _arc_hit(t1, t2, key):
            return True
        if len(t1) + len(t2) >= self.capacity:
            _evict_one(self)
        self.on_insert(key)
        return False


class _ShadowVLLMARC(VLLMARCPolicy):
    """The referee's vLLM ARC: ``request`` makes its decisions in one call per request."""

    def request(self, key: Key) -> bool:
        """A hit: ``on_access``. A miss: move ``p`` for a ghost, ``evict(1)`` when full, insert."""
        t1, t2 = self._t1, self._t2
        if _arc_hit(t1, t2, key):
            return True
        self._adapt(key)  # before the eviction, as vLLM's ``on_store_miss``
        if len(t1) + len(t2) >= self.capacity:
            _evict_one(self)
        t1[key] = None
        self._b1.pop(key, None)
        self._b2.pop(key, None)
        return False
