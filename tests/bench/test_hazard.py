"""Reuse hazard: hit density learned from the key stream, returns after an eviction included."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.learned_policies.hazard import RUN_CLASSES, ReuseHazardPolicy, run_class
from policies import make_policy
from policies.base import EvictionPolicy
from tests.policies.conftest import replay


def test_it_learns_a_loop_from_ghost_returns() -> None:
    """Keys reused in a cycle 1.5x the cache: LRU never hits. Every return happens after the
    key was evicted, so only the ghost shows it; learning "returns come at age ~1.5
    caches" makes the young keys the victims, and the old ones then hit."""
    loop = list(range(150)) * 40
    assert replay(make_policy("lru", 100), loop) == 0
    assert replay(ReuseHazardPolicy(100, period=200), loop) > 0.3 * len(loop)


def _stream(policy: EvictionPolicy, rounds: int) -> int:
    """Short runs (2 blocks) from a pool that comes back after ~3 caches of traffic,
    between long runs (20 blocks) of fresh keys that never come back. Returns the hits on
    the short runs (a run hits only if its head and its tail are both resident)."""
    pool = [(10_000_000 + 2 * i, 10_000_000 + 2 * i + 1) for i in range(40)]
    fresh = 0
    hits = 0
    for r in range(rounds):
        if r % 2:
            run = list(range(fresh, fresh + 20))
            fresh += 20
        else:
            run = list(pool[(r // 2) % len(pool)])
        if all(key in policy for key in run):
            hits += 1
            for key in reversed(run):
                policy.on_access(key)
            continue
        run = [key for key in run if key not in policy]
        need = len(policy) + len(run) - policy.capacity
        if need > 0:
            assert policy.evict(need) is not None
        policy.on_insert_run(run)
    return hits


def test_a_class_that_comes_back_is_kept_over_one_that_does_not() -> None:
    """LRU drops the short runs before they return (the long ones flush it); the policy
    learns by run length that short runs return and long ones do not, and keeps them."""
    rounds = 4_000
    lru = _stream(make_policy("lru", 300), rounds)
    hazard = _stream(ReuseHazardPolicy(300, period=256), rounds)
    assert lru < 0.05 * rounds / 2
    assert hazard > 0.5 * rounds / 2


def test_ghosts_and_per_key_state_stay_bounded() -> None:
    policy = ReuseHazardPolicy(50, ghost=2.0, period=64)
    rng = random.Random(3)
    for key in range(5_000):
        if len(policy) >= policy.capacity:
            assert policy.evict(rng.randint(1, 3)) is not None
        policy.on_insert_run([3 * key, 3 * key + 1, 3 * key + 2][: rng.randint(1, 3)])
        assert len(policy._ghost) <= 100
        assert len(policy._meta) == len(policy)
    assert len(policy._ghost) == 100
    assert len(policy._hits) == len(policy._events) == len(policy._density) == 4 * RUN_CLASSES * 3 * 2
    policy.clear()
    assert not len(policy) and not policy._ghost and not policy._meta


def test_a_returning_ghost_counts_as_a_return_and_keeps_its_use_count() -> None:
    policy = ReuseHazardPolicy(2, period=10**6)
    policy.on_insert_run([1])
    policy.on_access(1)
    assert policy.evict(1) == [1]
    assert 1 in policy._ghost and 1 not in policy
    before = sum(map(sum, policy._hits))
    policy.on_insert_run([1])
    assert sum(map(sum, policy._hits)) == before + 1
    assert 1 not in policy._ghost and policy._meta[1] == (3, 0, 1, 1)  # third use, a 1-block run, turn 1


def test_a_run_that_extends_a_known_chain_is_one_turn_deeper_and_its_reads_take_its_turn() -> None:
    policy = ReuseHazardPolicy(100, period=10**6)
    policy.on_insert_run([1, 2])  # turn 1
    policy.on_insert_run([3], parent=2)  # turn 2: extends the request that stored 2
    policy.on_access(2)  # the request's reads start from the run's parent
    policy.on_access(1)
    assert [policy._meta[k][2:] for k in (1, 2, 3)] == [(2, 1), (2, 1), (2, 2)]
    policy.on_insert_run([4], parent=3)  # turn 3
    assert policy.evict(1, lambda key: key == 4) == [4]
    policy.on_insert_run([6], parent=4)  # its parent is a ghost now, and still known: turn 4
    assert policy._meta[6][2:] == (4, 4)
    policy.on_insert_run([5], parent=999)  # a parent this tier never saw: turn 1
    assert policy._meta[5][2:] == (1, 1)


def test_shrinking_pulls_a_sparse_class_toward_its_group() -> None:
    """A class with a few events learns its own density only when nothing is shrunk."""
    raw, shrunk = ReuseHazardPolicy(64, shrink=0, period=10**6), ReuseHazardPolicy(64, period=10**6)
    for policy in (raw, shrunk):
        policy._hits[0][5] = 2.0
        policy._events[0] = 2.0  # class 0: 2 events, both back at age bin 5
        policy._events[2] = 1000.0  # class 2, same group: 1000 events, none back
        policy._learn()
    assert raw._density[0][0] > 0.0 and raw._density[2][0] == 0.0
    assert 0.0 < shrunk._density[0][0] < raw._density[0][0] / 100


def test_run_classes() -> None:
    assert [run_class(n) for n in (1, 3, 4, 7, 8, 16, 31, 32, 63, 64, 1000)] == [
        0,
        0,
        1,
        1,
        2,
        3,
        3,
        4,
        4,
        5,
        5,
    ]


@pytest.mark.parametrize(
    ("params", "word"),
    [
        ({"use_classes": 0}, "use_classes"),
        ({"turn_classes": 0}, "turn_classes"),
        ({"shrink": -1}, "shrink"),
        ({"shrink": float("inf")}, "shrink"),
        ({"ghost": float("nan")}, "ghost"),
        ({"ghost": 0}, "ghost"),
        ({"ghost": True}, "ghost"),
        ({"samples": 0}, "samples"),
        ({"decay": 1.0}, "decay"),
    ],
)
def test_bad_parameters_are_clear_errors(params: dict, word: str) -> None:
    with pytest.raises(ValueError, match=rf"'hazard'.*{word}"):
        make_policy("hazard", 10, **params)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10), keys=st.lists(st.integers(0, 40), min_size=1, max_size=300))
def test_it_is_deterministic_for_a_seed_and_keeps_bounded_state(seed: int, keys: list[int]) -> None:
    a, b = ReuseHazardPolicy(8, seed=seed, period=16), ReuseHazardPolicy(8, seed=seed, period=16)
    assert replay(a, keys) == replay(b, keys)
    assert list(a) == list(b)
    assert len(a._ghost) <= 32 and len(a._meta) == len(a)
    assert all(len(row) == 40 for row in a._hits + a._density)
