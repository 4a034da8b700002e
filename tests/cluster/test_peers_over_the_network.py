"""A remote tier whose peers are other hosts: UCX is told to use the network (by kvtier,
from the configured addresses), so the rows cross the peers' links."""

from __future__ import annotations

import os

import pytest

from tests.tiers.peer_fixtures import HostRows, key, open_tier

pytestmark = pytest.mark.multiprocess
KIB = 1024


async def test_rows_cross_the_peers_links(make_cluster) -> None:
    cluster = make_cluster(2)
    cluster.start_peers(capacity="32MiB", row_bytes="256KiB")
    addresses = [host.peer_address() for host in cluster.hosts]
    n = 32
    rows = HostRows([256 * KIB] * n, seed=5)
    keys = [key(i, salt=b"wire") for i in range(n)]
    before = [cluster.wire_bytes(host) for host in cluster.hosts]
    async with open_tier(addresses, rows.view) as tier:
        assert os.environ["UCX_TLS"] == "tcp" and os.environ["UCX_NET_DEVICES"] == cluster.nic
        assert await tier.put(list(zip(keys, rows.src, strict=True))) == [True] * n
        assert await tier.get(list(zip(keys, rows.dst, strict=True))) == [True] * n
        assert all(rows.same(i) for i in range(n))
        owned = {address: sum(tier.owner(k) == address for k in keys) for address in addresses}
    after = [cluster.wire_bytes(host) for host in cluster.hosts]
    for host, (to_before, from_before), (to_after, from_after) in zip(
        cluster.hosts, before, after, strict=True
    ):
        row_bytes = owned[host.peer_address()] * 256 * KIB
        assert row_bytes > 0
        assert to_after - to_before >= row_bytes  # the puts' WRITEs went over this link
        assert from_after - from_before >= row_bytes  # and the gets' READs came back over it
