"""The scheduler driver: kvtier through vLLM's factory makes the decisions it makes directly."""

from __future__ import annotations

import pytest

from bench import traces
from bench.scheduler_driver import alternate, make_job, run_once
from bench.simulate import device_prefix_hits
from bench.vllm_baseline import vllm_version

pytestmark = pytest.mark.skipif(vllm_version() is None, reason="vLLM's offloading manager does not import")


def small_trace() -> tuple[list[traces.Request], list[int]]:
    trace = traces.agentic(seed=2, tasks=40)
    return trace, device_prefix_hits(trace, 20)


@pytest.mark.parametrize("policy", ["lru", "arc", "hazard"])
def test_the_adapter_changes_no_decision(policy: str) -> None:
    trace, hits = small_trace()
    direct = run_once(make_job("direct", trace, hits, 120, policy))
    factory = run_once(make_job("factory", trace, hits, 120, policy))
    assert direct.hits == factory.hits > 0
    # vLLM's on_new_request is the one call the direct manager has no counterpart for.
    assert factory.calls == direct.calls + len(trace)


def test_rounds_alternate_kvtier_and_vllm() -> None:
    trace, hits = small_trace()
    jobs = {kind: make_job(kind, trace, hits, 120, "lru") for kind in ("factory", "vllm")}
    results = alternate(jobs, rounds=2)
    assert [len(r) for r in results.values()] == [2, 2]
    # Deterministic: every round of a manager makes the same decisions.
    assert all(rs[0].hits == rs[1].hits > 0 and rs[0].calls == rs[1].calls for rs in results.values())
    assert all(r.calls_per_s > 0 for rs in results.values() for r in rs)


def test_unknown_drive_is_an_error() -> None:
    trace, hits = small_trace()
    with pytest.raises(ValueError, match="unknown drive"):
        make_job("remote", trace, hits, 120, "lru")
