"""Policies by name: every built-in, aliases, prefix-aware forms, module paths, and clear errors."""

from __future__ import annotations

import pytest

from policies import make_policy, policy_names
from policies.adaptive_tinylfu import AdaptiveTinyLFUPolicy
from policies.arc import ARCPolicy
from policies.cost_aware import CostAwarePolicy
from policies.lru import LRUPolicy
from policies.prefix_aware import PrefixAware
from policies.s3fifo import S3FIFOPolicy
from policies.slru import SLRUPolicy
from policies.tinylfu import TinyLFUPolicy


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("lru", LRUPolicy),
        ("slru", SLRUPolicy),
        ("arc", ARCPolicy),
        ("s3fifo", S3FIFOPolicy),
        ("tinylfu", TinyLFUPolicy),
        ("w-tinylfu", TinyLFUPolicy),
        ("tinylfu-adaptive", AdaptiveTinyLFUPolicy),
        ("cost", CostAwarePolicy),
        ("cost-aware", CostAwarePolicy),
        ("policies.arc:ARCPolicy", ARCPolicy),
        ("policies.slru.SLRUPolicy", SLRUPolicy),
    ],
)
def test_names_and_module_paths_build_the_right_class(name: str, cls: type) -> None:
    policy = make_policy(name, 32)
    assert type(policy) is cls and policy.capacity == 32


def test_listed_names_all_build() -> None:
    names = policy_names()
    assert {"lru", "slru", "arc", "s3fifo", "tinylfu", "w-tinylfu", "cost"} <= set(names)
    for name in names:
        assert make_policy(name, 4).capacity == 4


def test_prefix_form_wraps_any_policy_and_routes_parameters() -> None:
    policy = make_policy("prefix:slru", 40, protected_fraction=0.5, search_limit=7)
    assert isinstance(policy, PrefixAware) and policy.search_limit == 7
    assert isinstance(policy.inner, SLRUPolicy) and policy.inner.protected_fraction == 0.5
    nested = make_policy("prefix:policies.arc:ARCPolicy", 8)
    assert isinstance(nested, PrefixAware) and isinstance(nested.inner, ARCPolicy)


@pytest.mark.parametrize(
    ("name", "params", "fragment"),
    [
        ("nope", {}, "unknown eviction policy 'nope'"),
        ("", {}, "non-empty"),
        ("no_such_module:Policy", {}, "cannot import"),
        ("policies.arc:NotThere", {}, "not an EvictionPolicy"),
        ("prefix:nope", {}, "'nope'"),
        ("lru", {"alpha": 1}, "bad parameters"),
        ("slru", {"protected_fraction": 1.5}, "protected_fraction"),
        ("tinylfu", {"window_fraction": 0.0}, "window_fraction"),
        ("tinylfu", {"sample_factor": 0}, "sample_factor"),
        ("s3fifo", {"small_fraction": 1.0}, "small_fraction"),
        ("s3fifo", {"move_threshold": 4}, "move_threshold"),
        ("cost", {"attention_weight": -1.0}, "attention_weight"),
        ("cost", {"max_frequency": 0}, "max_frequency"),
        ("prefix:arc", {"search_limit": -1}, "search_limit"),
        ("prefix:arc", {"inherit": -1}, "inherit"),
    ],
)
def test_bad_names_and_parameters_are_value_errors_naming_the_policy(
    name: str, params: dict, fragment: str
) -> None:
    with pytest.raises(ValueError) as excinfo:
        make_policy(name, 16, **params)
    message = str(excinfo.value)
    assert fragment in message
    if name:
        assert repr(name.removeprefix("prefix:")) in message or repr(name) in message


@pytest.mark.parametrize("capacity", [0, -3, 2.5, True])
def test_capacity_must_be_a_positive_row_count(capacity: object) -> None:
    with pytest.raises(ValueError, match="capacity"):
        make_policy("arc", capacity)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["lhd", "hazard"])
def test_a_policy_moved_to_the_benchmark_is_an_error_that_gives_its_class_path(name: str) -> None:
    """In a process that has not imported ``bench`` (a user's engine), the bare name of a
    learned policy is refused with the class path that still selects it; that path builds it."""
    import subprocess
    import sys

    from policies.registry import MOVED_TO_BENCH

    probe = f"from policies import make_policy\nmake_policy({name!r}, 8)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    assert done.returncode != 0
    assert "is a benchmark reference" in done.stderr and MOVED_TO_BENCH[name] in done.stderr
    assert make_policy(MOVED_TO_BENCH[name], 8).name == name
