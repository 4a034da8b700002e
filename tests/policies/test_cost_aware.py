"""Cost-aware eviction: recompute cost saved per byte, GreedyDual-Size-Frequency."""

from __future__ import annotations

from policies import make_policy
from policies.cost_aware import CostAwarePolicy, depth_class


def test_depth_classes_are_log2_buckets() -> None:
    assert [depth_class(d) for d in (0, 1, 2, 3, 4, 7, 8, 1 << 20)] == [0, 1, 2, 2, 3, 3, 4, 11]


def test_deep_blocks_outlive_shallow_ones_of_the_same_age() -> None:
    policy = CostAwarePolicy(100, attention_weight=0.5)
    policy.on_insert_run(list(range(40)))  # depths 0..39, one store
    victims = policy.evict(10)
    # The cheapest to recompute go first, class by class (depth 0, 1, 2-3, 4-7, then 8-15).
    assert victims is not None and set(victims[:8]) == set(range(8)) and max(victims) < 16


def test_without_attention_cost_it_is_lru_within_a_frequency() -> None:
    policy = CostAwarePolicy(10, attention_weight=0.0, max_frequency=1)
    for key in range(5):
        policy.on_insert(key)
    policy.on_access(0)
    assert policy.evict(2) == [1, 2]


def test_frequency_raises_priority_and_inflation_ages_it() -> None:
    policy = CostAwarePolicy(4, attention_weight=0.0, max_frequency=4)
    policy.on_insert("hot")
    for _ in range(3):
        policy.on_access("hot")
    for step in range(3):
        policy.on_insert(step)
    assert policy.evict(1) == [0]
    assert policy.inflation == 1.0
    # Each eviction of a frequency-1 key raises L; the hot key survives until L passes 4.
    evicted = []
    for key in range(10, 20):
        if len(policy) >= 4:
            evicted += policy.evict(1)  # type: ignore[arg-type]
        policy.on_insert(key)
    assert "hot" in evicted


def test_depth_comes_from_the_parent_even_after_it_left() -> None:
    policy = make_policy("cost", 10)
    policy.on_insert_run([1, 2, 3])
    assert policy._depth[3] == 2  # type: ignore[attr-defined]
    policy.evict(3)
    policy.on_insert_run([4], parent=3)  # 3 was evicted, its depth is remembered
    assert policy._depth[4] == 3  # type: ignore[attr-defined]
    policy.on_insert(99, parent=12345)  # unknown parent: depth 1
    assert policy._depth[99] == 1  # type: ignore[attr-defined]
