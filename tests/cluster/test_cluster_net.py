"""The simulated cluster itself: hosts reach each other over the bridge, faults act on one
host's link only, and nothing is left behind (processes, namespaces, links)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from bench import cluster_net
from bench.cluster_net import Cluster

# A TCP echo server in a host.
ECHO = """
import socket, sys
srv = socket.create_server((sys.argv[1], 9001))
print("echoing", flush=True)
while True:
    conn, _ = srv.accept()
    while chunk := conn.recv(1 << 16):
        conn.sendall(chunk)
    conn.close()
"""

# A TCP server in a host: accepts, reads until the client closes, says how much it read.
SERVER = """
import socket, sys
srv = socket.create_server((sys.argv[1], 9000))
print("serving", flush=True)
while True:
    conn, _ = srv.accept()
    total = 0
    while chunk := conn.recv(1 << 16):
        total += len(chunk)
    print("read", total, flush=True)
    conn.close()
"""


def _reaches(address: str, timeout: float = 1.0) -> bool:
    try:
        socket.create_connection((address, 9000), timeout=timeout).close()
    except OSError:
        return False
    return True


def _names() -> str:
    return (
        subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        + subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    )


def _serve(cluster: Cluster, host: cluster_net.Host) -> cluster_net.HostProcess:
    server = cluster.start(host, [sys.executable, "-c", SERVER, host.address])
    server.wait_for("serving")
    return server


def test_hosts_reach_each_other_and_faults_act_on_one_host(make_cluster) -> None:
    cluster = make_cluster(2)
    a, b = cluster.hosts
    for host in (a, b):
        _serve(cluster, host)
        assert _reaches(host.address)
    cluster.cut(a)
    assert not _reaches(a.address)
    assert _reaches(b.address)  # only a's link is cut
    cluster.heal(a)
    assert _reaches(a.address)
    cluster.partition(a, "out")  # a hears, cannot answer
    assert not _reaches(a.address)
    cluster.heal(a)
    cluster.set_loss(b, 1.0)
    assert not _reaches(b.address)
    cluster.set_loss(b, 0.0)
    assert _reaches(b.address)


def test_bytes_sent_to_a_host_cross_its_link(make_cluster) -> None:
    cluster = make_cluster(1)
    (host,) = cluster.hosts
    server = _serve(cluster, host)
    cluster.set_rate(host, "1gbit")
    before, _ = cluster.wire_bytes(host)
    with socket.create_connection((host.address, 9000), timeout=10) as sock:
        sock.sendall(b"x" * (4 << 20))
    server.wait_for("read 4194304")
    after, _ = cluster.wire_bytes(host)
    assert after - before >= 4 << 20
    qdiscs = subprocess.run(["tc", "qdisc", "show", "dev", host.port_dev], capture_output=True, text=True)
    assert "tbf" in qdiscs.stdout
    cluster.clear(host)
    qdiscs = subprocess.run(["tc", "qdisc", "show", "dev", host.port_dev], capture_output=True, text=True)
    assert "tbf" not in qdiscs.stdout


def test_everything_is_torn_down_even_after_an_error(tmp_path) -> None:
    if (reason := cluster_net.probe()) is not None:
        pytest.skip(reason)
    with pytest.raises(RuntimeError, match="boom"), Cluster(2, tmp_path) as cluster:
        server = _serve(cluster, cluster.hosts[0])
        server.stop()  # a stopped process is killed too
        names = [cluster.bridge, *(h.netns for h in cluster.hosts), *(h.port_dev for h in cluster.hosts)]
        raise RuntimeError("boom")
    assert server.proc.poll() is not None
    left = _names()
    assert [name for name in names if name in left] == []


def test_sweep_deletes_what_a_dead_creator_left_only(make_cluster) -> None:
    live = make_cluster(1)
    gone = subprocess.Popen(["true"])
    gone.wait()
    orphan = f"{cluster_net.PREFIX}-{gone.pid:x}x0-h0"
    subprocess.run(["ip", "netns", "add", orphan], check=True)
    try:
        assert cluster_net.sweep() >= 1
        left = _names()
        assert orphan not in left
        assert live.hosts[0].netns in left  # this process is alive: its cluster stays
    finally:
        subprocess.run(["ip", "netns", "del", orphan], capture_output=True)


def test_a_delayed_host_answers_late_and_intact(make_cluster) -> None:
    cluster = make_cluster(1)
    (host,) = cluster.hosts
    echo = cluster.start(host, [sys.executable, "-c", ECHO, host.address])
    echo.wait_for("echoing")
    cluster.set_delay(host, 25)
    with socket.create_connection((host.address, 9001), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        began = time.monotonic()
        sock.sendall(b"ping")
        assert sock.recv(4) == b"ping"
        # A lower bound: the relay holds each frame 25 ms each way, whatever the load.
        assert time.monotonic() - began >= 0.05
    relay_dev = f"{cluster.bridge[:-1]}r{host.index}"  # the relay's veth: kvt<tag>r<i>
    assert relay_dev in _names()
    cluster.clear_delay(host)
    assert relay_dev not in _names()
    with socket.create_connection((host.address, 9001), timeout=10) as sock:  # back on the bridge
        sock.sendall(b"pong")
        assert sock.recv(4) == b"pong"


def test_a_machine_that_forbids_namespaces_is_named_and_skipped(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setattr(cluster_net, "_probed", [])
    monkeypatch.setattr(cluster_net.os, "geteuid", lambda: 1000)
    assert cluster_net.probe() == "network namespaces need root"
    with pytest.raises(cluster_net.ClusterUnavailable, match="need root"):
        Cluster(1, tmp_path).__enter__()
    from bench.cluster import main as bench_cluster

    assert bench_cluster(["--hosts", "1"]) == 2
    assert "need root" in capsys.readouterr().err
    monkeypatch.setattr(cluster_net, "_probed", [])
    monkeypatch.setattr(cluster_net.shutil, "which", lambda name: None)
    monkeypatch.setattr(cluster_net.os, "geteuid", lambda: 0)
    assert cluster_net.probe() == "`ip` or `tc` (iproute2) is not installed"
