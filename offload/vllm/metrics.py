"""kvtier's metrics through vLLM's connector stats (``vllm:kv_offload_kvtier_*``).

The families are ``offload.metrics.FAMILIES`` (per-tier hits, misses, bytes, evictions,
rows, capacity; load and store latency). vLLM asks the manager for stats once per logging
interval (``get_stats``); counters are reported as the increase since the last report,
gauges as the value now, histograms as the observations since the last report. vLLM's
Prometheus endpoint then exports them (a counter gains ``_total``), labelled per engine
and per ``tier``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)

from offload.metrics import FAMILIES, LATENCY_BUCKETS, Family, Histogram

VLLM_PREFIX = "vllm:kv_offload_kvtier_"


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """What ``KVTierOffloadingSpec.build_metric_definitions`` declares to vLLM."""
    definitions: dict[str, OffloadingMetricMetadata] = {}
    for name, spec in FAMILIES.items():
        full = VLLM_PREFIX + name
        if spec.kind == "counter":
            definitions[full] = OffloadingCounterMetadata(spec.help, spec.labels)
        elif spec.kind == "gauge":
            definitions[full] = OffloadingGaugeMetadata(spec.help, spec.labels)
        else:
            definitions[full] = OffloadingHistogramMetadata(spec.help, spec.labels, LATENCY_BUCKETS)
    return definitions


class LatencyRecorder:
    """Latency observations per ``(op, tier)``: cumulative histograms for the Prometheus text,
    and the samples not yet handed to vLLM. Thread-safe (the tier engine's thread records)."""

    def __init__(self) -> None:
        self.histograms: dict[tuple[str, str], Histogram] = {}
        self._pending: dict[tuple[str, str], list[float]] = {}
        self._lock = threading.Lock()

    def observe(self, op: str, tier: str, seconds: float) -> None:
        key = (op, tier)
        with self._lock:
            histogram = self.histograms.get(key)
            if histogram is None:  # not setdefault: that built a Histogram per observation
                histogram = self.histograms[key] = Histogram()
            histogram.observe(seconds)
            pending = self._pending.get(key)
            if pending is None:
                self._pending[key] = [seconds]
            else:
                pending.append(seconds)

    def take(self) -> dict[tuple[str, str], list[float]]:
        with self._lock:
            pending, self._pending = self._pending, {}
        return pending


class StatsReporter:
    """Turns snapshots of kvtier's families into vLLM stats payloads (counter increases)."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, tuple[str, ...]], float] = {}

    def report(
        self, families: Sequence[Family], latency: dict[tuple[str, str], list[float]]
    ) -> OffloadingConnectorStats:
        stats = OffloadingConnectorStats()
        for family in families:
            name = VLLM_PREFIX + family.name
            for labels, value in family.samples:
                if isinstance(value, Histogram):
                    continue  # reported from the pending observations below
                if family.spec.kind == "gauge":
                    stats.set_gauge(name, value, labels)
                    continue
                last = self._last.get((family.name, labels), 0)
                self._last[(family.name, labels)] = value
                if value > last:
                    stats.increase_counter(name, value - last, labels)
        for (op, tier), samples in latency.items():
            for seconds in samples:
                stats.observe_histogram(f"{VLLM_PREFIX}{op}_latency_seconds", seconds, (tier,))
        return stats
