"""A client process that connects to a peer again and again with one NIXL agent, then exits:
``python -m tests.security.reconnect_child PORT TOKEN COUNT``. Prints ``done`` and waits for
a line on stdin before it exits (so the caller can look at the peer while it lives, then after)."""

from __future__ import annotations

import sys

from tests.tiers.peer_fixtures import RawAgent, RawConnection, die_with_parent


def main() -> int:
    die_with_parent()
    port, token, count = int(sys.argv[1]), sys.argv[2].encode(), int(sys.argv[3])
    agent = RawAgent()
    refused = 0
    for _ in range(count):
        raw = RawConnection(port, timeout=10.0)
        try:
            raw.handshake(token, agent=agent)
        except (AssertionError, OSError):  # closed mid-handshake (its tenant's worker recycled)
            refused += 1
        finally:
            raw.close()
    print(f"done {refused}", flush=True)
    sys.stdin.readline()
    agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
