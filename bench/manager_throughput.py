"""Scheduler-side throughput: kvtier's offloading manager beside vLLM's, on the same calls.

Both managers get the same sequence, built from a trace below the same device cache:
per request, ``lookup`` of the blocks after the device's hit until the first miss,
``prepare_store`` of the blocks after the hits, ``complete_store`` of what it accepted,
and ``touch`` of the hits; kvtier's manager also gets its ``on_schedule_end`` (one step
per request, timed but not counted as a call; vLLM's is a no-op and is left out). Keys
are the same ``OffloadKey`` bytes for both. The vLLM manager also needs a ``ReqContext``
per request, with each key's position set (its connector does that, not the manager):
those are built before the clock starts.

Throughput is calls per CPU second of those four methods (``time.process_time``: both
managers are single-threaded and CPU-bound, and on a shared machine the time the process
spends descheduled is not the manager's). With the same policy (``lru``) the
two managers make the same decisions, so the sequences are identical; with ``arc`` the two
ARCs differ in detail and so do their hits, so the counts differ by a few percent. Each
manager runs the sequence from empty, and ``compare`` alternates the two managers round by
round, so that a load that comes and goes on a shared machine hits both alike: the best
round of each counts, and the ratio of each round's pair shows the spread.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.traces import Request
from bench.vllm_baseline import offload_key, request_context


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


def key_lists(trace: Sequence[Request], device_hits: Sequence[int] | None = None) -> list[list[bytes]]:
    """Each request's offload keys past its ``device_hits`` (all of them without), one bytes
    object per block shared by every request that names it."""
    cache: dict[int, bytes] = {}
    skips = device_hits if device_hits is not None else [0] * len(trace)
    out = []
    for request, d in zip(trace, skips, strict=True):
        out.append([cache.get(k) or cache.setdefault(k, offload_key(k)) for k in request.keys[d:]])
    return out


Job = tuple[Callable[[], Any], Callable[[Any], tuple[int, int]]]
"""``(prepare, run)``: ``run(prepare())`` replays the calls once; only ``run`` is timed."""


def _once(job: Job) -> Throughput:
    prepare, run = job
    state = prepare()
    gc.collect()
    start = time.process_time()
    calls, keys = run(state)
    return Throughput(calls, keys, time.process_time() - start)


def _timed(job: Job, repeat: int) -> Throughput:
    """Best of ``repeat`` runs of ``job``."""
    return min((_once(job) for _ in range(repeat)), key=lambda t: t.seconds)


@dataclass(frozen=True)
class Comparison:
    """kvtier's and vLLM's best rounds, and the ratio of calls/s within each round."""

    kvtier: Throughput
    vllm: Throughput
    round_ratios: list[float]

    @property
    def ratio(self) -> float:
        return self.kvtier.calls_per_s / self.vllm.calls_per_s if self.vllm.calls_per_s else 0.0


def compare(
    trace: Sequence[Request], device_hits: Sequence[int], capacity: int, policy: str, rounds: int = 3
) -> Comparison:
    """kvtier's manager and vLLM's with ``policy`` ("lru" or "arc"), alternated for ``rounds`` rounds."""
    ours = kvtier_job(trace, device_hits, capacity, policy)
    theirs = vllm_job(trace, device_hits, capacity, policy)
    pairs = [(_once(ours), _once(theirs)) for _ in range(rounds)]
    return Comparison(
        kvtier=min((a for a, _ in pairs), key=lambda t: t.seconds),
        vllm=min((b for _, b in pairs), key=lambda t: t.seconds),
        round_ratios=[a.calls_per_s / b.calls_per_s for a, b in pairs if b.calls_per_s],
    )


def kvtier_throughput(
    trace: Sequence[Request], device_hits: Sequence[int], capacity: int, policy: str, repeat: int = 2
) -> Throughput:
    """Best of ``repeat`` runs of kvtier's manager with ``policy`` (see ``kvtier_job``)."""
    return _timed(kvtier_job(trace, device_hits, capacity, policy), repeat)


def vllm_throughput(
    trace: Sequence[Request], device_hits: Sequence[int], capacity: int, policy: str, repeat: int = 2
) -> Throughput:
    """Best of ``repeat`` runs of vLLM's manager with ``policy`` (see ``vllm_job``)."""
    return _timed(vllm_job(trace, device_hits, capacity, policy), repeat)


def kvtier_job(trace: Sequence[Request], device_hits: Sequence[int], capacity: int, policy: str) -> Job:
    """``offload.manager.HostTierManager`` (one KV group) with kvtier policy ``policy``."""
    from offload.manager import HostTierManager, Lookup
    from policies.registry import make_policy

    requests = key_lists(trace, device_hits)

    def prepare() -> Any:
        return HostTierManager(1, capacity, lambda rows: make_policy(policy, rows))

    def run(manager: Any) -> tuple[int, int]:
        lookup, prepare_store = manager.lookup, manager.prepare_store
        complete_store, touch = manager.complete_store, manager.touch
        # kvtier's contract: rows reported HIT stay unevictable until the step ends.
        end_step = getattr(manager, "on_schedule_end", None) or (lambda: None)
        hit = Lookup.HIT
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

    return prepare, run


def vllm_job(trace: Sequence[Request], device_hits: Sequence[int], capacity: int, policy: str) -> Job:
    """vLLM's ``CPUOffloadingManager`` with its policy ``policy`` ("lru" or "arc")."""
    from vllm.v1.kv_offload.base import LookupResult

    from bench.vllm_baseline import make_manager

    requests = key_lists(trace, device_hits)

    def prepare() -> Any:
        contexts = [
            request_context(r, request, d)
            for r, (request, d) in enumerate(zip(requests, device_hits, strict=True))
        ]
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

    return prepare, run
