"""kvtier as SGLang's HiCache storage backend (its "L3"): disk, peers and Mooncake below
SGLang's host pool, with checksummed rows, a namespace and tenants.

Launched through SGLang's ``dynamic`` backend (sglang 0.5.23)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "offload.sglang", "class_name": "KVTierStorage", "interface_v1": 1,
        "tiers": [{"kind": "disk", "path": "/var/cache/kvtier", "capacity": "200GiB"}]}'

SGLang's host pool is the host tier: SGLang decides what is in it and what is backed up;
this backend stores and fetches its pages. The call contract it serves
(``managers/cache_controller.py``):

- ``batch_exists(keys)`` on the prefetch thread: how many leading pages some tier holds,
  from each tier's index (``may_contain``: exact for the disk), then asking the tiers whose
  index is partial (peers, Mooncake: rows other engines stored) about the rest. SGLang
  takes the minimum over its ranks.
- ``batch_get_v1(keys, host_indices)`` on an IO thread: reads pages into the host pool;
  only the leading ``True`` results count, so it stops at the first page no tier serves.
  A page is written only after its row was verified (length, layout, checksum): a corrupt,
  foreign or missing row is a miss that leaves the host page as it was.
- ``batch_set_v1(keys, host_indices)`` on the backup thread: stores pages in every tier;
  SGLang keeps the host pages locked only until it returns, so every byte is copied out
  (into staging rows, ``offload.sglang.staging``) before it does. A page stored already is
  not written again; SGLang drops the rest of a batch unless every result is ``True``.

Every call is synchronous and ends within the tiers' deadlines (a dead peer, a full disk:
misses, counted), and never raises: a fault is logged and is a miss (SGLang's backup thread
has no other way to survive one).

Keys: SGLang gives each page the SHA-256 hex of its token chain, the same on every rank.
The namespace (``offload.namespace``) adds the model, the page's meaning
(``offload.sglang.pages``: layout, dtype, page size, regions), the pipeline and context
parallel shard, the tenant and, for MHA, the tensor-parallel rank (each rank holds other
heads); MLA pages are the same on every rank and shared.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from offload.config import ConfigError
from offload.keys import make_key
from offload.namespace import Namespace
from offload.sglang.base import StorageBase
from offload.sglang.pages import PageGeometry, gather, scatter
from offload.sglang.settings import BackendSettings, parse_extra_config
from offload.sglang.staging import StagingRows
from offload.tier_builder import build_tier
from offload.tier_engine import OpResult, TierEngine
from tiers.base import LowerTier, Row

log = logging.getLogger(__name__)

_HEX_KEY = 64
_DELETE_BATCH = 1024
MAX_TRACKED_KEYS = 1 << 20
"""How many stored keys ``clear`` remembers to delete."""


def page_key(key: str) -> bytes:
    """kvtier key bytes of SGLang's page key: the 32 bytes its SHA-256 hex spells (a key of
    another scheme: a 32-byte digest of its text), with KV group 0 (``offload.keys``)."""
    if len(key) == _HEX_KEY:
        try:
            return make_key(bytes.fromhex(key))
        except ValueError:
            pass
    return make_key(hashlib.blake2b(key.encode(), digest_size=32).digest())


@dataclass
class BackendStats:
    """The backend's own counters (each tier's are in ``KVTierStorage.stats()['tiers']``)."""

    exists_calls: int = 0
    get_pages: int = 0  # pages asked for
    get_hits: int = 0  # pages copied into the host pool
    set_pages: int = 0
    set_stored: int = 0  # pages some tier stored
    set_present: int = 0  # pages every tier held already: not written again
    refused_calls: int = 0  # host indices that did not match the pool's pages
    faults: int = 0  # exceptions caught and turned into misses


class KVTierStorage(StorageBase):
    """SGLang's HiCache storage over kvtier's lower tiers; see the module docstring.

    ``storage_config``: SGLang's ``HiCacheStorageConfig`` (ranks, ``is_mla_model``,
    ``model_name``, ``extra_config``); the second argument is what SGLang's factory passes
    beside it, unused. The tiers open when SGLang registers its host pool
    (``register_mem_pool_host``): the pool says what a page is.
    """

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.settings: BackendSettings = parse_extra_config(storage_config.extra_config)
        self.model = self.settings.model or storage_config.model_name
        if not self.model:
            raise ConfigError("model: SGLang gave no model name; set 'model' in the extra config")
        self.mem_pool_host: Any = None
        self.geometry: PageGeometry | None = None
        self.namespace: bytes = b""
        self.tiers: list[LowerTier] = []
        self._engine: TierEngine | None = None
        self._staging: StagingRows | None = None
        self._stored: dict[bytes, None] = {}  # what clear deletes, oldest first (under _lock)
        self._counters = BackendStats()
        self._lock = threading.Lock()  # the counters and the metrics lists
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }
        self._warned_generic = False

    # -- lifecycle -----------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Build and open the tiers for ``mem_pool_host``'s pages (``TierError`` if a tier
        cannot start: SGLang's attach fails with it)."""
        if self._engine is not None:
            raise RuntimeError("kvtier sglang backend: a host pool is registered already")
        super().register_mem_pool_host(mem_pool_host)
        geometry = PageGeometry.of(mem_pool_host)
        config = self.storage_config
        shard = (0, 1) if config.is_mla_model else (config.tp_rank, config.tp_size)
        parallel = (
            f";pp={config.pp_rank}/{config.pp_size}"
            f";cp={config.attn_cp_rank}/{config.attn_cp_size}"
            f";dcp={getattr(config, 'dcp_rank', 0)}/{getattr(config, 'dcp_size', 1)}"
        )
        self.namespace = Namespace(
            model=self.model,
            layout=geometry.description + parallel,
            dtype=str(mem_pool_host.dtype),
            shard=shard,
            tenant=self.settings.tenant,
        ).digest()
        self.tiers = [
            build_tier(tier, self.namespace, geometry.layout_id, row_bytes=geometry.row_bytes)
            for tier in self.settings.tiers
        ]
        rows = max(1, self.settings.staging_bytes // geometry.row_bytes)
        staging = StagingRows(geometry.row_bytes, rows)
        engine = TierEngine(self.tiers, deadline_s=max(t.deadline_s for t in self.settings.tiers))
        engine.start(staging.view)
        self.geometry, self._staging, self._engine = geometry, staging, engine
        log.info(
            "kvtier sglang backend: %s below the host pool; pages of %d tokens, rows of %d B, "
            "%d staging rows, namespace %s (%s)",
            "+".join(t.kind for t in self.tiers),
            geometry.tokens,
            geometry.row_bytes,
            rows,
            self.namespace.hex(),
            "shared by every rank (MLA)" if config.is_mla_model else f"rank {shard[0]} of {shard[1]}",
        )

    def close(self) -> None:
        """Close the tiers (SGLang's detach calls it)."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()

    # -- the zero-copy interface ----------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages of ``keys`` some tier holds (0 on any fault)."""
        try:
            with self._lock:
                self._counters.exists_calls += 1
            return self._leading_present([page_key(k) for k in keys])
        except Exception:
            self._fault("batch_exists")
            return 0

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Read pages into the host pool at ``host_indices``; ``True`` for each leading page
        copied, ``False`` from the first page no tier served (that page and the rest untouched)."""
        done = [False] * len(keys)
        try:
            started = time.perf_counter()
            pages = self._pages(host_indices, len(keys))
            if pages is None:
                return done
            wanted = [page_key(k) for k in keys]
            first = 0
            while first < len(keys):
                copied, asked = self._get_chunk(wanted, pages, first)
                done[first : first + copied] = [True] * copied
                if copied < asked:
                    break
                first += asked
            copied = done.count(True)
            with self._lock:
                self._counters.get_pages += len(keys)
                self._counters.get_hits += copied
                self._record("prefetch", copied, time.perf_counter() - started)
        except Exception:
            self._fault("batch_get_v1")
        return _leading(done)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store the pages at ``host_indices`` in every tier; ``True`` for each page some
        tier holds when it returns. Every byte is copied out before it returns."""
        done = [False] * len(keys)
        try:
            started = time.perf_counter()
            pages = self._pages(host_indices, len(keys))
            if pages is None:
                return done
            wanted = [page_key(k) for k in keys]
            todo: list[int] = []
            first_of: dict[bytes, int] = {}
            for i, key in enumerate(wanted):
                if all(tier.may_contain(key) for tier in self.tiers):
                    done[i] = True
                elif key not in first_of:  # a key twice in a batch is written once
                    first_of[key] = i
                    todo.append(i)
            present = done.count(True)
            stored = self._put(wanted, pages, todo)
            for i in todo:
                done[i] = stored.get(i, False)
            for i, key in enumerate(wanted):
                done[i] = done[i] or done[first_of.get(key, i)]
            with self._lock:
                self._counters.set_pages += len(keys)
                self._counters.set_present += present
                self._counters.set_stored += sum(stored.values())
                self._record("backup", sum(stored.values()), time.perf_counter() - started)
        except Exception:
            self._fault("batch_set_v1")
        return done

    # -- the rest of SGLang's interface ------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        self._generic_call("get")
        return None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[None]:
        self._generic_call("batch_get")
        return [None] * len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        self._generic_call("set")
        return False

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        self._generic_call("batch_set")
        return False

    def clear(self) -> None:
        """Delete the pages this process stored (the last ``MAX_TRACKED_KEYS``) from every
        tier. Pages other engines stored stay: peers, Mooncake and a disk reopened are
        shared, and one server's cache flush must not empty another's."""
        try:
            with self._lock:
                keys = list(self._stored)
            engine = self._require_engine()
            for start in range(0, len(keys), _DELETE_BATCH):
                batch = keys[start : start + _DELETE_BATCH]
                futures = [engine.call_delete(t, batch) for t in range(len(self.tiers))]
                for future in futures:
                    self._wait(future)
                with self._lock:
                    for key in batch:
                        self._stored.pop(key, None)
        except Exception:
            self._fault("clear")

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (``None`` where SGLang's metrics
        module does not import)."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception:
            return None
        with self._lock:
            metrics, self._metrics = self._metrics, {name: [] for name in self._metrics}
        return StorageMetrics(**metrics)

    def stats(self) -> dict[str, Any]:
        """kvtier's view: the backend's counters, each tier's, and staging rows held."""
        with self._lock:
            counters = dict(vars(self._counters))
        return {
            **counters,
            "staging_held": self._staging.held if self._staging else 0,
            "tiers": {tier.kind: dict(tier.stats()) for tier in self.tiers},
        }

    # -- helpers ------------------------------------------------------------------------------

    def _require_engine(self) -> TierEngine:
        if self._engine is None:
            raise RuntimeError("kvtier sglang backend: no host pool registered (or closed)")
        return self._engine

    def _wait(self, future: concurrent.futures.Future[OpResult]) -> OpResult | None:
        """A call's result; ``None`` if even the engine's safety deadline passed (its rows
        may still be in use)."""
        engine = self._require_engine()
        try:
            return future.result(timeout=engine.safety_deadline_s + 1.0)
        except concurrent.futures.TimeoutError:
            log.error("kvtier sglang backend: a tier call outlived the safety deadline")
            return None

    def _leading_present(self, keys: Sequence[bytes]) -> int:
        engine = self._require_engine()
        n = 0
        while n < len(keys) and any(tier.may_contain(keys[n]) for tier in self.tiers):
            n += 1
        partial = [i for i, tier in enumerate(self.tiers) if tier.index_is_partial]
        if n == len(keys) or not partial:
            return n
        rest = list(keys[n:])
        found = [any(tier.may_contain(key) for tier in self.tiers) for key in rest]  # past a gap too
        futures = [engine.call_contains(i, rest) for i in partial]
        for future in futures:
            result = self._wait(future)
            if result is not None:
                found = [a or b for a, b in zip(found, result.ok, strict=True)]
        return n + _leading(found).count(True)

    def _pages(self, host_indices: torch.Tensor, count: int) -> list | None:
        assert self.geometry is not None
        try:
            return self.geometry.pages(self.mem_pool_host, host_indices, count)
        except (ValueError, AssertionError, IndexError) as exc:
            log.warning("kvtier sglang backend: refused a call of %d pages: %s", count, exc)
            with self._lock:
                self._counters.refused_calls += 1
            return None

    def _get_chunk(self, keys: list[bytes], pages: list, first: int) -> tuple[int, int]:
        """Read the pages from ``first`` on, as many as staging rows allow: (how many leading
        pages were copied into the host pool, how many were asked)."""
        engine, staging = self._require_engine(), self._staging
        assert staging is not None
        slots = staging.take(len(keys) - first, engine.deadline_s)
        if not slots:
            log.warning("kvtier sglang backend: no staging row came free in %.1f s", engine.deadline_s)
            return 0, 1
        held: set[int] = set()
        try:
            count = len(slots)
            ok = [False] * count
            pending = list(range(count))
            for t in range(len(self.tiers)):
                if not pending:
                    break
                rows: list[Row] = [(keys[first + j], staging.row(slots[j])) for j in pending]
                result = self._wait(engine.call_get(t, rows))
                if result is None:
                    held.update(slots[j] for j in pending)
                    staging.hold([slots[j] for j in pending], None)
                    break
                for j, hit in zip(pending, result.ok, strict=True):
                    ok[j] = hit
                lost = [slots[j] for j in pending if not ok[j]]
                if result.abandoned:  # the tier may still write into the rows it missed
                    held.update(lost)
                    staging.hold(lost, result.ended)
                    break
                pending = [j for j in pending if not ok[j]]
            lead = _leading(ok).count(True)
            for j in range(lead):
                scatter(staging.row_address(slots[j]), pages[first + j])
            return lead, count
        finally:
            staging.give_back(s for s in slots if s not in held)

    def _put(self, keys: list[bytes], pages: list, todo: list[int]) -> dict[int, bool]:
        """Store pages ``todo`` in every tier, in chunks of staging rows: page -> stored."""
        engine, staging = self._require_engine(), self._staging
        assert staging is not None
        stored: dict[int, bool] = {}
        at = 0
        while at < len(todo):
            slots = staging.take(len(todo) - at, engine.deadline_s)
            if not slots:
                log.warning("kvtier sglang backend: no staging row came free in %.1f s", engine.deadline_s)
                break
            chunk = todo[at : at + len(slots)]
            held = False
            try:
                for slot, i in zip(slots, chunk, strict=False):
                    gather(pages[i], staging.row_address(slot))
                rows: list[Row] = [
                    (keys[i], staging.row(slot)) for slot, i in zip(slots, chunk, strict=False)
                ]
                futures = [engine.call_put(t, rows) for t in range(len(self.tiers))]
                ok = [False] * len(chunk)
                for future in futures:
                    result = self._wait(future)
                    if result is None or result.abandoned:  # a tier may still read the rows
                        held = True
                    if result is not None:
                        ok = [a or b for a, b in zip(ok, result.ok, strict=True)]
                for i, good in zip(chunk, ok, strict=True):
                    stored[i] = good
                self._remember([keys[i] for i, good in zip(chunk, ok, strict=True) if good])
            finally:
                if held:
                    staging.hold(slots, None)
                else:
                    staging.give_back(slots)
            at += len(chunk)
        return stored

    def _remember(self, keys: list[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._stored[key] = None
            while len(self._stored) > MAX_TRACKED_KEYS:
                del self._stored[next(iter(self._stored))]

    def _record(self, what: str, pages: int, seconds: float) -> None:
        """SGLang's storage metrics (caller holds ``_lock``)."""
        if not getattr(self.storage_config, "enable_storage_metrics", False) or self.geometry is None:
            return
        self._metrics[f"{what}_pgs"].append(pages)
        gib = pages * self.geometry.row_bytes / (1 << 30)
        self._metrics[f"{what}_bandwidth"].append(gib / seconds if seconds > 0 else 0.0)

    def _fault(self, call: str) -> None:
        log.exception("kvtier sglang backend: %s failed; answered as a miss", call)
        with self._lock:
            self._counters.faults += 1

    def _generic_call(self, call: str) -> None:
        if not self._warned_generic:
            self._warned_generic = True
            log.warning(
                "kvtier sglang backend: SGLang called %s, the copying interface, which kvtier does not serve "
                '(set "interface_v1": 1); answered as a miss',
                call,
            )


def _leading(flags: list[bool]) -> list[bool]:
    """``flags`` with every entry after the first ``False`` set ``False``."""
    out = list(flags)
    if False in out:
        cut = out.index(False)
        out[cut:] = [False] * (len(out) - cut)
    return out
