"""The adaptive policy: LRU, ARC or vLLM's ARC as its sampled shadows say, over one set of lists."""

from __future__ import annotations

import random

import pytest

from policies.adaptive import ARC, EXPERTS, LRU, VLLM_ARC, AdaptivePolicy
from policies.arc import ARCPolicy, VLLMARCPolicy
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
    scores = {cls: replay(cls(400), keys) for cls in (LRUPolicy, ARCPolicy, VLLMARCPolicy)}
    adaptive = replay(AdaptivePolicy(400, sample_bits=2), keys)
    assert adaptive >= 0.97 * max(scores.values())


@pytest.mark.parametrize("expert", [LRU, ARC, VLLM_ARC])
def test_each_expert_alone_makes_its_own_policys_decisions(expert: int) -> None:
    """With the referee silenced, the shared lists evict exactly as the expert's own class."""
    own = make_policy(EXPERTS[expert], 300)
    adaptive = AdaptivePolicy(300)
    adaptive.expert = expert
    adaptive._referee = lambda key: None  # type: ignore[method-assign]
    keys = scan_heavy(2)[:12_000]
    for key in keys:
        if key in own:
            own.on_access(key)
            adaptive.on_access(key)
            continue
        if len(own) >= 300:
            assert adaptive.evict(3) == own.evict(3)
        own.on_insert(key)
        adaptive.on_insert(key)
    assert set(adaptive) == set(own)


def test_lists_stay_disjoint_and_ordered_and_ghosts_bounded() -> None:
    policy = make_policy("adaptive", 64, sample_bits=1)
    rng = random.Random(5)
    experts = set()
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
        a, g, h = policy._a, policy._g, policy._h
        assert len(a) + len(g) + len(h) == len(set(a) | set(g) | set(h)) == len(policy)
        for part in (a, g, h):
            assert list(part.values()) == sorted(part.values())  # each list by last use
        assert policy.ghost_count() <= 4 * 64
        experts.add(policy.expert)
    assert len(experts) > 1  # the referee did switch on this mix
    policy.clear()
    assert len(policy) == 0 and not policy._b1 and not policy._v1 and policy.expert == LRU


def test_bad_parameters_are_errors() -> None:
    with pytest.raises(ValueError, match="sample_bits"):
        make_policy("adaptive", 8, sample_bits=20)
    with pytest.raises(ValueError, match="horizon"):
        make_policy("adaptive", 8, horizon=0)


def test_kvtier_keys_are_sampled_by_a_hash_byte_the_same_in_every_process() -> None:
    from policies.adaptive import _sample_byte

    key = bytes(range(8)) + (0).to_bytes(4, "big")
    assert _sample_byte(key) == 7 and _sample_byte(12) == 12
