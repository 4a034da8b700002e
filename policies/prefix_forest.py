"""The resident keys of a tier as a forest of prefix chains: who follows whom, who is orphaned.

A block is only ever hit as part of a prefix, so chain-aware policies (``prefix:*``, and the
benchmark's ``lhd`` and ``hazard`` in ``bench.learned_policies``) need the same three facts
about every resident key: its predecessor, the resident keys that follow it, and whether its
predecessor was here and left (an *orphan*: it cannot be hit again until the predecessor
comes back). ``lhd`` also samples chain *tails* (resident keys no resident key follows),
kept here in O(1) per change when asked for.

Children are indexed by predecessor whether or not the predecessor is resident, so a
predecessor stored again finds its children and un-orphans them.

Memory: a parent link per resident key and a child set per predecessor of a resident key,
both bounded by the number of resident keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator

from policies.base import Key


class PrefixForest:
    """Parent links, children and orphans of resident keys; chain tails with ``track_tails``."""

    __slots__ = ("_tail_index", "children", "orphans", "parent", "tails")

    def __init__(self, *, track_tails: bool = False) -> None:
        self.parent: dict[Key, Key | None] = {}
        self.children: dict[Key, set[Key]] = {}
        self.orphans: OrderedDict[Key, None] = OrderedDict()
        """Resident keys whose predecessor left after they arrived, oldest first."""
        self.tails: list[Key] | None = [] if track_tails else None
        """Resident keys with no resident child (``track_tails`` only): a list to sample from."""
        self._tail_index: dict[Key, int] = {}

    def __contains__(self, key: object) -> bool:
        return key in self.parent

    def __len__(self) -> int:
        return len(self.parent)

    def is_tail(self, key: Key) -> bool:
        return key in self._tail_index

    def link(self, key: Key, parent: Key | None) -> None:
        """Make ``key`` resident after ``parent``; children of ``key`` already here stop being orphans."""
        self.parent[key] = parent
        if parent is not None:
            siblings = self.children.get(parent)
            if siblings is None:
                self.children[parent] = {key}
            else:
                siblings.add(key)
            if self.tails is not None:
                self._drop_tail(parent)
        children = self.children.get(key)
        if children:
            for child in children:
                self.orphans.pop(child, None)
        elif self.tails is not None:
            self._add_tail(key)

    def unlink(self, key: Key) -> Key | None:
        """Forget a resident ``key`` (its children become orphans); returns its predecessor."""
        parent = self.parent.pop(key)
        self.orphans.pop(key, None)
        if self.tails is not None:
            self._drop_tail(key)
        if parent is not None:
            siblings = self.children[parent]
            siblings.discard(key)
            if not siblings:
                del self.children[parent]
                if self.tails is not None and parent in self.parent:
                    self._add_tail(parent)
        for child in self.children.get(key, ()):
            self.orphans[child] = None
        return parent

    def clear(self) -> None:
        self.parent.clear()
        self.children.clear()
        self.orphans.clear()
        self._tail_index.clear()
        if self.tails is not None:
            self.tails.clear()

    def _add_tail(self, key: Key) -> None:
        assert self.tails is not None
        if key not in self._tail_index:
            self._tail_index[key] = len(self.tails)
            self.tails.append(key)

    def _drop_tail(self, key: Key) -> None:
        assert self.tails is not None
        index = self._tail_index.pop(key, None)
        if index is None:
            return
        last = self.tails.pop()
        if index < len(self.tails):
            self.tails[index] = last
            self._tail_index[last] = index


def orphans_first(orphans: Collection[Key], keys: Iterable[Key]) -> Iterator[Key]:
    """Eviction order of a chain-aware policy: orphans (never hit again), then the rest."""
    yield from orphans
    for key in keys:
        if key not in orphans:
            yield key
