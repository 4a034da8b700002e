"""Cost-aware eviction: keep the blocks whose hit saves the most recomputation per byte.

Every block of a tier has the same size, but not the same worth: recomputing block ``d`` of
a prefix costs its linear layers plus attention over the ``d`` blocks before it, so a block
deep in a long prefix saves more per hit than one near the start. This is GreedyDual-Size-
Frequency (Cherkasova, 1998): a key's priority is ``H = L + f * cost / size``, where ``f``
counts its hits (capped) and ``L`` is the priority of the last victim, an inflation that
ages keys that stop being used. The lowest ``H`` goes first.

GDSF is usually a heap (O(log n)). Here cost is quantised into a few depth classes and ``f``
is capped, and keys sharing a (class, f) pair sit in one FIFO, in which ``H`` never
decreases (``L`` only grows), so the minimum is at one of a constant number of queue heads:
O(1) per operation, exact GDSF for the quantised costs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from policies.base import Evictable, EvictionPolicy, Key, always_evictable

_DEPTH_CLASSES = 12  # depth 0, 1, 2-3, 4-7, ..., >= 1024 blocks


def depth_class(depth: int) -> int:
    """Quantise a depth in blocks to a class: 0, 1, 2-3, 4-7, ... (log2 buckets)."""
    return min(depth.bit_length(), _DEPTH_CLASSES - 1)


class CostAwarePolicy(EvictionPolicy):
    """GreedyDual-Size-Frequency over recompute cost ``1 + attention_weight * depth``.

    ``attention_weight`` is the attention cost of one earlier block relative to a block's
    linear-layer cost: ~0.02 for 512-token blocks of an 8B model (32 layers, d_model 4096),
    ~0.0005 for 16-token blocks. ``size`` is one row for every block, so it drops out.

    Depth comes from the parent links: a run stored together (``on_insert_run``) is numbered
    from its parent's depth; the depths of recently evicted keys are remembered (at most
    ``capacity`` of them) so a run whose parent left the tier is still numbered right. A key
    whose parent is unknown counts as depth 1.
    """

    name = "cost"

    def __init__(self, capacity: int, attention_weight: float = 0.02, max_frequency: int = 4) -> None:
        super().__init__(capacity)
        if not attention_weight >= 0.0:
            raise ValueError(f"cost: attention_weight must be >= 0, got {attention_weight!r}")
        if not isinstance(max_frequency, int) or max_frequency < 1:
            raise ValueError(f"cost: max_frequency must be an int >= 1, got {max_frequency!r}")
        self.attention_weight = attention_weight
        self.max_frequency = max_frequency
        # Cost of a class: its depths' midpoint (class c holds depths [2**(c-1), 2**c)).
        self._class_cost = [
            1.0 + attention_weight * (0 if c == 0 else 1.5 * 2 ** (c - 1)) for c in range(_DEPTH_CLASSES)
        ]
        self.inflation = 0.0
        self._queues: dict[tuple[int, int], OrderedDict[Key, float]] = {}
        self._where: dict[Key, tuple[int, int]] = {}
        self._depth: dict[Key, int] = {}
        self._past_depth: OrderedDict[Key, int] = OrderedDict()

    def _depth_of(self, key: Key | None) -> int | None:
        if key is None:
            return -1
        depth = self._depth.get(key)
        return depth if depth is not None else self._past_depth.get(key)

    def _enqueue(self, key: Key, cls: int, freq: int) -> None:
        slot = (cls, freq)
        queue = self._queues.get(slot)
        if queue is None:
            queue = self._queues[slot] = OrderedDict()
        queue[key] = self.inflation + freq * self._class_cost[cls]
        self._where[key] = slot

    def _dequeue(self, key: Key) -> tuple[int, int]:
        slot = self._where.pop(key)
        queue = self._queues[slot]
        del queue[key]
        if not queue:
            del self._queues[slot]
        return slot

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        parent_depth = self._depth_of(parent)
        self._insert(key, 1 if parent_depth is None else parent_depth + 1)

    def on_insert_run(self, keys: Sequence[Key], parent: Key | None = None) -> None:
        parent_depth = self._depth_of(parent)
        base = 1 if parent_depth is None else parent_depth + 1
        # Tail first, as the base contract asks, with depths counted from the head.
        for i in range(len(keys) - 1, -1, -1):
            self._insert(keys[i], base + i)

    def _insert(self, key: Key, depth: int) -> None:
        if key in self._where:
            self.on_access(key)
            return
        self._past_depth.pop(key, None)
        self._depth[key] = depth
        self._enqueue(key, depth_class(depth), 1)

    def on_access(self, key: Key) -> None:
        slot = self._where.get(key)
        if slot is None:
            return
        self._dequeue(key)
        self._enqueue(key, slot[0], min(slot[1] + 1, self.max_frequency))

    def on_renew(self, keys: Sequence[Key]) -> None:
        """Each resident key's priority is set again from today's inflation, its count kept:
        in GDSF recency *is* the inflation a key was last priced at, so this is what makes
        it the most recent without counting a use."""
        for key in keys:
            slot = self._where.get(key)
            if slot is not None:
                self._dequeue(key)
                self._enqueue(key, *slot)

    def on_remove(self, key: Key) -> None:
        if key in self._where:
            self._dequeue(key)
            self._remember(key)

    def _remember(self, key: Key) -> None:
        self._past_depth[key] = self._depth.pop(key)
        if len(self._past_depth) > self.capacity:
            self._past_depth.popitem(last=False)

    def evict(self, n: int, evictable: Evictable = always_evictable) -> list[Key] | None:
        if n <= 0:
            return []
        # Each queue is walked once from its head; its first not-yet-taken evictable key is
        # its candidate, and the lowest candidate H goes next.
        cursors: dict[tuple[int, int], tuple[Iterator[tuple[Key, float]], Key, float]] = {}
        for slot, queue in self._queues.items():
            entries = iter(queue.items())
            head = _next_evictable(entries, evictable)
            if head is not None:
                cursors[slot] = (entries, *head)
        chosen: list[tuple[Key, float]] = []
        while len(chosen) < n:
            if not cursors:
                return None
            slot = min(cursors, key=lambda s: cursors[s][2])
            entries, key, priority = cursors[slot]
            chosen.append((key, priority))
            head = _next_evictable(entries, evictable)
            if head is None:
                del cursors[slot]
            else:
                cursors[slot] = (entries, *head)
        for key, priority in chosen:
            self._dequeue(key)
            self._remember(key)
            self.inflation = max(self.inflation, priority)
        return [key for key, _ in chosen]

    def ghost_count(self) -> int:
        """Depths remembered for evicted keys; at most ``capacity``."""
        return len(self._past_depth)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def __iter__(self) -> Iterator[Key]:
        for queue in self._queues.values():
            yield from queue

    def clear(self) -> None:
        self._queues.clear()
        self._where.clear()
        self._depth.clear()
        self._past_depth.clear()
        self.inflation = 0.0


def _next_evictable(entries: Iterator[tuple[Key, float]], evictable: Evictable) -> tuple[Key, float] | None:
    for key, priority in entries:
        if evictable(key):
            return key, priority
    return None
