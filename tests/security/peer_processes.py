"""A peer's processes and their sockets, seen from outside through ``/proc`` (the peer and
its children, the tenant workers): for the tests that count descriptors, connections in
CLOSE-WAIT or listeners."""

from __future__ import annotations

import os
from pathlib import Path

LISTEN = "0A"
CLOSE_WAIT = "08"


def peer_processes(pid: int) -> list[int]:
    """The peer and its children (the tenant workers)."""
    out = [pid]
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def open_descriptors(pid: int) -> tuple[int, set[str]]:
    """How many descriptors the peer's processes hold, and the inodes of their sockets."""
    count, inodes = 0, set()
    for proc in peer_processes(pid):
        for fd in os.listdir(f"/proc/{proc}/fd"):
            count += 1
            try:
                target = os.readlink(f"/proc/{proc}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return count, inodes


def tcp_sockets(pid: int, inodes: set[str]) -> list[tuple[str, str]]:
    """(local address in hex as ``/proc/net/tcp`` writes it, state) of each TCP socket among
    ``inodes``, from ``pid``'s network namespace."""
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                found.append((fields[1].split(":")[0], fields[3]))
    return found
