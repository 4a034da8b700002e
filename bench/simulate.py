"""Trace simulator: a device prefix cache above a chain of tiers, and the offline optimum.

The model is the one vLLM's offloading connector runs, one request at a time:

1. The device (GPU) prefix cache of ``device_blocks`` blocks serves the longest prefix of
   the request it holds: ``d`` blocks. It is an LRU over blocks, refreshed tail first at
   the end of every request, as vLLM frees a request's blocks (so a chain's tail leaves
   the device before its head).
2. The tiers serve the longest run after that: block ``d``, ``d+1``, ... as long as some
   tier holds the next block (the first tier that holds it serves it). The run stops at
   the first block no tier holds; the blocks after it are recomputed even if cached.
3. Hits in a tier below the host tier are promoted into the host tier where that tier's
   placement says so.
4. Stores go to the host tier (tier 0): the recomputed blocks, or, when the tiers served
   nothing, every block of the request (vLLM offers a request's whole prompt then, and a
   block already held counts as a use). The request's own blocks are never evicted to
   make room for them. Evicted blocks go down under write-back; stored blocks go down
   as well under write-through; each tier's admission rule filters what it accepts.
5. Policy calls follow the base contract: new runs by ``on_insert_run`` (tail first), then
   ``on_access`` for the blocks the request used that were already resident, tail first.

``device_prefix_hits`` replays the device cache alone: its contents do not depend on the
tiers (a block is on the device after a request whether it was loaded or recomputed), so
every policy sees the same stream below it, which is what makes ``opt_hits`` meaningful.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.traces import Request
from policies.base import EvictionPolicy
from policies.placement import AdmitAll, Placement, make_placement
from policies.registry import make_policy


def device_prefix_hits(trace: Sequence[Request], device_blocks: int) -> list[int]:
    """Blocks of each request served by the device prefix cache (an LRU of ``device_blocks``)."""
    cache: OrderedDict[int, None] = OrderedDict()  # least recent first
    hits: list[int] = []
    for request in trace:
        keys = request.keys
        d = 0
        for key in keys:
            if key not in cache:
                break
            d += 1
        hits.append(d)
        if device_blocks <= 0:
            continue
        for key in reversed(keys):
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > device_blocks:
            cache.popitem(last=False)
    return hits


@dataclass
class TierSpec:
    """One tier of the chain: rows, eviction policy (a registry name) and placement table."""

    name: str
    capacity: int
    policy: str = "lru"
    params: Mapping[str, Any] = field(default_factory=dict)
    placement: Mapping[str, Any] | None = None


class Tier:
    """A tier in the simulator: its policy is its index (the simulator moves no bytes)."""

    def __init__(self, name: str, capacity: int, policy: EvictionPolicy, placement: Placement) -> None:
        self.name = name
        self.capacity = capacity
        self.policy = policy
        self.placement = placement
        self.observes = not isinstance(placement.admission, AdmitAll)
        self.hits = 0
        self.stores = 0
        self.evictions = 0
        self.refused = 0

    @classmethod
    def from_spec(cls, spec: TierSpec) -> Tier:
        policy = make_policy(spec.policy, spec.capacity, **dict(spec.params))
        return cls(spec.name, spec.capacity, policy, make_placement(spec.placement, spec.capacity))


@dataclass
class SimResult:
    """Block counts of one replay. Ratios are over every block of every request."""

    accesses: int
    device_hits: int
    tier_names: list[str]
    tier_hits: list[int]
    tier_stores: list[int]

    @property
    def tier_hit_ratio(self) -> float:
        """Blocks served by the tiers (not the device), over all blocks requested."""
        return sum(self.tier_hits) / self.accesses if self.accesses else 0.0

    def hit_ratio(self, tier: int) -> float:
        return self.tier_hits[tier] / self.accesses if self.accesses else 0.0

    @property
    def device_hit_ratio(self) -> float:
        return self.device_hits / self.accesses if self.accesses else 0.0

    @property
    def total_hit_ratio(self) -> float:
        return self.device_hit_ratio + self.tier_hit_ratio


class TierChain:
    """The tiers below the device, host first, with the store and promotion rules above."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        if not tiers:
            raise ValueError("a tier chain needs at least one tier")
        self.tiers = list(tiers)
        self._parent: dict[int, int | None] = {}

    def request(self, keys: Sequence[int], d: int) -> None:
        """Replay one request whose first ``d`` blocks the device served."""
        tiers = self.tiers
        parent = self._parent
        prev = None
        for key in keys:
            parent[key] = prev
            prev = key
        for tier in tiers:
            if tier.observes:
                for key in keys:
                    tier.placement.admission.observe(key)
        # Lookup: the run of blocks after the device's that some tier holds.
        n = len(keys)
        served_by: list[int] = []
        i = d
        while i < n:
            t = self._holder(keys[i])
            if t < 0:
                break
            served_by.append(t)
            tiers[t].hits += 1
            i += 1
        h = i - d
        host = tiers[0]
        host_policy = host.policy
        protected = set(keys)
        # Host stores: promotions of lower-tier hits and the offered blocks it lacks.
        offer_start = d + h if h else 0
        new_positions: list[int] = []
        for j, t in enumerate(served_by):
            if t > 0 and tiers[t].placement.promote:
                new_positions.append(d + j)
        touched: list[int] = [d + j for j, t in enumerate(served_by) if t == 0]
        for p in range(offer_start, n):
            key = keys[p]
            if key in host_policy:
                touched.append(p)
            elif host.placement.admit(key):
                new_positions.append(p)
            else:
                host.refused += 1
        self._store(0, [keys[p] for p in sorted(new_positions)], protected)
        # Uses of blocks already resident, tail first.
        touched.sort(reverse=True)
        for p in touched:
            host_policy.on_access(keys[p])
        for j in range(len(served_by) - 1, -1, -1):
            t = served_by[j]
            if t > 0:
                tiers[t].policy.on_access(keys[d + j])

    def _holder(self, key: int) -> int:
        """The first tier that holds ``key``, or -1."""
        for t, tier in enumerate(self.tiers):
            if key in tier.policy:
                return t
        return -1

    def _store(self, t: int, keys: list[int], protected: set[int]) -> None:
        """Store ``keys`` (head first, not resident in tier ``t``) with room made by eviction."""
        if not keys:
            return
        tier = self.tiers[t]
        policy = tier.policy
        need = len(policy) + len(keys) - tier.capacity
        if need > 0:
            victims = policy.evict(need, lambda key: key not in protected)
            if victims is None:
                tier.refused += len(keys)
                return
            tier.evictions += len(victims)
            if tier.placement.copy_down_on_evict() and t + 1 < len(self.tiers):
                # Victims come least valuable first; reversed, a chain evicted from its
                # tail reads head first again, and lands below in the same order.
                self._offer_down(t + 1, victims[::-1], protected)
        tier.stores += len(keys)
        parent = self._parent
        # Runs of consecutive chain blocks, deepest run first, each tail first.
        runs: list[list[int]] = []
        for key in keys:
            if runs and parent[key] == runs[-1][-1]:
                runs[-1].append(key)
            else:
                runs.append([key])
        for run in reversed(runs):
            policy.on_insert_run(run, parent[run[0]])
        if tier.placement.copy_down_on_store() and t + 1 < len(self.tiers):
            self._offer_down(t + 1, keys, protected)

    def _offer_down(self, t: int, keys: Iterable[int], protected: set[int]) -> None:
        tier = self.tiers[t]
        accepted = []
        for key in keys:
            if key in tier.policy:
                continue
            if tier.placement.admit(key):
                accepted.append(key)
            else:
                tier.refused += 1
        self._store(t, accepted, protected)


