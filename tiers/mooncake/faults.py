"""What the Mooncake tier does about one storage host that stops answering, and about rows it drops.

A Mooncake Store spreads objects over the segments its clients mount; a get or put moves
bytes straight to or from the client that holds the segment (the *storage host*, named by
its transfer endpoint ``ip:port``). When one such host stops (SIGSTOP), loses its link or
slows, the store's call for its objects waits on Mooncake's own timeouts: 30 s with no
progress on a TCP session, 60 s for a transfer batch (issue #20 measured a get held 42 s
with ``deadline_s = 2``). Three things keep that from reaching the engine:

- ``bound_store_timeouts``: Mooncake's TCP transport reads ``MC_TCP_PROGRESS_TIMEOUT_SEC``
  and ``MC_TCP_STATUS_TIMEOUT_SEC`` (whole seconds, default 30); set from the deadline
  (unless the operator set them), a call stuck on a stopped or cut-off host ends within a
  few seconds (measured with 1 s: a get of objects on a SIGSTOPped ``mooncake_client``
  failed ``-800`` after 2-3 s, a put after 3-4 s), so the tier's threads are not held for a
  minute. Process-wide, read by Mooncake when a session starts: the first tier sets them,
  before its ``setup`` (``setenv`` is not safe beside another thread's ``getenv``: an
  operator who sets them before the process starts avoids even that first write).
- The tier returns at its deadline anyway (``tiers.mooncake.tier``), and then asks the
  master a cheap question (where the late call's objects live). No answer: the master is
  down. An answer: the master is fine, and the hosts holding those objects are
  ``SuspectHosts`` for a backoff: gets skip objects held only there (misses, counted),
  instead of waiting on them again. A host comes back when its backoff ends.
- ``DropLog``: a row a put could not place is counted by reason in ``MooncakeStats`` and
  logged, at most once per ``interval_s`` with the counts since the last line, so a full
  store cannot flood the log and no drop is silent.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable

from tiers.shared import Backoff

log = logging.getLogger(__name__)

STORE_TIMEOUT_VARIABLES = ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")


def bound_store_timeouts(deadline_s: float) -> dict[str, str]:
    """Set Mooncake's TCP timeouts to ``max(1, floor(deadline_s / 2))`` s where the process
    environment does not set them already; what they are now. Call before the store's ``setup``."""
    seconds = str(max(1, math.floor(deadline_s / 2)))
    for name in STORE_TIMEOUT_VARIABLES:
        if name not in os.environ:
            os.environ[name] = seconds
            log.info("mooncake tier: %s = %s (from deadline_s = %.1f)", name, seconds, deadline_s)
    return {name: os.environ[name] for name in STORE_TIMEOUT_VARIABLES}


def replica_hosts(descriptors: dict[str, list]) -> dict[str, set[str]]:
    """Object name -> transport endpoints of its memory replicas, from the store's
    ``batch_get_replica_desc`` answer (objects it does not know are left out)."""
    hosts: dict[str, set[str]] = {}
    for name, replicas in descriptors.items():
        endpoints = set()
        for replica in replicas:
            if replica.is_memory_replica():
                endpoints.add(replica.get_memory_descriptor().buffer_descriptor.transport_endpoint)
        if endpoints:
            hosts[name] = endpoints
    return hosts


class SuspectHosts:
    """Storage hosts a call overran on, each until its backoff ends (doubling per repeat).

    Used on the event loop (a get takes an ``active`` snapshot to its store thread); the
    lock is for readers on other threads (``MooncakeTier.suspect_hosts``).
    """

    def __init__(self, backoff: Backoff) -> None:
        self._backoff = backoff
        self._until: dict[str, float] = {}
        self._strikes: Counter[str] = Counter()
        self._lock = threading.Lock()

    def suspect(self, hosts: Iterable[str]) -> float:
        """Mark ``hosts``; the longest rest given (s). A host whose last rest ended more than
        the longest rest ago starts from one strike again."""
        longest = 0.0
        now = time.monotonic()
        with self._lock:
            for host in hosts:
                if self._until.get(host, now) + self._backoff.max_s < now:
                    self._strikes[host] = 0
                self._strikes[host] += 1
                self._until[host] = self._backoff.retry_at(self._strikes[host])
                longest = max(longest, self._until[host] - time.monotonic())
        return longest

    def active(self) -> frozenset[str]:
        """The hosts still resting now (those whose rest ended are tried again)."""
        now = time.monotonic()
        with self._lock:
            return frozenset(host for host, until in self._until.items() if until > now)


class DropLog:
    """Rows a put could not place, by reason, logged at most once per ``interval_s``."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._pending: Counter[str] = Counter()
        self._next_at = 0.0

    def add(self, reasons: Counter[str], rows: int) -> None:
        """Book a put's drops (``reasons``: rows per reason) out of its ``rows``."""
        if not reasons:
            return
        self._pending.update(reasons)
        now = time.monotonic()
        if now < self._next_at:
            return
        self._next_at = now + self.interval_s
        summary = ", ".join(f"{count} {reason}" for reason, count in sorted(self._pending.items()))
        log.warning(
            "mooncake tier: rows not stored since the last report: %s (the latest put: %d of %d)",
            summary,
            sum(reasons.values()),
            rows,
        )
        self._pending.clear()
