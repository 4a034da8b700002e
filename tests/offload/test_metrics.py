"""Prometheus text exposition of kvtier's stats (``offload.metrics``, ``Offloader.metrics_text``)."""

from __future__ import annotations

import re
import urllib.request

import pytest

from offload.api import Offloader
from offload.keys import make_key
from offload.metrics import FAMILIES, Family, Histogram, flat_families, render, serve
from tests.offload.layouts import per_layer_blocks_first


def samples(text: str) -> dict[str, float]:
    """``name{labels}`` -> value, for every sample line of an exposition."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_families_are_rendered_with_help_type_labels_and_total_suffix():
    hits = Family("hits", FAMILIES["hits"])
    hits.add(3, "host")
    hits.add(1, 'di"sk\\')
    rows = Family("rows", FAMILIES["rows"])
    rows.add(2.5, "host")
    text = render([hits, rows])
    assert "# HELP kvtier_hits_total Lookups answered with a readable row, per tier.\n" in text
    assert "# TYPE kvtier_hits_total counter\n" in text
    assert "# TYPE kvtier_rows gauge\n" in text
    assert samples(text) == {
        'kvtier_hits_total{tier="host"}': 3,
        'kvtier_hits_total{tier="di\\"sk\\\\"}': 1,
        'kvtier_rows{tier="host"}': 2.5,
    }
    assert text.endswith("\n")


def test_a_histogram_has_cumulative_buckets_sum_and_count():
    histogram = Histogram(buckets=(0.01, 0.1))
    for value in (0.005, 0.05, 0.05, 3.0):
        histogram.observe(value)
    family = Family("load_latency_seconds", FAMILIES["load_latency_seconds"])
    family.add(histogram, "host")
    got = samples(render([family]))
    assert got == {
        'kvtier_load_latency_seconds_bucket{tier="host",le="0.01"}': 1,
        'kvtier_load_latency_seconds_bucket{tier="host",le="0.1"}': 3,
        'kvtier_load_latency_seconds_bucket{tier="host",le="+Inf"}': 4,
        'kvtier_load_latency_seconds_sum{tier="host"}': pytest.approx(3.105),
        'kvtier_load_latency_seconds_count{tier="host"}': 4,
    }


def test_wrong_label_count_is_an_error():
    with pytest.raises(ValueError, match="expected labels"):
        Family("hits", FAMILIES["hits"]).add(1)


def test_offloader_metrics_count_hits_misses_bytes_and_evictions():
    kv, groups = per_layer_blocks_first()
    row = Offloader(kv, groups).caches.row_bytes(0)
    config = {"tiers": [{"kind": "host", "capacity": 4 * row}]}
    with Offloader(kv, groups, config) as offloader:
        keys = [make_key(f"k{i}".encode().ljust(16, b"."), 0) for i in range(6)]
        offloader.wait([offloader.store(keys[:4], [0, 1, 2, 3])])
        offloader.wait([offloader.store(keys[4:], [4, 5])])  # evicts two
        hit = offloader.lookup(keys[4:])
        offloader.wait([offloader.load(keys[4 : 4 + hit], [7, 8][:hit])])
        assert offloader.lookup([make_key(b"never-stored....", 0)]) == 0
        got = samples(offloader.metrics_text())
    assert hit == 2
    assert got['kvtier_hits_total{tier="host"}'] == 2
    assert got['kvtier_misses_total{tier="host"}'] == 1
    assert got["kvtier_lookups_total"] == 3
    assert got['kvtier_evictions_total{tier="host"}'] == 2
    assert got['kvtier_written_bytes_total{tier="host"}'] == 6 * row
    assert got['kvtier_read_bytes_total{tier="host"}'] == 2 * row
    assert got['kvtier_rows{tier="host"}'] == 4
    assert got['kvtier_capacity_bytes{tier="host"}'] == 4 * row


def test_the_metrics_endpoint_serves_the_text():
    server = serve(0, lambda: "kvtier_lookups_total 7\n")
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert response.read() == b"kvtier_lookups_total 7\n"
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=5)
    finally:
        server.shutdown()
        server.server_close()


def test_every_family_name_is_a_valid_metric_name():
    for name in FAMILIES:
        assert re.fullmatch(r"[a-z_][a-z0-9_]*", name)


def test_a_flat_stats_dict_renders_counters_and_gauges():
    text = render(
        flat_families({"rows_put": 5, "slots": 64, "up": True}, gauges={"slots"}), prefix="kvtier_peer_"
    )
    assert "# TYPE kvtier_peer_rows_put_total counter\n" in text
    assert samples(text) == {"kvtier_peer_rows_put_total": 5, "kvtier_peer_slots": 64}
