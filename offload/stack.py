"""Assembling a manager from a configuration: host policy, lower tiers, placement, engine.

The standalone ``Offloader`` and the vLLM spec build the same stack; this is the one place
that knows how. The host tier's memory is passed in (a private buffer for ``Offloader``, a
shared-memory mapping in vLLM's scheduler process).
"""

from __future__ import annotations

from offload.config import KVTierConfig
from offload.manager import HostTierManager
from offload.namespace import Namespace
from offload.row_layout import RowConverter
from offload.tier_builder import build_tier, placement_for
from offload.tier_engine import TierEngine
from offload.tiering import LowerTierChain
from policies import make_policy
from tiers.host import HostTier
from tiers.row_format import layout_id_from_fingerprint


def build_manager(
    config: KVTierConfig,
    host: HostTier,
    *,
    fingerprint: str,
    dtype: str,
    shard: tuple[int, int] = (0, 1),
    converter: RowConverter | None = None,
    convert_on_landing: bool = True,
) -> HostTierManager:
    """The manager for ``host``, with every lower tier of ``config`` opened and running.

    ``fingerprint`` is the layout fingerprint of the rows (``CanonicalKVCaches.fingerprint``);
    with ``dtype`` and ``shard`` it makes the namespace that keys every persisted row.
    ``converter``, where the rows can be described (``RowConverter`` of their layout), puts
    only their logical shape in the namespace instead, so rows of engines with other
    physical layouts are found; they are converted as they land in the host tier
    (``convert_on_landing``) or left for the worker to convert on load.
    Raises ``TierError`` if a lower tier cannot start, ``ConfigError`` for a tier kind
    without an implementation.
    """
    host_cfg = config.host
    lower = _start_lower_tiers(
        config,
        host,
        fingerprint=fingerprint,
        dtype=dtype,
        shard=shard,
        converter=converter,
        convert_on_landing=convert_on_landing,
    )
    host_rows = [slab.numpy() for slab in host.slabs]
    return HostTierManager(
        host.num_groups,
        host.num_slots,
        lambda capacity: make_policy(host_cfg.eviction, capacity, **host_cfg.eviction_params),
        lower=lower,
        host_row=(lambda group, slot: memoryview(host_rows[group][slot])) if lower else None,
        max_promoting_rows=host_cfg.max_promoting_rows,
        max_spilling_rows=host_cfg.max_spilling_rows,
    )


def _start_lower_tiers(
    config: KVTierConfig,
    host: HostTier,
    *,
    fingerprint: str,
    dtype: str,
    shard: tuple[int, int],
    converter: RowConverter | None,
    convert_on_landing: bool,
) -> LowerTierChain | None:
    tier_configs = config.lower_tiers
    if not tier_configs:
        return None
    namespace = Namespace(
        model=config.namespace.model,
        layout=converter.own.logical_description() if converter is not None else fingerprint,
        dtype=dtype,
        shard=shard,
        tenant=config.namespace.tenant,
    ).digest()
    if converter is not None:
        layout_id, readable = converter.own_id, converter.readable_ids
    else:
        layout_id, readable = layout_id_from_fingerprint(fingerprint), frozenset()
    mean_row = sum(host.row_bytes) // len(host.row_bytes)
    tiers = [build_tier(tier, namespace, layout_id, mean_row, readable) for tier in tier_configs]
    placements = [placement_for(tier, tier.capacity_bytes // mean_row) for tier in tier_configs]
    engine = TierEngine(
        tiers,
        deadline_s=max(tier.deadline_s for tier in tier_configs),
        converter=converter,
        convert_on_landing=convert_on_landing,
    )
    engine.start(memoryview(host.buffer.numpy()))
    wait = max(tier.lookup_wait_s for tier in tier_configs)
    pause = config.host.slow_tier_pause_s
    return LowerTierChain(tiers, placements, engine, lookup_wait_s=wait, pause_s=pause)
