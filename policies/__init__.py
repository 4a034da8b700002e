"""Eviction and placement policies: pure bookkeeping over opaque keys (a leaf package)."""

from policies.base import Evictable, EvictionPolicy, Key, always_evictable
from policies.registry import make_policy, policy_names, register_policy, resolve_policy

__all__ = [
    "Evictable",
    "EvictionPolicy",
    "Key",
    "always_evictable",
    "make_policy",
    "policy_names",
    "register_policy",
    "resolve_policy",
]
