"""kvtier's ``HostTierManager`` behind vLLM's ``OffloadingManager`` interface (scheduler process).

The two contracts are the same by design (lookup / prepare_load / touch / complete_load /
prepare_store / complete_store / events, one lock held by the caller across a step); this
adapter adds what only vLLM needs:

- **Group ids.** vLLM keys carry the KV-cache group id of its ``KVCacheConfig``; kvtier's
  manager numbers the offloaded groups 0..n-1. Keys are translated at the boundary (a
  no-op when the two agree, as they do unless some group is not offloaded).
- **Failed promotions stay misses.** vLLM asserts that every device transfer succeeds, so
  a row that fails to come up from disk or a peer must never reach a load: a lookup that
  started a promotion answers ``HIT_PENDING``; once the promotion has failed the manager
  answers ``MISS`` (and does not promote the key again for a while,
  ``offload.tiering.RETRY_FAILED_PROMOTIONS_S``), so the request recomputes it. The adapter
  observes the manager's results (``observe_results``) to log failures and to tell vLLM which
  tier a promoted row came from.
- **reset_cache.** vLLM forgets its in-flight jobs at a reset and never completes them;
  their pins and unfinished stores are released here, lower-tier work is drained, and the
  host tier is emptied. Until vLLM reports the reset's jobs flushed (``on_reset_flushed``;
  vLLM 0.32 has no such report: ``compat.UNFENCED_RESET_STEPS`` schedule ends instead)
  no promotion starts, so no tier writes into a slot a stale store may still be writing.
  Persisted rows in disk / remote tiers are kept (they are keyed by model and layout).
- **Tiers a request loads from.** vLLM's ``kv_load_tiers`` (``ReqContext.load_tier_filter``)
  chooses among the tiers below the host tier, by medium and locality
  (``offload.vllm.tier_filter``): a lookup promotes from, and asks, only those; the host tier
  is always looked in. (``max_offload_tokens`` needs nothing here: vLLM's scheduler stores no
  chunk past it, and lower tiers only get rows the host tier stored.)
- **Events** in vLLM's form (host: ``Medium.CPU``; disk: ``STORAGE``; remote: ``STORAGE``,
  ``REMOTE``), drained and dropped each step when vLLM does not publish KV events.
- **Stats**: per-tier counters and latency (``offload.vllm.metrics``).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from offload.manager import HostSlots, HostTierManager, Lookup
from offload.metrics import manager_families
from offload.tier_engine import OpKind
from offload.tiering import TierOutcome
from offload.vllm.compat import HAS_RESET_FENCE, UNFENCED_RESET_STEPS, ConfigInfo, ConfigInfoMapping
from offload.vllm.metrics import LatencyRecorder, StatsReporter
from offload.vllm.tier_filter import ALL_TIERS, lower_tiers_allowed, place
from offload.vllm.worker_adapter import HostRowsSpec
from tiers.host import HostTier

log = logging.getLogger(__name__)

_LOOKUP = {
    Lookup.HIT: LookupResult.HIT,
    Lookup.HIT_PENDING: LookupResult.HIT_PENDING,
    Lookup.MISS: LookupResult.MISS,
    # Peers are being asked (lookup_wait_s): vLLM defers the request and keeps looking up the
    # rest of its prefix, so every key of it is asked in the same round trip.
    Lookup.RETRY: LookupResult.RETRY,
}
_HIT, _MISS = Lookup.HIT, Lookup.MISS
_CHUNK_LEVEL = RequestOffloadingContext()
_SOURCE = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK, "remote": CacheHitSource.P2P}
_DRAIN_TIMEOUT_S = 10.0
_SOURCES_KEPT = 65536


@dataclass(frozen=True)
class KVTierInfo(ConfigInfo):
    """Static facts on ``vllm:kv_offload_config_info``."""

    kvtier_tiers: str
    kvtier_host_slots: int
    kvtier_row_bytes: int
    kvtier_blocks_per_chunk: int


class KVTierOffloadingManager(OffloadingManager):
    def __init__(
        self,
        manager: HostTierManager,
        host: HostTier,
        *,
        group_ids: Sequence[int],
        row_bytes: int,
        blocks_per_chunk: int,
        enable_events: bool,
    ) -> None:
        self.manager = manager
        self.host = host
        self.row_bytes = row_bytes
        self.enable_events = enable_events
        self.group_ids = list(group_ids)  # vLLM's KV group id of each of kvtier's groups, in order
        identity = list(group_ids) == list(range(len(group_ids)))
        self._to_index = None if identity else {gid: i for i, gid in enumerate(group_ids)}
        self._to_group_id = None if identity else list(group_ids)
        self._translate = not identity  # keys change at the boundary: only when some group is not offloaded
        # Start times of loads and stores in flight, under the first key of each call: what vLLM
        # may abandon at a reset is asked of the manager then (``held_by_caller``), not mirrored
        # key by key on every call.
        self._load_started: dict[OffloadKey, float] = {}
        self._store_started: dict[OffloadKey, float] = {}
        # Promoted rows not loaded yet: key -> the kind of the tier they came from.
        self._source: collections.OrderedDict[OffloadKey, str] = collections.OrderedDict()
        self._reset = False  # _reset_pending
        self._flush = False  # _flush_pending
        self._gated = False  # either: lookups take the slow path
        self._unfenced_steps_left = 0  # vLLM 0.32: schedule ends until a reset's flush is deemed done
        # Host only, keys as the manager's: vLLM calls the manager's own host lookup, answering
        # in vLLM's values (``HostTierManager.host_lookup``), not a frame of ours per key.
        self._host_lookup = (
            None
            if self._translate or manager.lower.tiers
            else manager.host_lookup(LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING)
        )
        self._bind_lookup()
        self._lower_kinds = [tier.kind for tier in manager.lower.tiers]
        self.latency = LatencyRecorder()
        # Host loads' and stores' latency (seconds), measured here on the scheduler's thread and
        # handed to ``latency`` in batches (``_record_host_latency``): a recorder observation
        # takes two locks, a list append none.
        self._host_loads: list[float] = []
        self._host_stores: list[float] = []
        # Rows loaded into vLLM's device cache, by the tier they were found in (host: already there).
        self.loads_by_tier: collections.Counter[str] = collections.Counter()
        self._reporter = StatsReporter()
        self._info = KVTierInfo(
            kvtier_tiers=",".join(["host", *(t.kind for t in manager.lower.tiers)]),
            kvtier_host_slots=manager.slots_per_group,
            kvtier_row_bytes=row_bytes,
            kvtier_blocks_per_chunk=blocks_per_chunk,
        )
        manager.observe_results(self._tier_result)

    @property
    def lock(self) -> Any:
        return self.manager.lock

    @property
    def _reset_pending(self) -> bool:
        """A reset waits for rows still pinned or in flight: until it is done lookups miss."""
        return self._reset

    @_reset_pending.setter
    def _reset_pending(self, value: bool) -> None:
        self._reset = value
        self._gates_changed()

    @property
    def _flush_pending(self) -> bool:
        """vLLM has not reported a reset's jobs flushed: no promotion may start."""
        return self._flush

    @_flush_pending.setter
    def _flush_pending(self, value: bool) -> None:
        self._flush = value
        self._gates_changed()

    def _gates_changed(self) -> None:
        self._gated = self._reset or self._flush
        self._bind_lookup()

    # -- lookups and loads -------------------------------------------------------------

    def _bind_lookup(self) -> None:
        """``lookup`` is the manager's host lookup while that is all a lookup does (host only,
        no translation, no reset pending or unflushed); else this class's ``lookup``."""
        if self._host_lookup is not None and not self._gated:
            self.lookup = self._host_lookup  # type: ignore[method-assign]
        else:
            self.__dict__.pop("lookup", None)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._translate:
            key = self._in(key)
        manager = self.manager
        if self._gated:  # a reset pending or its jobs not yet flushed: rarely
            if self._reset_pending and not self._retry_reset():
                return self._miss()
            if self._flush_pending:
                manager.apply_finished()  # a failed promotion frees its row: then it is not present
                if not manager.contains(key):
                    return self._miss()  # no promotion may start until the reset's jobs are flushed
        if req_context.load_tier_filter is ALL_TIERS:
            found = manager.lookup(key)
        else:  # the request named the tiers it loads from (kv_load_tiers): the host and those below
            found = manager.lookup(key, lower_tiers_allowed(req_context, self._lower_kinds))
        # Identity tests, not _LOOKUP[found]: an Enum hashes in Python, a call per lookup.
        if found is _HIT:
            return LookupResult.HIT
        if found is _MISS:
            return LookupResult.MISS
        return _LOOKUP[found]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return _SOURCE.get(self._source.get(self._in(key), "host"), CacheHitSource.EXTERNAL_UNSPECIFIED)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> HostRowsSpec:
        inner = keys if type(keys) is list and not self._translate else self._keys_in(keys)
        manager = self.manager
        groups = manager.num_groups
        if groups == 1:  # slots as they are: no HostSlots to split by group
            slots, layouts = manager.pin_for_load(inner)
            if inner:
                self._load_started[inner[0]] = time.monotonic()
            return HostRowsSpec([slots], None if layouts is None else [layouts])
        spec = manager.prepare_load(inner)
        if inner:
            self._load_started[inner[0]] = time.monotonic()
        return HostRowsSpec(spec.per_group(groups), spec.layouts_per_group(groups))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.manager.touch(keys if type(keys) is list and not self._translate else self._keys_in(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        inner = keys if type(keys) is list and not self._translate else self._keys_in(keys)
        self.manager.complete_load(inner)
        started = _pop_started(self._load_started, inner)
        source = self._source
        if source:  # rows promoted from a lower tier and not loaded yet
            for key in inner:
                self.loads_by_tier[source.pop(key, "host")] += 1
        else:
            self.loads_by_tier["host"] += len(inner)
        if started is not None:
            self._host_loads.append(time.monotonic() - started)

    # -- stores ------------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        if self._reset and not self._retry_reset():  # a reset pending
            return None
        translate = self._translate
        inner = keys if type(keys) is list and not translate else self._keys_in(keys)
        manager = self.manager
        planned = manager.plan_store(inner)
        if planned is None:
            return None
        to_store, slots, evicted = planned
        if to_store:
            self._store_started[to_store[0]] = time.monotonic()
        source = self._source
        if source:
            for key in to_store:
                source.pop(key, None)  # the engine's own copy now
        groups = manager.num_groups
        return PrepareStoreOutput(
            keys_to_store=[self._out(key) for key in to_store] if translate else to_store,
            store_spec=HostRowsSpec([slots] if groups == 1 else HostSlots(to_store, slots).per_group(groups)),
            evicted_keys=[self._out(key) for key in evicted] if translate else evicted,
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        inner = [self._in(key) for key in keys] if self._translate else keys
        started = _pop_started(self._store_started, inner)
        self.manager.complete_store(inner, success=success)
        if started is not None and success:
            self._host_stores.append(time.monotonic() - started)

    # -- requests and steps ------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return _CHUNK_LEVEL  # vLLM reads it, never writes it: one for every request

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Nothing is held per request (the manager's ``on_request_finished`` is empty too)."""

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self._gated:
            if self._reset_pending:
                self._retry_reset()
            if self._flush_pending and not HAS_RESET_FENCE:
                self._unfenced_steps_left -= 1
                if self._unfenced_steps_left <= 0:
                    self.on_reset_flushed()
        self.manager.on_schedule_end()  # sends this step's promotions; HITs may be evicted again
        if not self.enable_events:
            self.manager.drop_events()  # nobody publishes them: do not let them pile up

    def has_pending_work(self) -> bool:
        unfenced_flush = self._flush_pending and not HAS_RESET_FENCE  # keep stepping until it is deemed done
        return self._reset_pending or unfenced_flush or self.manager.inflight_below() > 0

    def take_events(self) -> Iterable[OffloadingEvent]:
        events = self.manager.take_events()
        if not self.enable_events:
            return []
        out = []
        for event in events:
            medium, locality = place(event.medium)
            out.append(
                OffloadingEvent(
                    keys=[self._out(key) for key in event.keys],
                    medium=medium,
                    removed=event.removed,
                    locality=locality,
                    ownership=None if event.medium == "host" else f"kvtier-{event.medium}",
                )
            )
        return out

    # -- reset -------------------------------------------------------------------------

    def reset_cache(self) -> None:
        manager = self.manager
        # vLLM 0.33 reports when the reset's jobs are flushed (at once when there were none);
        # 0.32 does not: only jobs in flight now, known by their pins and stores, need a flush.
        pinned, storing = manager.held_by_caller()
        self._flush_pending = HAS_RESET_FENCE or bool(pinned or storing)
        self._unfenced_steps_left = UNFENCED_RESET_STEPS
        for key, pins in pinned.items():
            for _ in range(pins):
                manager.complete_load([key])
        if storing:
            manager.complete_store(storing, success=False)
        self._load_started.clear()
        self._store_started.clear()
        self._source.clear()
        if not manager.wait_idle(_DRAIN_TIMEOUT_S):
            log.warning("kvtier reset: lower-tier transfers still running after %.0f s", _DRAIN_TIMEOUT_S)
        self._reset_pending = True
        if self._retry_reset():
            log.info("kvtier reset: the host tier is empty")

    def on_reset_flushed(self) -> None:
        self._flush_pending = False
        if self._reset_pending:
            self._retry_reset()

    def _retry_reset(self) -> bool:
        """Empty the host tier if nothing is in flight any more; until then lookups miss."""
        if self.manager.reset():
            self._reset_pending = False
            return True
        return False

    # -- stats -------------------------------------------------------------------------

    def get_stats(self) -> OffloadingConnectorStats | None:
        self._record_host_latency()
        families = manager_families(self.manager, self.row_bytes)
        return self._reporter.report(families, self.latency.take())

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return [self._info.as_config_info()]

    def metrics_text(self) -> str:
        """The same stats in the Prometheus text format (cumulative)."""
        from offload.metrics import render

        self._record_host_latency()
        return render(manager_families(self.manager, self.row_bytes, latency=self.latency.histograms))

    def shutdown(self) -> None:
        self.manager.shutdown()
        self.host.close(unlink=True)

    # -- internals ---------------------------------------------------------------------

    def _keys_in(self, keys: Collection[OffloadKey]) -> list[OffloadKey]:
        """``keys`` as the manager's, in a list (vLLM passes lists: those are not copied)."""
        if self._translate:
            return [self._in(key) for key in keys]
        return keys if type(keys) is list else list(keys)

    def _in(self, key: OffloadKey) -> OffloadKey:
        if self._to_index is None:
            return key
        group = int.from_bytes(key[-4:], "big")
        return OffloadKey(key[:-4] + self._to_index[group].to_bytes(4, "big"))

    def _out(self, key: bytes) -> OffloadKey:
        if self._to_group_id is None:
            return OffloadKey(key)
        index = int.from_bytes(key[-4:], "big")
        return OffloadKey(key[:-4] + self._to_group_id[index].to_bytes(4, "big"))

    def _record_host_latency(self) -> None:
        """Hand the host latencies measured since the last call to ``latency``. Only what was
        there when it started is taken (``del samples[:n]``, atomic): a sample appended on the
        scheduler's thread meanwhile waits for the next call, it is not lost."""
        for op, samples in (("load", self._host_loads), ("store", self._host_stores)):
            n = len(samples)
            if n:
                observe = self.latency.observe
                for seconds in samples[:n]:
                    observe(op, "host", seconds)
                del samples[:n]

    def _miss(self) -> LookupResult:
        """A miss the manager did not see (it still counts as a lookup)."""
        self.manager.stats.lookups += 1
        return LookupResult.MISS

    def _tier_result(self, outcome: TierOutcome) -> None:
        """Observe a finished lower-tier operation (``HostTierManager.observe_results``): its
        latency, where promoted rows came from, and failed promotions (misses from now on)."""
        op = "load" if outcome.kind is OpKind.GET else "store"
        self.latency.observe(op, outcome.tier, outcome.seconds)
        for key in outcome.landed:
            self._source[OffloadKey(key)] = outcome.tier
        while len(self._source) > _SOURCES_KEPT:
            self._source.popitem(last=False)
        for key in outcome.failed:
            log.info("kvtier: promoting %s from the %s tier failed; it is a miss", key.hex(), outcome.tier)


def _pop_started(started: dict[OffloadKey, float], keys: Iterable[OffloadKey]) -> float | None:
    """Forget the start times kept for ``keys`` (one per call, under its first key) and
    return the earliest. The usual call completes one call's keys while no other is in flight:
    its first key's start, one pop; else ``keys & started``, a set operation in C, no Python
    loop per key."""
    if not started:
        return None
    earliest = None
    if type(keys) is list and keys:
        earliest = started.pop(keys[0], None)
        if not started:
            return earliest
    found = started.keys() & keys
    if not found:
        return earliest
    first = min(map(started.pop, found))
    return first if earliest is None or first < earliest else earliest
