"""The host tier's manager: which block lives in which host slot, who may evict it, and when.

It runs on the engine's scheduler thread, next to the engine's own prefix cache, so every
method is synchronous bookkeeping that never blocks and never touches bytes. Its contract
is the one vLLM's ``OffloadingManager`` declares (``offload.vllm.manager_adapter`` maps one
onto the other):

- ``lookup(key)``: ``HIT`` when the row is in the host tier and readable, ``HIT_PENDING``
  when it will be (a store in flight), ``MISS`` otherwise.
- ``prepare_load(keys)`` pins the rows (a count: two requests sharing a prefix load it
  from one copy at the same time) and returns their slots in the order of ``keys``;
  ``complete_load(keys)`` unpins.
- ``touch(keys)`` records a hit; the keys are a prefix, touched tail first, so the head
  of a chain ends up the most recent and a chain is evicted from its tail.
- ``prepare_store(keys)`` drops keys already stored or in flight, allocates slots for the
  rest, evicting (never a pinned or in-flight row, never a key of the same call), and
  returns ``None`` with nothing changed when that cannot free enough. A readable row
  offered again counts as a use (``touch``), as vLLM's manager counts it; then the
  request's rows are renewed as vLLM renews them when a request ends (the policy's
  ``on_renew``: order, not a use), its loaded head the most recent.
  ``complete_store(keys, success)`` makes stored rows readable or frees failed ones.
- ``take_events()`` drains store / removal events once each, removals first; a key
  stored and removed between two drains is reported not at all. ``drop_events()`` drains
  them unread (nobody publishes them).
- ``reset()`` forgets every host row unless one is pinned or in flight.
- ``on_schedule_end()`` ends a scheduler step; a caller must call it once per step
  (``Offloader.poll`` does). A row reported ``HIT`` is kept from eviction until it is
  pinned by ``prepare_load`` or the step ends, so the load that follows finds it. A bounded
  number are kept so (``STEP_HITS_MAX_SHARE``): a caller that never ends its steps protects
  its most recent unloaded hits (a warning says so once), not every row it ever hit.

Where a block goes, with tiers below the host (``lower``, an ``offload.tiering.
LowerTierChain``; ``NoLowerTiers`` for a host-only stack):

- a host miss that a lower tier holds (``LowerTierChain.locate``) gets a freshly allocated
  host slot and a promotion into it, and answers ``HIT_PENDING`` until it lands; a
  promotion that failed leaves its key a ``MISS`` for a while (the chain remembers it), so
  the request recomputes it; a miss no tier is known to hold asks remote peers in the
  background (``RETRY`` while they are asked, with ``lookup_wait_s``);
- a stored row is copied down at ``complete_store`` to write-through tiers, and before its
  eviction to write-back tiers (rows near the eviction end are spilled in the
  background); until then it is *dirty*, and eviction prefers clean rows;
- a row being copied down (``readers``) or promoted (not ready) is never evicted.

Finished lower-tier work is applied at the start of every call, so the state never
changes behind the caller's back; promotions queued by a step's lookups and peer checks go
out together at ``on_schedule_end`` (``poll``, which it calls, does the same between
steps). For front ends, instead of reaching into the chain: ``inflight_below`` (lower-tier
operations in flight: keep stepping), ``wait_idle`` (block until there are none; the next
call applies them) and ``observe_results`` (each finished operation with its tier and
latency, the promotions landed and failed).

The engine's lock (``lock``) is held by the caller across a scheduler step; no method
takes it.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from itertools import filterfalse, islice, repeat
from typing import TypeVar

from offload.keys import GROUP_BYTES, OffloadKey, key_group
from offload.tier_engine import OpKind, OpResult
from offload.tiering import LowerTierChain, NoLowerTiers, TierObserver
from policies import EvictionPolicy
from policies.base import EvictableUnless
from tiers.host import SlotAllocator

log = logging.getLogger(__name__)

T = TypeVar("T")

HOST_MEDIUM = "host"

_GROUP_0 = (0).to_bytes(GROUP_BYTES, "big")

STEP_HITS_MAX_SHARE = 1 / 16
STEP_HITS_MIN = 1024
"""At most this share of the host rows, or ``STEP_HITS_MIN`` rows where that is more, is
kept from eviction as hits of the current step that no ``prepare_load`` has pinned yet, the
oldest let go first. vLLM pins a request's hits right after looking them up, so a step's
unpinned hits are those of the request being looked up (whose own promotions must not evict
them: hence the floor, a long prompt's worth) and of requests not scheduled. Unbounded, a
caller that never ended its steps protected every row it ever hit: on the shipped real
trace with 8,192 / 18,279 host rows, driven as vLLM drives the manager but never ending a
step, the hit ratio fell from 0.108 / 0.216 to 0.047 / 0.139 and calls/s 25-80x; bounded,
0.110 / 0.216, the calls/s of a caller that ends its steps within noise."""

PROMOTING_MAX_SHARE = 1 / 4
PROMOTING_MIN = 256
"""At most this share of the host rows (or ``PROMOTING_MIN`` where that is more, up to every
row) is promoting at once; a lookup past the bound is a ``MISS`` (the request
computes the block), counted in ``ChainStats.promotions_refused``. A promotion holds a host
row unreadable and unevictable until its slow tier answers: unbounded, every waiting
request's lookups promoted (vLLM #49902's storm) and a slow tier's promotions could fill the
host tier, refusing every store. The floor is a long prompt's worth (4,096 tokens of 16-token
blocks)."""

SPILLING_MAX_SHARE = 1 / 8
SPILLING_MIN = 16
"""At most this share of the host rows (or ``SPILLING_MIN`` where that is more) is being copied
down at once. A copy down holds its row unevictable until the tier below answers; past the
bound a write-through copy is dropped (``ChainStats.spills_dropped``) and a write-back one is
not started (the row stays dirty, is tried again as copies finish, and is counted in
``dirty_dropped`` if it is evicted first). Unbounded (only the tier engine's 64 operations per
tier, of any size), a slow tier's copies could hold every host row, so that every store of the
engine was refused while it wrote."""


class Lookup(enum.Enum):
    """What ``lookup`` found for a key."""

    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"
    RETRY = "retry"
    """Not here; a tier below is being asked whether it holds the key (``lookup_wait_s``):
    look it up again later. A caller that cannot wait treats it as a miss."""


_HIT, _MISS, _PENDING = Lookup.HIT, Lookup.MISS, Lookup.HIT_PENDING
"""Module constants for the hot path: ``Lookup.HIT`` is a class attribute lookup through
the enum's metaclass, ~10x the cost of a global."""


