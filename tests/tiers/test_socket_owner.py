"""``tiers/remote/socket_owner.py``: the kernel's answer to who holds a connection's other end."""

from __future__ import annotations

import socket
import subprocess
import sys

from tiers.remote.socket_owner import owner_pids

_CLIENT = """
import socket, sys
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
print("connected", flush=True)
sys.stdin.readline()
"""


def test_the_process_holding_the_other_end_is_found():
    listener = socket.create_server(("127.0.0.1", 0))
    child = subprocess.Popen(
        [sys.executable, "-c", _CLIENT, str(listener.getsockname()[1])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "connected"
        accepted, _ = listener.accept()
        assert owner_pids(accepted) == {child.pid}
        accepted.close()
    finally:
        child.kill()
        child.wait()
        listener.close()


def test_a_connection_within_this_process_has_no_other_owner():
    """This process is left out (the peer never binds a client to itself)."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname()[:2])
    accepted, _ = listener.accept()
    try:
        assert owner_pids(accepted) == set()
    finally:
        for s in (client, accepted, listener):
            s.close()
