"""A ``kvtier peer``'s ``/metrics`` and ``/health`` (``offload.peer_metrics``, ``kvtier peer
--metrics-port``), against a real peer process driven by a real remote tier."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from offload.metrics import render, serve
from offload.peer_metrics import PREFIX, peer_families
from tests.offload.test_metrics import samples
from tests.tiers.peer_fixtures import ROOT, HostRows, RawConnection, die_with_parent, key, open_tier
from tiers.remote import protocol as proto
from tiers.remote.peer_metrics import PeerSnapshot, TransferRecord

TENANTS = {
    "alice": b"alice-token-" + os.urandom(8).hex().encode(),
    "bob": b"bob-token-" + os.urandom(8).hex().encode(),
}
KIB = 1024

multiprocess = pytest.mark.multiprocess


@dataclass
class MonitoredPeer:
    """A ``kvtier peer --metrics-port`` child: its address and its metrics URL."""

    proc: subprocess.Popen
    address: str
    port: int
    url: str

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def metrics(self) -> dict[str, float]:
        status, text = self.get("/metrics")
        assert status == 200, text
        return samples(text)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_monitored_peer(tmp: Path) -> MonitoredPeer:
    """``kvtier peer`` with two tenants (alice, bob) and a metrics port; ready to scrape."""
    token_file = tmp / "tenants"
    token_file.write_bytes(b"".join(t.encode() + b": " + tok + b"\n" for t, tok in TENANTS.items()))
    metrics_port = free_port()
    argv = [
        "--listen",
        "127.0.0.1:0",
        "--capacity",
        "2MiB",
        "--row-bytes",
        "64KiB",
        "--token-file",
        str(token_file),
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "offload.cli", "peer", *argv, "--metrics-port", str(metrics_port)],
        cwd=ROOT,
        env={**os.environ, "NIXL_LOG_LEVEL": "WARN", "UCX_NET_DEVICES": "lo"},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=die_with_parent,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "listening on" in line, line
    address = line.split()[4].rstrip(":")
    peer = MonitoredPeer(proc, address, int(address.rsplit(":", 1)[1]), f"http://127.0.0.1:{metrics_port}")
    deadline = time.monotonic() + 20
    while True:  # the endpoint starts right after the ready line
        try:
            peer.get("/health")
            return peer
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)


@pytest.fixture(scope="module")
def peer(tmp_path_factory) -> Iterator[MonitoredPeer]:
    peer = start_monitored_peer(tmp_path_factory.mktemp("monitored"))
    try:
        yield peer
    finally:
        peer.proc.terminate()
        try:
            assert peer.proc.wait(timeout=20) == 0
        finally:
            peer.proc.kill()
            assert peer.proc.stdout is not None
            peer.proc.stdout.close()


async def put_and_get(address: str, tenant: str) -> None:
    """One put and one get of four rows through a real remote tier, as ``tenant``."""
    rows = HostRows([64 * KIB, 16 * KIB, 64 * KIB, 16 * KIB], seed=3)
    keys = [key(i, group=i % 2, salt=tenant.encode()) for i in range(4)]
    async with open_tier([address], rows.view, tenant=tenant, token=TENANTS[tenant]) as tier:
        assert await tier.put(list(zip(keys, rows.src, strict=True))) == [True] * 4
        rows.clear_dst()
        assert await tier.get(list(zip(keys, rows.dst, strict=True))) == [True] * 4
        assert all(rows.same(i) for i in range(4))


@multiprocess
def test_health_answers_200_while_the_peer_serves(peer):
    assert peer.get("/health") == (200, "ok\n")
    assert peer.get("/")[0] == 200  # / and /metrics are the metrics, as before
    assert peer.get("/nothing")[0] == 404


@multiprocess
async def test_metrics_count_connections_transfers_bytes_and_latency(peer):
    before = peer.metrics()
    assert before["kvtier_peer_slots"] == 32
    assert before["kvtier_peer_tenants"] == 2
    await put_and_get(peer.address, "alice")
    got = peer.metrics()
    assert got["kvtier_peer_connections_total"] >= before["kvtier_peer_connections_total"] + 1
    for op in ("put", "get"):
        assert got[f'kvtier_peer_transfer_seconds_count{{op="{op}"}}'] >= 1
        assert got[f'kvtier_peer_transfer_seconds_bucket{{op="{op}",le="+Inf"}}'] >= 1
        assert got[f'kvtier_peer_transfers_total{{op="{op}"}}'] >= 1
    # the bytes the peer READ for the put and WROTE for the get: the four rows, once each
    put_bytes = (
        got['kvtier_peer_transfer_bytes_total{op="put"}']
        - before['kvtier_peer_transfer_bytes_total{op="put"}']
    )
    get_bytes = (
        got['kvtier_peer_transfer_bytes_total{op="get"}']
        - before['kvtier_peer_transfer_bytes_total{op="get"}']
    )
    assert put_bytes == get_bytes == 160 * KIB
    assert got['kvtier_peer_tenant_rows{tenant="alice"}'] == 4
    assert got['kvtier_peer_tenant_rows{tenant="bob"}'] == 0
    assert got['kvtier_peer_tenant_used_bytes{tenant="alice"}'] == 4 * 64 * KIB
    assert got['kvtier_peer_tenant_rows_hit_total{tenant="alice"}'] == 4
    assert got["kvtier_peer_rows"] == 4
    assert got["kvtier_peer_used_bytes"] == 4 * 64 * KIB


@multiprocess
async def test_the_refusal_counter_rises_after_a_wrong_token(peer):
    reason = 'kvtier_peer_refusals_total{reason="auth_failed"}'
    before = peer.metrics()[reason]
    conn = RawConnection(peer.port)
    try:
        assert conn.handshake(b"not-the-token-" + os.urandom(8).hex().encode(), tenant="alice") is None
    finally:
        conn.close()
    deadline = time.monotonic() + 10
    while peer.metrics()[reason] < before + 1:
        assert time.monotonic() < deadline, "the wrong token was never counted"
        await asyncio.sleep(0.05)


def test_health_is_503_when_the_check_fails_or_raises():
    verdicts = iter([True, False])

    def check() -> bool:
        try:
            return next(verdicts)
        except StopIteration:
            raise TimeoutError("the loop did not answer") from None

    server = serve(0, lambda: "", health=check)
    url = f"http://127.0.0.1:{server.server_address[1]}/health"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            assert (response.status, response.read()) == (200, b"ok\n")
        for _ in range(2):  # false, then raises
            with pytest.raises(urllib.error.HTTPError, match="503"):
                urllib.request.urlopen(url, timeout=5)
    finally:
        server.shutdown()
        server.server_close()


def test_a_snapshot_renders_every_family_once():
    transfers = TransferRecord()
    transfers.served(
        (proto.Msg.LANDED, 1, proto.encode_landed(7, [proto.Landed.READ, proto.Landed.EXISTS])),
        [10, 20],
        0.002,
    )
    transfers.served((proto.Msg.GOT, 2, proto.encode_got([None, b"h" * proto.HEADER_BYTES])), [10, 20], 0.2)
    snapshot = PeerSnapshot(
        pool={"slots": 8, "slot_bytes": 100, "free_slots": 6, "rows": 2, "rows_hit": 1},
        tenants={"a": {"rows": 2, "used_slots": 2, "quota_slots": 4, "rows_hit": 1}},
        counters={"connections": 3, "auth_failures": 2, "limit_refusals": 1},
        open_connections=1,
        transfers=transfers,
    )
    text = render(peer_families(snapshot), prefix=PREFIX)
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))
    got = samples(text)
    assert got["kvtier_peer_used_bytes"] == 200 and got["kvtier_peer_capacity_bytes"] == 800
    assert got["kvtier_peer_rows_hit_total"] == 1 and got["kvtier_peer_slots"] == 8
    assert got['kvtier_peer_tenant_quota_bytes{tenant="a"}'] == 400
    assert got['kvtier_peer_tenant_rows_hit_total{tenant="a"}'] == 1
    assert got['kvtier_peer_refusals_total{reason="auth_failed"}'] == 2
    assert got['kvtier_peer_refusals_total{reason="limit"}'] == 1
    assert got['kvtier_peer_transfer_bytes_total{op="put"}'] == 10  # the EXISTS row was not read
    assert got['kvtier_peer_transfer_bytes_total{op="get"}'] == 20  # the miss was not written
    assert got['kvtier_peer_transfer_seconds_bucket{op="put",le="0.0025"}'] == 1
    assert got['kvtier_peer_transfer_seconds_bucket{op="get",le="0.1"}'] == 0
    assert got['kvtier_peer_transfer_seconds_count{op="get"}'] == 1
