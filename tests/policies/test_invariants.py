"""Invariants every eviction policy keeps, driven the way a tier drives it."""

from __future__ import annotations

import random

import pytest

from policies import make_policy
from policies.base import EvictableUnless, EvictionPolicy
from tests.policies.conftest import ALL_POLICIES


def drive(
    policy: EvictionPolicy,
    steps: int,
    seed: int,
    pinned: set[int] | None = None,
    *,
    as_blocked_set: bool = False,
    victims_seen: list[list[int]] | None = None,
) -> set[int]:
    """An owner: inserts runs of chained keys, hits some, evicts when full, sometimes drops an
    unpinned key itself. Returns the keys it holds at the end. ``as_blocked_set``: say which
    keys may go as the host tier says it (``EvictableUnless``), not with a predicate;
    ``victims_seen``: every eviction's victims are appended to it."""
    rng = random.Random(seed)
    resident: set[int] = set()
    pinned = pinned or set()
    evictable = EvictableUnless(pinned) if as_blocked_set else lambda k: k not in pinned
    next_key = 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.5 or not resident:
            parent = rng.choice(sorted(resident)) if resident and rng.random() < 0.7 else None
            run = list(range(next_key, next_key + rng.randint(1, 4)))
            next_key += len(run)
            need = len(resident) + len(run) - policy.capacity
            if need > 0:
                victims = policy.evict(need, evictable)
                if victims is None:
                    continue
                if victims_seen is not None:
                    victims_seen.append(victims)
                assert len(victims) == need == len(set(victims))
                assert set(victims) <= resident, "evicted a key that was not resident"
                assert not set(victims) & pinned, "evicted a pinned key"
                resident -= set(victims)
            policy.on_insert_run(run, parent)
            resident |= set(run)
        elif op < 0.9:
            policy.on_access(rng.choice(sorted(resident)))
        elif resident - pinned:
            key = rng.choice(sorted(resident - pinned))  # an owner never drops a pinned row
            policy.on_remove(key)
            resident.discard(key)
        assert len(policy) == len(resident) <= policy.capacity
    return resident


@pytest.mark.parametrize("name", ALL_POLICIES)
def test_capacity_membership_and_iteration_agree_with_the_owner(name: str) -> None:
    policy = make_policy(name, 16)
    resident = drive(policy, 600, seed=1)
    assert set(policy) == resident
    assert len(list(policy)) == len(resident)
    assert all(key in policy for key in resident)
    assert 10**9 not in policy


@pytest.mark.parametrize("name", ALL_POLICIES)
def test_pinned_keys_are_never_evicted(name: str) -> None:
    policy = make_policy(name, 12)
    pinned = {0, 1, 2, 5, 8}  # the first insertions: all of them are stored early
    resident = drive(policy, 500, seed=2, pinned=pinned)
    # drive() checks every eviction too; the pinned keys outlive ~500 others.
    assert pinned <= resident


@pytest.mark.parametrize("name", ALL_POLICIES)
def test_a_blocked_set_evicts_what_a_predicate_does(name: str) -> None:
    """``EvictableUnless`` lets ``take_evictable`` check a policy's first candidates in C; the
    victims must be those of the same rule as a predicate, pinned keys among the first
    candidates included (the early keys are the least recent for most of the run)."""
    pinned = {0, 1, 2, 5, 8, 13}
    by_predicate: list[list[int]] = []
    by_set: list[list[int]] = []
    drive(make_policy(name, 12), 500, seed=5, pinned=pinned, victims_seen=by_predicate)
    drive(make_policy(name, 12), 500, seed=5, pinned=pinned, as_blocked_set=True, victims_seen=by_set)
    assert by_set == by_predicate and len(by_set) > 50
    unpinned: list[list[int]] = []  # control: the same owner pinning nothing evicts otherwise
    drive(make_policy(name, 12), 500, seed=5, as_blocked_set=True, victims_seen=unpinned)
    assert unpinned != by_predicate


@pytest.mark.parametrize("name", ALL_POLICIES)
def test_evict_is_all_or_nothing(name: str) -> None:
    policy = make_policy(name, 10)
    policy.on_insert_run(list(range(10)))
    for key in (3, 4, 4, 7):
        policy.on_access(key)
    before = list(policy)
    # Only three keys may go: asking for four changes nothing.
    allowed = {0, 5, 9}
    assert policy.evict(4, lambda k: k in allowed) is None
    assert list(policy) == before
    victims = policy.evict(3, lambda k: k in allowed)
    assert victims is not None and sorted(victims) == [0, 5, 9]
    assert set(policy) == set(range(10)) - allowed
    assert policy.evict(0) == []


@pytest.mark.parametrize("name", ALL_POLICIES)
def test_clear_forgets_everything(name: str) -> None:
    policy = make_policy(name, 8)
    drive(policy, 100, seed=3)
    policy.clear()
    assert len(policy) == 0 and list(policy) == []
    assert policy.evict(1) is None


@pytest.mark.parametrize("name", ["arc", "s3fifo", "cost"])
def test_ghosts_stay_bounded(name: str) -> None:
    capacity = 20
    policy = make_policy(name, capacity)
    rng = random.Random(4)
    for step in range(5_000):
        key = rng.randrange(400) if rng.random() < 0.5 else 1_000 + step  # reuse and scans
        if key in policy:
            policy.on_access(key)
            continue
        if len(policy) >= capacity:
            assert policy.evict(1) is not None
        policy.on_insert(key)
        bound = 2 * capacity if name == "arc" else capacity
        assert policy.ghost_count() <= bound  # type: ignore[attr-defined]


