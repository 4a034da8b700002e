"""The chain of tiers below the host tier, as the manager sees it.

Every lower tier is fed from the host tier and feeds the host tier back; tiers do not
cascade into each other. What goes where is each tier's **placement** (``policies/
placement.py``):

- write-through: a row is copied down as soon as its store into the host tier completes;
- write-back: a row is copied down before the host tier evicts it (the manager spills
  rows nearing the eviction end of the host policy in the background, so that victims
  are already clean when a store needs their slots);
- admission: a tier only takes rows its rule admits (``seen-twice`` counts how often a
  block was computed or hit, in a bounded sketch);
- promotion: a lookup that misses the host tier but finds the row below copies it up
  (``HIT_PENDING`` until it lands).

Finding a row below is a local question for a disk (its index is exact) but not for
remote peers, which also hold what other engines put: for those a miss asks them in the
background (``offload.peer_asks``), and a later lookup of a key they hold promotes it.

This module holds those rules and the ``TierEngine``; the manager holds the row states.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from offload.config import ConfigError, TierConfig
from offload.peer_asks import AskStats, PeerAsks
from offload.tier_engine import OpResult, TierEngine
from policies.placement import Placement, make_admission
from tiers.base import LowerTier, Row

log = logging.getLogger(__name__)


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
            token=_read_token(tier.token_file),
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


def _read_token(path: str | None) -> bytes | None:
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


@dataclass
class ChainStats(AskStats):
    promotions_started: int = 0
    promotions_done: int = 0
    promotions_failed: int = 0
    spills_started: int = 0
    spills_done: int = 0
    spills_failed: int = 0
    spills_refused: int = 0
    dirty_dropped: int = 0


class LowerTierChain:
    """Placement rules and the engine that moves rows, for the tiers below the host."""

    def __init__(
        self,
        tiers: Sequence[LowerTier],
        placements: Sequence[Placement],
        engine: TierEngine,
        lookup_wait_s: float = 0.0,
    ) -> None:
        if len(tiers) != len(placements):
            raise ValueError(f"{len(tiers)} tiers but {len(placements)} placements")
        self.tiers = list(tiers)
        self.placements = list(placements)
        self.engine = engine
        self.stats = ChainStats()
        self._op_ids = itertools.count(1)
        partial = [
            index
            for index, (tier, placement) in enumerate(zip(self.tiers, self.placements, strict=True))
            if tier.index_is_partial and placement.promote
        ]
        self.asks = PeerAsks(engine, partial, self._next_op_id, lookup_wait_s=lookup_wait_s, stats=self.stats)

    def _next_op_id(self) -> int:
        return next(self._op_ids)

    @property
    def has_write_back(self) -> bool:
        return any(p.copy_down_on_evict() for p in self.placements)

    def observe(self, key: Hashable) -> None:
        """A block was computed or hit: count it for admission."""
        for placement in self.placements:
            placement.admission.observe(key)

    def locate(self, key: bytes) -> int | None:
        """The first promoting tier that holds ``key``, by its local index or a past ``contains``."""
        known = self.asks.known(key)
        for index, (tier, placement) in enumerate(zip(self.tiers, self.placements, strict=True)):
            if placement.promote_on_hit() and (known == index or tier.may_contain(key)):
                return index
        return None

    def ask_later(self, keys: Iterable[bytes]) -> None:
        """Queue ``contains`` checks for keys missing here, on tiers whose local index is partial."""
        self.asks.ask_later(keys)

    def flush_asks(self) -> None:
        """Send the queued checks, one ``contains`` per partial tier."""
        self.asks.flush()

    def asking(self, key: bytes) -> bool:
        """Whether a lookup of ``key`` should come back later (``PeerAsks.asking``)."""
        return self.asks.asking(key)

    def learn(self, result: OpResult) -> None:
        """Take a ``contains`` answer (``PeerAsks.learn``)."""
        self.asks.learn(result)

    def forget(self, key: bytes) -> None:
        """A promotion of ``key`` failed: do not send the next lookup to the same place."""
        self.asks.forget(key)

    def targets(self, key: bytes, *, on_evict: bool) -> list[int]:
        """Tiers that take ``key`` now: write-back ones before eviction, write-through ones on store."""
        return [
            index
            for index, placement in enumerate(self.placements)
            if (placement.copy_down_on_evict() if on_evict else placement.copy_down_on_store())
            and placement.admit(key)
        ]

    def put(self, tier: int, rows: Sequence[Row]) -> int | None:
        """Start copying host rows down; the operation id, or ``None`` if the tier is saturated."""
        op_id = next(self._op_ids)
        if not self.engine.submit_put(op_id, tier, rows):
            self.stats.spills_refused += len(rows)
            return None
        self.stats.spills_started += len(rows)
        return op_id

    def get(self, tier: int, rows: Sequence[Row]) -> int | None:
        """Start copying rows up into host rows; the operation id, or ``None`` if saturated."""
        op_id = next(self._op_ids)
        if not self.engine.submit_get(op_id, tier, rows):
            return None
        self.stats.promotions_started += len(rows)
        return op_id

    def drain(self) -> list[OpResult]:
        return self.engine.drain() if self.engine.has_results() else []

    def tier_kind(self, tier: int) -> str:
        return self.tiers[tier].kind

    def close(self) -> None:
        self.engine.close()
