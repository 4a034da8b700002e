"""Which network interface holds or reaches an address, so UCX uses the network kvtier is
configured for: where ``kvtier peer --listen`` says, and the way to a client's peers.

UCX opens its own listeners (TCP wire-up, and the data path over TCP) on every interface
unless ``UCX_NET_DEVICES`` names some: a peer started with ``--listen 10.0.0.5:7070`` would
also accept NIXL connections on its public interface. ``bind_ucx_to`` sets
``UCX_NET_DEVICES`` to the interface that holds the listen address, before any NIXL agent
exists (UCX reads it when a context starts). A value the user set is kept as it is; a
wildcard address (``0.0.0.0``, ``::``) or one no interface holds leaves UCX on every
interface, with a warning.

A client (the remote tier's NIXL agent) has the same problem from the other side, and one
more: UCX picks its transports by what it believes about the peer, and two processes on one
kernel (network namespaces, containers) look to UCX like one host, so rows move through
shared memory or CMA and never touch the network between them (measured: 16 MiB put and
got across namespaces put 12 KB on the wire). ``configure_ucx_for_peers`` sets, before the
client's agent starts and each only if the user did not:

- ``UCX_NET_DEVICES``: the interfaces that route to the configured peers (``lo`` for a peer
  on loopback, the interface holding the address for a peer on this host);
- ``UCX_TLS=^sm`` when no configured peer is on this host (no address of this network
  namespace, nor loopback): every transport but shared memory and CMA, so the rows cross
  the network as they would between machines (measured: the same 16 MiB then put 16.9 MB
  on the wire each way); with a peer on this host UCX keeps its default (shared memory and
  CMA for that peer). An exclusion, not a list such as ``tcp``: a list would keep RDMA
  NICs out of use between real machines, and on a machine with NVIDIA GPUs NIXL refuses to
  start a UCX agent whose ``UCX_TLS`` leaves CUDA's transports out (measured on an H100
  server: ``UCX_TLS=tcp`` failed every agent with ``NIXL_ERR_BACKEND``, ``^sm`` started);
- ``UCX_TCP_TX_SEG_SIZE=32k`` with that ``UCX_TLS``: a peer READs a put's rows out of this
  client, and over TCP UCX emulates that READ in software, this client answering in send
  segments of ``UCX_TCP_TX_SEG_SIZE`` (8 KiB by default: 128 sends a MiB, on the thread that
  progresses the agent). 32 KiB, half the receiving side's default buffer (``RX_SEG_SIZE``,
  64 KiB), took puts from one peer across a link from 0.97-1.03 to 1.18-1.25 GB/s and from
  four peers from 0.58-0.67 to 1.04-1.48 GB/s (2-core VM); RDMA reads are not emulated;
- ``UCX_TCP_BRIDGE_ENABLE=y`` when one of those interfaces is a bridge (a host whose
  containers are the peers): UCX ignores bridge devices otherwise and finds no transport.
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
NOT_BETWEEN_HOSTS = "^sm"
"""``UCX_TLS`` for peers on other hosts: UCX's transports less its shared-memory ones (CMA too)."""
TCP_SEND_SEGMENT = "32k"
"""``UCX_TCP_TX_SEG_SIZE`` for peers on other hosts: the segments this client answers their READs in."""
VARIABLES = ("UCX_NET_DEVICES", "UCX_TLS", "UCX_TCP_TX_SEG_SIZE", "UCX_TCP_BRIDGE_ENABLE")
"""What ``configure_ucx_for_peers`` may set."""
_SET_BY_KVTIER: dict[str, str] = {}  # what configure_ucx_for_peers set: not the user's to keep


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


def route_interface(host: str, port: int = 9) -> str | None:
    """The interface this host sends from to reach ``host`` (``None``: no route, or a name
    that does not resolve). A UDP ``connect`` asks the kernel's routing table; nothing is sent."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(info[0], socket.SOCK_DGRAM) as sock:
            sock.connect(info[4])
            source = sock.getsockname()[0]
    except (OSError, IndexError):
        return None
    return interface_of(source)


def on_this_host(host: str) -> bool:
    """Whether ``host`` is loopback or an address of an interface of this network namespace."""
    return interface_of(host) is not None


def configure_ucx_for_peers(hosts: list[str]) -> dict[str, str]:
    """Set the UCX variables of the module docstring for a client of peers on ``hosts``
    (before its NIXL agent starts); the values in force for each of them.

    A variable the user set is kept as it is; one this function set for an earlier client
    of this process is replaced (UCX reads the environment when each agent starts).
    """
    interfaces: list[str] = []
    local = False
    for host in hosts:
        name = interface_of(host)
        local = local or name is not None
        name = name or route_interface(host)
        if name is None:
            log.warning("no route to peer host %s: UCX_NET_DEVICES left as it is", host)
            interfaces = []
            break
        if name not in interfaces:
            interfaces.append(name)
    wanted: dict[str, str] = {}
    if interfaces:
        wanted["UCX_NET_DEVICES"] = ",".join(interfaces)
        if any(os.path.isdir(f"/sys/class/net/{name}/bridge") for name in interfaces):
            wanted["UCX_TCP_BRIDGE_ENABLE"] = "y"
    if hosts and not local:
        wanted["UCX_TLS"] = NOT_BETWEEN_HOSTS
        wanted["UCX_TCP_TX_SEG_SIZE"] = TCP_SEND_SEGMENT
    in_force = {}
    for var in VARIABLES:
        current = os.environ.get(var)
        ours = current is not None and _SET_BY_KVTIER.get(var) == current
        if current is not None and not ours:
            if var in wanted and wanted[var] != current:
                log.info("%s=%s (set by the user; the peers would want %s)", var, current, wanted[var])
            in_force[var] = current
        elif var in wanted:
            os.environ[var] = _SET_BY_KVTIER[var] = wanted[var]
            in_force[var] = wanted[var]
        elif ours:  # set for an earlier client, not wanted by this one
            del os.environ[var]
            _SET_BY_KVTIER.pop(var)
    log.info("UCX for peers on %s: %s", sorted(set(hosts)), in_force or "UCX's defaults")
    return in_force
