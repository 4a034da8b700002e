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
A promotion that fails (a flaky peer, a corrupt file) leaves its key a miss for a while
(``RETRY_FAILED_PROMOTIONS_S``), so the request recomputes it instead of failing again.

``LowerTierChain`` owns everything below the host rows: those rules, the ``TierEngine``,
queued promotions, peer answers, failed promotions and ``ChainStats``; the manager
(``offload.manager``) owns the host rows and their states (ready, pinned, read, dirty).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from offload.peer_asks import AskStats, PeerAsks
from offload.tier_engine import OpKind, OpResult, TierEngine
from policies.placement import Placement
from tiers.base import LowerTier, Row

log = logging.getLogger(__name__)


PROMOTION_BATCH = 256
"""Queued promotions of one tier are sent at the latest when this many wait (else at ``send``)."""

RETRY_FAILED_PROMOTIONS_S = 60.0
"""A key whose promotion failed is not promoted again for this long: its lookups are misses,
so the request recomputes it (vLLM asserts every device load succeeds; a row that failed to
come up once, from a flaky peer or a corrupt file, would likely fail again)."""

FAILED_PROMOTIONS_KEPT = 1 << 16
"""How many failed promotions are remembered (the oldest forgotten first)."""

SLOW_TIER_PAUSE_S = 10.0
"""A tier whose promotion failed whole and slowly (every key, after at least half the tier
engine's deadline: the tier is slower than its deadline, not missing a row) promotes nothing
for this long: its lookups are misses (``promotions_refused``), so requests compute instead of
waiting out the deadline again. Measured before it (``kvtier bench serve --slow-tiers``, a
peer behind 20 mbit/s): 187-259 promotions per run failed at the 2 s deadline, each one a
request held that long."""


@dataclass
class ChainStats(AskStats):
    """Counters of the chain, written by the chain only (``dropped_dirty`` for the manager's)."""

    promotions_started: int = 0
    promotions_done: int = 0
    promotions_failed: int = 0
    promotions_refused: int = 0  # lookups left misses: promotions at their bound, a saturated or paused tier
    tier_pauses: int = 0  # a tier's promotions paused: one failed whole, slowly (SLOW_TIER_PAUSE_S)
    spills_started: int = 0
    spills_done: int = 0
    spills_failed: int = 0
    spills_refused: int = 0
    spills_dropped: int = 0  # write-through copies not started: copies down at their bound
    dirty_dropped: int = 0


@dataclass(frozen=True)
class TierOutcome:
    """One finished lower-tier operation, as a results observer sees it (``observe_results``)."""

    kind: OpKind
    tier: str
    """The kind of the tier that ran it (``"disk"``, ``"remote"``, ...)."""
    seconds: float
    landed: list[bytes]
    """Promotions: keys now readable in the host tier."""
    failed: list[bytes]
    """Promotions: keys that failed; they are misses for ``RETRY_FAILED_PROMOTIONS_S``."""


TierObserver = Callable[[TierOutcome], None]


