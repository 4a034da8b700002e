"""The adaptive policy: LRU or ARC as its sampled shadows say, both orders kept exact."""

from __future__ import annotations

import random

import pytest

from policies.adaptive import AdaptivePolicy
from policies.arc import ARCPolicy
from policies.lru import LRUPolicy
from policies.registry import make_policy


def replay(policy, keys) -> int:
    hits = 0
    for key in keys:
        if key in policy:
            policy.on_access(key)
            hits += 1
        else:
            if len(policy) >= policy.capacity:
                assert policy.evict(1) is not None
            policy.on_insert(key)
    return hits


def scan_heavy(seed: int) -> list[int]:
    """Hot keys (come back often) between one-off scans: ARC's case, LRU's worst."""
    rng = random.Random(seed)
    keys, fresh = [], 10_000
    for _ in range(40_000):
        if rng.random() < 0.5:
            keys.append(rng.randrange(200))
        else:
            keys.append(fresh)
            fresh += 1
    return keys


def recency_friendly(seed: int) -> list[int]:
    """A window that slides: what was used lately comes back, frequency means nothing."""
    rng = random.Random(seed)
    return [max(0, i // 4 - int(rng.expovariate(1 / 60))) for i in range(40_000)]


@pytest.mark.parametrize("trace", [scan_heavy, recency_friendly])
def test_it_follows_the_better_expert(trace) -> None:
    keys = trace(1)
    scores = {cls: replay(cls(400), keys) for cls in (LRUPolicy, ARCPolicy)}
    adaptive = replay(AdaptivePolicy(400, sample_bits=2), keys)
    assert adaptive >= 0.97 * max(scores.values())


def test_lists_agree_after_any_sequence_and_ghosts_stay_bounded() -> None:
    policy = make_policy("adaptive", 64, sample_bits=1)
    rng = random.Random(5)
    for step in range(5_000):
        key = rng.randrange(300)
        if key in policy:
            policy.on_access(key)
        elif step % 7 == 0 and len(policy):
            policy.on_remove(next(iter(policy)))
        else:
            if len(policy) >= 64:
                assert policy.evict(1, lambda k: k % 5 != 0) is not None
            policy.on_insert(key)
        assert set(policy._recency) == set(policy._t1) | set(policy._t2)
        assert policy.ghost_count() <= 2 * 64
    policy.clear()
    assert len(policy) == 0 and not policy._recency and policy.use_lru


def test_bad_parameters_are_errors() -> None:
    with pytest.raises(ValueError, match="sample_bits"):
        make_policy("adaptive", 8, sample_bits=20)
    with pytest.raises(ValueError, match="horizon"):
        make_policy("adaptive", 8, horizon=0)


def test_kvtier_keys_are_sampled_by_a_hash_byte_the_same_in_every_process() -> None:
    from policies.adaptive import _sample_byte

    key = bytes(range(8)) + (0).to_bytes(4, "big")
    assert _sample_byte(key) == 7 and _sample_byte(12) == 12
