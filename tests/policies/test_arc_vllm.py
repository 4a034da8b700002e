"""``arc-vllm``: vLLM's ARC variant, checked against vLLM's own ``arc`` decision by decision;
and ``lru`` against vLLM's ``lru`` the same way."""

from __future__ import annotations

from typing import Any

import pytest

from bench import traces
from bench.manager_throughput import key_lists
from bench.simulate import device_prefix_hits
from bench.vllm_baseline import make_manager, request_context, vllm_version
from offload.manager import HostTierManager, Lookup
from policies.arc import ARCPolicy, VLLMARCPolicy
from policies.registry import make_policy


def resident_sets_in_lockstep(
    policy: str, trace: list[traces.Request], capacity: int, vllm_policy: str = "arc"
) -> list[tuple[set, set]]:
    """vLLM's ``CPUOffloadingManager`` with ``vllm_policy`` and kvtier's ``HostTierManager``
    with ``policy``, driven request by request as vLLM's scheduler drives a manager
    (``bench.scheduler_driver``): after each request, (vLLM's resident keys, kvtier's); a
    lookup answered differently ends the list with a pair that differs."""
    from vllm.v1.kv_offload.base import LookupResult

    device = device_prefix_hits(trace, 10)
    vllm: Any = make_manager(capacity, vllm_policy)

    def vllm_resident() -> set:
        held = vllm._policy
        return set(held.chunks) if vllm_policy == "lru" else set(held.t1) | set(held.t2)

    kvtier = HostTierManager(1, capacity, lambda rows: make_policy(policy, rows))
    out = []
    for r, (keys, d) in enumerate(zip(key_lists(trace), device, strict=True)):
        ctx = request_context(r, keys)
        vllm.on_new_request(ctx)
        h = 0
        for key in keys[d:]:
            hit_vllm = vllm.lookup(key, ctx) is LookupResult.HIT
            if hit_vllm != (kvtier.lookup(key) is Lookup.HIT):  # parted already: stop here
                out.append((vllm_resident(), set(kvtier._policies[0]) ^ {key}))
                return out
            if not hit_vllm:
                break
            h += 1
        if h:
            loaded = keys[d : d + h]
            vllm.prepare_load(loaded, ctx)
            vllm.touch(loaded, ctx)
            vllm.complete_load(loaded, ctx)
            kvtier.prepare_load(loaded)
            kvtier.touch(loaded)
            kvtier.complete_load(loaded)
        offer = keys[d + h :] if h else keys
        if offer:
            stored = vllm.prepare_store(offer, ctx)
            if stored is not None and stored.keys_to_store:
                vllm.complete_store(stored.keys_to_store, ctx)
            plan = kvtier.prepare_store(offer)
            if plan is not None and plan.keys_to_store:
                kvtier.complete_store(plan.keys_to_store)
        vllm.on_request_finished(ctx)
        kvtier.on_request_finished(str(r))
        kvtier.on_schedule_end()
        out.append((vllm_resident(), set(kvtier._policies[0])))
    return out


SHAPES = {
    "agentic": lambda: traces.agentic(seed=2, tasks=40),
    "long-doc-qa": lambda: traces.long_doc_qa(seed=3, documents=12, doc_blocks=(10, 30), questions=400),
}


@pytest.mark.skipif(vllm_version() is None, reason="vLLM's offloading manager does not import")
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_it_holds_what_vllm_arc_holds_after_every_request(shape: str) -> None:
    trace = SHAPES[shape]()
    states = resident_sets_in_lockstep("arc-vllm", trace, 60)
    first_diff = next((r for r, (v, k) in enumerate(states) if v != k), None)
    assert first_diff is None, f"request {first_diff} of {len(states)}: kvtier holds other keys than vLLM"
    # The check can fail: the paper's ARC, driven the same way, parts from vLLM's.
    assert any(v != k for v, k in resident_sets_in_lockstep("arc", trace, 60))


@pytest.mark.skipif(vllm_version() is None, reason="vLLM's offloading manager does not import")
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_lru_holds_what_vllm_lru_holds_after_every_request(shape: str, monkeypatch) -> None:
    """vLLM renews every key a request used when it ends, its head last; the host tier
    renews them so (``HostTierManager._renew_request``), and ``lru`` then holds what vLLM's
    ``lru`` holds."""
    trace = SHAPES[shape]()
    states = resident_sets_in_lockstep("lru", trace, 60, vllm_policy="lru")
    first_diff = next((r for r, (v, k) in enumerate(states) if v != k), None)
    assert first_diff is None, f"request {first_diff} of {len(states)}: kvtier holds other keys than vLLM"
    # The check can fail: without the renewal the loaded prefix ages behind the stored blocks.
    monkeypatch.setattr(HostTierManager, "_renew_request", lambda self, keys, again, again_first: None)
    assert any(v != k for v, k in resident_sets_in_lockstep("lru", trace, 60, vllm_policy="lru"))


def test_a_ghost_comes_back_to_t1_and_each_ghost_list_is_bounded_alone() -> None:
    for cls, back_in in ((VLLMARCPolicy, "_t1"), (ARCPolicy, "_t2")):
        policy = cls(3)
        for key in (1, 2, 3):
            policy.on_insert(key)
        assert policy.evict(1) == [1]
        policy.on_insert(1)  # back from B1
        assert 1 in getattr(policy, back_in), cls.__name__
        assert policy.p == 1.0
    policy = VLLMARCPolicy(3)
    for key in range(40):
        if len(policy) >= 3:
            policy.evict(1)
        policy.on_insert(key)
        assert len(policy._b1) <= 3 and len(policy._b2) <= 3


def test_t1_gives_the_victim_while_it_holds_int_p_or_more() -> None:
    policy = VLLMARCPolicy(4)
    for key in range(4):
        policy.on_insert(key)
    policy.on_access(0)
    policy.on_access(1)  # T1 = [2, 3], T2 = [0, 1]
    policy.p = 2.5  # |T1| = 2 >= int(p): T1 (the paper: |T1| > p is false, so T2)
    assert policy.evict(1) == [2]
    paper = ARCPolicy(4)
    for key in range(4):
        paper.on_insert(key)
    paper.on_access(0)
    paper.on_access(1)
    paper.p = 2.5
    assert paper.evict(1) == [0]


def test_on_miss_moves_p_before_the_eviction_and_only_once() -> None:
    policy = VLLMARCPolicy(2)
    for key in (1, 2):
        policy.on_insert(key)
    policy.evict(1)  # 1 -> B1
    policy.on_miss([1])
    assert policy.p == 1.0
    policy.evict(1)  # with p = 1 and |T1| = 1: T1's 2 goes
    policy.on_insert_run([1])  # counted already by on_miss
    assert policy.p == 1.0 and 1 in policy
