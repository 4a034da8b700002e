"""``kvtier bench mooncake``: put and get GB/s through the Mooncake tier, against the store's own calls.

A ``mooncake_master`` and one storage process (a Mooncake client that mounts a segment and
nothing else) run on this machine, on 127.0.0.1. The benchmark's client mounts no memory,
so every row crosses processes over Mooncake's transfer engine (TCP here), as it would
to another machine. The same host rows (2 MiB by default) move four ways, interleaved in
every repeat so drift hits all alike:

- store put / store get: ``batch_put_from`` / ``batch_get_into`` of the rows, one batch,
  by the same client: the cost of the store alone.
- ``MooncakeTier.put`` / ``MooncakeTier.get``: the whole tier (keys, header + row objects,
  checksums, verification, its thread and deadline).

Then ``bench.remote`` measures the NIXL peer tier on the same row shape, beside it.
Reported: GB/s of each, ``put_ratio`` and ``get_ratio`` (tier over store, target >= 0.8).
Every get is checked byte for byte against what was put.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import uvloop

from bench import remote
from bench.mooncake_master import MasterProcess
from bench.remote import _die_with_parent, _timed, aligned_zeros, spawn
from bench.report import write_json
from tiers.address import Address
from tiers.fast_checksum import checksum_at
from tiers.mooncake import MIN_SEGMENT_BYTES, MooncakeTier, object_key, store_class
from tiers.settings import MooncakeSettings

TARGET = 0.8
LAYOUT = b"bench-mooncake1\0"


def serve_storage(master: str, segment_bytes: int) -> int:
    """The storage process: mount a segment into the store, say so, wait for stdin to close."""
    store = store_class()()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment_bytes, 16 << 20, "tcp", "", master)
    sys.stdout.write(f"ready {rc}\n")
    sys.stdout.flush()
    sys.stdin.readline()
    store.close()
    return 0


async def measure(args: argparse.Namespace, workdir: Path) -> dict:
    rows, row_bytes = args.rows, args.row_bytes
    op_bytes = rows * row_bytes
    master = MasterProcess(workdir / "master.log", preexec_fn=_die_with_parent)
    storage = None
    tier = None
    try:
        segment = max(MIN_SEGMENT_BYTES, 3 * 2 * (op_bytes + rows * 4096))  # a round's objects, twice over
        storage, line = spawn(
            ["-m", "bench.mooncake", "--storage", master.address, str(segment)], dict(os.environ)
        )
        if line != "ready 0":
            raise RuntimeError(f"the storage process did not join the store: {line!r}")
        host = aligned_zeros(2 * op_bytes)
        src, dst = host[:op_bytes], host[op_bytes:]
        src[:] = np.random.default_rng(args.seed).integers(0, 256, op_bytes, dtype=np.uint8)
        view = memoryview(host)
        src_rows = [view[i * row_bytes : (i + 1) * row_bytes] for i in range(rows)]
        dst_rows = [view[(rows + i) * row_bytes : (rows + i + 1) * row_bytes] for i in range(rows)]
        src_addrs = [host.ctypes.data + i * row_bytes for i in range(rows)]
        dst_addrs = [a + op_bytes for a in src_addrs]
        settings = MooncakeSettings(capacity_bytes=0, master=Address.parse(master.address), deadline_s=30.0)
        tier = MooncakeTier(settings, os.urandom(16), LAYOUT)
        await tier.open(view)
        store = tier._store  # the same client, its host buffer registered by the tier
        loop = asyncio.get_running_loop()

        def keys(kind: str, repeat: int) -> list[bytes]:
            return [f"{kind}{repeat}-{i}".encode().ljust(36, b".") for i in range(rows)]

        def store_put(names: list[str]) -> list[bool]:
            return [code == 0 for code in store.batch_put_from(names, src_addrs, [row_bytes] * rows)]

        def store_get(names: list[str]) -> list[bool]:
            return [code == row_bytes for code in store.batch_get_into(names, dst_addrs, [row_bytes] * rows)]

        async def in_thread(fn, *fn_args):  # type: ignore[no-untyped-def]
            return await loop.run_in_executor(None, fn, *fn_args)  # a coroutine, which _timed awaits

        def checksum_all() -> None:
            for row, addr in zip(src_rows, src_addrs, strict=True):
                checksum_at(row, addr)

        times: dict[str, list[float]] = {
            name: [] for name in ("store_put", "put", "store_get", "get", "checksum")
        }
        for repeat in range(args.repeats + 1):  # the first round warms up and is not counted
            raw = [k.hex() for k in keys("raw", repeat)]
            mine = keys("tier", repeat)
            round_times = {
                "store_put": await _timed(lambda r=raw: in_thread(store_put, r)),
                "put": await _timed(lambda m=mine: tier.put(list(zip(m, src_rows, strict=True)))),
            }
            dst.fill(0)
            round_times["store_get"] = await _timed(lambda r=raw: in_thread(store_get, r))
            if not np.array_equal(src, dst):
                raise RuntimeError("the store's batch_get_into did not return the bytes put")
            dst.fill(0)
            round_times["get"] = await _timed(lambda m=mine: tier.get(list(zip(m, dst_rows, strict=True))))
            if not np.array_equal(src, dst):
                raise RuntimeError("the tier's get did not return the bytes put")
            round_times["checksum"] = await _timed(checksum_all)
            stale = raw + [object_key(tier.namespace, k) for k in mine]  # room for the next round
            await loop.run_in_executor(None, store.batch_remove, stale, True)
            if repeat:
                for name, seconds in round_times.items():
                    times[name].append(seconds)
    finally:
        if tier is not None:
            await tier.close()
        if storage is not None:
            assert storage.stdin is not None
            storage.stdin.close()
            try:
                storage.wait(10)
            except Exception:
                storage.kill()
        master.close()
    gbps = {name: op_bytes / statistics.median(t) / 1e9 for name, t in times.items()}
    return {
        **remote.ratio_figures(gbps, put_base="store_put", get_base="store_get"),
        **remote.row_figures(args),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier bench mooncake", description=__doc__.split("\n\n")[0])
    remote.add_row_arguments(parser, repeats=9)
    parser.add_argument("--no-peer", action="store_true", help="skip the NIXL peer tier figures")
    parser.add_argument("--storage", nargs=2, metavar=("MASTER", "SEGMENT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # Mooncake's C++ INFO lines, on stderr
    if args.storage:
        return serve_storage(args.storage[0], int(args.storage[1]))
    command = "kvtier bench mooncake " + " ".join(sys.argv[3:] if argv is None else argv)
    print(f"$ {command.strip()}")
    print(
        f"{args.rows} rows of {args.row_bytes} B per op; a mooncake_master and a storage process on "
        f"127.0.0.1 (TCP); {os.cpu_count()} cores, {platform.machine()}"
    )
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-mooncake-") as workdir:
        fig = uvloop.run(measure(args, Path(workdir)))
        peer = None
        if not args.no_peer:
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
            peer_args = argparse.Namespace(
                rows=args.rows,
                row_bytes=args.row_bytes,
                transfer_bytes=None,
                checksum_thread="on",
                repeats=args.repeats,
                seed=args.seed,
            )
            peer = uvloop.run(remote.measure(peer_args, Path(workdir)))
    header = ("op", "tier GB/s", "store GB/s", "ratio", "target", "ceiling", "peer GB/s")
    print("{:4} {:>9} {:>10} {:>6} {:>6} {:>7} {:>9}".format(*header))
    for op in ("put", "get"):
        peer_gbps = f"{peer[f'{op}_gbps']:9.2f}" if peer else f"{'-':>9}"
        print(
            f"{op:4} {fig[f'{op}_gbps']:9.2f} {fig[f'store_{op}_gbps']:10.2f} {fig[f'{op}_ratio']:6.2f} "
            f"{TARGET:>6} {fig[f'{op}_ceiling']:7.2f} {peer_gbps}"
        )
    print(
        f"xxh3 of the same rows: {fig['checksum_gbps']:.2f} GB/s; ceiling = the store's own call with every "
        "row checksummed, copy and hash not overlapping; peer = the NIXL peer tier (kvtier bench remote)"
    )
    if args.json:
        payload = {
            "command": command.strip(),
            "baseline": "the store's batch_put_from/batch_get_into of the same rows, same client, same run",
            "target": TARGET,
            **fig,
        }
        if peer is not None:
            payload.update(peer_put_gbps=peer["put_gbps"], peer_get_gbps=peer["get_gbps"])
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
