"""Drive an offloading manager the way vLLM's scheduler does, through vLLM's own factory.

Three managers get the same calls from the same trace, below the same device cache:

- ``factory``: kvtier as vLLM runs it, ``KVTierOffloadingSpec`` built by vLLM's
  ``OffloadingSpecFactory`` from a ``kv_connector_extra_config`` and its ``get_manager()``
  (``offload.vllm.manager_adapter``), host tier only;
- ``direct``: kvtier's ``HostTierManager`` called directly (the same policy, one group);
- ``vllm``: vLLM's ``CPUOffloadingManager`` with its ``lru`` or ``arc``.

One scheduler step per request, in the order vLLM 0.33's connector calls the manager
(``offloading/scheduler.py``): ``on_new_request``; ``lookup`` of the blocks after the
device's hit until the first miss; ``prepare_load``, ``touch`` and ``complete_load`` of
the hits; ``prepare_store`` of the recomputed blocks (of the whole prompt when nothing was
loaded: the connector then offers it all and the manager skips what it holds) and
``complete_store`` of what it accepted; ``on_request_finished``; ``on_schedule_end``.
Every call counts; ``ReqContext`` objects (with each key's end-token position set, as the
connector does) are built before the clock starts. A run reports its host hits (the hit
ratio is the same whichever way kvtier is driven: the adapter must not change a decision)
and its calls per CPU second (``time.process_time``: single-threaded, CPU-bound, and on a
shared machine the time spent descheduled is not the manager's).
"""

from __future__ import annotations

import gc
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.manager_throughput import key_lists
from bench.traces import Request
from bench.vllm_baseline import BLOCK_TOKENS, request_context

ROW_BYTES = 64
"""Bytes per block the spec is told (``worker_kv_bytes_per_block``): the smallest row, so a
host tier of 18k rows is a ~1 MiB shared file; bookkeeping does not depend on it."""

DRIVES = ("direct", "factory")
"""The ways kvtier's manager is driven; vLLM's is ``vllm``."""


@dataclass(frozen=True)
class DriveResult:
    """One replay: host hits, blocks looked at (device hits excluded), calls, CPU seconds."""

    hits: int
    calls: int
    seconds: float

    @property
    def calls_per_s(self) -> float:
        return self.calls / self.seconds if self.seconds else 0.0


def offloading_config(capacity: int, policy: str, shm_dir: str) -> Any:
    """The ``OffloadingConfig`` vLLM builds for ``KVTierOffloadingSpec`` with a host tier of
    ``capacity`` rows under ``policy`` (one KV group, one block per chunk, one worker)."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
    )

    extra = {
        "spec_name": "KVTierOffloadingSpec",
        "spec_module_path": "offload.vllm",
        "cpu_bytes_to_use": capacity * ROW_BYTES,
        "eviction_policy": policy,
        "shm_dir": shm_dir,
    }
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=BLOCK_TOKENS, layer_names=("layer0",), group_id=0),),
        worker_kv_bytes_per_block=ROW_BYTES,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id=f"kvtier-bench-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name="bench", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=1),
        parallel=one_worker(),
    )


def factory_manager(capacity: int, policy: str, shm_dir: str) -> Any:
    """kvtier's manager as vLLM gets it: ``OffloadingSpecFactory.create_spec(...).get_manager()``."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    spec = OffloadingSpecFactory.create_spec(offloading_config(capacity, policy, shm_dir))
    manager = spec.get_manager()
    if manager.manager.slots_per_group != capacity:
        raise AssertionError(
            f"asked for {capacity} host rows, the spec made {manager.manager.slots_per_group}"
        )
    return manager


Job = tuple[Callable[[], Any], Callable[[Any], tuple[int, int]], Callable[[Any], None]]
"""``(prepare, run, close)``: ``run(prepare())`` replays once (hits, calls); only ``run`` is timed."""


def vllm_api_job(
    trace: Sequence[Request],
    device_hits: Sequence[int],
    make: Callable[[], Any],
    close: Callable[[Any], None],
) -> Job:
    """A manager with vLLM's ``OffloadingManager`` interface (vLLM's own, or kvtier's adapter)."""
    from vllm.v1.kv_offload.base import LookupResult, ScheduleEndContext

    requests = key_lists(trace)
    end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())

    def prepare() -> Any:
        return make(), [request_context(r, keys) for r, keys in enumerate(requests)]

    def run(state: Any) -> tuple[int, int]:
        manager, contexts = state
        lookup, prepare_load, touch = manager.lookup, manager.prepare_load, manager.touch
        complete_load, prepare_store = manager.complete_load, manager.prepare_store
        complete_store, on_new, finished = (
            manager.complete_store,
            manager.on_new_request,
            manager.on_request_finished,
        )
        on_schedule_end = manager.on_schedule_end
        hit = LookupResult.HIT
        hits = calls = 0
        for keys, d, ctx in zip(requests, device_hits, contexts, strict=True):
            on_new(ctx)
            h = 0
            for key in keys[d:] if d else keys:
                calls += 1
                if lookup(key, ctx) is not hit:
                    break
                h += 1
            if h:
                loaded = keys[d : d + h]
                prepare_load(loaded, ctx)
                touch(loaded, ctx)
                complete_load(loaded, ctx)
                calls += 3
                hits += h
            offer = keys[d + h :] if h else keys
            if offer:
                out = prepare_store(offer, ctx)
                calls += 1
                if out is not None and out.keys_to_store:
                    complete_store(out.keys_to_store, ctx)
                    calls += 1
            finished(ctx)
            on_schedule_end(end)
            calls += 3
        return hits, calls

    return prepare, run, lambda state: close(state[0])


