"""Which processes of this host hold the other end of a TCP connection: the kernel's answer.

A client on the same host announces a NIXL agent whose UCX worker address names the process
the peer's CMA copies go to (``process_vm_readv``/``writev``); nothing in the metadata proves
that process is the client's. The kernel knows who holds the client's end of the control
connection: its socket is the line of ``/proc/net/tcp`` (or ``tcp6``) whose local and remote
addresses are ours swapped, and its inode is among the open descriptors of the processes that
hold it (``/proc/PID/fd``). ``tiers/remote/tenant_worker.py`` then binds the agent to those
processes (a secret written straight into their memory must come back through the agent).

Reading other processes' descriptors needs the same user (or root): the peer and its clients
run as one user, or the peer as root. Blocking (it scans ``/proc``): run it off the event loop.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct


def _hex_address(host: str, port: int) -> tuple[str, str]:
    """``HOST:PORT`` as ``/proc/net/tcp`` and ``tcp6`` write it (each 32-bit word in host order)."""
    addr = ipaddress.ip_address(host.split("%")[0])
    v4 = addr if addr.version == 4 else addr.ipv4_mapped
    four = f"{struct.unpack('=I', v4.packed)[0]:08X}:{port:04X}" if v4 is not None else ""
    raw6 = (addr if addr.version == 6 else ipaddress.IPv6Address(f"::ffff:{addr}")).packed
    six = "".join(f"{w:08X}" for w in struct.unpack("=4I", raw6)) + f":{port:04X}"
    return four, six


def _client_inode(local: tuple, remote: tuple) -> str | None:
    """The inode of the socket whose local address is ``remote`` and remote address ``local``."""
    ours4, ours6 = _hex_address(local[0], local[1])
    theirs4, theirs6 = _hex_address(remote[0], remote[1])
    for table, mine, theirs in (("tcp", ours4, theirs4), ("tcp6", ours6, theirs6)):
        if not mine:
            continue
        try:
            with open(f"/proc/net/{table}") as lines:
                next(lines)
                for line in lines:
                    fields = line.split()
                    if fields[1] == theirs and fields[2] == mine:
                        return fields[9]
        except OSError:
            continue
    return None


def owner_pids(sock: socket.socket) -> set[int] | None:
    """The processes (other than this one) that hold the other end of ``sock``; ``None`` when
    that end is not a socket of this host's network namespace (the client is elsewhere)."""
    inode = _client_inode(sock.getsockname(), sock.getpeername())
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    me = os.getpid()
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            fds = os.scandir(f"/proc/{entry.name}/fd")
        except OSError:
            continue
        with fds:
            for fd in fds:
                try:
                    if os.readlink(fd.path) == target:
                        found.add(int(entry.name))
                        break
                except OSError:
                    continue
    return found
