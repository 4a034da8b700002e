"""Approximate frequency of keys in constant memory: a count-min sketch behind a doorkeeper.

W-TinyLFU's admission and the "seen twice" placement rule both ask "how often was this key
requested lately?" for far more keys than a tier holds. Exact counts would need memory per
key ever seen; this answers in memory fixed at construction:

- ``CountMinSketch``: ``depth`` rows of saturating 4-bit counters (one byte each here, for
  speed); an estimate is the minimum over the rows, never below the true count.
- ``Doorkeeper``: a small Bloom filter that absorbs each key's first sighting, so the many
  keys seen once never reach (and never pollute) the counters.
- ``FrequencySketch``: both, with ageing: after ``sample_size`` recorded sightings every
  counter is halved and the doorkeeper cleared, so old popularity fades (TinyLFU's reset).
"""

from __future__ import annotations

from collections.abc import Hashable

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX = 0xBF58476D1CE4E5B9
_HALVE = bytes(i >> 1 for i in range(256))
_MAX_COUNT = 15


def _hashes(key: Hashable) -> tuple[int, int]:
    """Two well-mixed 64-bit hashes of ``key`` (Python's ``hash`` of an int is the int)."""
    h = (hash(key) * _GOLDEN) & _MASK64
    h ^= h >> 31
    h2 = (h * _MIX) & _MASK64
    h2 ^= h2 >> 29
    return h, h2 | 1


def _table_size(n: int) -> int:
    size = 16
    while size < n:
        size <<= 1
    return size


class CountMinSketch:
    """Saturating counters in ``depth`` rows of ``width`` (a power of two) cells."""

    def __init__(self, width: int, depth: int = 4) -> None:
        if width <= 0 or depth <= 0:
            raise ValueError(f"count-min sketch needs a positive width and depth, got {width}, {depth}")
        self.width = _table_size(width)
        self.depth = depth
        self._mask = self.width - 1
        self._rows = [bytearray(self.width) for _ in range(depth)]

    def _cells(self, h1: int, h2: int) -> list[int]:
        mask = self._mask
        return [((h1 + i * h2) >> 7) & mask for i in range(self.depth)]

    def add_hashed(self, h1: int, h2: int) -> None:
        for row, cell in zip(self._rows, self._cells(h1, h2), strict=True):
            if row[cell] < _MAX_COUNT:
                row[cell] += 1

    def estimate_hashed(self, h1: int, h2: int) -> int:
        return min(row[cell] for row, cell in zip(self._rows, self._cells(h1, h2), strict=True))

    def add(self, key: Hashable) -> None:
        self.add_hashed(*_hashes(key))

    def estimate(self, key: Hashable) -> int:
        return self.estimate_hashed(*_hashes(key))

    def halve(self) -> None:
        for row in self._rows:
            row[:] = row.translate(_HALVE)

    def clear(self) -> None:
        for row in self._rows:
            row[:] = bytes(self.width)

    @property
    def memory_cells(self) -> int:
        return self.width * self.depth


class Doorkeeper:
    """A Bloom filter for ``size`` keys: 8 bits a key and two probes, so while it holds at
    most ``size`` keys a stranger passes for "seen" less than 5% of the time."""

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"doorkeeper needs a positive size, got {size}")
        self.size = _table_size(size)  # bytes, i.e. 8 * size bits
        self._mask = 8 * self.size - 1
        self._bits = bytearray(self.size)

    def put_hashed(self, h1: int, h2: int) -> bool:
        """Mark the key; True if it was (probably) already marked."""
        bits = self._bits
        a, b = h1 & self._mask, (h2 >> 17) & self._mask
        bit_a, bit_b = 1 << (a & 7), 1 << (b & 7)
        a >>= 3
        b >>= 3
        seen = bits[a] & bit_a and bits[b] & bit_b
        bits[a] |= bit_a
        bits[b] |= bit_b
        return bool(seen)

    def contains_hashed(self, h1: int, h2: int) -> bool:
        a, b = h1 & self._mask, (h2 >> 17) & self._mask
        return bool(self._bits[a >> 3] & (1 << (a & 7)) and self._bits[b >> 3] & (1 << (b & 7)))

    def clear(self) -> None:
        self._bits[:] = bytes(self.size)


class FrequencySketch:
    """Recent request frequency of keys, in memory proportional to ``capacity``.

    ``record(key)`` counts one sighting; ``frequency(key)`` estimates the sightings since
    the last ageing, up to 16. ``sample_size`` (default ``10 * capacity``, TinyLFU's choice)
    sightings trigger the ageing. Memory: ``depth * width`` counter bytes plus the
    doorkeeper, both a small constant times ``capacity``.
    """

    def __init__(self, capacity: int, depth: int = 4, sample_factor: int = 10) -> None:
        if capacity <= 0:
            raise ValueError(f"frequency sketch needs a positive capacity, got {capacity}")
        if sample_factor <= 0:
            raise ValueError(f"frequency sketch needs a positive sample_factor, got {sample_factor}")
        self.sample_size = sample_factor * capacity
        self._sketch = CountMinSketch(width=capacity, depth=depth)
        self._doorkeeper = Doorkeeper(size=sample_factor * capacity)
        self._recorded = 0

    def record(self, key: Hashable) -> None:
        h1, h2 = _hashes(key)
        if self._doorkeeper.put_hashed(h1, h2):
            self._sketch.add_hashed(h1, h2)
        self._recorded += 1
        if self._recorded >= self.sample_size:
            self._sketch.halve()
            self._doorkeeper.clear()
            self._recorded = 0

    def frequency(self, key: Hashable) -> int:
        h1, h2 = _hashes(key)
        if not self._doorkeeper.contains_hashed(h1, h2):
            return self._sketch.estimate_hashed(h1, h2)
        return self._sketch.estimate_hashed(h1, h2) + 1

    def clear(self) -> None:
        self._sketch.clear()
        self._doorkeeper.clear()
        self._recorded = 0

    @property
    def memory_cells(self) -> int:
        """Bytes of counters and doorkeeper: fixed at construction."""
        return self._sketch.memory_cells + self._doorkeeper.size
