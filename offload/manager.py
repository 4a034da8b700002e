"""The offloading manager: which block lives in which host slot, who may evict it, and when.

It runs on the engine's scheduler thread, next to the engine's own prefix cache, so every
method is synchronous bookkeeping that never blocks and never touches bytes. Its contract
is vLLM's ``OffloadingManager``'s:

- ``lookup(key)``: ``HIT`` when the row is in the host tier and readable, ``HIT_PENDING``
  when it will be (a store in flight), ``MISS`` otherwise.
- ``prepare_load(keys)`` pins the rows (a count: two requests sharing a prefix load it
  from one copy at the same time) and returns their slots in the order of ``keys``;
  ``complete_load(keys)`` unpins.
- ``touch(keys)`` records a hit; the keys are a prefix, touched tail first, so the head
  of a chain ends up the most recent and a chain is evicted from its tail.
- ``prepare_store(keys)`` drops keys already stored or in flight, allocates slots for the
  rest, evicting (never a pinned or in-flight row, never a key of the same call), and
  returns ``None`` with nothing changed when that cannot free enough.
  ``complete_store(keys, success)`` makes stored rows readable or frees failed ones.
- ``take_events()`` drains store / removal events once each, removals first; a key
  stored and removed between two drains is reported not at all.
- ``reset()`` forgets everything unless a row is pinned or in flight.

The engine's lock (``lock``) is held by the caller across a scheduler step; no method
takes it.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from offload.keys import OffloadKey, key_group
from policies import EvictionPolicy
from tiers.host import SlotAllocator

log = logging.getLogger(__name__)

HOST_MEDIUM = "host"


class LookupResult(enum.Enum):
    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"


@dataclass(frozen=True)
class HostSlots:
    """Where rows are in the host tier: ``slots[i]`` holds ``keys[i]``."""

    keys: list[OffloadKey]
    slots: list[int]

    def per_group(self, num_groups: int) -> list[list[int]]:
        """Slots split by the group of their key, keeping order within a group."""
        grouped: list[list[int]] = [[] for _ in range(num_groups)]
        for key, slot in zip(self.keys, self.slots, strict=True):
            grouped[key_group(key)].append(slot)
        return grouped


@dataclass(frozen=True)
class PrepareStoreOutput:
    keys_to_store: list[OffloadKey]
    store_spec: HostSlots
    evicted_keys: list[OffloadKey]


@dataclass(frozen=True)
class OffloadingEvent:
    keys: list[OffloadKey]
    medium: str
    removed: bool


@dataclass
class _Row:
    slot: int
    ready: bool = False
    pins: int = 0


@dataclass
class ManagerStats:
    lookups: int = 0
    hits: int = 0
    pending: int = 0
    stored_rows: int = 0
    failed_stores: int = 0
    loaded_rows: int = 0
    evictions: int = 0
    rejected_stores: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Events:
    removed: dict[OffloadKey, None] = field(default_factory=dict)
    stored: dict[OffloadKey, None] = field(default_factory=dict)


class OffloadingManager:
    """Host-tier bookkeeping for ``num_groups`` KV groups of ``slots_per_group`` rows each.

    ``make_policy(capacity)`` builds one eviction policy per group: slots of one group
    can only be freed by evicting keys of that group.
    """

    def __init__(
        self,
        num_groups: int,
        slots_per_group: int,
        make_policy: Callable[[int], EvictionPolicy],
    ) -> None:
        if num_groups < 1 or slots_per_group < 1:
            raise ValueError(f"need at least one group and one slot, got {num_groups} and {slots_per_group}")
        self.num_groups = num_groups
        self.slots_per_group = slots_per_group
        self._make_policy = make_policy
        self._rows: dict[OffloadKey, _Row] = {}
        self._allocators = [SlotAllocator(slots_per_group) for _ in range(num_groups)]
        self._policies = [make_policy(slots_per_group) for _ in range(num_groups)]
        self._events = _Events()
        self.stats = ManagerStats()
        self._lock = threading.RLock()

    @property
    def lock(self) -> threading.RLock:
        """Held by the caller across a scheduler step; methods never take it themselves."""
        return self._lock

    # -- lookups and loads -------------------------------------------------------------

    def lookup(self, key: OffloadKey) -> LookupResult:
        self.stats.lookups += 1
        row = self._rows.get(key)
        if row is None:
            return LookupResult.MISS
        if row.ready:
            self.stats.hits += 1
            return LookupResult.HIT
        self.stats.pending += 1
        return LookupResult.HIT_PENDING

    def prepare_load(self, keys: Sequence[OffloadKey]) -> HostSlots:
        """Pin readable rows for loading; all or none (a key that is not a HIT raises)."""
        rows = []
        for key in keys:
            row = self._rows.get(key)
            if row is None or not row.ready:
                raise ValueError(f"prepare_load: key {key.hex()} is not a readable host row")
            rows.append(row)
        for row in rows:
            row.pins += 1
        return HostSlots(list(keys), [row.slot for row in rows])

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        for key in reversed(keys):
            if key in self._rows:
                self._policies[key_group(key)].on_access(key)

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            row = self._rows.get(key)
            if row is None or row.pins == 0:
                log.warning("complete_load: key %s was not being loaded", key.hex())
                continue
            row.pins -= 1
            self.stats.loaded_rows += 1

    # -- stores ------------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        protected = set(keys)
        new_keys = [key for key in dict.fromkeys(keys) if key not in self._rows]
        wanted = [0] * self.num_groups
        for key in new_keys:
            wanted[self._group(key)] += 1

        def evictable(key: object) -> bool:
            row = self._rows[key]  # type: ignore[index]
            return row.ready and row.pins == 0 and key not in protected

        victims: dict[int, list[OffloadKey]] = {}
        for group, count in enumerate(wanted):
            short = count - self._allocators[group].num_free
            if short <= 0:
                continue
            chosen = self._policies[group].evict(short, evictable)
            if chosen is None:
                self._restore(victims)
                self.stats.rejected_stores += 1
                return None
            victims[group] = chosen  # type: ignore[assignment]

        evicted = [key for chosen in victims.values() for key in chosen]
        for key in evicted:
            self._drop(key, removed_event=True)
        self.stats.evictions += len(evicted)

        slots: dict[OffloadKey, int] = {}
        for group, count in enumerate(wanted):
            if count:
                group_keys = [key for key in new_keys if self._group(key) == group]
                allocated = self._allocators[group].allocate(count)
                assert allocated is not None, "eviction freed too few slots"
                slots.update(zip(group_keys, allocated, strict=True))

        for key in new_keys:
            self._rows[key] = _Row(slots[key])
        for group, run, parent in _new_runs(keys, set(new_keys)):
            self._policies[group].on_insert_run(run, parent)
        return PrepareStoreOutput(new_keys, HostSlots(new_keys, [slots[k] for k in new_keys]), evicted)

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        for key in keys:
            row = self._rows.get(key)
            if row is None or row.ready:
                log.warning("complete_store: key %s was not being stored", key.hex())
                continue
            if success:
                row.ready = True
                self._events.stored[key] = None
                self.stats.stored_rows += 1
            else:
                self._policies[self._group(key)].on_remove(key)
                self._drop(key, removed_event=False)
                self.stats.failed_stores += 1

    # -- lifecycle ---------------------------------------------------------------------

    def on_request_finished(self, request_id: str) -> None:
        """Nothing is held per request: pins are released by ``complete_load``."""

    def take_events(self) -> list[OffloadingEvent]:
        events = []
        if self._events.removed:
            events.append(OffloadingEvent(list(self._events.removed), HOST_MEDIUM, removed=True))
        if self._events.stored:
            events.append(OffloadingEvent(list(self._events.stored), HOST_MEDIUM, removed=False))
        self._events = _Events()
        return events

    def reset(self) -> bool:
        """Forget every row; refused (``False``, nothing changed) while any is pinned or in flight."""
        if any(row.pins or not row.ready for row in self._rows.values()):
            return False
        for key in list(self._rows):
            self._drop(key, removed_event=True)
        self._policies = [self._make_policy(self.slots_per_group) for _ in range(self.num_groups)]
        return True

    def contains(self, key: OffloadKey) -> bool:
        return key in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def num_free_slots(self, group: int) -> int:
        return self._allocators[group].num_free

    # -- internals ---------------------------------------------------------------------

    def _group(self, key: OffloadKey) -> int:
        group = key_group(key)
        if group >= self.num_groups:
            raise ValueError(f"key {key.hex()} names group {group}, but there are {self.num_groups} groups")
        return group

    def _drop(self, key: OffloadKey, *, removed_event: bool) -> None:
        """Free a row whose key the policy has already forgotten."""
        row = self._rows.pop(key)
        self._allocators[key_group(key)].free([row.slot])
        if not (removed_event and row.ready):
            return
        if key in self._events.stored:  # stored and removed since the last drain: never seen
            del self._events.stored[key]
        else:
            self._events.removed[key] = None

    def _restore(self, victims: dict[int, list[OffloadKey]]) -> None:
        """Give back victims chosen for a store that turned out impossible (they become recent)."""
        for group, chosen in victims.items():
            for key in chosen:
                self._policies[group].on_insert(key)


def _new_runs(
    keys: Sequence[OffloadKey], new: set[OffloadKey]
) -> list[tuple[int, list[OffloadKey], OffloadKey | None]]:
    """Maximal runs of new keys that follow each other in one group's prefix order.

    ``(group, run, parent)``: ``parent`` is the key just before the run in the same group
    (already stored) or ``None`` at the start of the call. Policies take a run at once so
    that a chain's head ends up the last of it to be evicted.
    """
    runs: list[tuple[int, list[OffloadKey], OffloadKey | None]] = []
    open_runs: dict[int, tuple[list[OffloadKey], OffloadKey | None]] = {}
    previous: dict[int, OffloadKey] = {}
    for key in dict.fromkeys(keys):
        group = key_group(key)
        if key in new:
            if group not in open_runs:
                open_runs[group] = ([], previous.get(group))
            open_runs[group][0].append(key)
        elif group in open_runs:
            run, parent = open_runs.pop(group)
            runs.append((group, run, parent))
        previous[group] = key
    runs.extend((group, run, parent) for group, (run, parent) in open_runs.items())
    return runs
