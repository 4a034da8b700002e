"""A remote tier whose peers are other hosts: UCX is told to use the network (by kvtier,
from the configured addresses), so the rows cross the peers' links."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.multiprocess
ROWS = 32
ROW_BYTES = 256 << 10


def test_rows_cross_the_peers_links(make_cluster) -> None:
    cluster = make_cluster(3)
    engine_host, *peer_hosts = cluster.hosts
    cluster.start_peers(peer_hosts, capacity="32MiB", row_bytes="256KiB")
    engine = cluster.start_engine(engine_host, peer_hosts, rows=ROWS, row_bytes=ROW_BYTES)
    ucx = engine.request({"op": "state"})["ucx"]
    assert ucx["UCX_TLS"] == "^sm" and ucx["UCX_NET_DEVICES"] == "eth0"  # set by kvtier, not by us
    owners = engine.request({"op": "owners", "salt": "wire"})["result"]
    before = [cluster.wire_bytes(host) for host in peer_hosts]
    assert engine.request({"op": "put", "salt": "wire"})["result"] == [True] * ROWS
    got = engine.request({"op": "get", "salt": "wire"})
    assert got["result"] == [True] * ROWS and got["exact"]
    after = [cluster.wire_bytes(host) for host in peer_hosts]
    for host, (to_before, from_before), (to_after, from_after) in zip(peer_hosts, before, after, strict=True):
        row_bytes = owners.count(host.peer_address()) * ROW_BYTES
        assert row_bytes > 0
        assert to_after - to_before >= row_bytes  # the puts' WRITEs went over this host's link
        assert from_after - from_before >= row_bytes  # and the gets' READs came back over it
