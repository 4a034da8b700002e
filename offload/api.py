"""The standalone API: kvtier for any engine, in one process.

An engine that is not vLLM drives an ``Offloader`` with its own block keys and block ids::

    offloader = Offloader(kv_caches, groups=[layer_names], config="tiers.toml")
    job = offloader.store(keys, block_ids)        # after prefill: copy blocks out
    n = offloader.lookup(keys)                    # on a new request: how long a prefix hits
    job = offloader.load(keys[:n], free_block_ids)
    for result in offloader.poll(): ...           # once per step: finished jobs

Keys are bytes shaped like vLLM's ``OffloadKey`` (``offload.keys.make_key``); the group
index in a key says which KV group's block table ``block_ids`` refers to. ``block_ids[i]``
(or ``blocks_per_key`` consecutive entries from ``i * blocks_per_key``) is key ``i``'s
device block. Nothing blocks except ``wait``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from offload.config import ConfigError, KVTierConfig, default_config, load_config
from offload.keys import OffloadKey, key_group
from offload.layout import CanonicalKVCaches, canonicalize
from offload.manager import Lookup, TierEvent
from offload.row_layout import RowConverter, RowLayout
from offload.stack import build_manager
from offload.worker import OffloadingWorker, TransferResult
from tiers.base import TierError
from tiers.host import HostTier

log = logging.getLogger(__name__)


class Offloader:
    """Manager, worker and host tier wired together for one engine process."""

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        groups: Sequence[Sequence[str]],
        config: KVTierConfig | Mapping[str, Any] | str | Path | None = None,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        block_dims: Mapping[str, int] | None = None,
        blocks_per_key: int = 1,
        shard: tuple[int, int] = (0, 1),
        kv_layout: str = "NHD",
        convert_on_load: bool | None = None,
        kv_events: bool = False,
    ) -> None:
        """``kv_layout`` names the per-block dims of the given tensors (``"NHD"``: tokens,
        heads, head dim; or ``"HND"``); see ``offload.layout.canonicalize``. Rows stored by
        an engine with another physical layout or block size (same model, dtype, shard and
        tokens per key) are converted (``offload.row_layout``): by the worker as it loads
        them (``convert_on_load``, the default on a GPU: torch ops in device memory), else on
        the CPU once, as they land in the host tier (the default on CPU).

        ``kv_events``: keep the tiers' KV events (rows stored in, removed from each tier), as
        vLLM's connector publishes them to a KV-aware router, for ``take_events``; without
        it each ``poll`` drops them."""
        if config is None:
            config = default_config()
        elif not isinstance(config, KVTierConfig):
            config = load_config(config)
        self.config = config
        self.caches: CanonicalKVCaches = canonicalize(
            kv_caches,
            groups,
            num_blocks=num_blocks,
            block_size=block_size,
            block_dims=block_dims,
            kv_layout=kv_layout,
        )
        self.blocks_per_key = blocks_per_key
        row_layout = _chunked(self.caches.row_layout, blocks_per_key)
        converter = RowConverter(row_layout) if row_layout is not None else None
        if convert_on_load is None:
            convert_on_load = self.caches.device.type != "cpu"
        host_cfg = config.host
        row_bytes = [self.caches.row_bytes(g) * blocks_per_key for g in range(self.caches.num_groups)]
        try:
            self.host = HostTier(row_bytes, host_cfg.capacity_bytes)
        except TierError as exc:  # more than this process may allocate now
            raise ConfigError(f"tiers[0].capacity = {host_cfg.capacity_bytes}: {exc}") from exc
        self.manager = build_manager(
            config,
            self.host,
            fingerprint=self.caches.fingerprint,
            dtype=",".join(sorted({str(t.dtype).removeprefix("torch.") for t in kv_caches.values()})),
            shard=shard,
            converter=converter,
            convert_on_landing=not convert_on_load,
        )
        try:
            self.worker = OffloadingWorker(
                self.caches, self.host, blocks_per_row=blocks_per_key, converter=converter
            )
        except BaseException:
            self.manager.shutdown()  # the tier engine's thread and loop, the tiers' files
            self.host.close()
            raise
        self._job_ids = itertools.count(1)
        self._jobs: dict[int, tuple[bool, list[OffloadKey]]] = {}
        self._kv_events: list[TierEvent] | None = [] if kv_events else None

    def lookup(self, keys: Sequence[OffloadKey]) -> int:
        """How many leading ``keys`` can be loaded now.

        Keys found only in a lower tier start their promotion here (every one up to the
        first miss, in one pass), and count once they have landed: call again after
        ``poll`` to load the longer prefix. From the first miss on, remote peers are asked
        in the background whether they hold the rest (another engine may have put it); a key
        still being asked (``lookup_wait_s``) ends the prefix like a miss until they answer.
        A key whose promotion failed is a miss for a while
        (``offload.tiering.RETRY_FAILED_PROMOTIONS_S``): the engine recomputes it.
        """
        hits: int | None = None
        found = len(keys)
        for count, key in enumerate(keys):
            result = self.manager.lookup(key)
            if result is Lookup.MISS or result is Lookup.RETRY:
                self.manager.check_below(keys[count:])  # remote peers may hold the rest
                found = count
                break
            if result is Lookup.HIT_PENDING and hits is None:
                hits = count
        self.manager.poll()  # the promotions this lookup started go out as one request per tier
        return found if hits is None else hits

    def store(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> int | None:
        """Start copying the blocks of ``keys`` out; the job id, or ``None`` if the tier is full.

        Keys already stored are skipped (the job may then move nothing). ``None`` means every
        row that could make room is pinned or in flight: nothing was stored, nothing changed.
        """
        blocks_of = self._blocks_by_key(keys, block_ids)
        prepared = self.manager.prepare_store(keys)
        if prepared is None:
            return None
        job_id = next(self._job_ids)
        spec = prepared.store_spec
        self._submit(job_id, spec.keys, spec.per_group(self.caches.num_groups), blocks_of, is_store=True)
        return job_id

    def load(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> int:
        """Start copying stored rows into device blocks; every key must be a hit (see ``lookup``)."""
        blocks_of = self._blocks_by_key(keys, block_ids)
        spec = self.manager.prepare_load(keys)
        self.manager.touch(keys)
        job_id = next(self._job_ids)
        try:
            self._submit(
                job_id,
                spec.keys,
                spec.per_group(self.caches.num_groups),
                blocks_of,
                is_store=False,
                layouts=spec.layouts_per_group(self.caches.num_groups),
            )
        except ValueError:
            self.manager.complete_load(keys)
            raise
        return job_id

    def poll(self) -> list[TransferResult]:
        """Finished jobs since the last call; their rows become readable or are released.

        Also applies finished lower-tier work (promotions, spills).
        """
        self.manager.on_schedule_end()  # ends the step, and polls the lower tiers
        results = self.worker.get_finished()
        for result in results:
            is_store, keys = self._jobs.pop(result.job_id)
            if is_store:
                self.manager.complete_store(keys, success=result.success)
            else:
                self.manager.complete_load(keys)
        # Events nobody takes are dropped: kept in the manager, they grew with every row
        # stored below, and every eviction checked them key by key.
        if self._kv_events is None:
            self.manager.drop_events()
        else:
            self._kv_events.extend(self.manager.take_events())
        return results

    def take_events(self) -> list[TierEvent]:
        """The KV events the polls since the last call took, in order (an engine built with
        ``kv_events=True``): each names the keys stored in, or removed from, one tier
        (``medium``). They are kept until taken, so a caller that asks for them takes them
        once per step."""
        if self._kv_events is None:
            raise RuntimeError("this Offloader drops KV events: build it with kv_events=True to take them")
        events, self._kv_events = self._kv_events, []
        return events

    def wait(self, job_ids: Sequence[int] | None = None) -> list[TransferResult]:
        """Block until the jobs (default: all) finish; returns what ``poll`` returns."""
        self.worker.wait(list(self._jobs) if job_ids is None else job_ids)
        return self.poll()

    def wait_tiers(self, timeout: float = 10.0) -> None:
        """Block until lower-tier work (promotions, spills) has finished, then apply it."""
        self.manager.wait_idle(timeout)
        self.manager.poll()

    def stats(self) -> dict[str, object]:
        stats: dict[str, object] = asdict(self.manager.stats)
        lower = self.manager.lower
        if lower.tiers:
            stats["lower"] = asdict(lower.stats)
            stats["lower"]["rows_converted"] = lower.rows_converted + self.worker.rows_converted  # type: ignore[index]
            stats["tiers"] = {tier.kind: dict(tier.stats()) for tier in lower.tiers}
        return stats

    def metrics_text(self) -> str:
        """Per-tier hits, misses, bytes moved, evictions, rows and capacity in the Prometheus
        text format (``offload.metrics``), e.g. to serve with ``offload.metrics.serve``."""
        from offload.metrics import manager_families, render

        row_bytes = sum(self.host.row_bytes) // max(1, len(self.host.row_bytes))
        return render(manager_families(self.manager, row_bytes))

    def close(self) -> None:
        """Finish the jobs in flight, then release everything this object started: the copy
        threads, the tier engine's thread and event loop, the lower tiers' files, locks and
        connections, and the host tier's memory. Measured: file descriptors and threads
        flat over 100 open/close cycles with host and disk tiers (``tests/offload/test_api.py``)."""
        try:
            self.wait()
        finally:
            self.worker.shutdown()
            self.manager.shutdown()
            self.host.close()

    def __enter__(self) -> Offloader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _blocks_by_key(
        self, keys: Sequence[OffloadKey], block_ids: Sequence[int]
    ) -> dict[OffloadKey, list[int]]:
        per = self.blocks_per_key
        if len(block_ids) != len(keys) * per:
            raise ValueError(f"{len(keys)} keys need {len(keys) * per} block ids, got {len(block_ids)}")
        for key in keys:
            if key_group(key) >= self.caches.num_groups:
                raise ValueError(f"key {key.hex()} names group {key_group(key)} of {self.caches.num_groups}")
        return {key: list(block_ids[i * per : (i + 1) * per]) for i, key in enumerate(keys)}

    def _submit(
        self,
        job_id: int,
        keys: list[OffloadKey],
        slots: list[list[int]],
        blocks_of: dict[OffloadKey, list[int]],
        *,
        is_store: bool,
        layouts: list[list[bytes | None]] | None = None,
    ) -> None:
        blocks: list[list[int]] = [[] for _ in range(self.caches.num_groups)]
        for key in keys:
            blocks[key_group(key)].extend(blocks_of[key])
        try:
            if is_store:
                self.worker.submit_store(job_id, blocks, slots)
            else:
                self.worker.submit_load(job_id, blocks, slots, row_layouts=layouts)
        except ValueError:
            if is_store:
                self.manager.complete_store(keys, success=False)
            raise
        self._jobs[job_id] = (is_store, keys)


def _chunked(layout: RowLayout | None, blocks_per_key: int) -> RowLayout | None:
    """The layout of host rows that hold ``blocks_per_key`` device blocks each."""
    if layout is None:
        return None
    groups = tuple(replace(group, blocks_per_row=blocks_per_key) for group in layout.groups)
    return replace(layout, groups=groups)
