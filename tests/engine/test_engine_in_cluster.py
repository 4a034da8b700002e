"""A real vLLM engine (the CPU build, the tiny model) whose remote tier is ``kvtier peer``\\ s on
other simulated hosts (network namespaces on a bridge, ``bench/cluster_net.py``).

The engine runs in this machine's namespace, at the cluster's ``10.77.K.1``; it is a child
process started after the cluster exists (UCX reads the routing table once per process).
kvtier sets its UCX variables from the peers' addresses (``UCX_TLS`` without shared memory,
``UCX_NET_DEVICES`` the engine's veth on the bridge), so rows cross the peers' links: with
``UCX_TLS=all`` instead, the same 37 rows came back from the peers with under 2 KB on each
link (shared memory, as between processes of one host; 2026-11-26).

- A prefix reset out of vLLM's device cache and kvtier's host tier comes back from three
  peers, token- and logprob-exact against the engine's own device prefix cache, and its rows
  went over each peer's link both ways (``Cluster.wire_bytes``).
- Four peers; one after another fails after a document's rows went in (killed, stopped, cut
  off), the victim a peer whose first block of the document comes after at least
  ``MIN_SPLIT`` blocks held by others. The next request of the document finishes within the
  time of the same request without a fault plus the remote deadline plus ``SLACK_S``; the
  blocks before the victim's first come from the healthy peers and the rest is recomputed,
  token- and logprob-exact against the same split served by vLLM's device cache; every
  healthy peer's row of the document was promoted, every one of the victim's failed; the
  engine's log names the victim and no peer that has not failed.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.fixtures import ucx_from_the_peers  # noqa: F401 (autouse: kvtier sets UCX from the peers)
from tests.engine.conftest import document
from tests.engine.test_real_engine import (
    BLOCK,
    DOC,
    FULL_BLOCKS,
    ROWS,
    assert_another_document_differs,
    assert_exact,
    cold_and_reference,
    wait_spilled,
)
from tiers.remote import net_iface

pytestmark = pytest.mark.multiprocess

PEERS = 3
DEADLINE_S = 1.0
SLACK_S = 2.0  # scheduler steps while the request waits, and the noise of two shared cores
FAULTS_IN_TURN = ("killed", "stopped", "cut")  # each on another peer; one more peer stays healthy
MIN_SPLIT = 4  # blocks before the victim's first: rows the healthy peers must serve


def remote_config(cluster: Any) -> dict[str, Any]:
    """The host tier, then the cluster's peers written through (every stored row goes down)."""
    peers = [host.peer_address() for host in cluster.hosts]
    remote = {"kind": "remote", "peers": peers, "capacity": "128MiB", "placement": "write-through"}
    return {"tiers": [{"kind": "host", "eviction": "lru"}, {**remote, "deadline_s": DEADLINE_S}]}


def start(make_cluster: Any, make_engine: Any, peers: int) -> tuple[Any, list[Any], Any]:
    """The cluster, a peer on each host, then the engine (after them: UCX's routes)."""
    cluster = make_cluster(peers)
    peers = cluster.start_peers(capacity="64MiB", row_bytes="128KiB")
    engine = make_engine(kvtier_config=remote_config(cluster))
    return cluster, peers, engine


def engine_log(engine: Any, since: int = 0) -> str:
    return Path(engine.log_path).read_bytes()[since:].decode(errors="replace")


def warnings_naming(text: str, address: str) -> list[str]:
    """The WARNING/ERROR lines of ``text`` that name ``address`` (``host:port``)."""
    return [
        line
        for line in text.splitlines()
        if re.match(r"(WARNING|ERROR)\b", line) and re.search(rf"{re.escape(address)}\b", line)
    ]


def test_a_reset_prefix_comes_back_from_the_peers_across_the_bridge(make_cluster, make_engine):
    cluster, _peers, engine = start(make_cluster, make_engine, PEERS)
    ucx = next(line for line in engine_log(engine).splitlines() if "UCX for peers on" in line)
    assert f"'UCX_TLS': '{net_iface.NOT_BETWEEN_HOSTS}'" in ucx, ucx  # set by kvtier, not by us
    assert f"'UCX_NET_DEVICES': '{cluster.nic}'" in ucx, ucx
    before = [cluster.wire_bytes(host) for host in cluster.hosts]

    _cold, reference = cold_and_reference(engine)
    stats = wait_spilled(engine, ROWS)
    stored = [cluster.wire_bytes(host) for host in cluster.hosts]
    where = engine.remote_owners(DOC)
    assert all(where["known"]) and len(where["owners"]) == ROWS
    assert engine.reset_prefix_cache(connector=True)  # vLLM's device cache and kvtier's host tier

    again = engine.generate([DOC])[0]

    after = [cluster.wire_bytes(host) for host in cluster.hosts]
    assert again.external_cached_tokens == FULL_BLOCKS * BLOCK, "the whole prefix from the peers"
    assert_exact(again, reference)
    assert engine.kvtier_stats()["loaded_rows_by_tier"] == {"remote": ROWS}
    wire = zip(cluster.hosts, before, stored, after, strict=True)
    for host, (to_0, _), (to_1, from_1), (_, from_2) in wire:
        row_bytes = where["owners"].count(host.peer_address()) * stats["row_bytes"]
        assert row_bytes > 0, f"{host.address} holds none of the rows"
        assert to_1 - to_0 >= row_bytes  # the write-through went over this peer's link
        assert from_2 - from_1 >= row_bytes  # and the rows came back over it
        print(f"{host.address}: {row_bytes} B of rows, {to_1 - to_0} B to it, {from_2 - from_1} B back")
    assert_another_document_differs(engine, reference)


