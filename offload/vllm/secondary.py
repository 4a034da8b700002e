"""kvtier's disk and remote tiers as secondary tiers of vLLM's own tiering spec.

For users who keep vLLM's CPU tier (``TieringOffloadingSpec``) and want kvtier's LMDB disk
tier or its NIXL peers below it::

    "kv_connector_extra_config": {
      "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
      "secondary_tiers": [
        {"type": "KVTierDiskTier", "module_path": "offload.vllm.secondary",
         "path": "/var/cache/kvtier", "capacity": "200GiB"},
        {"type": "KVTierRemoteTier", "module_path": "offload.vllm.secondary",
         "peers": ["10.0.0.7:7400"], "token_file": "/etc/kvtier/token"}]}

A tier stores whole rows of vLLM's CPU tier (``primary_kv_view[c]``: one chunk, every
worker's pages) under the key vLLM gives, in a namespace of (model, this row layout,
dtype, tenant), so it never hands back a row another model or layout wrote. Transfers run
on kvtier's tier engine (a uvloop thread) with a deadline each: submits return at once,
``get_finished_jobs`` reports them. A promotion that fails for some keys reports those
keys as failed (vLLM's tiering allows partial promotions); a row that fails its checksum
is a miss, never bytes handed to the engine.

A peer also holds rows other engines put, which this engine's index does not list: a
lookup that misses that index asks the peer in the background (one ``contains`` per
step, sent at ``serve_external_requests``), and a later lookup of a key it holds is a hit.
With ``lookup_wait_s`` the lookup says ``RETRY`` while the peer is being asked, so vLLM
defers the request instead of recomputing a prefix a peer holds.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from offload.config import ConfigError, parse_tier
from offload.namespace import Namespace
from offload.peer_asks import PeerAsks
from offload.tier_builder import build_tier
from offload.tier_engine import OpKind, TierEngine
from offload.vllm.tier_filter import place
from tiers.base import LowerTier
from tiers.row_format import layout_id_from_fingerprint
from tiers.settings import LowerTierSettings

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
    from vllm.v1.kv_offload.tiering.base import ParentManager

log = logging.getLogger(__name__)

_DRAIN_TIMEOUT_S = 30.0


class _KVTierSecondaryTier(SecondaryTierManager):
    """One kvtier ``LowerTier`` behind vLLM's ``SecondaryTierManager`` (see the module doc)."""

    kind: ClassVar[str] = ""

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        *,
        model: str | None = None,
        tenant: str = "",
        locality: str | None = None,
        **tier_keys: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        # What vLLM's per-request kv_load_tiers filter matches (and KV events say): the kind's
        # place unless the tier's config names one, as for vLLM's own file tier.
        self.locality = _locality(locality) if locality is not None else place(self.kind)[1]
        config = offloading_spec.config
        self.tier_config = _tier_config(self.kind, tier_keys)
        fingerprint = primary_row_fingerprint(offloading_spec, self.block_size_bytes)
        namespace = Namespace(
            model=model or config.model.name,
            layout=fingerprint,
            dtype=config.model.dtype,
            tenant=tenant,
        ).digest()
        layout_id = layout_id_from_fingerprint(fingerprint)
        self.tier: LowerTier = build_tier(
            self.tier_config, namespace, layout_id, row_bytes=self.block_size_bytes
        )
        self._rows = primary_kv_view.cast("B")
        self.engine = TierEngine([self.tier], deadline_s=self.tier_config.deadline_s)
        self.engine.start(self._rows)
        self._op_ids = itertools.count(1)
        self._jobs: dict[int, TransferJob] = {}
        self._finished: list[JobResult] = []
        self._asks = PeerAsks(
            self.engine,
            [0] if self.tier.index_is_partial else [],
            lambda: next(self._op_ids),
            lookup_wait_s=self.tier_config.lookup_wait_s,
        )
        self._stored: list[OffloadKey] = []
        log.info(
            "kvtier %s tier under vLLM's CPU tier: rows of %d B, namespace %s",
            self.kind,
            self.block_size_bytes,
            namespace.hex(),
        )

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        raw = bytes(key)
        if self.tier.may_contain(raw) or self._asks.known(raw) is not None:
            return LookupResult.HIT
        self._asks.ask_later((raw,))
        return LookupResult.RETRY if self._asks.asking(raw) else LookupResult.MISS

    def serve_external_requests(self, parent: ParentManager) -> None:
        """Once per scheduler step: send the step's ``contains`` checks as one request."""
        self._asks.flush()

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self.engine.submit_put)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self.engine.submit_get)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        for result in self.engine.drain():
            if result.kind is OpKind.RELEASE:  # vLLM's own buffers: nothing held here to free
                continue
            if result.kind is OpKind.CONTAINS:
                self._asks.learn(result)
                continue
            job = self._jobs.pop(result.op_id)
            ok_keys = [OffloadKey(key) for key, ok in zip(result.keys, result.ok, strict=True) if ok]
            success = len(ok_keys) == len(result.keys)
            if job.is_promotion and not success:
                for key, ok in zip(result.keys, result.ok, strict=True):
                    if not ok:
                        self._asks.forget(bytes(key))  # not a hit next time
            if not job.is_promotion:
                self._stored.extend(ok_keys)
            self._finished.append(
                JobResult(
                    job_id=job.job_id,
                    success=success,
                    successful_keys=ok_keys if job.is_promotion and not success else None,
                    transfer_time=result.seconds,
                    transfer_bytes=len(ok_keys) * self.block_size_bytes,
                )
            )
        finished, self._finished = self._finished, []
        return finished

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or self._asks.waiting()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._stored:
            return ()
        keys, self._stored = self._stored, []
        return [
            OffloadingEvent(
                keys, self.medium, removed=False, locality=self.locality, ownership=self.tier_type
            )
        ]

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        if not self.engine.wait_idle(_DRAIN_TIMEOUT_S):
            log.warning("kvtier %s tier: transfers still running after %.0f s", self.kind, _DRAIN_TIMEOUT_S)

    def shutdown(self) -> None:
        self.engine.close()

    def _submit(self, job: TransferJob, submit: Any) -> None:
        size = self.block_size_bytes
        rows = [
            (bytes(key), self._rows[int(chunk) * size : (int(chunk) + 1) * size])
            for key, chunk in zip(job.keys, job.chunk_ids, strict=True)
        ]
        op_id = next(self._op_ids)
        self._jobs[op_id] = job
        if not submit(op_id, 0, rows):  # the tier is saturated: a failed job, reported next poll
            del self._jobs[op_id]
            self._finished.append(JobResult(job_id=job.job_id, success=False, successful_keys=[]))


