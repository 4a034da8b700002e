"""The eviction-policy contract shared by every tier.

A policy is pure bookkeeping over opaque, hashable keys (in kvtier: ``bytes``). It never
stores values, never does I/O and never imports ``offload/``: the tier that owns the rows
tells the policy what happened (``on_insert``, ``on_access``, ``on_remove``) and asks it
whom to evict (``evict``). Keeping storage out of the policy is what lets the same policy
run the host pool, the LMDB index, a remote peer's pool and the trace simulator.

Call contract (one thread; the owner serialises calls):

- ``on_insert(key, parent)`` once when ``key`` becomes resident. ``parent`` is the key of
  the previous block in the same prefix chain when the caller knows it (prefix-aware and
  cost-aware policies use it; others ignore it).
- ``on_insert_run(keys, parent)`` instead, when one store makes several consecutive blocks
  of a chain resident (``keys`` head first, ``keys[0]``'s predecessor is ``parent``). The
  default inserts them tail first, so a policy that orders by insertion evicts the deep end
  of a chain before its head (vLLM's LRU does the same with per-request ranks); a policy
  that needs depth (cost-aware) sees the whole run at once.
- ``on_miss(keys)``, optionally, when the owner is about to store ``keys`` (none resident)
  and before it evicts to make room for them: a policy that learns from misses (vLLM's
  ARC variant moves its target for ghosts) learns before choosing this store's victims.
  ``on_insert`` / ``on_insert_run`` of the same keys follow if the store goes ahead.
- ``on_access(key)`` on every hit of a resident key. The hits of one request are reported
  tail first, for the same reason as ``on_insert_run``.
- ``on_renew(keys)`` when the owner re-ranks resident keys it has already reported: each of
  ``keys``, in order, becomes the most recent, and nothing is counted as a use (vLLM renews
  every key a request used when the request ends, its head last, so a prefix's head outlives
  the blocks the request stored after it). Keys not resident are ignored; a policy with no
  order by recency ignores the call (the default).
- ``on_remove(key)`` when the owner drops a resident key for a reason of its own (the
  row turned out corrupt, an explicit delete). Not called for keys returned by ``evict``.
- ``evict(n, evictable)`` picks ``n`` resident keys for which ``evictable(key)`` is true
  and forgets them. It is all-or-nothing: when fewer than ``n`` keys can be evicted it
  returns ``None`` and changes nothing, so the caller never half-frees a request.

Ghost entries (keys remembered after eviction, as ARC and S3-FIFO keep) are the policy's
own business and must stay bounded by a constant times ``capacity``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from itertools import islice

Key = Hashable
"""An opaque key. kvtier passes ``bytes`` (an ``OffloadKey``); the simulator passes ints."""

Evictable = Callable[[Key], bool]
"""Whether the owner allows a key to be evicted now (not pinned, not in flight)."""


def always_evictable(_key: Key) -> bool:
    """The predicate for owners that never pin (the trace simulator, a disk index)."""
    return True


class EvictableUnless:
    """An ``Evictable`` that allows every key in none of ``blocked``: sets or dict key views,
    which may change between calls (the owner's live state).

    Said this way, a run of candidates is checked in C (``take_evictable``: one
    ``isdisjoint`` per container for the whole run, where a predicate is a Python call per
    key), and the least recent keys a policy offers are nearly always evictable.
    """

    __slots__ = ("blocked",)
    # Loops below, not all() over a generator: one more frame per call, on a hot path.

    def __init__(self, *blocked: AbstractSet[Key]) -> None:
        self.blocked = blocked

    def __call__(self, key: Key) -> bool:
        for container in self.blocked:  # noqa: SIM110
            if key in container:
                return False
        return True

    def allows_all(self, keys: list[Key]) -> bool:
        """Whether every key of ``keys`` may go."""
        for container in self.blocked:  # noqa: SIM110
            if container and not container.isdisjoint(keys):
                return False
        return True


def take_evictable(keys: Iterable[Key], evictable: Evictable, n: int) -> list[Key]:
    """Up to ``n`` keys of ``keys``, in order, that ``evictable`` allows (a plan: nothing
    is removed). An iterator is left just after the last key taken, so a later call on it
    goes on from there."""
    if n <= 0:
        return []
    if type(evictable) is EvictableUnless:  # the first n candidates at once, in C
        keys = iter(keys)
        chosen = list(islice(keys, n))
        if evictable.allows_all(chosen):
            return chosen
        chosen = [key for key in chosen if evictable(key)]
        if len(chosen) == n:
            return chosen
    else:
        chosen = []
    for key in keys:
        if evictable(key):
            chosen.append(key)
            if len(chosen) == n:
                break
    return chosen


class EvictionPolicy(ABC):
    """Orders the resident keys of one tier for eviction.

    ``capacity`` is the tier's size in rows; policies that size their segments or ghost
    lists from it (ARC, S3-FIFO, W-TinyLFU) read it, LRU does not need it.
    """

    name: str = ""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"policy capacity must be a positive number of rows, got {capacity!r}")
        self.capacity = capacity

    @abstractmethod
    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        """Record that ``key`` is now resident (it must not be resident already)."""

    def on_insert_run(self, keys: Sequence[Key], parent: Key | None = None) -> None:
        """Record that ``keys``, consecutive blocks of one chain (head first), became resident.

        ``keys[0]``'s predecessor is ``parent``; each later key's is the key before it. They
        are inserted tail first so that insertion order puts a chain's deep end nearest to
        eviction: its head is what every later request of the chain needs first.
        """
        for i in range(len(keys) - 1, -1, -1):
            self.on_insert(keys[i], keys[i - 1] if i else parent)

    def on_miss(self, keys: Sequence[Key]) -> None:
        """``keys`` are about to be stored (none is resident), before the eviction for them.

        Most policies learn at ``on_insert`` and leave this empty (the host tier does not
        call it for them: ``overrides_on_miss``).
        """
        del keys  # nothing to learn before the eviction

    @abstractmethod
    def on_access(self, key: Key) -> None:
        """Record a hit on a resident ``key``."""

    def on_renew(self, keys: Sequence[Key]) -> None:
        """Make each resident key of ``keys``, in order, the most recent, without counting a use."""
        del keys  # no order by recency to renew

    @abstractmethod
    def on_remove(self, key: Key) -> None:
        """Forget a resident ``key`` that the owner dropped outside of ``evict``."""

    @abstractmethod
    def evict(self, n: int, evictable: Evictable = always_evictable) -> list[Key] | None:
        """Choose and forget ``n`` evictable keys, or return ``None`` and change nothing."""

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Key]:
        """Resident keys, from the next to be evicted to the last (where the policy has an order)."""

    def overrides_on_miss(self) -> bool:
        """Whether ``on_miss`` does anything (owners skip the call when it does not)."""
        return type(self).on_miss is not EvictionPolicy.on_miss

    def clear(self) -> None:
        """Forget every key, ghosts included."""
        for key in list(self):
            self.on_remove(key)
