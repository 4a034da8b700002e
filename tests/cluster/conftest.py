"""Simulated clusters for the tests of this folder (``bench/cluster_net.py``): the fixtures
``make_cluster`` and ``ucx_from_the_peers`` of ``tests/cluster/fixtures.py``."""

from __future__ import annotations

from tests.cluster.fixtures import make_cluster, ucx_from_the_peers  # noqa: F401 (fixtures)