class KVTierDiskTier(_KVTierSecondaryTier):
    """kvtier's LMDB disk tier. Keys: ``path``, ``capacity`` (size), ``eviction``,
    ``eviction_params``; ``model``/``tenant`` override the namespace; ``locality`` (what vLLM's
    ``kv_load_tiers`` matches) is ``LOCAL`` unless given."""

    kind = "disk"
    medium = Medium.STORAGE


class KVTierRemoteTier(_KVTierSecondaryTier):
    """kvtier's NIXL peers. Keys: ``peers`` (``host:port`` list), ``token_file``,
    ``peer_tenant`` (the tenant claimed at the peers, which the token must grant),
    ``deadline_s``, ``lookup_wait_s``, ``checksum_thread``, ``capacity`` (required, as in the
    TOML); ``model``/``tenant`` override the namespace; ``locality`` is ``REMOTE`` unless given."""

    kind = "remote"
    medium = Medium.STORAGE


def _locality(value: object) -> Locality:
    """A tier config's ``locality`` (``"LOCAL"`` or ``"REMOTE"``, any case)."""
    try:
        return Locality(str(value).upper())
    except ValueError:
        raise ConfigError(f"locality = {value!r}: expected LOCAL or REMOTE") from None


def _tier_config(kind: str, keys: dict[str, Any]) -> LowerTierSettings:
    """Validate a tier's keys with kvtier's own parser (same names and errors as the TOML).

    Errors name it ``tiers[1]``: the tier right below vLLM's CPU tier, where it would be in
    a kvtier configuration.
    """
    settings = parse_tier({"kind": kind, **keys}, "tiers[1]")
    if not isinstance(settings, LowerTierSettings):
        raise ConfigError(f"tiers[1].kind = {settings.kind!r}: there is exactly one host tier, the first")
    return settings


def primary_row_fingerprint(spec: OffloadingSpec, row_bytes: int) -> str:
    """The meaning of a row of vLLM's CPU tier: its spec's groups, chunking and row size."""
    config = spec.config
    description = {
        "format": "vllm-cpu-primary-v1",
        "groups": [[list(g.layer_names), g.tokens_per_block] for g in config.groups],
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "row_bytes": row_bytes,
        "dtype": config.model.dtype,
        "kv_cache_layout": config.kv_cache_layout,
        "world_size": config.parallel.world_size,
        "replicated": config.replicated_layout,
        "canonical": config.canonical_layout,
    }
    return hashlib.blake2b(json.dumps(description, sort_keys=True).encode(), digest_size=16).hexdigest()
