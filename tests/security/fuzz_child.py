"""A hostile client process: ``python -m tests.security.fuzz_child PORT TOKEN TENANT COUNT
SEED`` announces its real NIXL agent ``COUNT`` times, each time with metadata fuzzed by
``test_peer_isolation.fuzzed`` (two connections at once), and prints how many frames it sent
and how many the peer answered READY. Its own process, so that its UCX, its threads and its
CPU are not the victim client's (and a peer that crashed it would crash only it).

``START`` (optional) skips the first frames: the test starts another attacker at the first
frame not announced by one that died on the way (its own UCX, answered by the peer's workers
that loaded its fuzzed metadata, was seen to crash with SIGSEGV, at the same frame again
when restarted there). Before each frame it prints ``frame I``, its index."""

from __future__ import annotations

import contextlib
import sys
import threading

from tests.security.test_peer_isolation import announce, fuzzed
from tests.tiers.peer_fixtures import RawAgent, die_with_parent

THREADS = 2


def main() -> int:
    die_with_parent()
    port, token, tenant = int(sys.argv[1]), sys.argv[2].encode(), sys.argv[3]
    count, seed = int(sys.argv[4]), int(sys.argv[5])
    start = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    agent = RawAgent()
    blobs = fuzzed(agent.metadata, count, seed)
    ready = [0] * THREADS
    lock = threading.Lock()
    done = start

    def attack(k: int) -> None:
        nonlocal done
        for index in range(start + k, len(blobs), THREADS):
            with lock:  # one thread's line at a time: the test parses them
                print(f"frame {index}", flush=True)  # announced now: the last words of a crash
            with contextlib.suppress(OSError, AssertionError):  # refused or closed: the next one
                ready[k] += announce(port, token, tenant, agent, blobs[index])
            with lock:
                done += 1

    threads = [threading.Thread(target=attack, args=(k,)) for k in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(f"sent {done} ready {sum(ready)}", flush=True)  # (ready: this process's)
    agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
