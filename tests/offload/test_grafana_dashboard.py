"""``docs/grafana/kvtier.json``: it loads, and every panel's query names only metrics kvtier
exports, as read off real renders: an ``Offloader``'s ``metrics_text()`` (host and disk
tiers), vLLM's names for the same families, and a real peer's ``/metrics``."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from offload.api import Offloader
from offload.keys import make_key
from offload.metrics import FAMILIES, Histogram, manager_families, render
from offload.peer_metrics import PEER_FAMILIES
from tests.offload.layouts import per_layer_blocks_first
from tests.offload.test_api import host_and_disk
from tests.offload.test_peer_metrics import start_monitored_peer
from tests.tiers.peer_fixtures import ROOT

DASHBOARD = ROOT / "docs" / "grafana" / "kvtier.json"
ENGINE_PREFIXES = ("kvtier_", "vllm:kv_offload_kvtier_")
PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
}


def panels(items: list[dict]) -> Iterator[dict]:
    for panel in items:
        if panel.get("type") == "row":
            yield from panels(panel.get("panels", []))
        else:
            yield panel


def queries(dashboard: dict) -> list[str]:
    """Every PromQL of the dashboard: its panels' targets and its query variables."""
    exprs = []
    for panel in panels(dashboard["panels"]):
        targets = panel.get("targets", [])
        assert targets and all(t.get("expr") for t in targets), f"panel {panel['title']!r} has no query"
        exprs += [t["expr"] for t in targets]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (not its functions, labels or keywords)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\blabel_values\(\s*([a-zA-Z_:][\w:]*)\s*,[^)]*\)", r"(\1)", expr)  # Grafana's
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][\w:]*", expr):
        rest = expr[match.end() :].lstrip()
        if rest.startswith("(") or match.group() in PROMQL_WORDS:
            continue  # a function or an operator
        names.add(match.group())
    return names


def exported(text: str) -> set[str]:
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines() if line and line[0] != "#"}


def substituted(expr: str, engine: str) -> str:
    return (
        expr.replace("${engine}", engine)
        .replace("$__rate_interval", "5m")
        .replace("${peer}", ".*")
        .replace("$peer", ".*")
    )


@pytest.fixture(scope="module")
def engine_names(tmp_path_factory) -> set[str]:
    """The names an engine's kvtier exports: ``Offloader.metrics_text()`` with a host and a
    disk tier, and the latency histograms the vLLM connector adds to the same families
    (``manager_families(..., latency=...)``, as ``ManagerAdapter.metrics_text`` renders)."""
    kv, groups = per_layer_blocks_first()
    row = Offloader(kv, groups).caches.row_bytes(0)
    config = host_and_disk(tmp_path_factory.mktemp("engine"), 8 * row)
    with Offloader(kv, groups, config) as offloader:
        keys = [make_key(f"g{i}".encode().ljust(16, b"."), 0) for i in range(4)]
        offloader.wait([offloader.store(keys, [0, 1, 2, 3])])
        offloader.wait_tiers()
        names = exported(offloader.metrics_text())
        latency = {(op, tier): Histogram() for op in ("load", "store") for tier in ("host", "disk")}
        names |= exported(render(manager_families(offloader.manager, row, latency=latency)))
    return names


@pytest.fixture(scope="module")
def vllm_names() -> set[str]:
    """vLLM's names for kvtier's families: its Prometheus metrics built from the definitions
    the connector declares (``OffloadPromMetrics._create_metric``'s classes and arguments),
    rendered by prometheus_client."""
    pytest.importorskip("vllm")
    prometheus = pytest.importorskip("prometheus_client")
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata

    from offload.vllm.metrics import metric_definitions

    registry = prometheus.CollectorRegistry()
    for name, metadata in metric_definitions().items():
        labels = list(metadata.labelnames)
        if isinstance(metadata, OffloadingCounterMetadata):
            metric = prometheus.Counter(name, metadata.documentation, labels, registry=registry)
        elif isinstance(metadata, OffloadingGaugeMetadata):
            metric = prometheus.Gauge(name, metadata.documentation, labels, registry=registry)
        else:
            metric = prometheus.Histogram(
                name, metadata.documentation, labels, registry=registry, buckets=metadata.buckets
            )
        if labels:
            metric.labels(*["x"] * len(labels))
    return exported(prometheus.generate_latest(registry).decode())


@pytest.fixture(scope="module")
def peer_names(tmp_path_factory) -> set[str]:
    peer = start_monitored_peer(tmp_path_factory.mktemp("peer"))
    try:
        return exported(peer.get("/metrics")[1])
    finally:
        peer.proc.kill()
        peer.proc.wait(timeout=20)
        assert peer.proc.stdout is not None
        peer.proc.stdout.close()


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_dashboard_loads_with_unique_panel_ids_and_an_engine_prefix_per_source():
    dashboard = load()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    engine = next(v for v in dashboard["templating"]["list"] if v["name"] == "engine")
    assert tuple(sorted(o["value"] for o in engine["options"])) == ENGINE_PREFIXES
    assert all("${engine}" in e for e in queries(dashboard) if "kvtier_peer_" not in e)


@pytest.mark.multiprocess
def test_every_query_names_only_metrics_kvtier_exports(engine_names, peer_names):
    exprs = queries(load())
    for expr in exprs:
        names = metric_names(substituted(expr, "kvtier_"))
        assert names, f"no metric in {expr!r}"
        unknown = names - engine_names - peer_names
        assert not unknown, f"{expr!r} names {sorted(unknown)}, which kvtier does not export"


def test_every_engine_query_names_metrics_vllm_exports_for_kvtier(vllm_names):
    for expr in queries(load()):
        if "${engine}" in expr:
            unknown = metric_names(substituted(expr, "vllm:kv_offload_kvtier_")) - vllm_names
            assert not unknown, f"{expr!r} names {sorted(unknown)}, which vLLM does not export"


def test_every_family_has_a_panel():
    """A family added to ``FAMILIES`` or ``PEER_FAMILIES`` needs a panel here too."""
    used = set().union(*(metric_names(substituted(e, "kvtier_")) for e in queries(load())))
    bases = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in used}
    for name in FAMILIES:
        assert "kvtier_" + name in bases, f"engine family {name!r} has no panel in {DASHBOARD.name}"
    for name in PEER_FAMILIES:
        assert "kvtier_peer_" + name in bases, f"peer family {name!r} has no panel in {DASHBOARD.name}"
