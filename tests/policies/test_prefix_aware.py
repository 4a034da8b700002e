"""Prefix-aware eviction: chains shrink from the tail; orphans go first."""

from __future__ import annotations

from policies import make_policy
from policies.lru import LRUPolicy
from policies.prefix_aware import PrefixAware


def test_a_chain_is_evicted_from_its_tail_even_when_its_head_is_oldest() -> None:
    # Inserted head first, one at a time: plain LRU would evict the head (and strand the rest).
    policy = PrefixAware(LRUPolicy(10))
    chain = list(range(6))
    for i, key in enumerate(chain):
        policy.on_insert(key, chain[i - 1] if i else None)
    assert policy.evict(3) == [5, 4, 3]
    assert policy.orphans == []
    assert set(policy) == {0, 1, 2}


def test_leaf_first_prefers_the_tails_of_every_chain() -> None:
    policy = PrefixAware(LRUPolicy(10))
    policy.on_insert(100)  # shared root
    for branch in (1, 2):
        keys = [branch * 10 + i for i in range(3)]
        for i, key in enumerate(keys):
            policy.on_insert(key, keys[i - 1] if i else 100)
    victims = policy.evict(2)
    assert victims == [12, 22]
    assert 100 in policy and not policy.orphans


def test_removing_a_middle_block_orphans_its_descendants_which_go_first() -> None:
    policy = make_policy("prefix:lru", 20)
    policy.on_insert_run(list(range(8)))  # 0 -> 1 -> ... -> 7
    policy.on_insert_run([50, 51])  # another chain, older in nothing but useful
    policy.on_remove(3)  # the owner drops a corrupt row: 4 can no longer be hit
    assert policy.orphans == [4]  # type: ignore[attr-defined]
    first = policy.evict(1)
    assert first == [4]
    assert policy.orphans == [5]  # type: ignore[attr-defined]
    assert policy.evict(3) == [5, 6, 7]
    assert set(policy) == {0, 1, 2, 50, 51}


def test_a_returning_parent_adopts_its_orphans_again() -> None:
    policy = make_policy("prefix:arc", 10)
    policy.on_insert_run([1, 2, 3])
    policy.on_remove(1)
    assert policy.orphans == [2]  # type: ignore[attr-defined]
    policy.on_insert(1)
    assert policy.orphans == []  # type: ignore[attr-defined]


def test_a_root_whose_parent_lives_elsewhere_is_not_an_orphan() -> None:
    policy = make_policy("prefix:lru", 10)
    policy.on_insert_run([7, 8, 9], parent=6)  # 6 is on the device, never stored here
    assert policy.orphans == []  # type: ignore[attr-defined]
    assert policy.evict(1) == [9]


def test_the_leaf_search_is_bounded_and_then_orphans_are_cleaned_up() -> None:
    # search_limit=0: one key asked for allows 4 refusals.
    policy = PrefixAware(LRUPolicy(10), search_limit=0)
    for i in range(5):
        policy.on_insert(i, i - 1 if i else None)  # head oldest: LRU order is 0, 1, 2, ...
    assert policy.evict(1) == [4]  # 0..3 refused, 4 is the leaf
    assert not policy.orphans
    policy = PrefixAware(LRUPolicy(10), search_limit=0)
    for i in range(6):
        policy.on_insert(i, i - 1 if i else None)
    assert policy.evict(1) == [4]  # 0..3 refused, then the budget is spent: interior 4 goes
    assert policy.orphans == [5]
    assert policy.evict(1) == [5]  # and its orphan goes next, before anything useful


def test_evicting_an_interior_block_when_nothing_else_can_go_orphans_its_children() -> None:
    policy = PrefixAware(LRUPolicy(4))
    policy.on_insert_run([1, 2, 3, 4])
    victims = policy.evict(1, lambda k: k == 2)  # only the interior block 2 may go
    assert victims == [2]
    assert policy.orphans == [3]
    assert policy.evict(1) == [3]
    assert policy.orphans == [4]


def test_extending_a_chain_counts_as_reuse_but_branching_does_not() -> None:
    policy = make_policy("prefix:slru", 10, protected_fraction=0.5)
    policy.on_insert_run([1, 2])  # a first turn: nothing to extend
    policy.on_access(1)
    policy.on_access(2)
    policy.on_insert_run([3], parent=2)  # the next turn extends the tail: inherits its reuse
    policy.on_insert_run([9], parent=1)  # a branch off an interior block: a new conversation
    inner = policy.inner  # type: ignore[attr-defined]
    assert 3 in inner._protected and 9 in inner._probation
