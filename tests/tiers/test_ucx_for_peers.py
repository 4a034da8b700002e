"""``configure_ucx_for_peers``: the UCX variables a remote tier's client sets from its
configured peers, and that a user's own settings win."""

from __future__ import annotations

import os

import pytest

from tiers.remote import net_iface
from tiers.remote.net_iface import configure_ucx_for_peers, route_interface

VARS = net_iface.VARIABLES


@pytest.fixture
def clean_env(monkeypatch):
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(net_iface, "_SET_BY_KVTIER", {})


def test_peers_on_loopback_bind_lo_and_keep_ucx_transports(clean_env) -> None:
    assert configure_ucx_for_peers(["127.0.0.1", "localhost"]) == {"UCX_NET_DEVICES": "lo"}
    assert os.environ["UCX_NET_DEVICES"] == "lo" and "UCX_TLS" not in os.environ


def test_peers_elsewhere_get_every_transport_but_shared_memory_on_the_interface_that_routes_to_them(
    clean_env,
) -> None:
    interface = route_interface("192.0.2.77")  # TEST-NET-1: routed by the default route, if any
    if interface is None:
        pytest.skip("this machine has no route beyond loopback")
    settings = configure_ucx_for_peers(["192.0.2.77"])
    # An exclusion: a list ("tcp") would keep RDMA out between machines, and NIXL refuses a
    # UCX agent whose list leaves CUDA's transports out on a machine with NVIDIA GPUs.
    assert settings["UCX_NET_DEVICES"] == interface and settings["UCX_TLS"] == "^sm"
    assert settings["UCX_TCP_TX_SEG_SIZE"] == "32k"  # a peer's READ over TCP: answered in these
    # A later client of loopback peers in this process replaces what kvtier set, not more.
    assert configure_ucx_for_peers(["127.0.0.1"]) == {"UCX_NET_DEVICES": "lo"}
    assert "UCX_TLS" not in os.environ and "UCX_TCP_TX_SEG_SIZE" not in os.environ


def test_a_user_setting_is_kept(clean_env, monkeypatch) -> None:
    monkeypatch.setenv("UCX_NET_DEVICES", "eth7")
    monkeypatch.setenv("UCX_TLS", "rc,tcp")
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "8k")
    mine = {"UCX_NET_DEVICES": "eth7", "UCX_TLS": "rc,tcp", "UCX_TCP_TX_SEG_SIZE": "8k"}
    assert configure_ucx_for_peers(["192.0.2.77"]) == mine
    assert {var: os.environ[var] for var in mine} == mine


def test_a_peer_with_no_route_leaves_the_devices_alone(clean_env, monkeypatch) -> None:
    monkeypatch.setattr(net_iface, "route_interface", lambda host, port=9: None)
    settings = configure_ucx_for_peers(["192.0.2.77"])
    assert "UCX_NET_DEVICES" not in settings and "UCX_NET_DEVICES" not in os.environ
