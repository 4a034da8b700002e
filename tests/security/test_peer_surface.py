"""What a ``kvtier peer`` exposes and accepts before any client talks to it: the interfaces
UCX listens on, the flags and token files it starts with."""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import time

import pytest

from offload.cli import main as kvtier_main
from tests.security.peer_processes import LISTEN, open_descriptors, tcp_sockets
from tests.tiers.peer_fixtures import ROOT
from tiers.remote.auth import MIN_TOKEN_BYTES, parse_token_file
from tiers.remote.net_iface import bind_ucx_to, interface_of, ipv4_of
from tiers.remote.server import parse_args

multiprocess = pytest.mark.multiprocess
GOOD_TOKEN = b"g" * MIN_TOKEN_BYTES


def _listening(pid: int) -> set[str]:
    """The local addresses (hex, as ``/proc/net/tcp`` writes them) of the TCP listeners of
    ``pid`` and its children (the tenant workers, whose UCX listens)."""
    _count, inodes = open_descriptors(pid)
    return {address for address, state in tcp_sockets(pid, inodes) if state == LISTEN}


def _peer_listeners(
    listen: str, ucx_net_devices: str | None = None, *, in_namespace: bool = False
) -> set[str]:
    """The addresses a ``kvtier peer --listen LISTEN`` listens on, its own socket and UCX's
    (``in_namespace``: started in a network namespace of its own, ``NETNS_SETUP``)."""
    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    env["NIXL_LOG_LEVEL"] = "WARN"
    if ucx_net_devices is not None:
        env["UCX_NET_DEVICES"] = ucx_net_devices
    argv = [sys.executable, "-m", "tiers.remote.server", "--listen", listen, "--capacity", "1MiB"]
    argv += ["--row-bytes", "64KiB"]
    if in_namespace:
        argv = ["unshare", "-n", "-m", "sh", "-c", f"{NETNS_SETUP} && exec {shlex.join(argv)}"]
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert proc.stdout is not None and "listening on" in proc.stdout.readline()
        time.sleep(0.3)
        return _listening(proc.pid)
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


LOOPBACK = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it


def _other_interface() -> str | None:
    """An interface besides ``lo`` with an IPv4 address (``eth0`` on most machines)."""
    for _, name in socket.if_nameindex():
        if name != "lo" and ipv4_of(name):
            return name
    return None


@multiprocess
def test_ucx_listens_only_on_the_interface_of_listen():
    assert _peer_listeners("127.0.0.1:0", None) == {LOOPBACK}


@multiprocess
def test_ucx_on_a_wildcard_listen_or_a_user_choice_listens_elsewhere_too():
    """The control for the test above (what the check sees when UCX is not bound), and a
    user's UCX_NET_DEVICES is honoured as set."""
    other = _other_interface()
    if other is None:
        pytest.skip("this machine has no interface besides lo with an IPv4 address")
    assert _peer_listeners("0.0.0.0:0", None) - {LOOPBACK, "00000000"}
    assert _peer_listeners("127.0.0.1:0", other) - {LOOPBACK}


def test_bind_ucx_to_names_the_interface_and_keeps_a_user_setting(monkeypatch):
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    assert interface_of("127.0.0.1") == "lo" and interface_of("127.0.0.2") == "lo"
    assert bind_ucx_to("127.0.0.1") == "lo" and os.environ["UCX_NET_DEVICES"] == "lo"
    monkeypatch.setenv("UCX_NET_DEVICES", "eth7")
    assert bind_ucx_to("127.0.0.1") == "eth7"
    monkeypatch.delenv("UCX_NET_DEVICES")
    assert bind_ucx_to("0.0.0.0") is None and "UCX_NET_DEVICES" not in os.environ
    assert bind_ucx_to("192.0.2.254") is None  # no interface holds it: a warning, no guess


# -- flags and token files ---------------------------------------------------------------

