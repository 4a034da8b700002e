"""The count-min sketch, the doorkeeper and the ageing frequency sketch."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.sketch import CountMinSketch, Doorkeeper, FrequencySketch


@settings(max_examples=60, deadline=None)
@given(keys=st.lists(st.integers(0, 300), max_size=400), width=st.integers(1, 64))
def test_count_min_never_underestimates_below_saturation(keys: list[int], width: int) -> None:
    sketch = CountMinSketch(width)
    for key in keys:
        sketch.add(key)
    for key, count in Counter(keys).items():
        assert sketch.estimate(key) >= min(count, 15)


def test_count_min_is_exact_without_collisions_and_halves() -> None:
    sketch = CountMinSketch(1 << 12)
    for _ in range(6):
        sketch.add("hot")
    sketch.add("cold")
    assert sketch.estimate("hot") == 6 and sketch.estimate("cold") == 1 and sketch.estimate("none") == 0
    sketch.halve()
    assert sketch.estimate("hot") == 3 and sketch.estimate("cold") == 0
    for _ in range(40):
        sketch.add("hot")
    assert sketch.estimate("hot") == 15  # 4-bit counters saturate


def test_doorkeeper_absorbs_first_sightings() -> None:
    door = Doorkeeper(1024)
    assert door.put_hashed(12345, 678901) is False
    assert door.put_hashed(12345, 678901) is True
    assert door.contains_hashed(12345, 678901)
    door.clear()
    assert not door.contains_hashed(12345, 678901)


def test_frequency_sketch_counts_ages_and_keeps_its_memory() -> None:
    sketch = FrequencySketch(capacity=100, sample_factor=10)
    memory = sketch.memory_cells
    hot = -1  # int keys hash the same in every process: the test is deterministic
    sketch.record(hot)
    assert sketch.frequency(hot) == 1  # in the doorkeeper only
    for _ in range(4):
        sketch.record(hot)
    assert sketch.frequency(hot) == 5
    for key in range(995):  # the 1,000th recording ages: counts halve, the doorkeeper clears
        sketch.record(key)  # seen once each: they stay in the doorkeeper
    assert sketch.frequency(hot) == 2
    assert sketch.memory_cells == memory
    sketch.clear()
    assert sketch.frequency(hot) == 0
