"""Scheduler-side throughput: kvtier's offloading manager beside vLLM's, on the same calls.

Both managers get the same sequence, built from a trace below the same device cache:
per request, ``lookup`` of the blocks after the device's hit until the first miss,
``prepare_store`` of the blocks after the hits, ``complete_store`` of what it accepted,
and ``touch`` of the hits; kvtier's manager also gets its ``on_schedule_end`` (one step
per request, timed but not counted as a call; vLLM's is a no-op and is left out). Keys
are the same ``OffloadKey`` bytes for both. The vLLM manager also needs a ``ReqContext``
per request, with each key's position set (its connector does that, not the manager):
those are built before the clock starts.

Throughput is calls per second of those four methods (the sequence is identical, so the
ratio is the same in keys per second). Each manager runs the sequence ``repeat`` times
from empty; the best run counts.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.traces import Request
from bench.vllm_baseline import BLOCK_TOKENS, offload_key


@dataclass(frozen=True)
class Throughput:
    calls: int
    keys: int
    seconds: float

    @property
    def calls_per_s(self) -> float:
        return self.calls / self.seconds if self.seconds else 0.0

    @property
    def keys_per_s(self) -> float:
        return self.keys / self.seconds if self.seconds else 0.0


def _key_lists(trace: Sequence[Request], device_hits: Sequence[int]) -> list[list[bytes]]:
    cache: dict[int, bytes] = {}
    out = []
    for request, d in zip(trace, device_hits, strict=True):
        out.append([cache.get(k) or cache.setdefault(k, offload_key(k)) for k in request.keys[d:]])
    return out


def _timed(prepare: Callable[[], Any], run: Callable[[Any], tuple[int, int]], repeat: int) -> Throughput:
    """Best of ``repeat`` runs of ``run(prepare())``; only ``run`` is timed."""
    best: Throughput | None = None
    for _ in range(repeat):
        state = prepare()
        gc.collect()
        start = time.perf_counter()
        calls, keys = run(state)
        took = time.perf_counter() - start
        if best is None or took < best.seconds:
            best = Throughput(calls, keys, took)
    assert best is not None
    return best


def kvtier_throughput(
    trace: Sequence[Request],
    device_hits: Sequence[int],
    capacity: int,
    policy: str,
    repeat: int = 2,
) -> Throughput:
    """``offload.manager.OffloadingManager`` (one KV group) with kvtier policy ``policy``."""
    from offload.manager import LookupResult, OffloadingManager
    from policies.registry import make_policy

    requests = _key_lists(trace, device_hits)

    def prepare() -> Any:
        return OffloadingManager(1, capacity, lambda rows: make_policy(policy, rows))

    def run(manager: Any) -> tuple[int, int]:
        lookup, prepare_store = manager.lookup, manager.prepare_store
        complete_store, touch = manager.complete_store, manager.touch
        # kvtier's contract: rows reported HIT stay unevictable until the step ends.
        end_step = getattr(manager, "on_schedule_end", None) or (lambda: None)
        hit = LookupResult.HIT
        calls = keys = 0
        for request in requests:
            h = 0
            for key in request:
                calls += 1
                keys += 1
                if lookup(key) is not hit:
                    break
                h += 1
            rest = request[h:]
            if rest:
                out = prepare_store(rest)
                calls += 1
                keys += len(rest)
                if out is not None and out.keys_to_store:
                    complete_store(out.keys_to_store)
                    calls += 1
                    keys += len(out.keys_to_store)
            if h:
                touch(request[:h])
                calls += 1
                keys += h
            end_step()
        return calls, keys

    return _timed(prepare, run, repeat)


def vllm_throughput(
    trace: Sequence[Request],
    device_hits: Sequence[int],
    capacity: int,
    policy: str,
    repeat: int = 2,
) -> Throughput:
    """vLLM's ``CPUOffloadingManager`` with its policy ``policy`` ("lru" or "arc")."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from bench.vllm_baseline import make_manager

    requests = _key_lists(trace, device_hits)

    def prepare() -> Any:
        contexts = []
        for r, (request, d) in enumerate(zip(requests, device_hits, strict=True)):
            ctx = ReqContext(req_id=str(r))
            for p, key in enumerate(request):
                ctx.set_offload_key_position(key, (d + p + 1) * BLOCK_TOKENS)
            contexts.append(ctx)
        return make_manager(capacity, policy), contexts

    def run(state: Any) -> tuple[int, int]:
        manager, ctxs = state
        lookup, prepare_store = manager.lookup, manager.prepare_store
        complete_store, touch = manager.complete_store, manager.touch
        hit = LookupResult.HIT
        calls = keys = 0
        for request, ctx in zip(requests, ctxs, strict=True):
            h = 0
            for key in request:
                calls += 1
                keys += 1
                if lookup(key, ctx) is not hit:
                    break
                h += 1
            rest = request[h:]
            if rest:
                out = prepare_store(rest, ctx)
                calls += 1
                keys += len(rest)
                if out is not None and out.keys_to_store:
                    complete_store(out.keys_to_store, ctx)
                    calls += 1
                    keys += len(out.keys_to_store)
            if h:
                touch(request[:h], ctx)
                calls += 1
                keys += h
        return calls, keys

    return _timed(prepare, run, repeat)