BASE = ["--listen", "127.0.0.1:0", "--capacity", "1MiB", "--row-bytes", "64KiB"]


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--max-connections", "0"], "--max-connections"),
        (["--max-connections", "-3"], "--max-connections"),
        (["--lease-ttl", "inf"], "--lease-ttl"),
        (["--lease-ttl", "nan"], "--lease-ttl"),
        (["--lease-ttl", "-1"], "--lease-ttl"),
        (["--alloc-ttl", "inf"], "--alloc-ttl"),
        (["--handshake-timeout", "0"], "--handshake-timeout"),
    ],
)
def test_peer_flags_out_of_range_are_usage_errors(extra, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*BASE, *extra])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize(
    "content, message",
    [
        (b"abc\n", "at least 16"),  # a 3-byte token
        (b"team-a: short\n", "line 1"),
        (b"team-a: " + GOOD_TOKEN + b"\nnot a tenant line\n", "line 2"),
        (b"bad/name: " + GOOD_TOKEN + b"\n" + b"x: " + GOOD_TOKEN + b"\n", "line 1"),
        (b"\n# only a comment\n", "empty"),
        (b"\xff\xfe binary", "UTF-8"),
    ],
)
def test_bad_token_files_are_usage_errors_naming_the_flag(tmp_path, content, message, capsys):
    path = tmp_path / "tokens"
    path.write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*BASE, "--token-file", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--token-file" in err and message in err


def test_a_pool_smaller_than_one_row_per_tenant_is_refused(tmp_path, capsys):
    path = tmp_path / "tokens"
    path.write_bytes(b"".join(b"t%d: " % i + GOOD_TOKEN + b"%d\n" % i for i in range(20)))
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--token-file", str(path)])  # 16 slots, 20 tenants
    assert "tenants" in capsys.readouterr().err


def test_a_tenants_file_maps_tokens_to_tenants_and_quotas():
    other = b"o" * MIN_TOKEN_BYTES
    creds = parse_token_file(
        b"# team tokens\nteam-a: " + GOOD_TOKEN + b"\nteam-b: " + other + b"\nteam-b: " + GOOD_TOKEN + b"\n"
    )
    assert creds.tokens_for("team-a") == (GOOD_TOKEN,)
    assert creds.tokens_for("team-b") == (other, GOOD_TOKEN)
    assert creds.tokens_for("team-c") == () and creds.tokens_for("default") == ()
    assert creds.quotas(17) == {"team-a": 8, "team-b": 8}
    single = parse_token_file(GOOD_TOKEN + b"\n")
    assert single.tokens_for("default") == (GOOD_TOKEN,) and single.tokens_for("team-a") == ()


def test_metrics_port_out_of_range_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        kvtier_main(["peer", *BASE, "--metrics-port", "99999"])
    assert exit_info.value.code == 2
    assert "--metrics-port" in capsys.readouterr().err


def _hex(ip: str) -> str:
    return f"{struct.unpack('<I', socket.inet_aton(ip))[0]:08X}"


# a mount namespace too: UCX finds network devices in /sys/class/net, which must be this
# namespace's sysfs to list the veth pair
NETNS_SETUP = (
    "mount -t sysfs none /sys && "
    "ip link set lo up && ip link add v0 type veth peer name v1 && "
    "ip addr add 10.99.0.1/24 dev v0 && ip addr add 10.99.0.2/24 dev v1 && "
    "ip link set v0 up && ip link set v1 up"
)


def _netns_available() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["unshare", "-n", "-m", "sh", "-c", NETNS_SETUP], capture_output=True)
    return probe.returncode == 0


@multiprocess
@pytest.mark.parametrize("listen", ["10.99.0.1", "0.0.0.0"])
def test_in_a_network_namespace_ucx_listens_on_the_listen_interface_only(listen):
    """A namespace of its own with lo and a veth pair (10.99.0.1 on v0, 10.99.0.2 on v1):
    listening on v0's address, the peer's listeners (its own and UCX's) are all on v0's
    address; the wildcard is the control (UCX then listens on the other interfaces too)."""
    if not _netns_available():
        pytest.skip("cannot create a network namespace with a veth pair here (needs root or user namespaces)")
    found = _peer_listeners(f"{listen}:0", in_namespace=True)
    if listen == "10.99.0.1":
        assert found == {_hex("10.99.0.1")}
    else:
        assert found - {"00000000", _hex("10.99.0.1")}  # UCX on lo and v1 as well
