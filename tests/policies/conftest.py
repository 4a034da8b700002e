"""Shared policy lists for the policy tests."""

from __future__ import annotations

# Every built-in policy, and each wrapped in prefix-aware eviction.
BASE_POLICIES = ["lru", "slru", "arc", "s3fifo", "tinylfu", "tinylfu-adaptive", "cost", "lhd"]
ALL_POLICIES = BASE_POLICIES + [f"prefix:{name}" for name in BASE_POLICIES]
