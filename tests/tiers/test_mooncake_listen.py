"""Mooncake's listeners kept on one interface (``tiers.mooncake.listen``), and what they serve.

The attack tried: a plain TCP connection, with no credentials, sends Mooncake's 24-byte
transfer request header (size, address, opcode READ) to a client's data listener and reads
the host tier's bytes. Kept on the loopback (the default), the listener refuses it from
this machine's other address; with ``listen_interface = "*"`` (Mooncake's own behaviour)
the same read succeeds there, which is what the default prevents. A multi-host test (another
machine on the network) is not possible here: the non-loopback address of this machine
stands in for the network, and the parts that need one skip without it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import struct

import pytest

from tiers.mooncake import listen as mooncake_listen

SECRET = b"kvtier-host-row-0123456789abcdef"
READ = 0  # Mooncake's TransferRequest::READ


def loopback_interface() -> str:
    return next(name for addr, name in mooncake_listen.interface_addresses().items() if addr.is_loopback)


def other_address() -> str | None:
    """An IPv4 address of this machine that is not the loopback's (the network stand-in)."""
    for address in mooncake_listen.interface_addresses():
        if isinstance(address, ipaddress.IPv4Address) and not address.is_loopback:
            return str(address)
    return None


def needs_other_address() -> str:
    address = other_address()
    if address is None:
        pytest.skip("this machine has no IPv4 address besides the loopback to connect from")
    return address


def connects(address: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((address, port), timeout=2):
        return True
    return False


@pytest.mark.parametrize("value", ["", "*", "lo", "eth0", "enp1s0f0.100", "10.0.0.7", "::1"])
def test_good_listen_interfaces(value):
    assert mooncake_listen.check_listen_interface(value) is None


@pytest.mark.parametrize("value", ["0.0.0.0 ", "eth0/1", "a" * 16, "two words", "*.*"])
def test_bad_listen_interfaces_are_named(value):
    assert "expected an interface name" in (mooncake_listen.check_listen_interface(value) or "")


@pytest.mark.parametrize("value", ["127.0.0.1", "10.0.0.7:17000", "node-7.cluster", "::1", "[fd00::2]:80"])
def test_good_hostnames(value):
    assert mooncake_listen.check_hostname(value) is None


@pytest.mark.parametrize("value", ["", "a b", "host:0", "host:99999", "host:x", "-bad", "a/b"])
def test_bad_hostnames_are_named(value):
    assert mooncake_listen.check_hostname(value)


def test_the_interface_of_an_address_or_name():
    lo = loopback_interface()
    assert mooncake_listen.interface_for("127.0.0.1") == lo
    assert mooncake_listen.interface_for("127.0.0.1:17000") == lo
    assert mooncake_listen.interface_for("localhost") == lo
    assert mooncake_listen.interface_for(lo) == lo
    with pytest.raises(OSError, match="not an address of any interface"):
        mooncake_listen.interface_for("203.0.113.9")  # TEST-NET-3: never this machine's
    with pytest.raises(OSError, match="does not resolve"):
        mooncake_listen.interface_for("no-such-host.invalid")


def test_a_listener_on_every_interface_is_refused_elsewhere_once_tied_to_the_loopback():
    address = needs_other_address()
    before = mooncake_listen.listening_sockets()
    with socket.socket(socket.AF_INET6) as listener:
        listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # as Mooncake's: [::]
        listener.bind(("::", 0))
        listener.listen()
        port = listener.getsockname()[1]
        fds = mooncake_listen.new_listeners(before)
        assert len(fds) == 1
        assert connects(address, port) and connects("127.0.0.1", port)  # every interface
        assert mooncake_listen.bind_to_interface(fds, loopback_interface()) == [port] * len(fds)
        assert not connects(address, port)
        assert connects("127.0.0.1", port)


# -- with a real Mooncake Store ------------------------------------------------------------


def read_over_tcp(port: int, address: str, addr: int, size: int) -> bytes:
    """Mooncake's TCP transfer protocol, spoken by hand: one READ request, no credentials."""
    with socket.create_connection((address, port), timeout=2) as conn:
        conn.sendall(struct.pack("<QQB7x", size, addr, READ))
        conn.settimeout(0.5)
        data = b""
        with contextlib.suppress(OSError):
            while len(data) < size and (chunk := conn.recv(size - len(data))):
                data += chunk
        return data


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    pytest.importorskip("mooncake.store")
    from tests.tiers.mooncake_fixtures import start_master

    process = start_master(tmp_path_factory.mktemp("mooncake-listen"))
    yield process
    process.close()


async def open_reading_tier(master, **kwargs):
    """A tier whose host buffer holds ``SECRET``, and the ports its ``open`` started listening on."""
    from tests.tiers.mooncake_fixtures import open_tier
    from tests.tiers.peer_fixtures import aligned_buffer

    host = aligned_buffer(1 << 20)
    host[4096 : 4096 + len(SECRET)] = list(SECRET)
    before = mooncake_listen.listening_sockets()
    context = open_tier(master, memoryview(host), namespace=b"listen", **kwargs)
    tier = await context.__aenter__()
    ports = []
    for fd in mooncake_listen.new_listeners(before):
        with socket.socket(fileno=os.dup(fd)) as sock:
            ports.append(sock.getsockname()[1])
    return context, tier, host, ports


def reads_secret(ports: list[int], address: str, host) -> bool:
    for port in ports:
        with contextlib.suppress(OSError):
            if read_over_tcp(port, address, host.ctypes.data + 4096, len(SECRET)) == SECRET:
                return True
    return False


@pytest.mark.multiprocess
async def test_multiprocess_by_default_the_listeners_refuse_every_interface_but_the_loopback(master):
    address = needs_other_address()
    context, tier, host, ports = await open_reading_tier(master)
    try:
        assert tier.listening_on == loopback_interface() and len(ports) >= 2
        assert reads_secret(ports, "127.0.0.1", host)  # the listener is live, and serves the host tier
        assert not any(connects(address, port) for port in ports)
    finally:
        await context.__aexit__(None, None, None)


@pytest.mark.multiprocess
async def test_multiprocess_listen_interface_star_leaves_them_open_to_the_network(master):
    address = needs_other_address()
    context, tier, host, ports = await open_reading_tier(master, listen_interface="*")
    try:
        assert tier.listening_on == ""
        assert reads_secret(ports, address, host)  # what any host on the network could do
    finally:
        await context.__aexit__(None, None, None)


@pytest.mark.multiprocess
async def test_multiprocess_an_interface_this_machine_lacks_fails_open_before_joining(master):
    from tests.tiers.mooncake_fixtures import open_tier
    from tests.tiers.peer_fixtures import aligned_buffer
    from tiers.base import TierError

    before = mooncake_listen.listening_sockets()
    with pytest.raises(
        TierError, match=r"no interface to keep its listeners on \(listen_interface: .*nosuch0"
    ):
        async with open_tier(master, memoryview(aligned_buffer(1 << 20)), listen_interface="nosuch0"):
            pass
    assert mooncake_listen.new_listeners(before) == []  # setup never ran
    with pytest.raises(TierError, match=r"local_hostname: '203\.0\.113\.9' is not an address"):
        async with open_tier(master, memoryview(aligned_buffer(1 << 20)), local_hostname="203.0.113.9"):
            pass