class LowerTierChain:
    """The tiers below the host: placement rules, the engine that moves rows, promotions
    queued for it, the peers' ``contains`` answers, failed promotions, and their stats.

    The manager owns host rows; the chain owns everything below them. The manager's calls
    (all on the scheduler thread, none blocking):

    - ``observe`` / ``computed``: a block was hit / is about to be stored (admission counts);
    - ``locate`` then ``promote``: a host miss that a tier holds comes up; ``ask`` otherwise
      (remote peers asked in the background); ``check`` for the rest of a prefix;
    - ``send`` (once per step): queued promotions and checks go out, a request per tier;
    - ``spill``: copy host rows down (write-through on store, write-back before eviction);
    - ``finished``: drain finished operations, once the chain has taken its part (stats,
      peer answers, failed promotions, observers); the manager applies the rest to its rows.

    ``NoLowerTiers`` is the chain of a host-only stack: every call is a cheap no-op.
    """

    def __init__(
        self,
        tiers: Sequence[LowerTier],
        placements: Sequence[Placement],
        engine: TierEngine,
        lookup_wait_s: float = 0.0,
        retry_failed_s: float = RETRY_FAILED_PROMOTIONS_S,
        pause_s: float | None = None,
    ) -> None:
        """``pause_s``: how long a tier that failed a promotion whole and slowly promotes
        nothing (``None``: ``SLOW_TIER_PAUSE_S``; 0: never paused)."""
        if len(tiers) != len(placements):
            raise ValueError(f"{len(tiers)} tiers but {len(placements)} placements")
        self.tiers = list(tiers)
        self.placements = list(placements)
        self.engine = engine
        self.stats = ChainStats()
        self.retry_failed_s = retry_failed_s
        self.has_write_back = any(p.copy_down_on_evict() for p in self.placements)
        self.has_write_through = any(p.copy_down_on_store() for p in self.placements)
        self._op_ids = itertools.count(1)
        partial = [
            index
            for index, (tier, placement) in enumerate(zip(self.tiers, self.placements, strict=True))
            if tier.index_is_partial and placement.promote
        ]
        self.asks = PeerAsks(engine, partial, self._next_op_id, lookup_wait_s=lookup_wait_s, stats=self.stats)
        self._promotions: dict[int, list[Row]] = {}  # per tier: queued until send
        self._failed: OrderedDict[bytes, float] = OrderedDict()  # key -> when its promotion failed
        self.slow_get_s = engine.deadline_s / 2 if hasattr(engine, "deadline_s") else 1.0
        self.pause_s = SLOW_TIER_PAUSE_S if pause_s is None else pause_s
        self._paused_until: dict[int, float] = {}  # tier -> until when it promotes nothing
        self._observers: list[TierObserver] = []

    def _next_op_id(self) -> int:
        return next(self._op_ids)

    # -- what is below -----------------------------------------------------------------

    def observe(self, key: Hashable) -> None:
        """A block was hit: count it for admission."""
        for placement in self.placements:
            placement.admission.observe(key)

    def computed(self, keys: Iterable[bytes]) -> None:
        """Blocks computed again and about to be stored: count them for admission; a failed
        promotion of one no longer matters (the host tier gets the engine's own copy)."""
        failed = self._failed
        for key in keys:
            self.observe(key)
            if failed:
                failed.pop(key, None)

    def locate(self, key: bytes, among: AbstractSet[int] | None = None) -> int | None:
        """The first promoting tier (of ``among``, unless ``None``) that holds ``key``, by its
        local index or a past ``contains``; ``None`` also for a key whose promotion failed
        lately (``RETRY_FAILED_PROMOTIONS_S``)."""
        if self._failed and self.failed_lately(key):
            return None
        known = self.asks.known(key)
        for index, (tier, placement) in enumerate(zip(self.tiers, self.placements, strict=True)):
            if among is not None and index not in among:
                continue
            if placement.promote_on_hit() and (known == index or tier.may_contain(key)):
                if self._paused_until and self._paused(index):
                    self.stats.promotions_refused += 1  # the tier is slow: compute instead
                    continue
                return index
        return None

    def _paused(self, tier: int) -> bool:
        until = self._paused_until.get(tier)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        del self._paused_until[tier]
        return False

    def failed_lately(self, key: bytes) -> bool:
        """Whether a promotion of ``key`` failed less than ``retry_failed_s`` ago."""
        failed_at = self._failed.get(key)
        if failed_at is None:
            return False
        if time.monotonic() - failed_at < self.retry_failed_s:
            return True
        del self._failed[key]
        return False

    def ask(self, key: bytes, among: AbstractSet[int] | None = None) -> bool:
        """A host miss that no tier is known to hold: queue a ``contains`` on the tiers whose
        index is partial; whether the lookup should come back later (``PeerAsks.asking``).
        A key whose promotion failed lately is not asked about: it is a miss; so is one whose
        lookup may not use any partial tier (``among``: the tiers it may use, ``None``: all)."""
        if self._failed and self.failed_lately(key):
            return False
        if among is not None and among.isdisjoint(self.asks.tiers):
            return False
        self.asks.ask_later([key])
        return self.asks.asking(key)

    def check(self, keys: Iterable[bytes]) -> None:
        """Ask the tiers whose index is partial about ``keys`` now, in one ``contains`` each
        (with the checks already queued)."""
        self.asks.ask_later(keys)
        self.asks.flush()

    def forget_failures(self) -> None:
        """Forget failed promotions (the host tier was reset: every key may be tried again)."""
        self._failed.clear()

    # -- moving rows -------------------------------------------------------------------

    def promote(self, tier: int, key: bytes, host_row: memoryview) -> list[bytes]:
        """Queue copying ``key`` up from ``tier`` into ``host_row``; sent with the tier's next
        batch. The keys refused because the tier is saturated (a full batch is sent at once):
        they stay misses, and the caller frees their rows."""
        queue = self._promotions.setdefault(tier, [])
        queue.append((bytes(key), host_row))
        if len(queue) >= PROMOTION_BATCH:
            return self._send_promotions()
        return []

    def send(self) -> list[bytes]:
        """Send queued promotions, one operation per tier (a prefix moves in one request), and
        queued checks, one ``contains`` per partial tier; the keys of promotions refused
        because their tier is saturated (see ``promote``)."""
        refused = self._send_promotions()
        self.asks.flush()
        return refused

    def _send_promotions(self) -> list[bytes]:
        refused: list[bytes] = []
        while self._promotions:
            tier, rows = self._promotions.popitem()
            if self.get(tier, rows) is None:
                refused.extend(key for key, _ in rows)
        return refused

    def spill(
        self, keys: Sequence[bytes], host_row: Callable[[bytes], memoryview], *, on_evict: bool
    ) -> tuple[list[bytes], list[bytes]]:
        """Start copying host rows down to the tiers that take them now (``targets``).

        ``(copying, unwanted)``: one entry of ``copying`` per copy started (the row must stay
        where it is until its result is applied), and the keys no tier takes. A saturated
        tier starts nothing (write-back rows stay dirty and are tried again later).
        """
        by_tier: dict[int, list[bytes]] = {}
        unwanted: list[bytes] = []
        for key in keys:
            targets = self.targets(key, on_evict=on_evict)
            if not targets:
                unwanted.append(key)
            for tier in targets:
                by_tier.setdefault(tier, []).append(key)
        copying: list[bytes] = []
        for tier, tier_keys in by_tier.items():
            if self.put(tier, [(bytes(key), host_row(key)) for key in tier_keys]) is not None:
                copying.extend(tier_keys)
        return copying, unwanted

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

    # -- finished work -----------------------------------------------------------------

    def has_results(self) -> bool:
        """Whether some operation has finished since the last ``finished``."""
        return self.engine.has_results()

    def finished(self) -> list[OpResult]:
        """Finished operations, once the chain has taken its part of each: ``contains``
        answers learned, failed promotions remembered, stats counted, observers told.

        The caller applies promotions (``GET``) and copies down (``PUT``) to its host rows;
        it may ignore ``CONTAINS`` results.
        """
        results = self.engine.drain() if self.engine.has_results() else []
        for result in results:
            if result.kind is OpKind.RELEASE:  # slots of an abandoned get: the caller's to free
                continue
            landed: list[bytes] = []
            failed: list[bytes] = []
            if result.kind is OpKind.GET:
                for key, ok in zip(result.keys, result.ok, strict=True):
                    (landed if ok else failed).append(key)
                self._promotions_finished(landed, failed)
                if failed and not landed and result.seconds >= self.slow_get_s:
                    self._pause(result.tier, result.seconds)
            elif result.kind is OpKind.PUT:
                done = sum(result.ok)
                self.stats.spills_done += done
                self.stats.spills_failed += len(result.ok) - done
            else:
                self.asks.learn(result)
            if self._observers:
                outcome = TierOutcome(
                    result.kind, self.tier_kind(result.tier), result.seconds, landed, failed
                )
                for observer in self._observers:
                    observer(outcome)
        return results

    def _pause(self, tier: int, seconds: float) -> None:
        """``tier`` failed a whole promotion after ``seconds``: no promotions from it for
        ``pause_s`` (``SLOW_TIER_PAUSE_S``; 0: never paused, nor counted as a pause)."""
        if self.pause_s <= 0:
            return
        if tier not in self._paused_until:
            log.warning(
                "%s tier: a promotion failed after %.1f s; promoting nothing from it for %.0f s",
                self.tier_kind(tier),
                seconds,
                self.pause_s,
            )
            self.stats.tier_pauses += 1
        self._paused_until[tier] = time.monotonic() + self.pause_s

    def _promotions_finished(self, landed: list[bytes], failed: list[bytes]) -> None:
        self.stats.promotions_done += len(landed)
        self.stats.promotions_failed += len(failed)
        now = time.monotonic()
        for key in failed:
            self.asks.forget(key)  # do not send the next lookup to the same place
            self._failed[key] = now
            self._failed.move_to_end(key)
        while len(self._failed) > FAILED_PROMOTIONS_KEPT:
            self._failed.popitem(last=False)

    def observe_results(self, observer: TierObserver) -> None:
        """Call ``observer`` with every finished operation, as ``finished`` drains it."""
        self._observers.append(observer)

    def dropped_dirty(self, count: int) -> None:
        """The host tier dropped ``count`` rows before they reached their write-back tier."""
        self.stats.dirty_dropped += count

    def tier_kind(self, tier: int) -> str:
        return self.tiers[tier].kind

    def writes_back(self, tier: int) -> bool:
        """Whether ``tier`` is fed before eviction (a finished copy leaves its rows clean)."""
        return self.placements[tier].copy_down_on_evict()

    # -- the engine --------------------------------------------------------------------

    def inflight(self) -> int:
        """Operations submitted and not yet finished."""
        return self.engine.inflight()

    def wait_idle(self, timeout: float | None) -> bool:
        """Block until no operation is in flight (``True``) or ``timeout`` passes (``False``)."""
        return self.engine.wait_idle(timeout)

    @property
    def rows_converted(self) -> int:
        """Rows converted from another engine's layout as they landed in the host tier."""
        converter = self.engine.converter
        return converter.converted if converter is not None else 0

    def close(self) -> None:
        self.engine.close()


