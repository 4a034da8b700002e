"""Which network interface holds an address, so UCX listens where ``--listen`` says.

UCX opens its own listeners (TCP wire-up, and the data path over TCP) on every interface
unless ``UCX_NET_DEVICES`` names some: a peer started with ``--listen 10.0.0.5:7070`` would
also accept NIXL connections on its public interface. ``bind_ucx_to`` sets
``UCX_NET_DEVICES`` to the interface that holds the listen address, before any NIXL agent
exists (UCX reads it when a context starts). A value the user set is kept as it is; a
wildcard address (``0.0.0.0``, ``::``) or one no interface holds leaves UCX on every
interface, with a warning.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct

from tiers.shared import ipv6_interfaces

log = logging.getLogger("kvtier.peer")

_SIOCGIFADDR = 0x8915


def ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_of(host: str) -> str | None:
    """The interface whose address is ``host`` (a name is resolved first); ``None`` if none."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            address = ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0])
        except (OSError, IndexError, ValueError):
            return None
    if address.is_loopback:
        names = [name for _, name in socket.if_nameindex()]
        return "lo" if "lo" in names else None
    if address.version == 6:
        return ipv6_interfaces().get(ipaddress.IPv6Address(address))
    for _, name in socket.if_nameindex():
        if ipv4_of(name) == str(address):
            return name
    return None


def bind_ucx_to(host: str) -> str | None:
    """Set ``UCX_NET_DEVICES`` to the interface of ``host`` unless set; the value in force."""
    current = os.environ.get("UCX_NET_DEVICES")
    if current:
        log.info("UCX_NET_DEVICES=%s (set by the user): UCX listens there", current)
        return current
    try:
        wildcard = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        wildcard = host == ""
    if wildcard:
        log.warning("listening on every interface: so does UCX (the NIXL data path)")
        return None
    name = interface_of(host)
    if name is None:
        log.warning("no interface holds %s: UCX listens on every interface (set UCX_NET_DEVICES)", host)
        return None
    os.environ["UCX_NET_DEVICES"] = name
    log.info("UCX bound to %s, the interface of %s", name, host)
    return name