def test_tinylfu_sketch_memory_is_fixed_by_capacity() -> None:
    policy = make_policy("tinylfu", 64)
    cells = policy.sketch.memory_cells  # type: ignore[attr-defined]
    for key in range(50_000):
        if len(policy) >= 64:
            policy.evict(1)
        policy.on_insert(key)
    assert policy.sketch.memory_cells == cells <= 64 * 64  # type: ignore[attr-defined]


def test_scan_resistant_policies_keep_a_hot_set_through_a_scan() -> None:
    """A one-off scan larger than the cache must not flush keys that are hit again and again."""
    for name in ("slru", "arc", "s3fifo", "tinylfu"):
        policy = make_policy(name, 50)
        hot = list(range(20))

        def use(key: int, policy: EvictionPolicy = policy) -> None:
            if key in policy:
                policy.on_access(key)
                return
            if len(policy) >= policy.capacity:
                policy.evict(1)
            policy.on_insert(key)

        for _ in range(5):
            for key in hot:
                use(key)
        for key in range(1_000, 1_200):
            use(key)
            if key % 10 == 0:
                for h in hot:
                    use(h)
        assert sum(key in policy for key in hot) >= 15, name


@pytest.mark.parametrize("name", ALL_POLICIES)
def test_a_renewal_changes_no_membership(name: str) -> None:
    policy = make_policy(name, 10)
    policy.on_insert_run(list(range(10)))
    policy.on_renew([3, 1, 99])  # 99 is not resident: ignored
    assert set(policy) == set(range(10)) and len(policy) == 10


@pytest.mark.parametrize("name", ["lru", "arc", "arc-vllm", "slru", "adaptive", "adaptive-ghosts"])
def test_a_renewal_is_order_not_a_use(name: str) -> None:
    """``on_renew`` makes keys the most recent in their own list; a use also makes a
    once-seen key frequent where a policy counts frequency (ARC's T2, SLRU's protected
    segment), so it then outlives a newer once-seen key."""
    renewed, used = make_policy(name, 4), make_policy(name, 4)
    for policy in (renewed, used):
        policy.on_insert_run([0, 1, 2, 3])  # tail first: 3 is the least recent, 0 the most
    renewed.on_renew([3, 2])
    used.on_access(3)
    used.on_access(2)
    for policy in (renewed, used):
        assert policy.evict(1) == [1]
        policy.on_insert(9)
    assert renewed.evict(3) == [0, 3, 2]  # still once-seen, by last use: 9 is the newest
    frequency = name in ("arc", "arc-vllm", "slru")
    assert (used.evict(3) == [0, 9, 3]) is frequency


def test_tinylfu_renews_within_its_segment_without_counting_a_use() -> None:
    """A renewed probation key outlives its segment's older keys, but stays on probation
    and the sketch does not count it: a use would have promoted it."""
    renewed, plain, used = (make_policy("tinylfu", 4) for _ in range(3))
    for policy in (renewed, plain, used):
        policy.on_insert_run([0, 1, 2, 3])  # window [0]; probation, least recent first: [3, 2, 1]
    frequency = renewed.sketch.frequency(3)  # type: ignore[attr-defined]
    renewed.on_renew([3])
    used.on_access(3)
    assert renewed.sketch.frequency(3) == frequency  # type: ignore[attr-defined]
    assert used.sketch.frequency(3) > frequency  # type: ignore[attr-defined]
    assert plain.evict(1) == [3]
    assert renewed.evict(1) == [2]
    assert 3 in renewed._probation and 3 in used._protected  # type: ignore[attr-defined]


def test_cost_renews_by_repricing_at_todays_inflation_without_counting_a_use() -> None:
    """GDSF's recency is the inflation a key was last priced at: a renewed key is priced
    again (it outlives keys priced before), with its count kept (a use would raise it)."""
    renewed, plain, used = (make_policy("cost", 8, attention_weight=0.0) for _ in range(3))
    for policy in (renewed, plain, used):
        for key in range(4):
            policy.on_insert(key)  # one depth, one count: a FIFO 0, 1, 2, 3, each at H = 1
        assert policy.evict(1) == [0]  # the inflation is 1 now
    renewed.on_renew([1])  # H = 1 + 1
    used.on_access(1)  # H = 1 + 2
    for policy in (renewed, plain, used):
        policy.on_insert(9)  # H = 1 + 1, after the renewed key
    assert plain.evict(3) == [1, 2, 3]
    assert renewed.evict(3) == [2, 3, 1]
    assert used.evict(3) == [2, 3, 9]


def test_a_renewal_is_no_request_for_adaptives_referee() -> None:
    policy = make_policy("adaptive", 64)
    policy.on_insert_run([0])  # key 0 is in the sample (an int key is its own hash)
    scores = list(policy.scores)  # type: ignore[attr-defined]
    policy.on_renew([0])
    assert policy.scores == scores  # type: ignore[attr-defined]
    policy.on_access(0)
    assert policy.scores != scores  # type: ignore[attr-defined]
