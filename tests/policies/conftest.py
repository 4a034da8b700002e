"""Shared policy lists for the policy tests."""

from __future__ import annotations

from bench.learned_policies import LEARNED_POLICIES
from policies.registry import builtin_policies

# Every built-in policy and the benchmark's learned ones (the same contract), and each
# wrapped in prefix-aware eviction.
BASE_POLICIES = builtin_policies() + list(LEARNED_POLICIES)
ALL_POLICIES = BASE_POLICIES + [f"prefix:{name}" for name in BASE_POLICIES]


def replay(policy, keys: list[int]) -> int:
    """Hits of ``policy`` as a plain cache over ``keys``: a miss evicts one key if full, then inserts."""
    hits = 0
    for key in keys:
        if key in policy:
            policy.on_access(key)
            hits += 1
            continue
        if len(policy) >= policy.capacity:
            policy.evict(1)
        policy.on_insert(key)
    return hits
