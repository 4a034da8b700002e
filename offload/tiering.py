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

from offload.peer_asks import AskStats, PeerAsks
from offload.tier_engine import OpResult, TierEngine
from policies.placement import Placement
from tiers.base import LowerTier, Row

log = logging.getLogger(__name__)


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