def simulate(
    trace: Sequence[Request],
    tiers: Sequence[TierSpec] | Sequence[Tier],
    device_blocks: int,
    device_hits: Sequence[int] | None = None,
) -> SimResult:
    """Replay ``trace`` through the device cache and the tier chain; count hits per tier.

    ``device_hits`` (from ``device_prefix_hits``) may be passed in to share one device
    replay between many policies.
    """
    if device_hits is None:
        device_hits = device_prefix_hits(trace, device_blocks)
    built = [t if isinstance(t, Tier) else Tier.from_spec(t) for t in tiers]
    chain = TierChain(built)
    accesses = 0
    for request, d in zip(trace, device_hits, strict=True):
        accesses += len(request.keys)
        chain.request(request.keys, d)
    return SimResult(
        accesses=accesses,
        device_hits=sum(device_hits),
        tier_names=[t.name for t in built],
        tier_hits=[t.hits for t in built],
        tier_stores=[t.stores for t in built],
    )


def opt_hits(trace: Sequence[Request], capacity: int, device_hits: Sequence[int]) -> int:
    """Belady's OPT: the most tier hits any policy of ``capacity`` blocks could get.

    What "optimal" means with prefix hits below a device cache:

    - The tiers see a fixed stream: the device's contents do not depend on them, so each
      request *demands* blocks ``d..n-1`` from the tiers and *offers* blocks ``0..d-1``
      (device hits, which a store may copy down for free).
    - Between two consecutive events of a block (demand or offer), holding it pays off
      only if the later event is a demand: then it is a hit. A block can be (re)stored at
      any of its events, so each such interval is independent, and OPT is the largest set
      of intervals of which at most ``capacity`` overlap at any time. With unit-size
      blocks, evicting the block whose next demand is farthest (and not storing a block
      that would be that one) is optimal for that problem: Belady's MIN with bypass.
    - Within a request, demands are looked up before anything is stored, as in the
      simulator, so a block stored by a request never takes a slot from one of its hits.
    - It counts a held block as a hit even if its predecessor missed, where a real cache
      would recompute it; so it bounds every policy's prefix hits from above. (With
      farthest-next-demand eviction a predecessor, demanded first, always leaves after its
      successor, so the two counts almost never differ.)
    """
    if capacity <= 0:
        return 0
    # Backward pass: for each (request, position), the stream index of the block's next
    # demand, or -1 when its next event is an offer or there is none (nothing to hold for).
    upcoming: dict[int, int] = {}
    next_demand: list[list[int]] = [[] for _ in trace]
    index = sum(len(r.keys) for r in trace)
    for r in range(len(trace) - 1, -1, -1):
        keys = trace[r].keys
        d = device_hits[r]
        index -= len(keys)
        row = [upcoming.get(key, -1) for key in keys]
        next_demand[r] = row
        for p, key in enumerate(keys):
            upcoming[key] = index + p if p >= d else -1
    resident: dict[int, int] = {}
    heap: list[tuple[int, int]] = []  # (-next demand, key), lazily invalidated
    hits = 0
    for r, request in enumerate(trace):
        keys = request.keys
        for p in range(device_hits[r], len(keys)):
            if resident.pop(keys[p], None) is not None:
                hits += 1
        for key, nxt in zip(keys, next_demand[r], strict=True):
            if nxt < 0:
                continue
            if len(resident) >= capacity:
                while True:
                    far, victim = heap[0]
                    if resident.get(victim) == -far:
                        break
                    heapq.heappop(heap)
                if -far <= nxt:
                    continue
                heapq.heappop(heap)
                del resident[victim]
            resident[key] = nxt
            heapq.heappush(heap, (-nxt, key))
        if len(heap) > 4 * capacity + 1024:
            heap = [(-nxt, key) for key, nxt in resident.items()]
            heapq.heapify(heap)
    return hits
