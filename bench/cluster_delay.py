"""A userspace relay that delays every frame between two interfaces: the simulated cluster's
``delay`` (this kernel has no ``netem``).

    python -m bench.cluster_delay IFACE_A IFACE_B DELAY_MS

Frames read on one interface are sent out of the other ``DELAY_MS`` later, both ways, in
order. ``PACKET_VNET_HDR`` keeps segmentation-offloaded frames (up to 64 KiB) whole, as the
veth driver passes them, so the relay moves a TCP stream in few large frames. Prints
``relaying`` once both sockets are open; runs until killed.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import sys
import threading
import time

ETH_P_ALL = 0x0003
PACKET_VNET_HDR = 15
SOL_PACKET = 263
MAX_FRAME = 10 + (64 << 10) + 256  # virtio-net header + the largest offloaded frame


def _socket(iface: str) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind((iface, ETH_P_ALL))
    return sock


def _direction(source: socket.socket, sink: socket.socket, delay_s: float) -> None:
    """Read frames from ``source`` and send each out of ``sink`` ``delay_s`` after it came."""
    queue: collections.deque[tuple[float, bytes]] = collections.deque()
    ready = threading.Condition()

    def send() -> None:
        while True:
            with ready:
                while not queue:
                    ready.wait()
                due, frame = queue[0]
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            with ready:
                queue.popleft()
            with contextlib.suppress(OSError):  # a frame the other side cannot take is lost, as on a wire
                sink.send(frame)

    threading.Thread(target=send, daemon=True).start()
    while True:
        frame, address = source.recvfrom(MAX_FRAME)
        if address[2] == socket.PACKET_OUTGOING:
            continue  # what the relay itself sent out of this interface
        with ready:
            queue.append((time.monotonic() + delay_s, frame))
            ready.notify()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    a, b, delay_s = _socket(argv[0]), _socket(argv[1]), float(argv[2]) / 1000
    threading.Thread(target=_direction, args=(b, a, delay_s), daemon=True).start()
    print("relaying", flush=True)
    _direction(a, b, delay_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
