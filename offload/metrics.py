"""kvtier's metrics: per-tier counters read from a manager, latency histograms, Prometheus text.

One table (``FAMILIES``) names every metric once, with its type, help and label names; the
vLLM adapter (``offload.vllm.metrics``) reports the same families through vLLM's connector
stats, and ``render`` writes them in the Prometheus text exposition format (version 0.0.4)
for ``Offloader.metrics_text`` and a ``--metrics-port`` endpoint (``serve``). No
dependency: the format is a few lines of text.

Per tier (label ``tier``: ``host``, ``disk``, ``remote``, ``mooncake``):

- ``hits`` / ``misses``: host lookups that found a readable row / found nothing (a lookup
  that starts a promotion is neither); for a lower tier, rows its ``get`` served / missed.
- ``read_bytes`` / ``written_bytes``: rows read out of / written into the tier, times the
  row size (host: loads to and stores from the device; a lower tier: promotions and
  spills).
- ``evictions``, ``rows`` and ``capacity_bytes``.

Latency (``load_latency_seconds`` / ``store_latency_seconds``, histograms per tier) is
measured by whoever sees both ends of a transfer and kept in a ``Histogram``.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from offload.manager import HostTierManager

log = logging.getLogger(__name__)

PREFIX = "kvtier_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Seconds: a host copy takes well under a millisecond per block, a remote one up to the deadline."""


@dataclass(frozen=True)
class FamilySpec:
    kind: str  # "counter", "gauge" or "histogram"
    help: str
    labels: tuple[str, ...] = ()


FAMILIES: dict[str, FamilySpec] = {
    "lookups": FamilySpec("counter", "Host-tier lookups (one per block key)."),
    "hits": FamilySpec("counter", "Lookups answered with a readable row, per tier.", ("tier",)),
    "misses": FamilySpec("counter", "Lookups that found no row, per tier.", ("tier",)),
    "read_bytes": FamilySpec("counter", "Bytes read out of a tier (host: to the device).", ("tier",)),
    "written_bytes": FamilySpec("counter", "Bytes written into a tier (host: from the device).", ("tier",)),
    "evictions": FamilySpec("counter", "Rows evicted from a tier.", ("tier",)),
    "rejected_stores": FamilySpec(
        "counter", "Host stores refused: every row that could make room is in use."
    ),
    "lookup_retries": FamilySpec(
        "counter", "Host-tier lookups told to come back while peers were asked (lookup_wait_s)."
    ),
    "promotions": FamilySpec(
        "counter",
        "Rows copied up from a lower tier into the host tier, by result (refused: lookups left"
        " misses, promotions at their bound or the tier saturated).",
        ("result",),
    ),
    "spills": FamilySpec(
        "counter",
        "Rows copied down from the host tier, by result (dropped: copies at their bound;"
        " evicted_dirty: write-back rows evicted before they reached their tier).",
        ("result",),
    ),
    "inflight_rows": FamilySpec(
        "gauge", "Host rows promoting (promote) or being copied down (spill) now.", ("op",)
    ),
    "tier_pauses": FamilySpec(
        "counter", "Times a lower tier's promotions were paused: one failed whole after half its deadline."
    ),
    "inflight_rows_max": FamilySpec(
        "gauge", "The bound on inflight_rows: past it lookups miss and copies down are dropped.", ("op",)
    ),
    "rows": FamilySpec("gauge", "Rows a tier holds now.", ("tier",)),
    "capacity_bytes": FamilySpec("gauge", "Bytes a tier may hold.", ("tier",)),
    "load_latency_seconds": FamilySpec(
        "histogram", "Seconds from the start of a load out of a tier until its rows landed.", ("tier",)
    ),
    "store_latency_seconds": FamilySpec(
        "histogram", "Seconds from the start of a store into a tier until it completed.", ("tier",)
    ),
}


