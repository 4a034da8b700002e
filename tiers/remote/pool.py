"""A peer's bookkeeping: which slot holds which key, and who may touch which slot now.

The peer's NIXL-registered memory is a run of fixed-size slots (``--row-bytes``, the largest
row it serves; a smaller row uses the head of its slot). Clients READ and WRITE slots
one-sided, so the peer cannot see a transfer: it can only promise, by protocol, that a
slot a client was told to touch holds what the client expects while the client may touch
it. That promise is this module:

- **free -> pending**: ``allocate`` gives a put fresh slots (evicting by the policy if the
  pool is full). Only that client writes them. A pending slot is in no index and no lease,
  so nobody reads it. An allocation that is not committed within ``alloc_ttl_s`` (the
  client died or hung) is taken back.
- **pending -> stored**: ``commit`` records the row header the client sends and makes the
  key visible; the policy learns of it.
- **stored + lease**: ``lookup`` answers hits with their slots and headers and takes a
  lease: a leased slot is never evicted, and a leased slot whose key is deleted or replaced
  is *retired*, not freed, until its last lease is released or expires. So a READ never
  races a WRITE of another row into the same slot. (Should a lease expire under a client
  that was merely slow, the row's checksum still turns a torn read into a miss.)

Owners are connection ids: closing a connection gives back its allocations and leases at
once. Pure Python, single-threaded (the peer's event loop), no I/O: testable alone.

**Tenants.** Every verb takes the tenant its connection authenticated as
(``tiers/remote/auth.py``), and every key lives in that tenant's namespace (the index key is
``tenant NUL key``; tenant names hold no NUL), so a tenant's GET, CONTAINS, DELETE and PUT
never see or touch another tenant's rows, and its STATS count only its own. With
``quotas`` each tenant owns a fixed run of slots, its quota (``slot_range``), holds rows
(stored, pending, retired) only there, and makes room only by evicting its **own** rows:
flooding by one tenant evicts nothing of another's, and the peer can register each run
with NIXL apart and hand a tenant's clients only their run (``tiers/remote/server.py``).
Without quotas (a peer without a token) the tenants share one pool and one eviction order.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from policies.base import EvictionPolicy
from tiers.base import Stats
from tiers.remote.protocol import EXISTS, NO_SLOT
from tiers.row_format import RowHeader


class PoolLimitError(Exception):
    """An owner holds too many allocations or leases; a well-behaved client never does."""


class UnknownAllocation(Exception):
    """A commit for an allocation that expired, was aborted, or belongs to someone else."""


class FreeSlots:
    """Free slot numbers, lowest first, so one put's rows tend to be adjacent (and NIXL merges
    adjacent descriptors). Freeing a slot that is free is a bookkeeping bug and raises."""

    def __init__(self, num_slots: int, start: int = 0) -> None:
        self.start = start
        self._heap = list(range(start, start + num_slots))
        self._free = bytearray(b"\x01") * num_slots

    def __len__(self) -> int:
        return len(self._heap)

    def take(self, n: int) -> list[int]:
        slots = [heapq.heappop(self._heap) for _ in range(min(n, len(self._heap)))]
        for slot in slots:
            self._free[slot - self.start] = 0
        return slots

    def give(self, slot: int) -> None:
        if self._free[slot - self.start]:
            raise RuntimeError(f"slot {slot} freed twice")
        self._free[slot - self.start] = 1
        heapq.heappush(self._heap, slot)


@dataclass
class _Allocation:
    owner: int
    keys: list[bytes]
    slots: list[int]
    lengths: list[int]
    expires: float


@dataclass
class _Lease:
    owner: int
    slots: list[int]
    expires: float


@dataclass
class PoolCounters(Stats):
    """What a pool did, in all (``PeerPool.counters``) or for one tenant (its STATS reply)."""

    rows_put: int = 0
    rows_existing: int = 0  # puts of keys held already (not sent again)
    rows_refused: int = 0  # puts with no slot to give
    rows_hit: int = 0
    rows_missed: int = 0
    rows_deleted: int = 0
    rows_corrupt: int = 0  # rows whose bytes no longer matched their checksum when served: dropped
    evictions: int = 0
    allocs_expired: int = 0  # PUT_ALLOCs never committed nor aborted in time
    leases_expired: int = 0  # GET leases never released in time


_NO_SLOTS = FreeSlots(0)


def _prefix(tenant: str) -> bytes:
    return tenant.encode() + b"\x00"


def _tenant_of(index_key: bytes) -> str:
    return index_key[: index_key.index(0)].decode()


class PeerPool:
    """Slots, index, allocations and leases of one peer; see the module docstring."""

    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        policy: EvictionPolicy,
        *,
        alloc_ttl_s: float = 10.0,
        lease_ttl_s: float = 10.0,
        max_allocs_per_owner: int = 256,
        max_leases_per_owner: int = 1024,
        quotas: Mapping[str, int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_slots <= 0 or slot_bytes <= 0:
            raise ValueError("a pool needs at least one slot of at least one byte")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.policy = policy
        self.alloc_ttl_s = alloc_ttl_s
        self.lease_ttl_s = lease_ttl_s
        self.max_allocs_per_owner = max_allocs_per_owner
        self.max_leases_per_owner = max_leases_per_owner
        self._clock = clock
        self._index: dict[bytes, tuple[int, bytes]] = {}  # key -> (slot, 40-byte header)
        self._leased = [0] * num_slots  # lease count per slot
        self._retired: set[int] = set()  # dropped from the index while leased
        self._allocs: dict[int, _Allocation] = {}  # in creation order = expiry order
        self._leases: dict[int, _Lease] = {}
        self._owner_allocs: dict[int, set[int]] = {}
        self._owner_leases: dict[int, set[int]] = {}
        self._ids = itertools.count(1)
        if quotas is not None and sum(quotas.values()) > num_slots:
            raise ValueError(f"tenant quotas add up to {sum(quotas.values())} slots of {num_slots}")
        self.quotas = dict(quotas) if quotas is not None else None
        # Under quotas each tenant owns a fixed run of slots (tenants in name order), so the
        # peer can register each run with NIXL apart and show a tenant only its own run.
        self.ranges: dict[str, tuple[int, int]] = {"": (0, num_slots)}  # tenant -> (first, count)
        if self.quotas is not None:
            self.ranges, first = {}, 0
            for name in sorted(self.quotas):
                self.ranges[name] = (first, self.quotas[name])
                first += self.quotas[name]
        self._free = {name: FreeSlots(count, first) for name, (first, count) in self.ranges.items()}
        self._run_of = [""] * num_slots  # the run (its tenant, or "" without quotas) of each slot
        for name, (first, count) in self.ranges.items():
            self._run_of[first : first + count] = [name] * count
        self._slot_tenant: list[str] = [""] * num_slots  # who holds each slot that is not free
        self._used: dict[str, int] = {}  # slots held per tenant (pending, stored, retired)
        self._rows: dict[str, int] = {}  # stored rows per tenant
        self.counters = PoolCounters()
        self._tenant_counters: dict[str, PoolCounters] = {}

    # -- put ------------------------------------------------------------------------------

    def allocate(
        self, owner: int, keys: Sequence[bytes], lengths: Sequence[int], tenant: str = ""
    ) -> tuple[int, list[int]]:
        """Slots for the keys not stored yet: ``(allocation id or 0, per key slot/EXISTS/NO_SLOT)``.

        A key already stored answers ``EXISTS`` (keys name their content, so there is nothing
        to write); a row longer than a slot, or one the pool cannot make room for (every
        resident row it may evict is leased, or the tenant's quota is held by pending and
        leased rows), answers ``NO_SLOT``.
        """
        if len(self._owner_allocs.get(owner, ())) >= self.max_allocs_per_owner:
            raise PoolLimitError(f"{self.max_allocs_per_owner} uncommitted allocations")
        prefix = _prefix(tenant)
        statuses = [NO_SLOT] * len(keys)
        wanted = []
        for i, (key, length) in enumerate(zip(keys, lengths, strict=True)):
            if prefix + key in self._index:
                statuses[i] = EXISTS
                self.policy.on_access(prefix + key)
                for counters in self._counted(tenant):
                    counters.rows_existing += 1
            elif 0 < length <= self.slot_bytes:
                wanted.append(i)
        free = self._free_of(tenant)
        self._make_room(len(wanted) - len(free), None if self.quotas is None else prefix)
        slots = free.take(len(wanted))
        for slot in slots:
            self._slot_tenant[slot] = tenant
        self._used[tenant] = self._used.get(tenant, 0) + len(slots)
        refused = len(keys) - len(slots) - statuses.count(EXISTS)
        for counters in self._counted(tenant):
            counters.rows_refused += refused
        if not slots:
            return 0, statuses
        chosen = wanted[: len(slots)]
        for i, slot in zip(chosen, slots, strict=True):
            statuses[i] = slot
        alloc_id = next(self._ids)
        self._allocs[alloc_id] = _Allocation(
            owner,
            [prefix + keys[i] for i in chosen],
            slots,
            [lengths[i] for i in chosen],
            self._clock() + self.alloc_ttl_s,
        )
        self._owner_allocs.setdefault(owner, set()).add(alloc_id)
        return alloc_id, statuses

    def commit(self, owner: int, alloc_id: int, headers: Sequence[bytes]) -> list[bool]:
        """Make the written rows visible; per allocated slot whether its key is now stored.

        A header that is not one (all zeros: the client did not write that row) or whose
        length is not the allocated one frees the slot. A key stored meanwhile by another
        put keeps its first row and the new slot goes back.
        """
        alloc = self._take_alloc(owner, alloc_id)
        if len(headers) != len(alloc.slots):
            self._free_slots(alloc.slots)
            raise ValueError(f"{len(headers)} headers for an allocation of {len(alloc.slots)} slots")
        stored = []
        for key, slot, length, header in zip(alloc.keys, alloc.slots, alloc.lengths, headers, strict=True):
            parsed = RowHeader.unpack(header)
            if parsed is None or parsed.row_length != length:
                self._give(slot)
                stored.append(False)
            elif key in self._index:
                self._give(slot)
                self.policy.on_access(key)
                stored.append(True)
            else:
                self._index[key] = (slot, bytes(header))
                self.policy.on_insert(key)
                tenant = self._slot_tenant[slot]
                self._rows[tenant] = self._rows.get(tenant, 0) + 1
                for counters in self._counted(tenant):
                    counters.rows_put += 1
                stored.append(True)
        return stored

    def abort(self, owner: int, alloc_id: int) -> None:
        """Give back an allocation whose rows were not (all) written."""
        try:
            alloc = self._take_alloc(owner, alloc_id)
        except UnknownAllocation:
            return
        self._free_slots(alloc.slots)

    # -- get ------------------------------------------------------------------------------

    def lookup(
        self, owner: int, keys: Sequence[bytes], tenant: str = ""
    ) -> tuple[int, list[tuple[int, bytes] | None]]:
        """Per key ``(slot, header)`` or ``None``, and the id of a lease on the hit slots (0: none)."""
        if len(self._owner_leases.get(owner, ())) >= self.max_leases_per_owner:
            raise PoolLimitError(f"{self.max_leases_per_owner} unreleased leases")
        prefix = _prefix(tenant)
        entries: list[tuple[int, bytes] | None] = []
        slots = []
        for key in keys:
            entry = self._index.get(prefix + key)
            entries.append(entry)
            if entry is None:
                for counters in self._counted(tenant):
                    counters.rows_missed += 1
                continue
            for counters in self._counted(tenant):
                counters.rows_hit += 1
            self.policy.on_access(prefix + key)
            slots.append(entry[0])
            self._leased[entry[0]] += 1
        if not slots:
            return 0, entries
        lease_id = next(self._ids)
        self._leases[lease_id] = _Lease(owner, slots, self._clock() + self.lease_ttl_s)
        self._owner_leases.setdefault(owner, set()).add(lease_id)
        return lease_id, entries

    def release(self, owner: int, lease_id: int) -> None:
        lease = self._leases.get(lease_id)
        if lease is None or lease.owner != owner:
            return
        self._end_lease(lease_id)

    # -- other verbs ----------------------------------------------------------------------

    def contains(self, keys: Sequence[bytes], tenant: str = "") -> list[bool]:
        prefix = _prefix(tenant)
        return [prefix + key in self._index for key in keys]

    def delete(self, keys: Sequence[bytes], tenant: str = "") -> int:
        prefix = _prefix(tenant)
        deleted = 0
        for key in keys:
            entry = self._index.pop(prefix + key, None)
            if entry is None:
                continue
            self.policy.on_remove(prefix + key)
            self._rows[tenant] -= 1
            self._drop_slot(entry[0])
            deleted += 1
        for counters in self._counted(tenant):
            counters.rows_deleted += deleted
        return deleted

    def drop_corrupt(self, keys: Sequence[bytes], tenant: str = "") -> None:
        """Forget rows whose bytes failed their checksum when served (counted, not as deletions)."""
        dropped = self.delete(keys, tenant)
        for counters in self._counted(tenant):
            counters.rows_deleted -= dropped
            counters.rows_corrupt += dropped

    def drop_run(self, run: str) -> int:
        """Forget every stored row in run ``run`` (a tenant's quota; ``""`` without quotas):
        their bytes are gone (the tenant worker that held them ended). Counted as corrupt;
        how many."""
        lost: dict[str, list[bytes]] = {}
        for index_key, entry in self._index.items():
            if self._run_of[entry[0]] == run:
                tenant = _tenant_of(index_key)
                lost.setdefault(tenant, []).append(index_key[len(tenant) + 1 :])
        for tenant, keys in lost.items():
            self.drop_corrupt(keys, tenant)
        return sum(len(keys) for keys in lost.values())

    def drop_owner(self, owner: int) -> None:
        """A connection closed: its pending writes and its reads are over."""
        for alloc_id in list(self._owner_allocs.get(owner, ())):
            self.abort(owner, alloc_id)
        for lease_id in list(self._owner_leases.get(owner, ())):
            self._end_lease(lease_id)
        self._owner_allocs.pop(owner, None)
        self._owner_leases.pop(owner, None)

    def expire(self) -> None:
        """Take back allocations and leases past their time (creation order is expiry order)."""
        now = self._clock()
        while self._allocs:
            alloc_id, alloc = next(iter(self._allocs.items()))
            if alloc.expires > now:
                break
            self.abort(alloc.owner, alloc_id)
            for counters in self._counted(self._slot_tenant[alloc.slots[0]]):
                counters.allocs_expired += 1
        while self._leases:
            lease_id, lease = next(iter(self._leases.items()))
            if lease.expires > now:
                break
            self._end_lease(lease_id)
            self.counters.leases_expired += 1

    def stats(self, tenant: str | None = None) -> dict[str, int]:
        """The whole pool's figures (for the operator), or one tenant's own (for its clients)."""
        if tenant is not None:
            quota = self.num_slots if self.quotas is None else self.quotas.get(tenant, 0)
            return {
                "slots": self.num_slots,
                "slot_bytes": self.slot_bytes,
                "quota_slots": quota,
                "used_slots": self._used.get(tenant, 0),
                "rows": self._rows.get(tenant, 0),
                "pending_slots": sum(
                    len(a.slots) for a in self._allocs.values() if self._slot_tenant[a.slots[0]] == tenant
                ),
                "leases": sum(
                    1 for lease in self._leases.values() if self._slot_tenant[lease.slots[0]] == tenant
                ),
                **self._tenant_counters.get(tenant, PoolCounters()),
            }
        pending = sum(len(a.slots) for a in self._allocs.values())
        return {
            "slots": self.num_slots,
            "slot_bytes": self.slot_bytes,
            "rows": len(self._index),
            "free_slots": self._free_count(),
            "pending_slots": pending,
            "retired_slots": len(self._retired),
            "leases": len(self._leases),
            **self.counters,
        }

    def check(self) -> None:
        """Every slot of a run is in exactly one state (free, pending, stored, retired), and
        every row lies in its tenant's run: for tests."""
        stored = [slot for slot, _ in self._index.values()]
        pending = [slot for a in self._allocs.values() for slot in a.slots]
        free = [slot for run in self._free.values() for slot in run._heap]
        everything = stored + pending + free + list(self._retired)
        in_runs = sorted(s for first, count in self.ranges.values() for s in range(first, first + count))
        if sorted(everything) != in_runs:
            raise AssertionError("a slot is lost or in two states")
        if self.quotas is not None and any(self._run_of[s] != self._slot_tenant[s] for s in stored + pending):
            raise AssertionError("a row outside its tenant's run")
        if any(self._leased[slot] == 0 for slot in self._retired):
            raise AssertionError("a retired slot without a lease")
        if any(self._leased[slot] for slot in free + pending):
            raise AssertionError("a leased slot is free or pending")
        if len(self.policy) != len(self._index):
            raise AssertionError("policy and index disagree")
        used: dict[str, int] = {}
        for slot in stored + pending + list(self._retired):
            used[self._slot_tenant[slot]] = used.get(self._slot_tenant[slot], 0) + 1
        if {t: n for t, n in used.items() if n} != {t: n for t, n in self._used.items() if n}:
            raise AssertionError("slots held per tenant disagree")
        if self.quotas is not None and any(n > self.quotas.get(t, 0) for t, n in used.items()):
            raise AssertionError("a tenant holds more than its quota")
        rows: dict[str, int] = {}
        for key in self._index:
            rows[_tenant_of(key)] = rows.get(_tenant_of(key), 0) + 1
        if rows != {t: n for t, n in self._rows.items() if n}:
            raise AssertionError("rows per tenant disagree")

    # -- internals ------------------------------------------------------------------------

    def _take_alloc(self, owner: int, alloc_id: int) -> _Allocation:
        alloc = self._allocs.get(alloc_id)
        if alloc is None or alloc.owner != owner:
            raise UnknownAllocation(alloc_id)
        del self._allocs[alloc_id]
        self._owner_allocs[owner].discard(alloc_id)
        return alloc

    def _end_lease(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id)
        self._owner_leases[lease.owner].discard(lease_id)
        for slot in lease.slots:
            self._leased[slot] -= 1
            if self._leased[slot] == 0 and slot in self._retired:
                self._retired.discard(slot)
                self._give(slot)

    def _evictable(self, key: object) -> bool:
        entry = self._index.get(key)  # type: ignore[arg-type]
        return entry is not None and self._leased[entry[0]] == 0

    def _make_room(self, short: int, own: bytes | None) -> None:
        """Evict to free ``short`` more slots: any rows (``own is None``, one shared pool) or
        only rows whose index key starts with ``own`` (the tenant's own run, under quotas)."""
        if own is None:
            evictable = self._evictable
        else:

            def evictable(key: object) -> bool:
                return key.startswith(own) and self._evictable(key)  # type: ignore[attr-defined]

        if short <= 0:
            return
        victims = self.policy.evict(short, evictable)
        if victims is None:  # all-or-nothing: take what can be had, one at a time
            victims = []
            while len(victims) < short and (one := self.policy.evict(1, evictable)):
                victims.extend(one)
        for key in victims:
            entry = self._index.pop(key, None)  # type: ignore[arg-type]
            if entry is not None:
                tenant = self._slot_tenant[entry[0]]
                self._rows[tenant] -= 1
                self._drop_slot(entry[0])
                for counters in self._counted(tenant):
                    counters.evictions += 1

    def _drop_slot(self, slot: int) -> None:
        if self._leased[slot]:
            self._retired.add(slot)
        else:
            self._give(slot)

    def slot_range(self, tenant: str) -> tuple[int, int]:
        """``(first slot, count)`` a tenant's rows may occupy (the whole pool without quotas)."""
        return self.ranges.get(tenant if self.quotas is not None else "", (0, 0))

    def _free_of(self, tenant: str) -> FreeSlots:
        return self._free.get(tenant if self.quotas is not None else "", _NO_SLOTS)

    def _free_count(self) -> int:
        return sum(len(run) for run in self._free.values())

    def _give(self, slot: int) -> None:
        self._free[self._run_of[slot]].give(slot)
        self._used[self._slot_tenant[slot]] -= 1

    def _free_slots(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self._give(slot)

    def _counted(self, tenant: str) -> tuple[PoolCounters, PoolCounters]:
        """The counters an event of ``tenant`` goes into: the pool's, and the tenant's own."""
        counters = self._tenant_counters.get(tenant)
        if counters is None:
            counters = self._tenant_counters[tenant] = PoolCounters()
        return self.counters, counters
