"""The disk tier's bookkeeping: which rows the file holds, what they cost, whom to evict.

Pure bookkeeping (no I/O), so it can be reasoned about, and tested, apart from LMDB. The
tier's writer thread plans a batch here, commits it to LMDB, then books the outcome here;
its reader threads report hits. Every method that changes state is called with ``mutex``
held; ``__contains__`` (behind ``may_contain``) is a dict membership test and needs none.

A plan books the batch as if it will commit: victims leave the policy and ``used`` counts
the new rows, so a plan made while the previous batch is still being written is right. The
index itself (``sizes``) changes only when the commit is known: ``book`` after success,
``undo`` (victims resident again) after a failure.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from policies import EvictionPolicy, make_policy


@dataclass(frozen=True)
class Planned:
    index: int  # the row's position in its batch
    size: int  # entry bytes
    seq: int  # insertion sequence number


class DiskIndex:
    """Rows of one namespace: key -> entry bytes, within ``capacity`` bytes, in policy order.

    The policy is sized in rows; ``row_entry_bytes`` is the usual row's cost, or, when not
    known, the first row's seen (at load, or at the first plan).
    """

    def __init__(
        self,
        capacity: int,
        eviction: str,
        eviction_params: dict[str, Any],
        row_entry_bytes: int | None = None,
    ) -> None:
        self.capacity = capacity
        self.eviction = eviction
        self.eviction_params = eviction_params
        self.row_entry_bytes = row_entry_bytes
        self.mutex = threading.Lock()
        self.sizes: dict[bytes, int] = {}
        self.used = 0
        self.next_seq = 0
        self.policy: EvictionPolicy | None = None

    def __contains__(self, key: object) -> bool:
        return key in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def load(self, entries: Iterable[tuple[bytes, int, int]], foreign_bytes: int) -> None:
        """Start from the file: ``(key, entry bytes, seq)`` oldest first, and the bytes of
        other namespaces' rows (never evicted here, so they shrink this namespace's room)."""
        entries = list(entries)
        self.capacity = max(0, self.capacity - foreign_bytes)
        self.sizes = {key: size for key, size, _ in entries}
        self.used = sum(self.sizes.values())
        self.next_seq = entries[-1][2] + 1 if entries else 0
        self.policy = None
        if self.row_entry_bytes is not None or entries:
            policy = self._make_policy(self.row_entry_bytes or self.used // len(entries))
            for key in self.sizes:
                policy.on_insert(key)

    def _make_policy(self, entry_bytes: int) -> EvictionPolicy:
        rows = max(1, self.capacity // max(1, entry_bytes))
        self.policy = make_policy(self.eviction, rows, **self.eviction_params)
        return self.policy

    def plan(self, rows: Sequence[tuple[bytes, int]]) -> tuple[list[Planned], list[bytes]]:
        """Which of ``(key, entry bytes)`` to store, and whom to evict for them.

        A key given twice counts once (its last row); rows of the batch are never evicted
        for each other, so a batch larger than the room stores its first rows. A row that
        cannot fit is left out of the plan (the caller counts it dropped); victims evicted
        for it are deleted all the same.
        """
        last = {key: i for i, (key, _) in enumerate(rows)}
        planned: list[Planned] = []
        victims: list[bytes] = []
        for i in sorted(last.values()):
            key, size = rows[i]
            if size > self.capacity:
                continue
            policy = self.policy if self.policy is not None else self._make_policy(size)
            grow = size - self.sizes.get(key, 0)
            while self.used + grow > self.capacity:
                chosen = policy.evict(1, lambda k: k not in last)
                if not chosen:
                    break
                victims.append(chosen[0])
                self.used -= self.sizes[chosen[0]]
            if self.used + grow > self.capacity:
                continue
            self.used += grow
            planned.append(Planned(i, size, self.next_seq))
            self.next_seq += 1
        return planned, victims

    def book(self, keys: Sequence[bytes], planned: Sequence[Planned], victims: Sequence[bytes]) -> None:
        """The plan was committed: the index follows."""
        for key in victims:
            del self.sizes[key]
        for row in planned:
            key = keys[row.index]
            if self.policy is not None:
                if key in self.sizes:
                    self.policy.on_access(key)  # stored again: it is wanted
                else:
                    self.policy.on_insert(key)
            self.sizes[key] = row.size

    def undo(self, victims: Sequence[bytes], used_before: int) -> None:
        """The plan failed: its victims are still stored, so they are resident again."""
        if self.policy is not None:
            for key in victims:
                self.policy.on_insert(key)
        self.used = used_before

    def forget(self, keys: Iterable[bytes]) -> None:
        """Rows removed for a reason of the tier's own (a delete, corruption)."""
        for key in keys:
            size = self.sizes.pop(key, None)
            if size is not None:
                self.used -= size
                if self.policy is not None:
                    self.policy.on_remove(key)

    def hit(self, keys_tail_first: Iterable[bytes]) -> None:
        """Rows read; the policy hears of the resident ones, tail of a request first."""
        if self.policy is not None:
            for key in keys_tail_first:
                if key in self.policy:
                    self.policy.on_access(key)

    def excess(self) -> list[bytes]:
        """Victims that bring the rows back within capacity (it was lowered since they were
        stored); they leave the policy and ``used``, and ``book`` them once deleted."""
        victims: list[bytes] = []
        while self.policy is not None and self.used > self.capacity and len(self.policy):
            chosen = self.policy.evict(1)
            if not chosen:
                break
            victims.append(chosen[0])
            self.used -= self.sizes[chosen[0]]
        return victims