class NoLowerTiers(LowerTierChain):
    """The chain of a host-only stack: nothing below, so nothing is located, asked, moved or
    finished. Its hot-path methods return at once, so a host-only manager calls them
    unconditionally instead of checking for a chain."""

    def __init__(self) -> None:  # no engine, no tiers: nothing of the base class is needed
        self.tiers = []
        self.placements = []
        self.stats = ChainStats()
        self.retry_failed_s = RETRY_FAILED_PROMOTIONS_S
        self.has_write_back = False
        self.has_write_through = False

    def observe(self, key: Hashable) -> None:
        pass

    def computed(self, keys: Iterable[bytes]) -> None:
        pass

    def locate(self, key: bytes, among: AbstractSet[int] | None = None) -> int | None:
        return None

    def failed_lately(self, key: bytes) -> bool:
        return False

    def ask(self, key: bytes, among: AbstractSet[int] | None = None) -> bool:
        return False

    def check(self, keys: Iterable[bytes]) -> None:
        pass

    def forget_failures(self) -> None:
        pass

    def send(self) -> list[bytes]:
        return []

    def has_results(self) -> bool:
        return False

    def finished(self) -> list[OpResult]:
        return []

    def observe_results(self, observer: TierObserver) -> None:
        pass  # nothing below ever finishes

    def inflight(self) -> int:
        return 0

    def wait_idle(self, timeout: float | None) -> bool:
        return True

    @property
    def rows_converted(self) -> int:
        return 0

    def close(self) -> None:
        pass
