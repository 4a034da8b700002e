"""From a lower tier's configuration to the running pieces: the tier itself and its placement rule.

The one place that knows which class implements each tier kind, so that the manager's stack
(``offload.stack``) and vLLM's secondary tiers (``offload.vllm.secondary``) build tiers the
same way. A tier's configuration is validated already (``offload.config``); what is read here
is only what it points to (a token file), at the moment the tier is built.
"""

from __future__ import annotations

from offload.config import ConfigError, TierConfig
from policies.placement import Placement, make_admission
from tiers.base import LowerTier


def placement_for(tier: TierConfig, capacity_rows: int) -> Placement:
    """The placement rule of a configured lower tier."""
    return Placement(
        write=tier.placement,  # type: ignore[arg-type]
        admission=make_admission(tier.admission, max(1, capacity_rows)),
        promote=tier.promotion,
    )


def build_tier(
    tier: TierConfig,
    namespace: bytes,
    layout_id: bytes,
    row_bytes: int,
    readable_layouts: frozenset[bytes] = frozenset(),
) -> LowerTier:
    """The lower tier a config entry describes, keyed by ``namespace``, storing rows of
    ``layout_id`` and serving those and rows of ``readable_layouts`` (converted on landing).

    ``row_bytes`` is the usual row size, for tiers that size their policy in rows.
    """
    if tier.kind == "disk":
        from tiers.disk import DiskTier

        assert tier.path is not None
        return DiskTier(
            tier.path,
            tier.capacity_bytes,
            namespace,
            layout_id,
            eviction=tier.eviction,
            eviction_params=dict(tier.eviction_params),
            row_bytes=row_bytes,
            readable_layouts=readable_layouts,
        )
    if tier.kind == "remote":
        from tiers.remote import RemoteTier

        return RemoteTier(
            list(tier.peers),
            namespace,
            layout_id,
            token=read_token(tier.token_file),
            tenant=tier.peer_tenant,
            deadline_s=tier.deadline_s,
            readable_layouts=readable_layouts,
            checksum_thread=tier.checksum_thread,
        )
    if tier.kind == "mooncake" and tier.mooncake is not None:
        from tiers.mooncake import MooncakeTier

        settings = tier.mooncake
        return MooncakeTier(
            settings.master,
            namespace,
            layout_id,
            metadata_server=settings.metadata_server,
            segment_bytes=tier.capacity_bytes,
            local_buffer_bytes=settings.local_buffer_bytes,
            protocol=settings.protocol,
            device_name=settings.device_name,
            local_hostname=settings.local_hostname,
            listen_interface=settings.listen_interface,
            replicas=settings.replicas,
            deadline_s=tier.deadline_s,
            readable_layouts=readable_layouts,
        )
    raise ConfigError(f"tiers: kind {tier.kind!r} has no lower-tier implementation")


def read_token(path: str | None) -> bytes | None:
    """The token in ``path`` (surrounding whitespace removed); ``None`` without a path."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            token = f.read().strip()
    except OSError as exc:
        raise ConfigError(f"token_file = {path!r}: cannot read it: {exc.strerror}") from exc
    if not token:
        raise ConfigError(f"token_file = {path!r}: the file is empty")
    return token
