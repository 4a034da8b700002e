"""Keeping Mooncake's listeners on one network interface.

Mooncake Store has no credentials. Its client (the transfer engine inside this process)
opens two TCP listeners at ``setup``, on every interface whatever ``local_hostname`` says
(measured with 0.3.13: ``0.0.0.0:<handshake port>`` and ``[::]:<data port>``) and with no
option to bind them elsewhere (``MC_TCP_BIND_ADDRESS`` changed neither). The data listener
serves reads and writes of any memory this process registered with Mooncake, to anyone:
the mounted segment, and the whole host tier (the tier registers it to move rows
zero-copy), i.e. every row cached for every request. Measured: a plain TCP connection with
no credentials, sending one 24-byte request header, read bytes of the host tier; an
address outside registered memory got the connection closed.

So after ``setup`` the tier finds the listening sockets that ``setup`` created (those of this
process that were not listening before: ``new_listeners``) and ties each to one interface
with ``SO_BINDTODEVICE`` (``bind_to_interface``): connections that arrive on any other
interface are refused, as if nothing listened. The interface is the one that holds the
address other clients are told to use (``local_hostname``: the loopback by default), or
the one configured (``listen_interface``); ``"*"`` keeps Mooncake's every-interface
listeners, logged as a warning.

What this does not do: authenticate anyone. A host that reaches the interface (on a
cluster, the one other clients use) still reads and writes as above, and the master, and
every client, read, overwrite and remove any object. Run Mooncake on a private network.
A listener that another thread of the process opens during ``setup`` would be tied to the
interface too (the window is the ``setup`` call).
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import os
import re
import socket
import struct

from tiers.address import split_host_port, valid_port
from tiers.shared import ipv6_interfaces

ANY_INTERFACE = "*"
_INTERFACE_NAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")  # IFNAMSIZ - 1, no '/' or spaces
_SIOCGIFCONF = 0x8912
_IFREQ_BYTES = 40  # struct ifreq on 64-bit Linux
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def check_listen_interface(value: str) -> str | None:
    """What is wrong with a ``listen_interface`` value, or ``None``: ``""`` (the interface of
    ``local_hostname``), ``"*"`` (every interface), an interface name, or an IP address."""
    if value in ("", ANY_INTERFACE):
        return None
    try:
        ipaddress.ip_address(value)
    except ValueError:
        pass
    else:
        return None
    if not _INTERFACE_NAME.match(value):
        return "expected an interface name (such as 'lo' or 'eth0'), an IP address of it, or '*'"
    return None


def check_hostname(value: str) -> str | None:
    """What is wrong with a ``local_hostname`` (``host`` or ``host:port``), or ``None``."""
    host, port = split_host_port(value)
    if port and not valid_port(port):
        return f"port {port!r} is not in 1..65535"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if value.startswith("[") or not re.match(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252})$", host):
            return "expected an IP address or a host name of this machine"
    return None


def interface_for(where: str) -> str:
    """The interface a listener should be tied to for ``where``: an interface name, or an
    address (or ``host[:port]``) held by an interface of this machine. ``OSError`` if none."""
    names = {name for _, name in socket.if_nameindex()}
    if where in names:
        return where
    host, _ = split_host_port(where)
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise OSError(f"{host!r} does not resolve: {exc}") from exc
    held = interface_addresses()
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%")[0])
        if address in held:
            return held[address]
        if address.is_loopback:
            loopback = [name for addr, name in held.items() if addr.is_loopback]
            if loopback:
                return loopback[0]
    raise OSError(f"{host!r} is not an address of any interface of this machine ({sorted(names)})")


def interface_addresses() -> dict[ipaddress.IPv4Address | ipaddress.IPv6Address, str]:
    """Every address of this machine's interfaces (IPv4 by ``SIOCGIFCONF``, IPv6 from
    ``/proc/net/if_inet6``) and the interface that holds it."""
    held: dict[ipaddress.IPv4Address | ipaddress.IPv6Address, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        room = 256 * _IFREQ_BYTES
        buffer = array.array("B", bytes(room))
        request = struct.pack("iL", room, buffer.buffer_info()[0])
        used = struct.unpack("iL", fcntl.ioctl(probe.fileno(), _SIOCGIFCONF, request))[0]
        raw = buffer.tobytes()
        for at in range(0, used, _IFREQ_BYTES):
            name = raw[at : at + 16].split(b"\0", 1)[0].decode().split(":")[0]  # "eth0:1" is eth0
            held[ipaddress.IPv4Address(raw[at + 20 : at + 24])] = name
    held.update(ipv6_interfaces())
    return held


def listening_sockets() -> dict[int, int]:
    """This process's listening TCP sockets: socket inode -> one of its descriptors."""
    listening: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                next(lines, None)
                for line in lines:
                    fields = line.split()
                    if len(fields) > 9 and fields[3] == _LISTEN:
                        listening.add(int(fields[9]))
        except OSError:
            continue
    found: dict[int, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inode = int(target[8:-1])
            if inode in listening:
                found.setdefault(inode, int(name))
    return found


def new_listeners(before: dict[int, int]) -> list[int]:
    """Descriptors of listening sockets that were not in ``before`` (``listening_sockets``)."""
    return [fd for inode, fd in listening_sockets().items() if inode not in before]


def bind_to_interface(fds: list[int], interface: str) -> list[int]:
    """Tie each listening socket to ``interface`` (``SO_BINDTODEVICE``); their ports.

    Works on a socket already listening: the kernel checks the device of every connection
    it would accept. ``OSError`` (``EPERM`` where the process may not, ``ENODEV``) otherwise.
    """
    ports = []
    for fd in fds:
        sock = socket.socket(fileno=os.dup(fd))  # a second descriptor of the same socket
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, interface.encode())
            ports.append(sock.getsockname()[1])
        finally:
            sock.close()  # the duplicate only: Mooncake's descriptor stays open
    return ports
