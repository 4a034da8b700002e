"""Policies by name, and a user's own policy by module path.

``make_policy("lru", capacity)`` or ``make_policy("my_pkg.policies:MyPolicy", capacity,
alpha=0.5)``. Every failure is a ``ValueError`` that names the policy and what is wrong, so
the configuration layer can report the key and value at fault.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from policies.base import EvictionPolicy
from policies.lru import LRUPolicy

_BUILTIN: dict[str, type[EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
}


def register_policy(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Make a policy class selectable by its ``name`` (usable as a class decorator)."""
    if not cls.name:
        raise ValueError(f"policy class {cls.__qualname__} has no name")
    _BUILTIN[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    """The names accepted by ``make_policy`` besides module paths."""
    return sorted(_BUILTIN)


def resolve_policy(name: str) -> type[EvictionPolicy]:
    """The class behind a built-in name or a ``module.path:ClassName`` / ``module.path.ClassName``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"eviction policy must be a non-empty string, got {name!r}")
    if name in _BUILTIN:
        return _BUILTIN[name]
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
    """Build a policy for a tier of ``capacity`` rows; unknown parameters are errors."""
    cls = resolve_policy(name)
    try:
        inspect.signature(cls).bind(capacity, **params)
    except TypeError as exc:
        raise ValueError(f"eviction policy {name!r}: bad parameters {params}: {exc}") from exc
    return cls(capacity, **params)
