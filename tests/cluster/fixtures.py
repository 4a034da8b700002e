"""Simulated-cluster fixtures, shared by ``tests/cluster/`` and the real-engine tests in the
cluster (``tests/engine/test_engine_in_cluster.py``); a test module imports them by name.

``make_cluster(n)`` builds ``n`` hosts (network namespaces on one bridge, ``bench/cluster_net.py``)
and tears them down after the test, whatever happened in it. Where this machine cannot build
namespaces (not root, no iproute2, refused), every test that asks for one is skipped with the
reason.

``ucx_from_the_peers`` (autouse where imported) removes the UCX variables a test process may
carry (``tests/tiers/peer_fixtures.py`` binds UCX to ``lo`` for the whole process once imported):
the remote tier sets them from its peers' addresses (``tiers/remote/net_iface.py``), as it
would in a real deployment, and an engine started as a child process inherits none.
"""

from __future__ import annotations

import pytest

from bench.cluster_net import Cluster, probe
from tiers.remote import net_iface


@pytest.fixture
def make_cluster(tmp_path):
    reason = probe()
    if reason is not None:
        pytest.skip(f"no simulated cluster here: {reason}")
    built: list[Cluster] = []

    def make(hosts: int, **kwargs) -> Cluster:
        cluster = Cluster(hosts, tmp_path / f"cluster-{len(built)}", **kwargs)
        built.append(cluster)
        return cluster.__enter__()

    yield make
    for cluster in built:
        cluster.close()


@pytest.fixture(autouse=True)
def ucx_from_the_peers(monkeypatch):
    for var in net_iface.VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(net_iface, "_SET_BY_KVTIER", {})