def direct_job(trace: Sequence[Request], device_hits: Sequence[int], capacity: int, policy: str) -> Job:
    """kvtier's ``HostTierManager`` (one group, host only) with the same calls, its own
    interface, its events dropped each step as the adapter and the standalone API drop them
    when nobody publishes them (kept, they made every eviction check them key by key)."""
    from offload.manager import HostTierManager, Lookup
    from policies.registry import make_policy

    requests = key_lists(trace)

    def prepare() -> Any:
        return HostTierManager(1, capacity, lambda rows: make_policy(policy, rows))

    def run(manager: Any) -> tuple[int, int]:
        lookup, prepare_load, touch = manager.lookup, manager.prepare_load, manager.touch
        complete_load, prepare_store = manager.complete_load, manager.prepare_store
        complete_store, finished = manager.complete_store, manager.on_request_finished
        on_schedule_end, drop_events = manager.on_schedule_end, manager.drop_events
        hit = Lookup.HIT
        hits = calls = 0
        for r, (keys, d) in enumerate(zip(requests, device_hits, strict=True)):
            h = 0
            for key in keys[d:] if d else keys:
                calls += 1
                if lookup(key) is not hit:
                    break
                h += 1
            if h:
                loaded = keys[d : d + h]
                prepare_load(loaded)
                touch(loaded)
                complete_load(loaded)
                calls += 3
                hits += h
            offer = keys[d + h :] if h else keys
            if offer:
                out = prepare_store(offer)
                calls += 1
                if out is not None and out.keys_to_store:
                    complete_store(out.keys_to_store)
                    calls += 1
            finished(str(r))
            on_schedule_end()
            drop_events()  # as the adapter and the standalone API do when nobody publishes them
            calls += 2  # on_new_request is vLLM's alone
        return hits, calls

    return prepare, run, lambda manager: None


def make_job(
    kind: str, trace: Sequence[Request], device_hits: Sequence[int], capacity: int, policy: str
) -> Job:
    """``kind``: ``direct`` / ``factory`` (kvtier, any policy) or ``vllm`` (``lru`` / ``arc``)."""
    if kind == "direct":
        return direct_job(trace, device_hits, capacity, policy)
    if kind == "factory":
        shm_dir = tempfile.gettempdir()
        return vllm_api_job(
            trace, device_hits, lambda: factory_manager(capacity, policy, shm_dir), lambda m: m.shutdown()
        )
    if kind == "vllm":
        from bench.vllm_baseline import make_manager

        return vllm_api_job(trace, device_hits, lambda: make_manager(capacity, policy), lambda m: None)
    raise ValueError(f"unknown drive {kind!r}: direct, factory or vllm")


def run_once(job: Job) -> DriveResult:
    prepare, run, close = job
    state = prepare()
    # The trace's keys and contexts outlive the run: frozen, as vLLM freezes its start-up heap,
    # so the collector's full passes scan what the manager allocates, not the benchmark's input.
    gc.collect()
    gc.freeze()
    try:
        start = time.process_time()
        hits, calls = run(state)
        seconds = time.process_time() - start
    finally:
        gc.unfreeze()
        close(state)
    return DriveResult(hits, calls, seconds)


def alternate(jobs: dict[str, Job], rounds: int) -> dict[str, list[DriveResult]]:
    """Every job once per round, in the same order, for ``rounds`` rounds: a load that comes
    and goes on a shared machine hits them all alike, and ratios within a round are fair."""
    out: dict[str, list[DriveResult]] = {name: [] for name in jobs}
    for _ in range(rounds):
        for name, job in jobs.items():
            out[name].append(run_once(job))
    return out


def one_worker() -> Any:
    """vLLM's ``OffloadingParallelConfig`` of one worker: no tensor, pipeline, context or data
    parallelism (what a scheduler-side driver or test needs)."""
    from vllm.v1.kv_offload.config import OffloadingParallelConfig

    return OffloadingParallelConfig(
        rank=0,
        world_size=1,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        data_parallel_index=0,
        data_parallel_size=1,
        data_parallel_rank_local=None,
        is_parallelism_agnostic=False,
    )