class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics); thread-safe."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    @classmethod
    def from_counts(cls, buckets: Sequence[float], counts: Sequence[int], total: float) -> Histogram:
        """A histogram holding observations already bucketed elsewhere: ``counts[i]`` of them
        in bucket ``i`` of ``buckets`` (sorted; the last count: above every bound), summing to
        ``total`` (e.g. a peer's, which ``tiers/`` keeps without this class)."""
        histogram = cls(buckets)
        if histogram.buckets != tuple(buckets) or len(counts) != len(buckets) + 1:
            raise ValueError(f"{len(counts)} counts for {len(buckets)} sorted buckets (and +Inf)")
        histogram._counts = list(counts)
        histogram._sum = total
        return histogram

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value

    @property
    def count(self) -> int:
        return sum(self._counts)

    @property
    def sum(self) -> float:
        return self._sum

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations <= bound)`` for every bucket and ``+Inf``."""
        with self._lock:
            counts = list(self._counts)
        total, out = 0, []
        for bound, count in zip((*self.buckets, math.inf), counts, strict=True):
            total += count
            out.append((bound, total))
        return out


Value = float | Histogram


@dataclass
class Family:
    """One metric: its name (without ``PREFIX``), spec and samples ``(labels, value)``."""

    name: str
    spec: FamilySpec
    samples: list[tuple[tuple[str, ...], Value]] = field(default_factory=list)

    def add(self, value: Value, *labels: str) -> None:
        if len(labels) != len(self.spec.labels):
            raise ValueError(f"{self.name}: expected labels {self.spec.labels}, got {labels}")
        self.samples.append((tuple(labels), value))


def manager_families(
    manager: HostTierManager,
    row_bytes: int,
    *,
    latency: Mapping[tuple[str, str], Histogram] | None = None,
) -> list[Family]:
    """The per-tier counters and gauges of ``manager`` (and latency histograms, if given).

    ``row_bytes`` is the size of one host row (bytes are rows times that). ``latency`` maps
    ``("load" | "store", tier)`` to its histogram.
    """
    families = {name: Family(name, spec) for name, spec in FAMILIES.items()}
    stats = manager.stats
    families["lookups"].add(stats.lookups)
    families["hits"].add(stats.hits, "host")
    families["misses"].add(max(0, stats.lookups - stats.hits - stats.pending - stats.retries), "host")
    families["read_bytes"].add(stats.loaded_rows * row_bytes, "host")
    families["written_bytes"].add(stats.stored_rows * row_bytes, "host")
    families["evictions"].add(stats.evictions, "host")
    families["rejected_stores"].add(stats.rejected_stores)
    families["lookup_retries"].add(stats.retries)
    families["rows"].add(len(manager), "host")
    families["capacity_bytes"].add(manager.slots_per_group * manager.num_groups * row_bytes, "host")
    lower = manager.lower
    if lower.tiers:
        chain = lower.stats
        families["promotions"].add(chain.promotions_done, "done")
        families["promotions"].add(chain.promotions_failed, "failed")
        families["spills"].add(chain.spills_done, "done")
        families["spills"].add(chain.spills_failed, "failed")
        families["spills"].add(chain.spills_refused, "refused")
        families["spills"].add(chain.spills_dropped, "dropped")
        families["spills"].add(chain.dirty_dropped, "evicted_dirty")
        families["promotions"].add(chain.promotions_refused, "refused")
        families["tier_pauses"].add(chain.tier_pauses)
        families["inflight_rows"].add(manager.promoting_rows(), "promote")
        families["inflight_rows"].add(manager.spilling_rows(), "spill")
        families["inflight_rows_max"].add(manager.max_promoting_rows, "promote")
        families["inflight_rows_max"].add(manager.max_spilling_rows, "spill")
        for tier in lower.tiers:
            tier_stats = tier.stats()
            kind = tier.kind
            families["hits"].add(tier_stats.get("hits", 0), kind)
            families["misses"].add(tier_stats.get("misses", 0), kind)
            families["read_bytes"].add(tier_stats.get("hits", 0) * row_bytes, kind)
            families["written_bytes"].add(tier_stats.get("stored", 0) * row_bytes, kind)
            families["evictions"].add(tier_stats.get("evictions", 0), kind)
            if "rows" in tier_stats:
                families["rows"].add(tier_stats["rows"], kind)
            if "capacity_bytes" in tier_stats:
                families["capacity_bytes"].add(tier_stats["capacity_bytes"], kind)
    for (op, tier), histogram in sorted((latency or {}).items()):
        families[f"{op}_latency_seconds"].add(histogram, tier)
    return [family for family in families.values() if family.samples]


def flat_families(stats: Mapping[str, float], *, gauges: Iterable[str] = (), help: str = "") -> list[Family]:
    """Families for a flat stats dict (a tier's or a peer's ``stats()``): every key a counter
    unless named in ``gauges`` (sizes and levels, not totals)."""
    gauge_names = set(gauges)
    families = []
    for name, value in sorted(stats.items()):
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        kind = "gauge" if name in gauge_names else "counter"
        family = Family(name, FamilySpec(kind, help or name.replace("_", " ")))
        family.add(value)
        families.append(family)
    return families


def render(families: Iterable[Family], prefix: str = PREFIX) -> str:
    """The Prometheus text exposition (0.0.4) of ``families``."""
    lines: list[str] = []
    for family in families:
        name = prefix + family.name + ("_total" if family.spec.kind == "counter" else "")
        lines.append(f"# HELP {name} {_escape_help(family.spec.help)}")
        lines.append(f"# TYPE {name} {family.spec.kind}")
        for labels, value in family.samples:
            pairs = list(zip(family.spec.labels, labels, strict=True))
            if isinstance(value, Histogram):
                for bound, count in value.cumulative():
                    le = "+Inf" if math.isinf(bound) else _number(bound)
                    lines.append(f"{name}_bucket{_labels([*pairs, ('le', le)])} {count}")
                lines.append(f"{name}_sum{_labels(pairs)} {_number(value.sum)}")
                lines.append(f"{name}_count{_labels(pairs)} {value.count}")
            else:
                lines.append(f"{name}{_labels(pairs)} {_number(value)}")
    return "\n".join(lines) + "\n"


def serve(
    port: int,
    collect: Callable[[], str],
    host: str = "127.0.0.1",
    *,
    health: Callable[[], bool] | None = None,
) -> ThreadingHTTPServer:
    """Serve ``collect()`` at ``http://host:port/metrics`` (and ``/``) from a daemon thread;
    returns the server (``shutdown()`` stops it). ``port=0`` picks a free port
    (``server.server_address``). With ``health``, ``/health`` answers 200 ``ok`` while it
    returns true and 503 otherwise (or if it raises)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/health" and health is not None:
                self._health()
                return
            if path not in ("/metrics", "/"):
                self.send_error(404)
                return
            try:
                body = collect().encode()
            except Exception:
                log.exception("collecting metrics failed")
                self.send_error(500)
                return
            self._answer(200, CONTENT_TYPE, body)

        def _health(self) -> None:
            assert health is not None
            try:
                ok = bool(health())
            except Exception:
                log.debug("health check failed", exc_info=True)
                ok = False
            self._answer(200 if ok else 503, "text/plain; charset=utf-8", b"ok\n" if ok else b"unavailable\n")

        def _answer(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("metrics: " + format, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="kvtier-metrics", daemon=True).start()
    log.info("metrics at http://%s:%d/metrics", host, server.server_address[1])
    return server


def _labels(pairs: Sequence[tuple[str, str]]) -> str:
    if not pairs:
        return ""
    inner = ",".join(f'{key}="{_escape_label(value)}"' for key, value in pairs)
    return "{" + inner + "}"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
