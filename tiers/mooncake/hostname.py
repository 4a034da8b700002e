"""Which address a Mooncake client tells the others to reach it at (``local_hostname``).

Every client of a Mooncake Store publishes ``local_hostname`` with its segment: another
client that the master sends to that segment (a put placed there, a get of an object held
there) connects to that address. Mooncake's own default, and kvtier's until issue #20, was
``127.0.0.1``: a client mounts its segment fine with it, but across hosts every transfer to
that segment fails at once (``-800``, connection refused: the other host dials its own
loopback). Measured with three hosts as network namespaces: 760 of 1,200 rows dropped.

So an unset ``local_hostname`` is the address this machine uses to reach the master: the
source address the kernel picks for the route to it (``source_address_towards``; no packet
is sent). Whoever reaches the master reaches that address in a flat private network, which
is what Mooncake needs anyway (``docs/cluster.md``); a host with several networks sets the
key. A loopback ``local_hostname`` with a master elsewhere is refused (``loopback_problem``):
it cannot work, and it used to fail row by row, quietly.
"""

from __future__ import annotations

import ipaddress
import socket

from tiers.address import Address, split_host_port

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP literal or a name, no port) is this machine's loopback, judged
    from its text alone: ``127.0.0.0/8``, ``::1`` or a name such as ``localhost``. A name
    that merely resolves to the loopback is not caught here (see ``resolves_to_loopback``)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() in LOOPBACK_NAMES


def resolves_to_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback one (``False`` if it does not
    resolve: the caller's connection attempt reports that)."""
    if is_loopback(host):
        return True
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def loopback_problem(local_hostname: str, master: Address, *, resolve: bool = False) -> str | None:
    """What is wrong with ``local_hostname`` for a cluster whose master is ``master``: a
    loopback address while the master is not on this machine's loopback. Judged from the text
    alone (the configuration may be checked on another machine), or with ``resolve`` from
    what the master's name resolves to here. ``None``: nothing wrong visible."""
    host, _ = split_host_port(local_hostname)
    if not host or not is_loopback(host):
        return None
    if (resolves_to_loopback if resolve else is_loopback)(master.host):
        return None
    return (
        f"a loopback address, while the master ({master}) is not on this machine's loopback: "
        "other hosts cannot reach this client's segment there (every transfer to it would fail); "
        "leave local_hostname out (kvtier then uses this machine's address on the route to the "
        "master) or set the address other hosts reach this one at"
    )


def source_address_towards(host: str, port: int) -> str:
    """The source address the kernel picks for packets to ``host:port`` (a connected UDP
    socket: the route is looked up, nothing is sent). ``OSError`` if there is no route."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    last: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(sockaddr)
                return str(probe.getsockname()[0]).split("%")[0]
        except OSError as exc:
            last = exc
    raise last or OSError(f"{host!r} does not resolve")


def advertised_hostname(local_hostname: str, master: Address) -> str:
    """The ``local_hostname`` to give Mooncake: the configured one, or (``""``) this machine's
    address on the route to the master. ``ValueError`` (naming ``local_hostname``) for a
    loopback address with a master that is not on the loopback, or no route to the master."""
    if local_hostname:
        problem = loopback_problem(local_hostname, master, resolve=True)
        if problem:
            raise ValueError(f"local_hostname = {local_hostname!r}: {problem}")
        return local_hostname
    try:
        address = source_address_towards(master.host, master.port)
    except (OSError, UnicodeError) as exc:
        raise ValueError(
            f"local_hostname is not set and this machine has no route to the master {master} to take "
            f"its address from ({exc}); set local_hostname to the address other hosts reach this one at"
        ) from exc
    return address
