"""LRU or ARC, whichever is winning: two experts and a referee on a sample of the keys.

No single simple policy wins everywhere: on chat traces whose old turns never come back
plain LRU beats ARC, on traces with hot prefixes and one-off scans ARC beats LRU by a
quarter (``kvtier bench policy``). This policy keeps both orders over the same resident
keys (ARC's T1/T2 with their ghosts, and one recency list) and evicts by the one that is
doing better now.

The referee is two shadow caches (an ``LRUPolicy`` and an ``ARCPolicy``) of
``capacity / 2 ** SAMPLE_BITS`` rows that see only the keys that fall in the sample (one
in ``2 ** SAMPLE_BITS``, by a byte of the key's hash), the spatial sampling of SHARDS
(Waldspurger et al., FAST'15): a sampled cache of a scaled-down size has the hit ratio of
the full one, within noise. Each request the tier sees (``on_insert``: it was missed;
``on_access``: it was hit) is replayed in both shadows, and each shadow's hits are counted
with an exponential decay (a horizon of ``HORIZON`` times the shadow's size in sampled
requests), so the choice follows a trace that changes. The regret against the better
expert is bounded by the sampling noise and the horizon's lag, the argument of adaptive
selection between experts (LeCaR, CACHEUS); the cost is one byte test per key, and the
shadows' work on one key in ``2 ** SAMPLE_BITS``.

Both orders are kept exact: an eviction by LRU order still moves the victim to ARC's ghost
list it came from, so ARC's adaptation (``p``) keeps learning whichever expert evicts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from policies.arc import ARCPolicy
from policies.base import Evictable, Key, always_evictable, take_evictable
from policies.lru import LRUPolicy

SAMPLE_BITS = 4
"""One key in ``2 ** SAMPLE_BITS`` (by its hash) is replayed in the shadows."""
HORIZON = 2.0
"""Shadow hits decay with a half-life of about this many capacities of sampled requests."""
MIN_SHADOW = 16
"""Shadow caches hold at least this many rows (a tiny tier is sampled more coarsely)."""


def _sample_byte(key: Key) -> int:
    """What decides whether ``key`` is sampled, the same in every process: a kvtier key's
    last hash byte (before its 4-byte group index), an int key itself (the simulator's),
    else its hash (``bytes`` and ``str`` hashes are salted per process)."""
    if type(key) is bytes and len(key) > 4:
        return key[-5]
    if type(key) is int:
        return key
    return hash(key)


class AdaptivePolicy(ARCPolicy):
    """ARC's lists plus one recency list; evicts by ARC or by LRU as the shadows say."""

    name = "adaptive"

    def __init__(self, capacity: int, sample_bits: int = SAMPLE_BITS, horizon: float = HORIZON) -> None:
        super().__init__(capacity)
        if not 0 <= sample_bits <= 16:
            raise ValueError(f"sample_bits must be in [0, 16], got {sample_bits!r}")
        if horizon <= 0:
            raise ValueError(f"horizon must be positive, got {horizon!r}")
        self._recency: OrderedDict[Key, None] = OrderedDict()
        self._mask = (1 << sample_bits) - 1
        shadow = max(MIN_SHADOW, capacity >> sample_bits)
        self._shadow_lru = _ShadowLRU(shadow)
        self._shadow_arc = _ShadowARC(shadow)
        self._decay = 1.0 - 1.0 / (horizon * shadow)
        self.score_lru = 0.0
        self.score_arc = 0.0
        self.use_lru = True  # LRU until the shadows say otherwise: vLLM's default

    # -- the referee -------------------------------------------------------------------

    def _referee(self, key: Key) -> None:
        """Replay one sampled request in both shadows; follow the one with more recent hits."""
        decay = self._decay
        if self._shadow_lru.request(key):
            self.score_lru = self.score_lru * decay + 1.0
        else:
            self.score_lru *= decay
        if self._shadow_arc.request(key):
            self.score_arc = self.score_arc * decay + 1.0
        else:
            self.score_arc *= decay
        self.use_lru = self.score_lru >= self.score_arc

    # -- the contract ------------------------------------------------------------------

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        super().on_insert(key, parent)
        self._recency[key] = None
        self._recency.move_to_end(key)
        if not _sample_byte(key) & self._mask:
            self._referee(key)

    def on_insert_run(self, keys: Sequence[Key], parent: Key | None = None) -> None:
        # ARC's ``on_insert_run`` and the recency list's, tail first, in one loop: a run of
        # new keys (the usual store) only appends to T1 and to the recency list.
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        recency, mask = self._recency, self._mask
        for i in range(len(keys) - 1, -1, -1):
            key = keys[i]
            if key in t1 or key in t2 or key in b1 or key in b2:
                self.on_insert(key)
                continue
            t1[key] = None
            recency[key] = None
            if not (key[-5] if type(key) is bytes and len(key) > 4 else _sample_byte(key)) & mask:
                self._referee(key)

    def on_access(self, key: Key) -> None:
        recency = self._recency
        if key in recency:  # resident: in T1 or T2 (ARC's ``on_access``, inlined)
            t2 = self._t2
            if key in t2:
                t2.move_to_end(key)
            else:
                del self._t1[key]
                t2[key] = None
            recency.move_to_end(key)
            if not (key[-5] if type(key) is bytes and len(key) > 4 else _sample_byte(key)) & self._mask:
                self._referee(key)

    def on_remove(self, key: Key) -> None:
        super().on_remove(key)
        self._recency.pop(key, None)

    def evict(self, n: int, evictable: Evictable = always_evictable) -> list[Key] | None:
        if n <= 0:
            return []
        recency = self._recency
        if not self.use_lru:
            chosen = super().evict(n, evictable)
            if chosen is not None:
                for key in chosen:
                    del recency[key]
            return chosen
        chosen = take_evictable(recency, evictable, n)
        if len(chosen) < n:
            return None
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        for key in chosen:
            del recency[key]
            if key in t1:
                del t1[key]
                b1[key] = None
            else:
                del t2[key]
                b2[key] = None
        self._trim_ghosts()
        return chosen

    def __iter__(self) -> Iterator[Key]:
        return iter(self._recency) if self.use_lru else super().__iter__()

    def clear(self) -> None:
        super().clear()
        self._recency.clear()
        self._shadow_lru.clear()
        self._shadow_arc.clear()
        self.score_lru = self.score_arc = 0.0
        self.use_lru = True


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


class _ShadowARC(ARCPolicy):
    """The referee's ARC: ``request`` makes ARC's decisions in one call per request."""

    def request(self, key: Key) -> bool:
        """``on_access`` on a hit; else ``evict(1)`` when full and ``on_insert``. Hit or not."""
        t1, t2 = self._t1, self._t2
        if key in t2:
            t2.move_to_end(key)
            return True
        if key in t1:
            del t1[key]
            t2[key] = None
            return True
        if len(t1) + len(t2) >= self.capacity:
            # evict(1) with nothing pinned: T1's oldest while |T1| > p, else T2's, else T1's.
            if t1 and (len(t1) > self.p or not t2):
                self._b1[t1.popitem(last=False)[0]] = None
            else:
                self._b2[t2.popitem(last=False)[0]] = None
            self._trim_ghosts()
        self.on_insert(key)
        return False
