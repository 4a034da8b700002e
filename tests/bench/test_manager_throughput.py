"""The manager throughput comparison: both managers replay the same calls, alternated."""

from __future__ import annotations

import pytest

from bench import traces
from bench.manager_throughput import compare, kvtier_throughput
from bench.simulate import device_prefix_hits
from bench.vllm_baseline import vllm_version


def small_trace() -> tuple[list[traces.Request], list[int]]:
    trace = traces.multi_turn(seed=3, sessions=120)
    return trace, device_prefix_hits(trace, 20)


@pytest.mark.skipif(vllm_version() is None, reason="vLLM's offloading manager does not import")
def test_compare_alternates_rounds_and_lru_makes_the_same_calls() -> None:
    trace, hits = small_trace()
    both = compare(trace, hits, 150, "lru", rounds=2)
    assert len(both.round_ratios) == 2 and all(r > 0 for r in both.round_ratios)
    # Same policy, same decisions: the two call sequences are the same length.
    assert both.kvtier.calls == both.vllm.calls and both.kvtier.keys == both.vllm.keys
    assert both.ratio == both.kvtier.calls_per_s / both.vllm.calls_per_s


def test_every_kvtier_policy_replays_the_sequence() -> None:
    trace, hits = small_trace()
    calls = {
        name: kvtier_throughput(trace, hits, 150, name, repeat=1).calls
        for name in ("lru", "arc", "lhd", "hazard")
    }
    # A call per lookup, store and touch: at least one per request, whatever the policy.
    assert all(count >= len(trace) for count in calls.values())
