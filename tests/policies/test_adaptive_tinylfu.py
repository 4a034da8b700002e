"""Adaptive W-TinyLFU: the hill climber alone, and the window it sizes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import make_policy
from policies.adaptive_tinylfu import AdaptiveTinyLFUPolicy, HillClimber
from tests.policies.conftest import replay


def sample(climber: HillClimber, hits: int, misses: int) -> int:
    """Feed one sample of ``hits + misses`` events; the window change at its end."""
    assert hits + misses == climber.sample
    changes = [climber.record(True) for _ in range(hits)] + [climber.record(False) for _ in range(misses)]
    assert not any(changes[:-1])
    return changes[-1]


def test_the_climber_keeps_going_while_it_pays_and_turns_back_when_it_does_not() -> None:
    climber = HillClimber(capacity=1_000, sample=100, step_fraction=0.1, decay=0.5, restart=0.5)
    assert sample(climber, 10, 90) == 100  # first sample: up a full step
    assert sample(climber, 20, 80) == 50  # better: same way, half the step
    assert sample(climber, 10, 90) == -25  # worse: back, half again
    assert sample(climber, 10, 90) == -12  # no change counts as no worse: keep going


def test_a_jump_in_hit_ratio_restarts_with_a_full_step() -> None:
    climber = HillClimber(capacity=1_000, sample=100, step_fraction=0.1, decay=0.5, restart=0.2)
    sample(climber, 10, 90)
    sample(climber, 15, 85)
    assert sample(climber, 60, 40) == 25  # the step used is the decayed one...
    assert climber.step == 100  # ...and the next starts full again, same direction


def recency_trace(capacity: int, rounds: int) -> list[int]:
    """Every key comes back once, within ``capacity`` keys: a 1% window and a
    frequency contest (every key seen once) lose it; a cache of recency would not."""
    gap = capacity // 4
    keys: list[int] = []
    for r in range(rounds):
        new = list(range(r * gap, (r + 1) * gap))
        keys += new + [k - gap for k in new if k >= gap]
    return keys


def test_the_window_grows_where_recency_pays() -> None:
    trace = recency_trace(200, 60)
    fixed = replay(make_policy("tinylfu", 200), trace)
    adaptive = make_policy("tinylfu-adaptive", 200)
    assert isinstance(adaptive, AdaptiveTinyLFUPolicy)
    assert replay(adaptive, trace) > 2 * fixed
    assert adaptive.window_size > 0.5 * 200


@settings(max_examples=40, deadline=None)
@given(capacity=st.integers(2, 40), sizes=st.lists(st.integers(-60, 60), max_size=8))
def test_a_resize_keeps_every_key_and_the_window_within_its_share(capacity: int, sizes: list[int]) -> None:
    policy = AdaptiveTinyLFUPolicy(capacity)
    for key in range(capacity):
        policy.on_insert(key)
    for size in sizes:
        policy._resize(policy.window_size + size)
        assert 1 <= policy.window_size <= capacity - 1
        assert len(policy._window) <= policy.window_size
        assert set(policy) == set(range(capacity))


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"climb_sample": 0}, "climb_sample"),
        ({"step_fraction": 0.0}, "step_fraction"),
        ({"window_fraction": 1.0}, "window_fraction"),
    ],
)
def test_bad_parameters_are_config_errors(params: dict, named: str) -> None:
    with pytest.raises(ValueError, match=rf"'tinylfu-adaptive'.*{named}"):
        make_policy("tinylfu-adaptive", 100, **params)


def test_asking_to_evict_nothing_does_not_start_the_climb() -> None:
    """Climbing starts at the first eviction; ``evict(0)`` evicts nothing, so a tier that asked
    for nothing behaves as one that was never asked (found by the batch-equals-singles
    property: the batch ``evict(0)`` started the climb, zero ``evict(1)`` calls did not)."""
    asked, never = AdaptiveTinyLFUPolicy(10, climb_sample=0.1), AdaptiveTinyLFUPolicy(10, climb_sample=0.1)
    assert asked.evict(0) == []
    for key in range(12):
        for policy in (asked, never):
            policy.on_insert(key)
    assert asked.window_size == never.window_size == 1
    assert list(asked) == list(never)
    asked.evict(1)  # a real eviction starts it: the next misses move the window
    for key in range(12, 20):
        asked.on_insert(key)
    assert asked.window_size > 1
