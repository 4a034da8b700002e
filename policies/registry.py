"""Policies by name, and a user's own policy by module path.

``make_policy("lru", capacity)`` or ``make_policy("my_pkg.policies:MyPolicy", capacity,
alpha=0.5)``. Every failure is a ``ValueError`` that names the policy and what is wrong, so
the configuration layer can report the key and value at fault.

Built-in names: ``lru``, ``adaptive`` (LRU or ARC, whichever sampled shadows of the two
say is winning now), ``adaptive-ghosts`` (the same, ARC's ghost size chosen by shadows
too), ``slru``, ``arc``, ``arc-vllm`` (ARC as vLLM's ``arc`` runs it), ``s3fifo``,
``tinylfu`` (alias ``w-tinylfu``), ``tinylfu-adaptive`` (its window sized by hill climbing,
as in Caffeine), ``cost`` (alias ``cost-aware``). (``lhd`` and ``hazard`` moved to
``bench.learned_policies``: too slow for vLLM's scheduler thread; their bare names are an
error that gives their class paths.) Any of them, or a module path, wrapped in prefix-aware eviction
(``policies.prefix_aware.PrefixAware``): ``"prefix:<name>"``, e.g. ``"prefix:arc"`` or
``"prefix:my_pkg.policies:MyPolicy"``. The parameters go to the inner policy, except
``search_limit`` and ``inherit``, which are the wrapper's. The name ``prefix`` is therefore
reserved: a user module called ``prefix`` cannot be given as ``prefix:Class``.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from policies.adaptive import AdaptivePolicy, SizedGhostsAdaptivePolicy
from policies.adaptive_tinylfu import AdaptiveTinyLFUPolicy
from policies.arc import ARCPolicy, VLLMARCPolicy
from policies.base import EvictionPolicy
from policies.cost_aware import CostAwarePolicy
from policies.lru import LRUPolicy
from policies.prefix_aware import PrefixAware
from policies.s3fifo import S3FIFOPolicy
from policies.slru import SLRUPolicy
from policies.tinylfu import TinyLFUPolicy

_CLASSES = (
    LRUPolicy,
    AdaptivePolicy,
    SizedGhostsAdaptivePolicy,
    SLRUPolicy,
    ARCPolicy,
    VLLMARCPolicy,
    S3FIFOPolicy,
    TinyLFUPolicy,
    AdaptiveTinyLFUPolicy,
    CostAwarePolicy,
)
_BUILTIN: dict[str, type[EvictionPolicy]] = {cls.name: cls for cls in _CLASSES}
_ALIASES = {"w-tinylfu": TinyLFUPolicy.name, "cost-aware": CostAwarePolicy.name}
MOVED_TO_BENCH = {
    "lhd": "bench.learned_policies.hit_density:HitDensityPolicy",
    "hazard": "bench.learned_policies.hazard:ReuseHazardPolicy",
}
"""Former built-ins now kept as benchmark references, and the class path that still selects
each (``bench.learned_policies`` says why they left; importing ``bench`` registers them)."""
PREFIX = "prefix:"
DEFAULT_POLICY = "adaptive-ghosts"
"""The host tier's policy when the configuration names none (``tiers[].eviction``,
``eviction_policy``): LRU or ARC as sampled shadows say, ARC's ghosts sized the same way.
``kvtier bench policy``'s table, driven as vLLM's scheduler drives a manager
(docs/policies.md#what-a-vllm-user-gets): at or over vLLM's better policy in 13 of its 15
cells (2.9% under at worst, on the production trace's cold second half) and within 2.4% on
27 held out, and over vLLM ``arc`` where ARC's split leads (+11% on the agentic trace at
host 10%, +57% at 5%), at 2x vLLM ``arc``'s calls/s or more on the long-document, chat and
production traces (the production trace at host 10% the nearest: 2.05-2.12x over four runs,
since its referees are compiled). ``adaptive`` (ghosts of one size) gains less (+7.5%
there) a few percent faster; ``lru`` (vLLM's default) runs faster still but loses up to 11%
to vLLM ``arc`` on those traces and half the hits on a scan-heavy one."""
LOWER_TIER_POLICY = "lru"
"""The policy of a tier below the host tier when its table names none: such a tier sees
only the host tier's victims, and a call there costs far less than its I/O."""


def register_policy(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Make a policy class selectable by its ``name`` (usable as a class decorator)."""
    if not cls.name:
        raise ValueError(f"policy class {cls.__qualname__} has no name")
    _BUILTIN[cls.name] = cls
    return cls


def builtin_policies() -> list[str]:
    """kvtier's own policies, in the order benchmarks and tests list them (no aliases)."""
    return [cls.name for cls in _CLASSES]


def policy_names() -> list[str]:
    """The names accepted by ``make_policy`` besides module paths (and ``prefix:`` forms)."""
    return sorted([*_BUILTIN, *_ALIASES])


def resolve_policy(name: str) -> type[EvictionPolicy]:
    """The class behind a built-in name or a ``module.path:ClassName`` / ``module.path.ClassName``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"eviction policy must be a non-empty string, got {name!r}")
    name = _ALIASES.get(name, name)
    if name in _BUILTIN:
        return _BUILTIN[name]
    if name in MOVED_TO_BENCH:
        raise ValueError(
            f"eviction policy {name!r} is a benchmark reference, not a kvtier policy: it runs "
            "far under vLLM's own policies' speed on the scheduler thread "
            "(docs/policies.md#learned-policies-are-benchmark-references); "
            f"give {MOVED_TO_BENCH[name]!r} to use it anyway"
        )
    if name.startswith(PREFIX):
        raise ValueError(f"eviction policy {name!r}: a prefix-aware policy is built by make_policy")
    module_name, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"unknown eviction policy {name!r}: choose one of {policy_names()} "
            "or give a class as 'module.path:ClassName'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"eviction policy {name!r}: cannot import {module_name!r}: {exc}") from exc
    cls = getattr(module, attr, None)
    if not (inspect.isclass(cls) and issubclass(cls, EvictionPolicy)):
        raise ValueError(f"eviction policy {name!r}: {attr!r} is not an EvictionPolicy subclass")
    return cls


def make_policy(name: str, capacity: int, **params: Any) -> EvictionPolicy:
    """Build a policy for a tier of ``capacity`` rows; unknown parameters are errors.

    A bad value (a fraction out of range, a negative weight) is a ``ValueError`` naming the
    policy as well: the policy's own check, re-raised with the name in front.
    """
    if isinstance(name, str) and name.startswith(PREFIX):
        wrapper_params = {k: params.pop(k) for k in ("search_limit", "inherit") if k in params}
        inner = make_policy(name[len(PREFIX) :], capacity, **params)
        try:
            return PrefixAware(inner, **wrapper_params)
        except ValueError as exc:
            raise ValueError(f"eviction policy {name!r}: {exc}") from exc
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        raise ValueError(f"eviction policy {name!r}: capacity must be a positive row count, got {capacity!r}")
    cls = resolve_policy(name)
    try:
        inspect.signature(cls).bind(capacity, **params)
    except TypeError as exc:
        raise ValueError(f"eviction policy {name!r}: bad parameters {params}: {exc}") from exc
    try:
        return cls(capacity, **params)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"eviction policy {name!r}: {exc}") from exc
