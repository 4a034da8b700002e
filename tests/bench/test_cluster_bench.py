"""``kvtier bench cluster``, run small: throughput against raw NIXL over the simulated links,
idle CPU, fault rows that name the host at fault, and the membership timeline."""

from __future__ import annotations

import json

import pytest

from bench import cluster_net
from offload.cli import main as kvtier_main

pytestmark = pytest.mark.multiprocess


def test_bench_cluster_runs_small_and_writes_its_figures(tmp_path, capsys) -> None:
    if (reason := cluster_net.probe()) is not None:
        pytest.skip(f"no simulated cluster here: {reason}")
    out = tmp_path / "cluster.json"
    argv = ["bench", "cluster", "--hosts", "1,2", "--rows", "8", "--repeats", "1", "--scaling-base", "1"]
    argv += ["--idle-peers", "2", "--idle-s", "1", "--faults", "killed,cut", "--json", str(out)]
    argv += ["--membership", "4", "--membership-rows", "32", "--plot", str(tmp_path / "plots")]
    assert kvtier_main(argv) == 0
    assert "kvtier bench cluster --hosts 1,2" in capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert [row["peers"] for row in figures["throughput"]] == [1, 2]
    for row in figures["throughput"]:
        assert row["put_gbps"] > 0 and row["raw_read_gbps"] > 0 and row["get_scaling"] > 0
        assert row["bytes_to_peer_hosts"] >= 2 * 8 * (256 << 10)  # two rounds' puts crossed the links
    assert figures["idle"]["peers_up"] == 2 and figures["idle"]["rows_put_after"] == 8
    assert figures["idle"]["cores"] >= 0
    for row in figures["faults"]:
        assert row["rows_missed"] == row["victims_rows"] > 0
        assert row["hosts_named"] == [row["host_at_fault"]]
        assert row["took_s"] < row["deadline_s"] + 1.5 and row["peers_up_after"] == 2
    membership = figures["membership"]
    assert [row["event"] for row in membership["events"]][:3] == ["killed", "cut", "left"]
    for row in membership["events"]:
        assert row["within_share"], row  # no event lost more than the rows of the peer that went or came
    assert membership["events"][0]["rows_lost"] > 0  # a killed peer's rows are lost: the check can fail
    assert membership["stalls"] == 0 and membership["all_exact"]
    assert membership["balance"] <= membership["balance_target"]
    assert (tmp_path / "plots" / "cluster-membership.png").stat().st_size > 0
