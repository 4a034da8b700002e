"""``KVTierOffloadingSpec``: kvtier as a vLLM offloading spec (vLLM 0.32 and 0.33).

.. code-block:: text

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KVTierOffloadingSpec",
        "spec_module_path": "offload.vllm", "cpu_bytes_to_use": 8589934592,
        "kvtier_config": "/etc/kvtier/tiers.toml"}}'

vLLM builds the spec in the scheduler process (``get_manager``: the manager, the lower
tiers and their tier engine) and in every worker process (``get_worker``: device <-> host
copies). Both map one shared host-tier file (``<shm_dir>/kvtier_<engine_id>.mmap``), sized
from the configuration alone (``canonical.HostLayout``), so spills and promotions between
the host tier and disk or peers happen in the scheduler process, next to the manager,
and never travel through the connector. The file's name is removed as soon as the
scheduler and every worker have mapped it (``HostTier(sharers=...)``), so nothing is left
in ``shm_dir`` however the engine exits; until then (a manager whose workers never map it,
an engine that fails to start) each process that mapped it removes the name when it shuts
down, or exits normally without a shutdown; only a process killed before every sharer
mapped it leaves the file. Keys settings in ``settings.py``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches as VllmCanonicalKVCaches
from vllm.v1.kv_offload.base import OffloadingMetricMetadata, OffloadingSpec
from vllm.v1.kv_offload.config import OffloadingConfig

from offload.row_layout import RowConverter
from offload.stack import build_manager
from offload.vllm.canonical import HostLayout, config_fingerprint, to_kvtier_caches
from offload.vllm.compat import check_vllm_version
from offload.vllm.manager_adapter import KVTierInfo, KVTierOffloadingManager
from offload.vllm.metrics import metric_definitions
from offload.vllm.row_layout import describe_rows, read_model_shape, resolve_convert_on, resolve_page_split
from offload.vllm.settings import SpecSettings
from offload.vllm.worker_adapter import KVTierWorker
from offload.worker import OffloadingWorker
from tiers.host import HostTier

log = logging.getLogger(__name__)


class KVTierOffloadingSpec(OffloadingSpec):
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions()

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return KVTierInfo.config_info_keys()

    def __init__(self, config: OffloadingConfig) -> None:
        check_vllm_version()  # vLLM's factory builds the spec: say here what is wrong with the install
        super().__init__(config)
        self.settings = SpecSettings.from_extra_config(config.extra_config, model=config.model.name)
        opt_into_sync_loads(self.extra_config)
        self.layout = HostLayout.from_config(config)
        # Byte-identical ranks (MLA under TP) share one band: only rank 0 writes it.
        self.replicated_layout = config.replicated_layout
        self.fingerprint = config_fingerprint(config, self.layout)
        # What the rows' bytes mean, where vLLM's config and the model's say (row_layout.py):
        # rows of engines with other page orders or packing are then found and converted.
        self.row_layout, why = describe_rows(
            config,
            self.layout,
            read_model_shape(config.model.name),
            resolve_page_split(self.settings.kv_page_split),
        )
        if self.row_layout is None:
            log.info("kvtier: rows keyed by the configuration fingerprint only: %s", why)
        self.convert_on_landing = resolve_convert_on(self.settings.convert_on) == "landing"
        self.shm_path = os.path.join(self.settings.shm_dir, f"kvtier_{config.engine_id}.mmap")
        self._manager: KVTierOffloadingManager | None = None
        self._worker: KVTierWorker | None = None

    @property
    def sharers(self) -> int:
        """Processes that map the host file: the scheduler's and one per worker."""
        return 1 + max(1, self.config.parallel.world_size)

    @property
    def row_bytes(self) -> list[int]:
        return [self.layout.row_bytes] * self.layout.num_groups

    def get_manager(self) -> KVTierOffloadingManager:
        if self._manager is None:
            settings = self.settings
            # The scheduler process only bookkeeps and moves rows to and from lower tiers:
            # it never pins the mapping (that would start a CUDA context here).
            host = HostTier(
                self.row_bytes,
                settings.tiers.host.capacity_bytes,
                pin=False,
                shm_path=self.shm_path,
                sharers=self.sharers,
            )
            try:
                manager = build_manager(
                    settings.tiers,
                    host,
                    fingerprint=self.fingerprint,
                    dtype=self.config.model.dtype,
                    converter=self._converter(),
                    convert_on_landing=self.convert_on_landing,
                )
            except Exception:
                host.close(unlink=True)
                raise
            self._manager = KVTierOffloadingManager(
                manager,
                host,
                group_ids=[group.group_id for group in self.config.groups],
                row_bytes=self.layout.row_bytes,
                blocks_per_chunk=self.layout.blocks_per_chunk,
                enable_events=self.kv_events_config.enable_kv_cache_events,
            )
            log.info(
                "kvtier: tiers %s (config from %s), %d host rows per group of %d B (%d block(s) per row), "
                "layout %s (%s), host file %s",
                [tier.kind for tier in settings.tiers.tiers],
                settings.config_source,
                host.num_slots,
                self.layout.row_bytes,
                self.layout.blocks_per_chunk,
                self.fingerprint,
                "described: rows of other layouts convert" if self.row_layout else "fingerprint only",
                self.shm_path,
            )
        return self._manager

    def _converter(self) -> RowConverter | None:
        return RowConverter(self.row_layout) if self.row_layout is not None else None

    def get_worker(self, kv_caches: VllmCanonicalKVCaches) -> KVTierWorker:
        if self._worker is None:
            layout = self.layout
            caches = to_kvtier_caches(
                kv_caches, fingerprint=self.fingerprint, block_size=self.config.groups[0].tokens_per_block
            )
            if caches.num_groups != layout.num_groups:
                raise ValueError(
                    f"vLLM registered KV caches for {caches.num_groups} groups, "
                    f"its config names {layout.num_groups}"
                )
            for group in range(caches.num_groups):
                if caches.row_bytes(group) > layout.worker_block_bytes:
                    raise ValueError(
                        f"group {group}: a block is {caches.row_bytes(group)} B, more than the "
                        f"{layout.worker_block_bytes} B per block vLLM reported (worker_kv_bytes_per_block)"
                    )
            rank = self.config.parallel.rank
            host = HostTier(
                self.row_bytes,
                self.settings.tiers.host.capacity_bytes,
                shm_path=self.shm_path,
                sharers=self.sharers,
            )
            worker = OffloadingWorker(
                caches,
                host,
                blocks_per_row=layout.blocks_per_chunk,
                host_block_bytes=[layout.sub_row_bytes] * layout.num_groups,
                host_offset_bytes=[layout.band_offset(rank)] * layout.num_groups,
                converter=self._converter(),  # rows the scheduler leaves in another layout
            )
            self._worker = KVTierWorker(worker, host)
            log.info(
                "kvtier worker (rank %d): %d KV tensors, %s segment(s) per block per group, on %s",
                rank,
                len(caches.tensors),
                [caches.segments_per_block(g) for g in range(caches.num_groups)],
                caches.device,
            )
        return self._worker


SYNC_LOAD_BUDGET_BYTES = 64 << 20
"""Per engine step (and worker), the bytes of host-tier hits vLLM loads inside the step
instead of between steps (vLLM 0.33's ``sync_load_budget_bytes``; its own default, 0, turns
it off). Loaded asynchronously, a hit waits at least one engine step more than a hit of the
device cache (``tests/vllm/test_sync_load.py``); loaded in the step, it takes the device
hit's steps, and the step waits for the copy: 64 MiB is a few milliseconds at a host link's
10-25 GB/s, less than an engine step. Hits beyond it in a step load asynchronously."""


def opt_into_sync_loads(extra_config: dict[str, Any]) -> None:
    """Let vLLM load small host-tier hits within the step (``SYNC_LOAD_BUDGET_BYTES``) unless
    the user set ``sync_load_budget_bytes`` (0: never). vLLM releases without the key ignore it."""
    if "sync_load_budget_bytes" not in extra_config:
        extra_config["sync_load_budget_bytes"] = SYNC_LOAD_BUDGET_BYTES
