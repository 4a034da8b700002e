"""A ``kvtier peer``'s metrics (Prometheus names ``kvtier_peer_*``), from a ``PeerSnapshot``.

``kvtier peer --metrics-port`` serves them (``offload.cli``); the peer itself, in ``tiers/``,
only keeps the numbers (``tiers.remote.peer_metrics``), since ``tiers/`` never imports
``offload/``. The families:

- the pool's figures (``PeerPool.stats()``), each under its own name as before: gauges
  ``POOL_GAUGES`` (``slots``, ``rows``, ``free_slots``, ...), every other one a counter
  (``rows_put``, ``rows_hit``, ``rows_missed``, ``evictions``, ...);
- ``PEER_FAMILIES``: bytes held and capacity, tenants (with ``tenant`` labels where the
  peer has a token file), connections, transfers (``op`` = ``put``: the peer's READs;
  ``get``: its WRITEs), their bytes and seconds, refusals by ``reason``, failed transfers.
"""

from __future__ import annotations

from offload.metrics import Family, FamilySpec, Histogram
from tiers.remote.peer_metrics import LatencyRecord, PeerSnapshot

PREFIX = "kvtier_peer_"

POOL_GAUGES = frozenset(
    {"slots", "slot_bytes", "rows", "free_slots", "pending_slots", "retired_slots", "leases"}
)
"""Pool figures that are levels; the others count since the peer started."""

TENANT_GAUGES = frozenset(
    {"slots", "slot_bytes", "quota_slots", "used_slots", "rows", "pending_slots", "leases"}
)
"""A tenant's figures (``PeerPool.stats(tenant)``) that are levels; its counters are the
pool's counters, for that tenant alone (``tenant_rows_hit``, ...)."""

REFUSAL_REASONS = {
    "auth_failed": "auth_failures",  # no valid handshake in time, or a wrong token (pushed out too)
    "agent_refused": "agents_refused",
    "protocol_error": "protocol_errors",
    "pushed_out": "pushed_out",
    "limit": "limit_refusals",
    "connection_cap": "connections_refused",  # over --max-connections or the tenant's cap
    "request_bound": "requests_refused",  # repeated keys, --max-request-bytes, the tenant's share
    "idle": "idle_closed",  # closed after --idle-timeout
}
"""``refusals`` label ``reason`` -> the server's counter."""

PEER_FAMILIES: dict[str, FamilySpec] = {
    "capacity_bytes": FamilySpec("gauge", "Bytes of the pool's slots."),
    "used_bytes": FamilySpec(
        "gauge", "Bytes of slots not free (rows stored, puts in flight, rows still read)."
    ),
    "tenants": FamilySpec(
        "gauge", "Tenants of the token file (0 without one: tenants are namespaces there)."
    ),
    "tenant_rows": FamilySpec("gauge", "Rows a tenant has stored.", ("tenant",)),
    "tenant_used_bytes": FamilySpec("gauge", "Bytes of slots a tenant holds.", ("tenant",)),
    "tenant_quota_bytes": FamilySpec("gauge", "Bytes of slots a tenant may hold.", ("tenant",)),
    "connections_open": FamilySpec("gauge", "Authenticated connections now."),
    "connections": FamilySpec("counter", "Connections that authenticated."),
    "transfers": FamilySpec(
        "counter", "PUTs (op=put: the peer's READs) and GETs (op=get: its WRITEs) answered.", ("op",)
    ),
    "transfer_bytes": FamilySpec(
        "counter", "Bytes of rows moved: READ for puts, WRITTEN and verified for gets.", ("op",)
    ),
    "transfer_seconds": FamilySpec(
        "histogram",
        "Seconds from a PUT or GET request to the peer's answer (a put's commit not in it).",
        ("op",),
    ),
    "refusals": FamilySpec("counter", "Connections or requests refused, by reason.", ("reason",)),
    "transfers_failed": FamilySpec(
        "counter", "PUTs and GETs whose READ or WRITE failed or ran late (their connection closed)."
    ),
}


def peer_families(snapshot: PeerSnapshot) -> list[Family]:
    """Every ``kvtier_peer_`` family of ``snapshot`` (the prefix is ``render``'s)."""
    families = _pool_families(snapshot)
    own = {name: Family(name, spec) for name, spec in PEER_FAMILIES.items()}
    pool = snapshot.pool
    slot_bytes = pool.get("slot_bytes", 0)
    own["capacity_bytes"].add(pool.get("slots", 0) * slot_bytes)
    own["used_bytes"].add((pool.get("slots", 0) - pool.get("free_slots", 0)) * slot_bytes)
    own["tenants"].add(len(snapshot.tenants))
    for tenant, stats in snapshot.tenants.items():
        own["tenant_rows"].add(stats.get("rows", 0), tenant)
        own["tenant_used_bytes"].add(stats.get("used_slots", 0) * slot_bytes, tenant)
        own["tenant_quota_bytes"].add(stats.get("quota_slots", 0) * slot_bytes, tenant)
    counters = snapshot.counters
    own["connections_open"].add(snapshot.open_connections)
    own["connections"].add(counters.get("connections", 0))
    transfers = snapshot.transfers
    own["transfers"].add(transfers.puts, "put")
    own["transfers"].add(transfers.gets, "get")
    own["transfer_bytes"].add(transfers.put_bytes, "put")
    own["transfer_bytes"].add(transfers.get_bytes, "get")
    own["transfer_seconds"].add(_histogram(transfers.put_seconds), "put")
    own["transfer_seconds"].add(_histogram(transfers.get_seconds), "get")
    for reason, counter in REFUSAL_REASONS.items():
        own["refusals"].add(counters.get(counter, 0), reason)
    own["transfers_failed"].add(counters.get("transfers_failed", 0))
    families += [family for family in own.values() if family.samples]
    return families + _tenant_counter_families(snapshot)


def _pool_families(snapshot: PeerSnapshot) -> list[Family]:
    """The pool's figures under their own names (gauges or counters)."""
    families = []
    for name, value in sorted(snapshot.pool.items()):
        if name in PEER_FAMILIES or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        kind = "gauge" if name in POOL_GAUGES else "counter"
        family = Family(name, FamilySpec(kind, f"The pool's {name.replace('_', ' ')}."))
        family.add(value)
        families.append(family)
    return families


def _tenant_counter_families(snapshot: PeerSnapshot) -> list[Family]:
    """``tenant_<counter>`` per counter of a tenant's stats, labelled by tenant."""
    families: dict[str, Family] = {}
    for tenant, stats in snapshot.tenants.items():
        for name, value in sorted(stats.items()):
            if name in TENANT_GAUGES or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            family = families.get(name)
            if family is None:
                spec = FamilySpec("counter", f"A tenant's {name.replace('_', ' ')}.", ("tenant",))
                family = families[name] = Family(f"tenant_{name}", spec)
            family.add(value, tenant)
    return list(families.values())


def _histogram(record: LatencyRecord) -> Histogram:
    return Histogram.from_counts(record.buckets, record.counts, record.sum)
