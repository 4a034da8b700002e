"""From a lower tier's settings to the running pieces: the tier itself and its placement rule.

The one place that knows which class implements each tier kind, so that the manager's stack
(``offload.stack``) and vLLM's secondary tiers (``offload.vllm.secondary``) build tiers the
same way. A tier's settings are validated already (``offload.config``); what is read here is
only what the settings point to (a token file), at the moment the tier is built.
"""

from __future__ import annotations

from offload.config import ConfigError
from policies.placement import Placement, make_admission
from tiers.base import LowerTier
from tiers.settings import DiskSettings, LowerTierSettings, MooncakeSettings, RemoteSettings


def placement_for(tier: LowerTierSettings, capacity_rows: int) -> Placement:
    """The placement rule of a configured lower tier."""
    return Placement(
        write=tier.placement,  # type: ignore[arg-type]  # PLACEMENTS, checked by offload.config
        admission=make_admission(tier.admission, max(1, capacity_rows)),
        promote=tier.promotion,
    )


def build_tier(
    tier: LowerTierSettings,
    namespace: bytes,
    layout_id: bytes,
    row_bytes: int,
    readable_layouts: frozenset[bytes] = frozenset(),
) -> LowerTier:
    """The lower tier ``tier`` describes, keyed by ``namespace``, storing rows of
    ``layout_id`` and serving those and rows of ``readable_layouts`` (converted on landing).

    ``row_bytes`` is the usual row size, for tiers that size their policy in rows. The tier
    classes are imported here, on use: a configuration without Mooncake never loads it.
    """
    if isinstance(tier, DiskSettings):
        from tiers.disk import DiskTier

        return DiskTier(
            tier, namespace, layout_id, row_bytes=row_bytes, readable_layouts=readable_layouts, sync=tier.sync
        )
    if isinstance(tier, RemoteSettings):
        from tiers.remote import RemoteTier

        token = read_token(tier.token_file)
        return RemoteTier(tier, namespace, layout_id, token=token, readable_layouts=readable_layouts)
    if isinstance(tier, MooncakeSettings):
        from tiers.mooncake import MooncakeTier

        return MooncakeTier(tier, namespace, layout_id, readable_layouts=readable_layouts)
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
