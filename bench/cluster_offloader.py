"""An engine host of the simulated cluster running a standalone ``Offloader`` (host tier +
remote tier over the peers), driven by JSON lines: what an engine sees when a peer fails.

    python -m bench.cluster_offloader --peers A:P,B:P [--deadline-s S] [--host-rows N]

Requests (one line each, one answer line each; the first line out is ``{"ready": true}``):

- ``{"op": "store", "salt": S, "count": N, "first_block": B}``: store keys ``(S, i)`` from
  device blocks ``B + i``
  (write-through: every row also goes to its peer), wait until the tiers are idle; the
  host tier keeps only ``--host-rows``, so earlier rows live on the peers only;
- ``{"op": "owners", "salt": S, "count": N}``: the peer that owns each key now;
- ``{"op": "lookup", "salt": S, "count": N}``: ``Offloader.lookup`` of each key alone,
  ``result`` (1 hit / 0 miss) and ``elapsed_s`` of them all (a lookup never waits for the
  network: a key only a peer holds is a miss now and starts its promotion);
- ``{"op": "settle", "timeout_s": T}``: ``wait_tiers``: how long the lower-tier work (the
  promotions) took to end, or the error if it did not;
- ``{"op": "load_check", "salt": S, "count": N}``: load every key that is a hit into spare
  blocks; ``exact``: each one's bytes are the ones stored;
- ``{"op": "quit"}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch

from offload.api import Offloader
from offload.keys import make_key

BLOCKS = 128
SHAPE = (2, 16, 4, 64)  # K/V, tokens, heads, head dim: 32 KiB per layer in float32


def key_of(salt: str, i: int) -> bytes:
    return make_key(f"{salt}/{i}".encode().ljust(16, b".")[:16], 0)


def serve(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    kv = {f"layer.{i}": torch.randn(BLOCKS, *SHAPE) for i in range(2)}
    groups = [list(kv)]
    row_bytes = 2 * torch.zeros(SHAPE).numel() * 4
    config = {
        "tiers": [
            {"kind": "host", "capacity": args.host_rows * row_bytes},
            {
                "kind": "remote",
                "peers": args.peers.split(","),
                "capacity": "64MiB",
                "placement": "write-through",
                "deadline_s": args.deadline_s,
            },
        ]
    }
    stored: dict[bytes, bytes] = {}
    with Offloader(kv, groups, config) as offloader:
        remote = next(t for t in offloader.manager.lower.tiers if t.kind == "remote")
        sys.stdout.write(json.dumps({"ready": True, "peers_up": remote.peers_up()}) + "\n")
        sys.stdout.flush()
        for line in sys.stdin:
            request = json.loads(line)
            op = request["op"]
            if op == "quit":
                break
            keys = [key_of(str(request.get("salt", "")), i) for i in range(int(request.get("count", 0)))]
            answer: dict = {}
            began = time.monotonic()
            try:
                if op == "store":
                    first = int(request.get("first_block", 0))
                    for i, key in enumerate(keys, start=first):
                        offloader.store([key], [i])
                        offloader.wait()
                        offloader.wait_tiers()
                        stored[key] = offloader.caches.read_row(0, i)
                elif op == "owners":
                    answer["result"] = [remote.owner(key) for key in keys]
                elif op == "lookup":
                    answer["result"] = [offloader.lookup([key]) for key in keys]
                elif op == "settle":
                    offloader.wait_tiers(float(request["timeout_s"]))
                elif op == "load_check":
                    hits = [key for key in keys if offloader.lookup([key]) == 1]
                    spare = list(range(BLOCKS - len(hits), BLOCKS))
                    offloader.load(hits, spare)
                    offloader.wait()
                    answer["loaded"] = len(hits)
                    answer["exact"] = all(
                        offloader.caches.read_row(0, b) == stored[k] for k, b in zip(hits, spare, strict=True)
                    )
                else:
                    raise ValueError(f"unknown op {op!r}")
            except Exception as exc:
                answer["error"] = f"{type(exc).__name__}: {exc}"
            answer["elapsed_s"] = time.monotonic() - began
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster_offloader")
    parser.add_argument("--peers", required=True, help="HOST:PORT,HOST:PORT,...")
    parser.add_argument("--deadline-s", type=float, default=1.0)
    parser.add_argument("--host-rows", type=int, default=4)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