@dataclass(frozen=True)
class HostSlots:
    """Where rows are in the host tier: ``slots[i]`` holds ``keys[i]``."""

    keys: list[OffloadKey]
    slots: list[int]
    layouts: list[bytes | None] | None = None
    """Loads only: per key, the layout id of a row still in another engine's layout (the
    worker converts it as it loads it), ``None`` for a row in ours; ``None``: all ours."""

    def per_group(self, num_groups: int) -> list[list[int]]:
        """Slots split by the group of their key, keeping order within a group."""
        if num_groups == 1:  # most models: every key is of group 0 (prepare_* checked it)
            return [self.slots]
        return self._split(self.slots, num_groups)

    def layouts_per_group(self, num_groups: int) -> list[list[bytes | None]] | None:
        """``layouts`` split like ``per_group``, or ``None`` when every row is in our layout."""
        if self.layouts is None:
            return None
        return [self.layouts] if num_groups == 1 else self._split(self.layouts, num_groups)

    def _split(self, values: Sequence, num_groups: int) -> list[list]:
        grouped: list[list] = [[] for _ in range(num_groups)]
        for key, value in zip(self.keys, values, strict=True):
            grouped[key_group(key)].append(value)
        return grouped


@dataclass(frozen=True)
class StorePlan:
    """What ``prepare_store`` decided: the keys to copy out, their slots, the rows evicted."""

    keys_to_store: list[OffloadKey]
    store_spec: HostSlots
    evicted_keys: list[OffloadKey]


@dataclass(frozen=True)
class TierEvent:
    """Keys stored in (or removed from) the tier ``medium``, for ``take_events``."""

    keys: list[OffloadKey]
    medium: str
    removed: bool


@dataclass
class ManagerStats:
    lookups: int = 0
    hits: int = 0
    pending: int = 0
    retries: int = 0  # lookups told to come back: a tier below was being asked
    stored_rows: int = 0
    failed_stores: int = 0
    loaded_rows: int = 0
    evictions: int = 0
    rejected_stores: int = 0
    quarantined_slots: int = 0  # slots a tier may still write (abandoned promotions), now


@dataclass
class _Events:
    removed: dict[OffloadKey, None] = field(default_factory=dict)
    stored: dict[OffloadKey, None] = field(default_factory=dict)
    stored_below: dict[str, dict[OffloadKey, None]] = field(default_factory=dict)


