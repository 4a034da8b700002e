"""Prefix-aware eviction, around any policy: evict chains from the tail, orphans first.

A block is only ever hit as part of a prefix: a request hits block ``d`` only if it also hit
blocks ``0..d-1``. So a block whose predecessor has left the tier is worth nothing here
until the predecessor comes back, and evicting the middle of a chain wastes every block
behind it. This wrapper keeps the inner policy's judgement of *which chain* to shorten, and
adds the structure the inner policy does not know:

- **Leaves first.** Victims are asked of the inner policy with a predicate that refuses
  keys that still have resident children, so chains shrink from their deep end.
- **Bounded search.** The refusals per ``evict`` call are capped (``search_limit`` plus
  four per key asked for), so eviction stays O(1) amortised even if the inner order puts
  many chain heads first. Past the cap an interior key may go...
- **Orphans first.** ...and then its resident descendants are orphans: they sit in a FIFO
  that the next evictions empty before asking the inner policy again. An owner's
  ``on_remove`` of an interior key orphans its children the same way. No orphan is kept
  while a block that can still be hit is dropped.

A key whose predecessor was never resident here (it lives in the device cache above, or in
another tier) is a root, not an orphan: only a predecessor that was here and left makes one.
If that predecessor is stored again, its children stop being orphans.

**Continuations inherit reuse** (``inherit``, default 1): a run stored as the extension of a
resident chain's tail (the next turn of a conversation, the next step of an agent) is
reported to the inner policy as already used ``min(inherit, uses of its predecessor + 1)``
times, so a frequency-minded policy (ARC's T2, SLRU's protected segment) treats it like the
chain it continues. A run that branches off an interior block (a new conversation under a
shared system prompt) inherits nothing. ``inherit=0`` turns this off.

The chains themselves are a ``PrefixForest`` (``policies/prefix_forest.py``), shared with
the benchmark's ``lhd`` (``bench.learned_policies``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from itertools import islice

from policies.base import Evictable, EvictionPolicy, Key, always_evictable
from policies.prefix_forest import PrefixForest, orphans_first


class PrefixAware(EvictionPolicy):
    """Wraps ``inner`` (any ``EvictionPolicy``); see the module docstring for the rules."""

    name = "prefix"

    def __init__(self, inner: EvictionPolicy, search_limit: int = 64, inherit: int = 1) -> None:
        if not isinstance(inner, EvictionPolicy):
            raise ValueError(f"prefix: inner must be an EvictionPolicy, got {type(inner).__name__}")
        if not isinstance(search_limit, int) or search_limit < 0:
            raise ValueError(f"prefix: search_limit must be an int >= 0, got {search_limit!r}")
        if not isinstance(inherit, int) or inherit < 0:
            raise ValueError(f"prefix: inherit must be an int >= 0, got {inherit!r}")
        super().__init__(inner.capacity)
        self.inner = inner
        self.search_limit = search_limit
        self.inherit = inherit
        self._uses: dict[Key, int] = {}
        self._forest = PrefixForest()
        self._parent = self._forest.parent
        self._children = self._forest.children
        self._orphans = self._forest.orphans

    @property
    def orphans(self) -> list[Key]:
        """Resident keys whose predecessor left this tier after they arrived."""
        return list(self._orphans)

    def has_children(self, key: Key) -> bool:
        """Whether some resident key names ``key`` as its predecessor."""
        return key in self._children

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        if key in self._parent:
            self.inner.on_access(key)
            return
        self.inner.on_insert(key, parent)
        self._link(key, parent)

    def on_insert_run(self, keys: Sequence[Key], parent: Key | None = None) -> None:
        if any(key in self._parent for key in keys):
            EvictionPolicy.on_insert_run(self, keys, parent)
            return
        extends = parent is not None and parent in self._parent and parent not in self._children
        self.inner.on_insert_run(keys, parent)
        for i, key in enumerate(keys):
            self._link(key, keys[i - 1] if i else parent)
        if extends and self.inherit:
            uses = min(self.inherit, self._uses.get(parent, 0) + 1)
            for key in reversed(keys):
                self._uses[key] = uses
                for _ in range(uses):
                    self.inner.on_access(key)

    def on_miss(self, keys: Sequence[Key]) -> None:
        self.inner.on_miss(keys)

    def overrides_on_miss(self) -> bool:
        return self.inner.overrides_on_miss()

    def on_access(self, key: Key) -> None:
        self.inner.on_access(key)
        if key in self._parent:
            self._uses[key] = self._uses.get(key, 0) + 1

    def on_renew(self, keys: Sequence[Key]) -> None:
        self.inner.on_renew(keys)

    def on_remove(self, key: Key) -> None:
        if key in self._parent:
            self.inner.on_remove(key)
            self._unlink(key)

    def _link(self, key: Key, parent: Key | None) -> None:
        self._forest.link(key, parent)

    def _unlink(self, key: Key) -> None:
        self._forest.unlink(key)
        self._uses.pop(key, None)

    def evict(self, n: int, evictable: Evictable = always_evictable) -> list[Key] | None:
        if n <= 0:
            return []
        chosen = self._orphans_to_evict(n, evictable)
        rest = n - len(chosen)
        taken = set(chosen)
        victims: list[Key] | None = []
        if rest:
            # Usually the inner order is already tail first (runs are inserted and touched
            # tail first), and one batch does it.
            victims = self.inner.evict(rest, self._leaf_first(rest, taken, evictable))
        if victims is None:
            # Interior keys came first in the inner order: the batch could not look past
            # them to the leaves they hide. Check that enough keys can go at all (the
            # contract is all-or-nothing), then take them one at a time, so a chain's
            # next-to-last block becomes a leaf once its tail has gone.
            def free(key: Key) -> bool:
                return key not in taken and evictable(key)

            if sum(1 for _ in islice(filter(free, self.inner), rest)) < rest:
                return None
            self._commit_orphans(chosen)
            victims = []
            for _ in range(rest):
                one = self.inner.evict(1, self._leaf_first(1, taken, evictable)) or self.inner.evict(1, free)
                assert one, "an evictable key was counted but not found"
                self._unlink(one[0])
                taken.add(one[0])
                victims.append(one[0])
            return chosen + victims
        self._commit_orphans(chosen)
        for key in victims:
            self._unlink(key)
        return chosen + victims

    def _orphans_to_evict(self, n: int, evictable: Evictable) -> list[Key]:
        """Up to ``n`` evictable orphans, oldest first, then the descendants they orphan."""
        chosen: list[Key] = []
        queue = deque(self._orphans)
        seen: set[Key] = set()
        while queue and len(chosen) < n:
            key = queue.popleft()
            if key in seen:
                continue
            seen.add(key)
            if evictable(key):
                chosen.append(key)
                queue.extend(self._children.get(key, ()))
        return chosen

    def _commit_orphans(self, chosen: list[Key]) -> None:
        for key in chosen:
            self.inner.on_remove(key)
            self._unlink(key)

    def _leaf_first(self, wanted: int, taken: set[Key], evictable: Evictable) -> Evictable:
        """A predicate that refuses keys with resident children, a bounded number of times."""
        refusals = self.search_limit + 4 * wanted
        children = self._children

        def leaf_first(key: Key) -> bool:
            nonlocal refusals
            if key in taken or not evictable(key):
                return False
            if key in children and refusals > 0:
                refusals -= 1
                return False
            return True

        return leaf_first

    def __contains__(self, key: object) -> bool:
        return key in self._parent

    def __len__(self) -> int:
        return len(self._parent)

    def __iter__(self) -> Iterator[Key]:
        return orphans_first(self._orphans, self.inner)

    def clear(self) -> None:
        self.inner.clear()
        self._forest.clear()
        self._uses.clear()
