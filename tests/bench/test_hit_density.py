"""Least hit density: learns reuse by class and age, evicts chain tails only."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.learned_policies.hit_density import HitDensityPolicy
from policies import make_policy
from tests.policies.conftest import replay


def test_it_learns_a_loop_that_lru_thrashes_on() -> None:
    """Keys reused in a cycle 1.5x the cache: LRU always evicts the next key needed; a
    policy that learns "hits come at age ~1.5 caches" evicts the young ones instead."""
    loop = list(range(150)) * 40
    lru_hits = replay(make_policy("lru", 100), loop)
    lhd_hits = replay(HitDensityPolicy(100, period=200), loop)
    assert lru_hits == 0
    assert lhd_hits > 0.3 * len(loop)


def test_chains_leave_from_the_tail_and_nothing_is_orphaned() -> None:
    rng = random.Random(5)
    policy = HitDensityPolicy(60)
    parent_of: dict[int, int | None] = {}
    next_key = 0
    for _ in range(400):
        parent = rng.choice(list(policy)) if len(policy) and rng.random() < 0.5 else None
        run = list(range(next_key, next_key + rng.randint(1, 6)))
        next_key += len(run)
        for i, key in enumerate(run):
            parent_of[key] = run[i - 1] if i else parent
        need = len(policy) + len(run) - policy.capacity
        if need > 0:
            victims = policy.evict(need)
            assert victims is not None
            for victim in victims:  # a victim never leaves a resident successor behind
                assert not any(parent_of[k] == victim for k in policy), victim
        policy.on_insert_run(run, parent)
        if rng.random() < 0.5:
            policy.on_access(rng.choice(list(policy)))
    assert not policy._forest.orphans


def test_an_owner_removal_orphans_descendants_which_go_first() -> None:
    policy = HitDensityPolicy(20)
    policy.on_insert_run([1, 2, 3, 4])
    policy.on_insert_run([10, 11])
    policy.on_remove(2)
    assert policy.evict(2) == [3, 4]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10), keys=st.lists(st.integers(0, 40), min_size=1, max_size=300))
def test_it_is_deterministic_for_a_seed_and_keeps_bounded_state(seed: int, keys: list[int]) -> None:
    a, b = HitDensityPolicy(8, seed=seed, period=16), HitDensityPolicy(8, seed=seed, period=16)
    assert replay(a, keys) == replay(b, keys)
    assert list(a) == list(b)
    assert len(a._forest.children) <= len(a) and len(a._forest.tails) <= len(a)
    assert all(len(row) == 256 for row in a._hits + a._evictions + a._density)
