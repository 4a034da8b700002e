"""A storage host of a Mooncake Store: a kvtier Mooncake tier that only lends its segment.

``python -m bench.mooncake_storage --master HOST:PORT [--segment 64MiB] [--local-hostname H]``
opens a ``MooncakeTier`` with a segment and nothing else to do, prints ``mooncake storage
ready as <local_hostname>`` and serves until killed. With ``--local-hostname`` unset the
tier takes this machine's address on the route to the master, as a kvtier engine on that
host would (``tiers.mooncake.hostname``); a loopback one with a master elsewhere makes it
exit with the tier's error. What the cluster tests (``tests/cluster``) run in a storage
host, and a way to try a cluster by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import numpy as np

from tiers.address import Address
from tiers.base import TierError
from tiers.mooncake import MooncakeTier
from tiers.settings import MooncakeSettings
from tiers.sizes import parse_size

LAYOUT = b"mooncake-storage"  # no row of its own is ever read or written


async def serve(settings: MooncakeSettings) -> None:
    host = np.zeros(1 << 20, dtype=np.uint8)  # a tier needs a host buffer; nothing moves through it
    tier = MooncakeTier(settings, b"storage".ljust(16, b"\0"), LAYOUT)
    await tier.open(memoryview(host))
    print(f"mooncake storage ready as {tier.local_hostname}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await tier.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", required=True, help="the master's host:port")
    parser.add_argument("--segment", default="64MiB", help="memory lent to the store's pool")
    parser.add_argument(
        "--local-hostname", default="", help="default: the address on the route to the master"
    )
    args = parser.parse_args(argv)
    settings = MooncakeSettings(
        master=Address.parse(args.master),
        capacity_bytes=parse_size(args.segment),
        local_hostname=args.local_hostname,
    )
    try:
        asyncio.run(serve(settings))
    except TierError as exc:
        print(f"mooncake storage: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