class HostTierManager:
    """Host-tier bookkeeping for ``num_groups`` KV groups of ``slots_per_group`` rows each.

    ``make_policy(capacity)`` builds one eviction policy per group: slots of one group
    can only be freed by evicting keys of that group. ``lower`` is the chain of tiers
    below the host and ``host_row(group, slot)`` the bytes of a host row (what the lower
    tiers read and write); both or neither (neither: a host-only stack, ``NoLowerTiers``).
    """

    def __init__(
        self,
        num_groups: int,
        slots_per_group: int,
        make_policy: Callable[[int], EvictionPolicy],
        *,
        lower: LowerTierChain | None = None,
        host_row: Callable[[int, int], memoryview] | None = None,
        writeback_window: int | None = None,
        max_promoting_rows: int | None = None,
        max_spilling_rows: int | None = None,
    ) -> None:
        """``max_promoting_rows`` / ``max_spilling_rows``: rows promoting / being copied down at
        once (default: ``PROMOTING_*`` / ``SPILLING_*`` of the host rows)."""
        if (lower is None) != (host_row is None):
            raise ValueError("lower tiers need host_row, and host_row is only for lower tiers")
        if num_groups < 1 or slots_per_group < 1:
            raise ValueError(f"need at least one group and one slot, got {num_groups} and {slots_per_group}")
        self.num_groups = num_groups
        self.slots_per_group = slots_per_group
        self._make_policy = make_policy
        # A row's state is kept in sets and dicts by key, not in an object per row: a store,
        # its completion and an eviction then update them with one C call per batch
        # (``dict.update``, ``set.difference_update``), where an object per row cost a Python
        # step per row at each (measured: the floor of every policy's calls/s, ~1 us per row
        # stored and evicted). Every set but ``_slots`` holds the exceptions.
        self._slots: dict[OffloadKey, int] = {}  # every host row, in any state -> its slot in its group
        self._unready: set[OffloadKey] = set()  # stores and promotions in flight: not readable yet
        self._promoting: set[OffloadKey] = set()  # those of _unready a lower tier is copying up
        self._pins: dict[OffloadKey, int] = {}  # loads in flight (device <- host)
        self._readers: dict[OffloadKey, int] = {}  # copies down in flight (host -> lower tier)
        self._dirty: set[OffloadKey] = set()  # must reach a write-back tier before it is evicted
        self._layouts: dict[OffloadKey, bytes] = {}  # promoted in another engine's layout: converted on load
        self._allocators = [SlotAllocator(slots_per_group) for _ in range(num_groups)]
        # Per abandoned promotion (op id): the (group, slot)s its tier may still write.
        self._quarantined: dict[int, list[tuple[int, int]]] = {}
        self._policies = [make_policy(slots_per_group) for _ in range(num_groups)]
        self._miss_hooks = any(policy.overrides_on_miss() for policy in self._policies)
        self._events = _Events()
        self.stats = ManagerStats()
        self._lock = threading.RLock()
        self.lower: LowerTierChain = lower if lower is not None else NoLowerTiers()
        self._host_row = host_row
        # Rows reported HIT this step and not yet pinned, oldest first.
        self._step_hits: OrderedDict[OffloadKey, None] = OrderedDict()
        self._step_hits_max = max(STEP_HITS_MIN, int(num_groups * slots_per_group * STEP_HITS_MAX_SHARE))
        self._warned_step_hits = False
        self._last_lookup: dict[int, OffloadKey] = {}  # per group: a promoted key's likely parent
        self._last_touched: Sequence[OffloadKey] = ()  # this step's last loaded keys
        self._writeback_window = writeback_window or max(16, slots_per_group // 8)
        rows = num_groups * slots_per_group
        self.max_promoting_rows = max_promoting_rows or min(
            rows, max(PROMOTING_MIN, int(rows * PROMOTING_MAX_SHARE))
        )
        self.max_spilling_rows = max_spilling_rows or max(SPILLING_MIN, int(rows * SPILLING_MAX_SHARE))
        if self.max_promoting_rows < 1 or self.max_spilling_rows < 1:
            raise ValueError("max_promoting_rows and max_spilling_rows must be positive")
        self._spilling = 0  # copies down in flight, a row once per tier it is copied to
        self._lookup_host: Callable[[OffloadKey], Lookup] = self._host_lookup(_HIT, _MISS, _PENDING)
        if not self.lower.tiers:
            # Host only: nothing below to apply, promote, ask or count for admission. Bound
            # once, so the hot path does not pay for calls into ``NoLowerTiers`` (measured:
            # 2-5% of calls/s on the shipped trace).
            self.lookup = self._lookup_host  # type: ignore[method-assign]
            self.poll = _nothing_below  # type: ignore[method-assign]

    @property
    def lock(self) -> threading.RLock:
        """Held by the caller across a scheduler step; methods never take it themselves."""
        return self._lock

    # -- lookups and loads -------------------------------------------------------------

    def lookup(self, key: OffloadKey, below: AbstractSet[int] | None = None) -> Lookup:
        """Where ``key`` is: in the host tier (``_lookup_host``), else below (``_look_below``).

        ``below``: the indices of the lower tiers this lookup may promote from or ask (a
        request's choice, e.g. vLLM's ``kv_load_tiers``); ``None`` for all of them. The host
        tier is always looked in: every load comes from it.
        """
        lower = self.lower
        if lower.has_results():
            self.apply_finished()  # not poll(): promotions queued by this step's lookups go out together
        found = self._lookup_host(key)
        if found is Lookup.MISS:
            return self._look_below(key, below)
        self._last_lookup[key_group(key)] = key
        if found is Lookup.HIT:
            lower.observe(key)
        return found

    def host_lookup(self, hit: T, miss: T, pending: T) -> Callable[..., T]:
        """The host tier's ``lookup`` answering ``hit`` / ``miss`` / ``pending`` instead of
        ``Lookup``'s members, taking (and ignoring) a second argument: a front end whose
        caller has its own answers and passes a context (vLLM) hands this function to its
        caller as its own ``lookup``, without a frame of its own per key (``kvtier bench policy``'s
        scheduler table, long-doc QA: the vLLM adapter's speed rose from 0.72-0.80x of the
        manager called directly to 0.82-0.86x with this alone). Host only: with tiers below,
        a miss must go through ``lookup``."""
        if self.lower.tiers:
            raise ValueError("host_lookup answers for the host tier alone: there are tiers below")
        return self._host_lookup(hit, miss, pending)

    def _host_lookup(self, hit: T, miss: T, pending: T) -> Callable[..., T]:
        """``lookup`` in the host tier alone, as a closure over the state it reads (none of it
        is ever replaced): a host-only manager's ``lookup`` (bound in ``__init__``)."""
        stats, slots, unready, step_hits = self.stats, self._slots, self._unready, self._step_hits
        step_hits_max, drop_oldest = self._step_hits_max, self._drop_oldest_step_hit

        def lookup_host(key: OffloadKey, _context: object = None) -> T:
            stats.lookups += 1
            if key not in slots:
                return miss
            if key in unready:
                stats.pending += 1
                return pending
            stats.hits += 1
            if key not in step_hits:
                step_hits[key] = None
                if len(step_hits) > step_hits_max:
                    drop_oldest()
            return hit

        return lookup_host

    def _look_below(self, key: OffloadKey, below: AbstractSet[int] | None) -> Lookup:
        """A host miss: promote ``key`` from a tier that holds it, else ask the peers about it
        (only tiers in ``below``, unless it is ``None``)."""
        lower = self.lower
        tier = lower.locate(key, below)
        if tier is not None and len(self._promoting) >= self.max_promoting_rows:
            lower.stats.promotions_refused += 1  # the request computes it: never waits on a backlog
            return Lookup.MISS
        if tier is not None and self._promote(key, tier):
            self._last_lookup[key_group(key)] = key
            self.stats.pending += 1
            return Lookup.HIT_PENDING
        if lower.ask(key, below):
            self.stats.retries += 1
            return Lookup.RETRY
        return Lookup.MISS

    def prepare_load(self, keys: Sequence[OffloadKey]) -> HostSlots:
        """Pin readable rows for loading; all or none (a key that is not a HIT raises)."""
        slots, layouts = self.pin_for_load(keys)
        return HostSlots(list(keys), slots, layouts)

    def pin_for_load(self, keys: Sequence[OffloadKey]) -> tuple[list[int], list[bytes | None] | None]:
        """``prepare_load`` as ``(slots, layouts)``, for a front end that builds its own spec
        (a ``HostSlots``, a frozen dataclass, costs ~0.6 us: a third of what vLLM's adapter
        added per request over the manager called directly)."""
        slots, unready = self._slots, self._unready
        if not all(map(slots.__contains__, keys)) or not unready.isdisjoint(keys):
            bad = next(key for key in keys if key not in slots or key in unready)
            raise ValueError(f"prepare_load: key {bad.hex()} is not a readable host row")
        pins, step_hits = self._pins, self._step_hits
        for key in keys:
            pins[key] = pins.get(key, 0) + 1
            step_hits.pop(key, None)  # the pin protects it now
        found = list(map(slots.__getitem__, keys))
        if not self._layouts:
            return found, None
        layouts = list(map(self._layouts.get, keys))
        return found, layouts if any(layouts) else None

    def _drop_oldest_step_hit(self) -> None:
        # OrderedDict: O(1) here, where deleting a plain dict's first key over and over
        # leaves each next lookup of the first key slower.
        self._step_hits.popitem(last=False)
        if not self._warned_step_hits:
            self._warned_step_hits = True
            log.warning(
                "more than %d rows reported HIT and not loaded in one step: the oldest may be evicted again;"
                " call on_schedule_end once per scheduler step (Offloader.poll does)",
                self._step_hits_max,
            )

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self._last_touched = keys
        self._use(keys)

    def _use(self, keys: Sequence[OffloadKey]) -> None:
        """``on_access`` of each resident key, tail first (the head ends the most recent)."""
        slots = self._slots
        if self.num_groups == 1:
            on_access = self._policies[0].on_access
            for key in reversed(keys):
                if key in slots:
                    on_access(key)
            return
        for key in reversed(keys):
            if key in slots:
                self._policies[key_group(key)].on_access(key)

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        pins, loaded = self._pins, 0
        for key in keys:
            if not _release(pins, key):
                log.warning("complete_load: key %s was not being loaded", key.hex())
                continue
            loaded += 1
        self.stats.loaded_rows += loaded

    # -- stores ------------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[OffloadKey]) -> StorePlan | None:
        planned = self.plan_store(keys)
        if planned is None:
            return None
        new_keys, slots, evicted = planned
        return StorePlan(new_keys, HostSlots(new_keys, slots), evicted)

    def plan_store(
        self, keys: Sequence[OffloadKey]
    ) -> tuple[list[OffloadKey], list[int], list[OffloadKey]] | None:
        """``prepare_store`` as ``(keys to store, their slots, evicted keys)``, for a front end
        that builds its own result (see ``pin_for_load``)."""
        self.poll()
        new_keys = list(filterfalse(self._slots.__contains__, dict.fromkeys(keys)))
        if self.num_groups == 1:
            return self._prepare_store_one_group(keys, new_keys)
        wanted = [0] * self.num_groups
        group_of = {key: int.from_bytes(key[-GROUP_BYTES:], "big") for key in new_keys}  # key_group, inlined
        for key, group in group_of.items():
            if group >= self.num_groups or len(key) <= GROUP_BYTES:
                self._group(key)  # raises the error that names the key
            wanted[group] += 1
        evicted = self._room_for(new_keys, wanted, keys)
        again = self._use_offered_again(keys) if len(new_keys) < len(keys) else []
        again_first = bool(again) and _single_run_start(keys, new_keys) is not None
        if evicted is None:
            self._renew_request(keys, again, again_first)
            return None

        free_slots = [
            iter(self._allocators[group].allocate(count) or ()) if count else iter(())
            for group, count in enumerate(wanted)
        ]
        slots = [next(free_slots[group_of[key]]) for key in new_keys]  # make_room left enough free
        self._slots.update(zip(new_keys, slots, strict=True))
        self._unready.update(new_keys)
        for group, run, parent in reversed(_new_runs(keys, group_of)):  # the last run first
            self._policies[group].on_insert_run(run, parent)
        if new_keys or again:
            self._renew_request(keys, again, again_first)
        self._write_back(extra=len(new_keys))
        return new_keys, slots, evicted

    def _prepare_store_one_group(
        self, keys: Sequence[OffloadKey], new_keys: list[OffloadKey]
    ) -> tuple[list[OffloadKey], list[int], list[OffloadKey]] | None:
        """``plan_store`` with one KV group (most models): no per-key group bookkeeping."""
        # Every key must name group 0: checked by map() in C, key by key only to name a bad one.
        if new_keys and (
            min(map(len, new_keys)) <= GROUP_BYTES or not all(map(bytes.endswith, new_keys, repeat(_GROUP_0)))
        ):
            for key in new_keys:
                if len(key) <= GROUP_BYTES or not key.endswith(_GROUP_0):
                    self._group(key)  # raises the error that names the key
        evicted = self._room_for(new_keys, [len(new_keys)], keys)
        offered_again = len(new_keys) < len(keys)
        again = self._use_offered_again(keys) if offered_again else []
        start = _single_run_start(keys, new_keys) if offered_again else None  # new keys: one run at the end
        if evicted is None:
            self._renew_request(keys, again, start is not None)
            return None
        slots = self._allocators[0].allocate(len(new_keys)) if new_keys else []
        assert slots is not None, "eviction freed too few slots"
        self._slots.update(zip(new_keys, slots, strict=True))
        self._unready.update(new_keys)
        policy = self._policies[0]
        if len(new_keys) == len(keys):  # the usual store: every key new, so one run
            if new_keys:
                policy.on_insert_run(new_keys, None)
        elif start is not None:
            policy.on_insert_run(new_keys, keys[start - 1])
        elif new_keys:
            # the last run first: a store tail first, as vLLM renews a request's uses
            for _, run, parent in reversed(_new_runs(keys, dict.fromkeys(new_keys, 0))):
                policy.on_insert_run(run, parent)
        if new_keys or again:
            self._renew_request(keys, again, start is not None)
        self._write_back(extra=len(new_keys))
        return new_keys, slots, evicted

    def _use_offered_again(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """Readable rows offered to ``prepare_store`` again are used again (after the store's
        eviction, or its refusal, and before its new rows are in); those keys, in order.
        vLLM's manager counts them so (its ``ready_existing_keys``, whether the store goes
        ahead or not); uncounted, the prefix of a prompt that the device cache serves, which
        vLLM offers whole when nothing was loaded, aged in the host tier: on ``kvtier bench
        policy``'s scheduler table ``lru`` was 0.1-1.9% under vLLM ``lru`` (5% hosts)."""
        slots, unready = self._slots, self._unready
        again = [key for key in keys if key in slots and key not in unready]
        if again:
            self._use(again)
        return again

    def _renew_request(self, keys: Sequence[OffloadKey], again: list[OffloadKey], again_first: bool) -> None:
        """Renew the request's rows as vLLM does when a request ends: every key it used
        (loaded, offered again, stored), tail first, so that its head ends the most recent and
        outlives what the request stored after it (``on_renew``: order only, not a use).

        The rows this step last loaded are its head, renewed last. A store's new keys went in
        tail first, already in order; rows offered again before them (the usual: the prefix
        the device cache served, when vLLM offers a whole prompt) are renewed after them, and
        where new and old keys interleave the whole offer is. Without this, the loaded prefix
        aged behind the blocks the request computed: on ``kvtier bench policy``'s scheduler
        table ``lru`` was up to 0.6% under vLLM ``lru`` (long-doc QA and agentic 5%), with it
        equal in every cell; ``arc-vllm`` holds what vLLM's ``arc`` holds either way (a
        renewal moves a key within its list: ``tests/policies/test_arc_vllm.py``).
        ``again_first``: the store's new keys are one run after every key offered again."""
        if again:
            self._renew(again if again_first else keys)
        if self._last_touched:
            self._renew(self._last_touched)

    def _renew(self, keys: Sequence[OffloadKey]) -> None:
        """``on_renew`` of ``keys`` tail first, each group's policy with its own keys."""
        if self.num_groups == 1:
            self._policies[0].on_renew(keys[::-1])
            return
        for group, group_keys in _by_group(reversed(keys)).items():
            self._policies[group].on_renew(group_keys)

    def _room_for(
        self, new_keys: list[OffloadKey], wanted: list[int], keys: Sequence[OffloadKey]
    ) -> list[OffloadKey] | None:
        """Count ``new_keys`` for the admission rules below, then evict so each group has
        ``wanted[group]`` free slots (never a key of ``keys``): the victims, or ``None``
        (a rejected store, counted) and no change."""
        self.lower.computed(new_keys)
        if new_keys and self._miss_hooks:
            self._tell_misses(new_keys)
        evicted = self._make_room(wanted, protected=keys)
        if evicted is None:
            self.stats.rejected_stores += 1
        return evicted

    def _tell_misses(self, new_keys: list[OffloadKey]) -> None:
        """``on_miss`` of the policies that learn from a miss before their eviction (vLLM's
        ARC variant), each with its group's keys in order."""
        if self.num_groups == 1:
            self._policies[0].on_miss(new_keys)
            return
        for group, group_keys in _by_group(new_keys).items():
            if self._policies[group].overrides_on_miss():
                self._policies[group].on_miss(group_keys)

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        self.poll()
        keys = keys if type(keys) is list else list(keys)
        if not keys:
            return
        stored = dict.fromkeys(keys)
        unready = self._unready
        if not (success and len(stored) == len(keys) and unready.issuperset(stored)) or (
            self._promoting and not self._promoting.isdisjoint(stored)
        ):
            stored = self._complete_store_keywise(keys, success)
            if not stored:
                return
        unready.difference_update(stored)
        self._events.stored.update(stored)
        self.stats.stored_rows += len(stored)
        lower = self.lower
        if lower.has_write_back:
            self._dirty.update(stored)
        if lower.has_write_through:
            self._copy_down(list(stored), on_evict=False)
        if lower.has_write_back:
            self._write_back()  # rows stored near the eviction end start their way down now

    def _complete_store_keywise(self, keys: list[OffloadKey], success: bool) -> dict[OffloadKey, None]:
        """``complete_store`` key by key: a failed store's rows are freed, keys that were not
        being stored (or came twice) are warned about and skipped. The keys stored."""
        stored: dict[OffloadKey, None] = {}
        for key in keys:
            if key not in self._unready or key in self._promoting or key in stored:
                log.warning("complete_store: key %s was not being stored", key.hex())
            elif success:
                stored[key] = None
            else:
                self._policies[key_group(key)].on_remove(key)
                self._drop(key, removed_event=False)
                self.stats.failed_stores += 1
        return stored

    # -- lifecycle ---------------------------------------------------------------------

    def on_request_finished(self, request_id: str) -> None:
        """Nothing is held per request: pins are released by ``complete_load``."""

    def on_schedule_end(self) -> None:
        """End of a scheduler step: rows reported ``HIT`` during it may be evicted again.

        Between a ``HIT`` and the ``prepare_load`` that pins it, nothing this manager does
        (a store, a promotion) evicts that row, or the load would find it gone.
        """
        self._step_hits.clear()
        self._last_touched = ()
        self._last_lookup.clear()
        self.poll()

    def take_events(self) -> list[TierEvent]:
        self.poll()
        events = []
        if self._events.removed:
            events.append(TierEvent(list(self._events.removed), HOST_MEDIUM, removed=True))
        if self._events.stored:
            events.append(TierEvent(list(self._events.stored), HOST_MEDIUM, removed=False))
        for medium, keys in self._events.stored_below.items():
            events.append(TierEvent(list(keys), medium, removed=False))
        self._events = _Events()
        return events

    def held_by_caller(self) -> tuple[dict[OffloadKey, int], list[OffloadKey]]:
        """What the caller holds now: pins by key (``prepare_load`` not yet completed) and the
        keys of stores prepared and not completed. O(rows): for a reset, not a hot path (a
        front end need not mirror them key by key on every call)."""
        unready, promoting = self._unready, self._promoting
        storing = [key for key in self._slots if key in unready and key not in promoting]
        return dict(self._pins), storing

    def drop_events(self) -> None:
        """``take_events`` for a caller that publishes none, right after ``on_schedule_end``
        (which applied the finished work below): drained, without building them."""
        events = self._events  # emptied in place: a new _Events per step cost ~1 us
        if events.removed:
            events.removed.clear()
        if events.stored:
            events.stored.clear()
        if events.stored_below:
            events.stored_below.clear()

    def reset(self) -> bool:
        """Forget every host row; refused (``False``, nothing changed) while any is pinned or in flight.

        Lower tiers keep their rows: they are caches of what any engine computed, not of
        this engine's state.
        """
        self.poll()
        if self._pins or self._readers or self._unready:
            return False
        self._drop_many(list(self._slots))  # every row is readable here
        self._policies = [self._make_policy(self.slots_per_group) for _ in range(self.num_groups)]
        self._miss_hooks = any(policy.overrides_on_miss() for policy in self._policies)
        self.lower.forget_failures()  # every key may be promoted again
        return True

    def discard(self, keys: Iterable[OffloadKey]) -> int:
        """Forget these host rows as if evicted (removal events included); rows pinned,
        read or not yet readable stay, and so do lower tiers' copies. The number forgotten."""
        busy = (self._pins, self._readers, self._unready)
        victims = [
            key for key in dict.fromkeys(keys) if key in self._slots and not any(key in b for b in busy)
        ]
        for key in victims:
            self._policies[key_group(key)].on_remove(key)
        self._drop_many(victims)
        return len(victims)

    def poll(self) -> None:
        """Send queued promotions and checks below, and apply finished lower-tier work."""
        self._drop_refused(self.lower.send())
        self.apply_finished()

    def apply_finished(self) -> None:
        """Apply finished lower-tier work: promoted rows become readable, spilled rows clean."""
        results = self.lower.finished()
        for result in results:
            if result.kind is OpKind.GET:
                self._finish_promotion(result)
            elif result.kind is OpKind.PUT:
                self._finish_copy_down(result)
            elif result.kind is OpKind.RELEASE:
                self._release_quarantined(result.op_id)
        if results:
            self._write_back()  # rows that finished copying may have left room for more

    def check_below(self, keys: Sequence[OffloadKey]) -> None:
        """Ask tiers below whose index is partial (remote peers) about ``keys``, in the background.

        A lookup stops at its first miss; an engine that knows the rest of the prefix passes
        it here so that one round trip finds the whole prefix for the next request.
        """
        self.lower.check(key for key in keys if key not in self._slots)

    # -- for front ends ----------------------------------------------------------------

    def inflight_below(self) -> int:
        """Lower-tier operations (promotions, spills, peer checks) submitted and not yet
        finished: a front end keeps stepping while there are some."""
        return self.lower.inflight()

    def wait_idle(self, timeout: float | None) -> bool:
        """Block until no lower-tier operation is in flight (``True``) or ``timeout`` passes
        (``False``). Nothing is applied here: the next call (or ``poll``) applies it."""
        return self.lower.wait_idle(timeout)

    def observe_results(self, observer: TierObserver) -> None:
        """Call ``observer`` with every finished lower-tier operation as it is applied: its
        tier, latency, and for promotions the keys landed and failed (those stay misses for
        ``offload.tiering.RETRY_FAILED_PROMOTIONS_S``). Never called without tiers below."""
        self.lower.observe_results(observer)

    def shutdown(self) -> None:
        self.lower.close()

    def promoting_rows(self) -> int:
        """Host rows a lower tier is copying up now (at most ``max_promoting_rows``)."""
        return len(self._promoting)

    def spilling_rows(self) -> int:
        """Copies down in flight now, a row once per tier (at most ``max_spilling_rows``)."""
        return self._spilling

    def contains(self, key: OffloadKey) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def held_keys(self) -> list[OffloadKey]:
        """The keys of the host rows held now (readable or not)."""
        return list(self._slots)

    def slot_of(self, key: OffloadKey) -> int | None:
        """The host slot (in its group) holding ``key``'s row now; None where none does."""
        return self._slots.get(key)

    def num_free_slots(self, group: int) -> int:
        return self._allocators[group].num_free

    # -- internals ---------------------------------------------------------------------

    def _group(self, key: OffloadKey) -> int:
        group = key_group(key)
        if group >= self.num_groups:
            raise ValueError(f"key {key.hex()} names group {group}, but there are {self.num_groups} groups")
        return group

    def _drop(self, key: OffloadKey, *, removed_event: bool) -> None:
        """Free a row whose key the policy has already forgotten (no load or copy reads it)."""
        ready = key not in self._unready
        self._allocators[key_group(key)].free([self._forget(key)])
        if removed_event and ready:
            self._announce_removal(key)

    def _forget(self, key: OffloadKey) -> int:
        """Forget a row's state (no load or copy reads it); its slot, which the caller frees
        or, where a tier may still write into it, keeps out of use."""
        self._unready.discard(key)
        self._promoting.discard(key)
        self._dirty.discard(key)
        self._layouts.pop(key, None)
        return self._slots.pop(key)

    def _drop_many(self, victims: list[OffloadKey]) -> None:
        """``_drop`` of readable rows no load or copy reads (evicted, or a reset), freeing each
        group's slots at once."""
        take_slot = self._slots.pop
        if self.num_groups == 1:
            self._allocators[0].free(list(map(take_slot, victims)))
        else:
            freed: list[list[int]] = [[] for _ in range(self.num_groups)]
            for key in victims:
                freed[key_group(key)].append(take_slot(key))
            for group, slots in enumerate(freed):
                if slots:
                    self._allocators[group].free(slots)
        if self._dirty and (dropped_dirty := self._dirty.intersection(victims)):
            self._dirty.difference_update(dropped_dirty)
            self.lower.dropped_dirty(len(dropped_dirty))
        if self._layouts:
            for key in victims:
                self._layouts.pop(key, None)
        stored, removed = self._events.stored, self._events.removed
        if stored and not stored.keys().isdisjoint(victims):
            for key in victims:
                self._announce_removal(key)
        else:
            removed.update(dict.fromkeys(victims))

    def _announce_removal(self, key: OffloadKey) -> None:
        if key in self._events.stored:  # stored and removed since the last drain: never seen
            del self._events.stored[key]
        else:
            self._events.removed[key] = None

    def _evictable(self, protected: set[OffloadKey], *, clean_only: bool) -> EvictableUnless:
        """Whether a row may go: readable, not pinned or read, not protected by the call or the step."""
        blocked: list[AbstractSet[OffloadKey]] = [
            self._unready,
            self._pins.keys(),
            protected,
            self._step_hits.keys(),
        ]
        if self.lower.tiers:  # (host only, no row is ever read by a copy down, nor dirty)
            blocked.append(self._readers.keys())
            if clean_only and self.lower.has_write_back:
                blocked.append(self._dirty)
        return EvictableUnless(*blocked)

    def _make_room(self, wanted: Sequence[int], protected: Iterable[OffloadKey]) -> list[OffloadKey] | None:
        """Evict so each group has ``wanted[group]`` free slots: the victims, or ``None`` and no change.

        Rows already safe below (clean) go first; a dirty row is dropped without reaching
        its write-back tier only when nothing clean can make room.
        """
        victims: dict[int, list[OffloadKey]] = {}
        protected_set: set[OffloadKey] | None = None
        for group, count in enumerate(wanted):
            short = count - self._allocators[group].num_free
            if short <= 0:
                continue
            if protected_set is None:  # built only when something must be evicted
                protected_set = set(protected)
            policy = self._policies[group]
            chosen = policy.evict(short, self._evictable(protected_set, clean_only=True))
            if chosen is None and self.lower.has_write_back:
                chosen = policy.evict(short, self._evictable(protected_set, clean_only=False))
            if chosen is None:
                self._restore(victims)
                return None
            victims[group] = chosen  # type: ignore[assignment]
        evicted = [key for chosen in victims.values() for key in chosen]
        self._drop_many(evicted)
        self.stats.evictions += len(evicted)
        return evicted

    def _promote(self, key: OffloadKey, tier: int) -> bool:
        """Start copying ``key`` up from ``tier`` into a fresh host row; ``False`` if no row can be freed."""
        assert self._host_row is not None
        group = self._group(key)
        wanted = [0] * self.num_groups
        wanted[group] = 1
        if self._make_room(wanted, protected={key}) is None:
            return False
        allocated = self._allocators[group].allocate(1)
        assert allocated is not None, "eviction freed too few slots"
        slot = allocated[0]
        self._slots[key] = slot
        self._unready.add(key)
        self._promoting.add(key)
        self._policies[group].on_insert(key, self._last_lookup.get(group))
        self._drop_refused(self.lower.promote(tier, key, self._host_row(group, slot)))
        return True

    def _drop_refused(self, keys: Sequence[bytes]) -> None:
        """Free the rows of promotions their tier refused (saturated): those keys stay misses."""
        if keys:
            self.lower.stats.promotions_refused += len(keys)
        for key in keys:
            key = OffloadKey(key)
            self._policies[key_group(key)].on_remove(key)
            self._drop(key, removed_event=False)

    def _finish_promotion(self, result: OpResult) -> None:
        """Promoted rows become readable; failed ones are freed (the chain remembers the keys)."""
        layouts = result.layouts or [None] * len(result.keys)
        for key, ok, layout in zip(result.keys, result.ok, layouts, strict=True):
            key = OffloadKey(key)
            if key not in self._promoting:  # cannot happen: a promoting row is never evictable
                continue
            if ok:
                self._unready.discard(key)
                self._promoting.discard(key)
                if layout is not None:
                    self._layouts[key] = layout
                self._events.stored[key] = None
                continue
            group = key_group(key)
            self._policies[group].on_remove(key)
            if result.abandoned:  # the tier may still write into the slot: out of use until it says
                self.stats.quarantined_slots += 1
                self._quarantined.setdefault(result.op_id, []).append((group, self._forget(key)))
            else:
                self._drop(key, removed_event=False)

    def _release_quarantined(self, op_id: int) -> None:
        """The transfer of an abandoned promotion has ended (``OpKind.RELEASE``): its slots
        are free again."""
        for group, slot in self._quarantined.pop(op_id, ()):
            self._allocators[group].free([slot])
            self.stats.quarantined_slots -= 1

    def _copy_down(self, keys: Sequence[OffloadKey], *, on_evict: bool) -> None:
        """Start copying host rows to the tiers that take them (write-back or write-through),
        as many as ``max_spilling_rows`` allows: past it, write-through copies are dropped
        (counted) and write-back rows stay dirty (tried again when copies finish)."""
        room = self.max_spilling_rows - self._spilling
        if len(keys) > room:
            if not on_evict:
                self.lower.stats.spills_dropped += len(keys) - max(room, 0)
            keys = keys[: max(room, 0)]
        if not keys:
            return
        copying, unwanted = self.lower.spill(keys, self._row_bytes, on_evict=on_evict)
        if on_evict:  # rows not admitted below: nothing to keep them dirty for
            self._dirty.difference_update(map(OffloadKey, unwanted))
        readers = self._readers
        for key in map(OffloadKey, copying):
            readers[key] = readers.get(key, 0) + 1
        self._spilling += len(copying)

    def _row_bytes(self, key: bytes) -> memoryview:
        assert self._host_row is not None
        key = OffloadKey(key)
        return self._host_row(key_group(key), self._slots[key])

    def _finish_copy_down(self, result: OpResult) -> None:
        """Copied rows may be read again; write-back ones are clean (or not worth retrying)."""
        medium = self.lower.tier_kind(result.tier)
        write_back = self.lower.writes_back(result.tier)
        for key, ok in zip(result.keys, result.ok, strict=True):
            key = OffloadKey(key)
            # An abandoned copy may still read the row: its read stays counted.
            released = not result.abandoned and _release(self._readers, key)
            if released:
                self._spilling -= 1
            if released and write_back:
                self._dirty.discard(key)  # copied, or failed and not worth retrying
            if ok:
                self._events.stored_below.setdefault(medium, {})[key] = None

    def _write_back(self, extra: int = 0) -> None:
        """Copy down dirty rows near the eviction end, so victims are clean when room is needed."""
        if not self.lower.has_write_back:
            return
        window = self._writeback_window + extra
        for policy in self._policies:
            if self._spilling >= self.max_spilling_rows:
                return  # the rows stay dirty: tried again when copies finish
            candidates = []
            for key in islice(iter(policy), window):
                if key in self._dirty and key not in self._unready and key not in self._readers:
                    candidates.append(key)
            if candidates:
                self._copy_down(candidates, on_evict=True)

    def _restore(self, victims: dict[int, list[OffloadKey]]) -> None:
        """Give back victims chosen for a store that turned out impossible (they become recent)."""
        for group, chosen in victims.items():
            for key in chosen:
                self._policies[group].on_insert(key)


def _nothing_below() -> None:
    """``poll`` of a host-only manager: nothing below to send or apply."""


def _release(counts: dict[OffloadKey, int], key: OffloadKey) -> bool:
    """One holder of ``key`` (a load's pin, a copy's read) is done: count it down, forget the
    key at zero. ``False`` if nothing held it."""
    count = counts.get(key)
    if count is None:
        return False
    if count == 1:
        del counts[key]
    else:
        counts[key] = count - 1
    return True


def _by_group(keys: Iterable[OffloadKey]) -> dict[int, list[OffloadKey]]:
    """``keys`` split by their group (checked already), in order within each."""
    by_group: dict[int, list[OffloadKey]] = {}
    for key in keys:
        by_group.setdefault(key_group(key), []).append(key)
    return by_group


def _single_run_start(keys: Sequence[OffloadKey], new_keys: list[OffloadKey]) -> int | None:
    """Where ``new_keys`` are one run at the end of ``keys`` (held keys first: vLLM offers a
    whole prompt when it loaded nothing), its index in ``keys``; else ``None``. What
    ``_new_runs`` finds then, by list operations in C instead of a Python loop per key
    (only for ``keys`` without repeats, where its order is theirs)."""
    start = len(keys) - len(new_keys)
    if start <= 0 or keys[start:] != new_keys or len(set(keys)) != len(keys):
        return None
    return start


def _new_runs(
    keys: Sequence[OffloadKey], new: dict[OffloadKey, int]
) -> list[tuple[int, list[OffloadKey], OffloadKey | None]]:
    """Maximal runs of new keys (``new``: key -> group) that follow each other in one group's prefix order.

    ``(group, run, parent)``: ``parent`` is the key just before the run in the same group
    (already stored) or ``None`` at the start of the call. Policies take a run at once so
    that a chain's head ends up the last of it to be evicted.
    """
    runs: list[tuple[int, list[OffloadKey], OffloadKey | None]] = []
    open_runs: dict[int, tuple[list[OffloadKey], OffloadKey | None]] = {}
    previous: dict[int, OffloadKey] = {}
    for key in dict.fromkeys(keys):
        group = new.get(key)
        if group is not None:
            if group not in open_runs:
                open_runs[group] = ([], previous.get(group))
            open_runs[group][0].append(key)
        else:
            group = key_group(key)
            if group in open_runs:
                run, parent = open_runs.pop(group)
                runs.append((group, run, parent))
        previous[group] = key
    runs.extend((group, run, parent) for group, (run, parent) in open_runs.items())
    return runs