def choose_victim(owners: list[str | None]) -> tuple[str, int]:
    """A peer that does not own the first block, and the index of its first block (0: none):
    of those peers, the one whose first block comes latest (the most rows before it served)."""
    first: dict[str, int] = {}
    for index, owner in enumerate(owners):
        assert owner is not None, "no peer is up"
        first.setdefault(owner, index)
    candidates = {owner: index for owner, index in first.items() if index > 0}
    if not candidates:
        return "", 0
    victim = max(candidates, key=candidates.__getitem__)
    return victim, candidates[victim]


def a_document_and_its_victim(engine: Any, seed: int) -> tuple[list[int], list[str], str, int]:
    """A document at least ``MIN_SPLIT`` of whose first blocks are on peers other than the
    victim (where each block's row would go is known before it is stored)."""
    for tries in range(200):
        doc = document(seed + tries, len(DOC))
        owners = engine.remote_owners(doc)["owners"]
        victim, split = choose_victim(owners)
        if split >= MIN_SPLIT:
            return doc, owners, victim, split
    raise AssertionError("no document with enough blocks before a victim's")


def settled_lower_stats(engine: Any, timeout_s: float = 30.0) -> dict[str, Any]:
    """The lower tiers' counters once nothing is in flight below the host tier."""
    deadline = time.monotonic() + timeout_s
    while (stats := engine.kvtier_stats())["lower_inflight"]:
        assert time.monotonic() < deadline, f"lower-tier work still in flight after {timeout_s} s"
        time.sleep(0.1)
    return stats["lower"]


def test_a_failed_peer_host_costs_a_request_its_deadline_never_a_stall(make_cluster, make_engine):
    cluster, peers, engine = start(make_cluster, make_engine, len(FAULTS_IN_TURN) + 1)
    hosts = zip(cluster.hosts, peers, strict=True)
    by_address = {host.peer_address(): (host, process) for host, process in hosts}
    failed: list[str] = []
    for turn, fault in enumerate(FAULTS_IN_TURN):
        doc, owners, victim, split = a_document_and_its_victim(engine, 1000 * (turn + 1))
        spilled = engine.kvtier_stats()["lower"]["spills_done"]
        # The reference: the blocks before the victim's first computed and kept in vLLM's
        # device cache (and stored), then the whole document, the rest computed (and stored).
        engine.generate([doc[: split * BLOCK + 1]])
        began = time.monotonic()
        reference = engine.generate([doc])[0]
        no_fault_s = time.monotonic() - began
        assert reference.num_cached_tokens == split * BLOCK and reference.external_cached_tokens == 0
        wait_spilled(engine, spilled + ROWS)
        where = engine.remote_owners(doc)
        assert all(where["known"]) and where["owners"] == owners, "the rows went where the owners said"
        loaded = engine.kvtier_stats()["loaded_rows_by_tier"].get("remote", 0)
        lower = settled_lower_stats(engine)
        mark = len(Path(engine.log_path).read_bytes())

        host, process = by_address[victim]
        cluster.inflict(host, process, fault)
        failed.append(victim)
        began = time.monotonic()
        assert engine.reset_prefix_cache(connector=True)
        reset_s = time.monotonic() - began
        began = time.monotonic()
        again = engine.generate([doc])[0]
        took = time.monotonic() - began

        assert reset_s < DEADLINE_S + SLACK_S, f"the reset after the victim was {fault} took {reset_s:.2f} s"
        assert took < no_fault_s + DEADLINE_S + SLACK_S, (
            f"the request after the victim was {fault} took {took:.2f} s ({no_fault_s:.2f} s without a fault)"
        )
        assert again.external_cached_tokens == split * BLOCK, "the healthy peers' rows before the victim's"
        assert engine.kvtier_stats()["loaded_rows_by_tier"]["remote"] == loaded + split
        assert_exact(again, reference)  # the victim's blocks and all after them recomputed
        # Every block was promoted (the lookup goes on past a pending one): the healthy
        # peers' rows all landed, the victim's all failed.
        after = settled_lower_stats(engine)
        assert after["promotions_done"] - lower["promotions_done"] == ROWS - owners.count(victim)
        assert after["promotions_failed"] - lower["promotions_failed"] == owners.count(victim)
        text = engine_log(engine, mark)
        assert warnings_naming(text, victim), f"the victim {victim} ({fault}) is not named:\n{text[-3000:]}"
        for address in by_address:
            if address not in failed:
                assert not warnings_naming(text, address), f"a healthy peer {address} is blamed"
        print(
            f"{fault}: {took:.2f} s after the fault (reset {reset_s:.2f} s), {no_fault_s:.2f} s without;"
            f" {split} rows loaded,"
            f" {ROWS - owners.count(victim)} promoted, {owners.count(victim)} missed"
        )


def test_bench_cluster_vllm_runs_and_accounts_for_its_rows(make_cluster, tmp_path, capsys):
    """``kvtier bench cluster --vllm-peers`` at a small size (``make_cluster`` only for its skip):
    every prefix came whole from the peers (the run raises otherwise) and over their links. No
    timing is asserted: figures belong to the benchmark's run."""
    from bench import cluster

    out = tmp_path / "cluster.json"
    only_vllm = ["--hosts", "", "--idle-peers", "0", "--faults", "", "--membership", "0"]
    small = ["--vllm-peers", "2", "--vllm-rounds", "1", "--vllm-tokens", "600"]
    assert cluster.main([*only_vllm, *small, "--json", str(out)]) == 0
    assert "from the peers" in capsys.readouterr().out
    fig = json.loads(out.read_text())["vllm"]
    rows = (600 - 1) // BLOCK
    assert fig["rows_per_prefix"] == rows and fig["rows_loaded_by_tier"] == {"remote": rows}
    assert fig["bytes_from_peer_hosts"] >= rows * (128 << 10)
