"""Which rows do remote peers hold? Background ``contains`` checks and their answers.

A disk tier's index is exact, but a remote peer (or Mooncake Store) also holds what other
engines put, so a key missing from this engine's index may still be there. ``PeerAsks``
queues a ``contains`` for such keys, sends the queue as one request per tier, and
remembers (boundedly) which keys a tier said it holds, so a later lookup can promote them.

Nobody waits for an answer by default: the lookup that asked is a miss, and the answer
serves later requests. With ``lookup_wait_s`` a key stays *being asked* (``asking``) from
its lookup until every asked tier has answered, or that many seconds have passed (a dead
peer is waited for no longer); vLLM's connector then defers the request (``RETRY``) and
looks up the rest of its prefix, so one round trip answers for all of it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from offload.tier_engine import OpResult, TierEngine

KNOWN_KEYS = 1 << 16
"""How many keys found below by ``contains`` (and asked about) are remembered."""


@dataclass
class AskStats:
    checks_asked: int = 0  # keys sent, counted once per tier asked
    checks_found: int = 0  # of those, keys a tier holds


class PeerAsks:
    """``contains`` checks on the engine's tiers ``tiers`` (indices), and what they found."""

    def __init__(
        self,
        engine: TierEngine,
        tiers: Sequence[int],
        next_op_id: Callable[[], int],
        *,
        lookup_wait_s: float = 0.0,
        stats: AskStats | None = None,
    ) -> None:
        if not lookup_wait_s >= 0:
            raise ValueError(f"lookup_wait_s must be >= 0, got {lookup_wait_s!r}")
        self.engine = engine
        self.tiers = list(tiers)
        self._next_op_id = next_op_id
        self.lookup_wait_s = lookup_wait_s if self.tiers else 0.0
        self.stats = stats if stats is not None else AskStats()
        self._known: OrderedDict[bytes, int] = OrderedDict()  # found: key -> tier
        self._asked: OrderedDict[bytes, None] = OrderedDict()  # asked lately: not again
        self._to_ask: dict[bytes, None] = {}
        # Sent and not yet answered by every tier asked: key -> [answers due, give up at].
        self._unanswered: OrderedDict[bytes, list[float]] = OrderedDict()

    def known(self, key: bytes) -> int | None:
        """The tier a past ``contains`` found ``key`` in, if any."""
        return self._known.get(key)

    def forget(self, key: bytes) -> None:
        """A promotion of ``key`` failed: do not send the next lookup to the same place."""
        self._known.pop(key, None)

    def ask_later(self, keys: Iterable[bytes]) -> None:
        """Queue checks for ``keys`` (those not asked lately and not known)."""
        if not self.tiers:
            return
        for key in keys:
            if key not in self._asked and key not in self._known:
                self._to_ask[key] = None

    def flush(self) -> None:
        """Send the queued checks, one ``contains`` per tier."""
        self._expire()
        if not self._to_ask:
            return
        keys = list(self._to_ask)
        self._to_ask.clear()
        for key in keys:
            _remember(self._asked, key, None)
        sent = 0
        for tier in self.tiers:
            if self.engine.submit_contains(self._next_op_id(), tier, keys):
                self.stats.checks_asked += len(keys)
                sent += 1
        if self.lookup_wait_s and sent:
            give_up = time.monotonic() + self.lookup_wait_s
            for key in keys:
                self._unanswered[key] = [sent, give_up]
                self._unanswered.move_to_end(key)

    def asking(self, key: bytes) -> bool:
        """Whether a lookup of ``key`` should come back later: with ``lookup_wait_s``, while a
        check of it is queued, or sent and unanswered for less than that. Without it, never."""
        if not self.lookup_wait_s:
            return False
        if key in self._to_ask:
            return True
        pending = self._unanswered.get(key)
        if pending is None:
            return False
        if time.monotonic() < pending[1]:
            return True
        del self._unanswered[key]
        return False

    def waiting(self) -> bool:
        """Whether some check is queued or still awaited (a lookup may be waiting on it)."""
        self._expire()
        return bool(self._to_ask or self._unanswered)

    def learn(self, result: OpResult) -> None:
        """Take a ``contains`` answer: remember the keys found; a key every asked tier has
        answered is no longer being asked."""
        unanswered = self._unanswered
        for key, found in zip(result.keys, result.ok, strict=True):
            key = bytes(key)
            if found:
                _remember(self._known, key, result.tier)
                self.stats.checks_found += 1
            pending = unanswered.get(key)
            if pending is not None:
                pending[0] -= 1
                if pending[0] <= 0:
                    del unanswered[key]

    def _expire(self) -> None:
        """Forget checks past their wait (in send order), so the table stays bounded."""
        now = time.monotonic()
        unanswered = self._unanswered
        while unanswered:
            key, (_, give_up) = next(iter(unanswered.items()))
            if give_up > now:
                break
            del unanswered[key]


def _remember(table: OrderedDict, key: bytes, value: object) -> None:
    table[key] = value
    table.move_to_end(key)
    if len(table) > KNOWN_KEYS:
        table.popitem(last=False)
