"""``kvtier bench disk``: row write and read GB/s through the disk tier vs plain file I/O.

The same bytes go two ways in the same run: through ``DiskTier`` (each row written to its
pages of the rows file with its checksummed trailer, one LMDB index commit per batch,
evicting as it goes; reads verify every row) and through a plain file (``pwritev`` of each
batch, sequential ``readv``), with the same fsync policy: ``fsync`` flushes every batch to
the device on both sides (``fdatasync`` of the rows file and a synced LMDB commit;
``fdatasync`` for the file), ``nosync`` flushes neither. Rows are Llama-3-8B-shaped KV
blocks by default (32 layers x K,V x 16 tokens x 8 KV heads x head dim 128, bf16: 2 MiB).

Page cache: every write and every "cold" read starts with its own files flushed and dropped
from the page cache (``POSIX_FADV_DONTNEED``, the tier closed so no mapping pins pages),
on both sides alike; a disk tier is larger than RAM, so what it writes over and reads back
is mostly not cached. A "warm" read follows the cold one, everything cached: it shows the
CPU cost of the tier (lookups, checksums, copies) alone.

Steady state: both files are written once before timing and then written over, never
created or deleted inside a round (on ext4 with ``discard``, deleting hundreds of MiB stalls
the I/O that follows). The tier gets new keys every round with room for one round, so each
round's puts evict the previous round's rows, as a full spill tier does all the time. The
two sides alternate who goes first; figures are medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

import uvloop

from bench.report import write_json
from tiers.disk import DiskTier
from tiers.disk.lmdb_store import DATA_FILES
from tiers.settings import DiskSettings

ROW_BYTES = 32 * 2 * 16 * 8 * 128 * 2  # layers x (K, V) x tokens x KV heads x head dim x bf16
NAMESPACE = bytes(range(16))
LAYOUT_ID = bytes(range(16, 32))
TARGET = 0.7
MEASURED = (
    "DiskTier.put/get of whole batches (rows file + LMDB index, every row checksummed on write "
    "and verified on read, evicting the previous round's rows) vs plain pwritev/readv"
)

Op = Callable[[], Awaitable[float]]


@dataclass
class Figures:
    write_gbps: float
    read_gbps: float
    warm_read_gbps: float
    plain_write_gbps: float
    plain_read_gbps: float
    plain_warm_read_gbps: float
    write_ratio: float
    read_ratio: float
    warm_read_ratio: float


@dataclass
class Setup:
    rows: int
    row_bytes: int
    batch: int
    rounds: int
    workdir: str


def drop_cache(path: str) -> None:
    """Flush ``path`` and drop its pages from the page cache (only clean pages can go)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Bench:
    """The timed operations of one fsync policy; each returns its seconds."""

    def __init__(self, setup: Setup, sync: bool) -> None:
        self.s = setup
        self.sync = sync
        self.total = setup.rows * setup.row_bytes
        self.plain_path = os.path.join(setup.workdir, "plain.bin")
        self.tier_path = os.path.join(setup.workdir, "tier")
        self.tier_files = [os.path.join(self.tier_path, name) for name in DATA_FILES]
        self.src = bytearray(os.urandom(setup.batch * setup.row_bytes))
        self.dst = bytearray(setup.batch * setup.row_bytes)
        self.src_rows = _rows(self.src, setup.row_bytes)
        self.dst_rows = _rows(self.dst, setup.row_bytes)
        self.generation = 0  # the tier's keys of the current round

    def _tier(self) -> DiskTier:
        # The rows of one round, plus what each costs beyond its bytes (trailer page, index entry).
        capacity = self.s.rows * (self.s.row_bytes + 2 * 4096)
        settings = DiskSettings(path=self.tier_path, capacity_bytes=capacity)
        return DiskTier(settings, NAMESPACE, LAYOUT_ID, sync=self.sync)

    def _batches(self) -> list[list[bytes]]:
        gen = self.generation.to_bytes(4, "big")
        keys = [gen + i.to_bytes(28, "big") + (0).to_bytes(4, "big") for i in range(self.s.rows)]
        return [keys[at : at + self.s.batch] for at in range(0, len(keys), self.s.batch)]

    async def prepare(self) -> None:
        """Write both files once, untimed."""
        os.close(os.open(self.plain_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
        await self.plain_write()
        await self.tier_write()

    async def plain_write(self) -> float:
        drop_cache(self.plain_path)
        fd = os.open(self.plain_path, os.O_WRONLY)
        try:
            start = time.perf_counter()
            offset = 0
            for batch in self._batches():
                offset += os.pwritev(fd, self.src_rows[: len(batch)], offset)
                if self.sync:
                    os.fdatasync(fd)
            return time.perf_counter() - start
        finally:
            os.close(fd)

    async def plain_read(self, cold: bool) -> float:
        if cold:
            drop_cache(self.plain_path)
        fd = os.open(self.plain_path, os.O_RDONLY)
        try:
            start = time.perf_counter()
            for batch in self._batches():
                got = os.readv(fd, self.dst_rows[: len(batch)])
                if got != len(batch) * self.s.row_bytes:
                    raise RuntimeError(f"plain read returned {got} bytes")
            elapsed = time.perf_counter() - start
        finally:
            os.close(fd)
        self._check_dst()
        return elapsed

    async def tier_write(self) -> float:
        self._drop_tier_cache()
        self.generation += 1
        tier = self._tier()
        await tier.open()
        try:
            start = time.perf_counter()
            for batch in self._batches():
                stored = await tier.put(list(zip(batch, self.src_rows, strict=False)))
                if not all(stored):
                    raise RuntimeError(f"the tier dropped rows: {tier.stats()}")
            return time.perf_counter() - start
        finally:
            await tier.close()

    async def tier_read(self, cold: bool) -> float:
        if cold:
            self._drop_tier_cache()
        tier = self._tier()
        await tier.open()  # rebuilds the index (no row is read): not part of the timing
        try:
            start = time.perf_counter()
            for batch in self._batches():
                hits = await tier.get(list(zip(batch, self.dst_rows, strict=False)))
                if not all(hits):
                    raise RuntimeError(f"the tier missed rows: {tier.stats()}")
            elapsed = time.perf_counter() - start
        finally:
            await tier.close()
        self._check_dst()
        return elapsed

    def _drop_tier_cache(self) -> None:
        for path in self.tier_files:  # the rows file and the LMDB index
            if os.path.exists(path):
                drop_cache(path)

    def _check_dst(self) -> None:
        """The last batch read holds the bytes written (every batch wrote the same rows)."""
        n = (self.s.rows - 1) % self.s.batch + 1
        if self.dst[: n * self.s.row_bytes] != self.src[: n * self.s.row_bytes]:
            raise RuntimeError("a read returned other bytes than were written")

    async def run(self) -> Figures:
        await self.prepare()
        pairs: list[tuple[tuple[str, Op], tuple[str, Op]]] = [
            (("pw", self.plain_write), ("w", self.tier_write)),
            (("pr", lambda: self.plain_read(True)), ("r", lambda: self.tier_read(True))),
            (("pwr", lambda: self.plain_read(False)), ("wr", lambda: self.tier_read(False))),
        ]
        times: dict[str, list[float]] = {key: [] for pair in pairs for key, _ in pair}
        for round_ in range(self.s.rounds):
            for pair in pairs:
                for key, op in pair if round_ % 2 == 0 else pair[::-1]:
                    times[key].append(await op())
        gbps = {key: self.total / statistics.median(t) / 1e9 for key, t in times.items()}
        return Figures(
            write_gbps=gbps["w"],
            read_gbps=gbps["r"],
            warm_read_gbps=gbps["wr"],
            plain_write_gbps=gbps["pw"],
            plain_read_gbps=gbps["pr"],
            plain_warm_read_gbps=gbps["pwr"],
            write_ratio=gbps["w"] / gbps["pw"],
            read_ratio=gbps["r"] / gbps["pr"],
            warm_read_ratio=gbps["wr"] / gbps["pwr"],
        )


def _rows(buffer: bytearray, row_bytes: int) -> list[memoryview]:
    view = memoryview(buffer)
    return [view[at : at + row_bytes] for at in range(0, len(buffer), row_bytes)]


def _filesystem(path: str) -> str:
    """The filesystem type under ``path`` (from /proc/mounts), for the record."""
    best, fstype = "", "unknown"
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                mount_point, kind = line.split()[1:3]
                if os.path.realpath(path).startswith(mount_point) and len(mount_point) > len(best):
                    best, fstype = mount_point, kind
    except (OSError, ValueError):
        pass
    return fstype


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier bench disk", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    parser.add_argument("--rows", type=int, default=256, help="rows per pass (default 256 = 512 MiB)")
    parser.add_argument("--row-bytes", type=int, default=ROW_BYTES, help="bytes per row (default 2 MiB)")
    parser.add_argument("--batch", type=int, default=16, help="rows per put/get and per plain pwritev")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per figure (median)")
    parser.add_argument(
        "--sync",
        choices=("off", "on", "both"),
        default="both",
        help="fsync policy for both sides: off (the tier's default), on (every batch), both",
    )
    parser.add_argument("--dir", default=None, help="where to put the files (default: the temp dir)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    command = " ".join(["kvtier bench disk", *argv])
    print(f"$ {command}")
    policies = {"off": [False], "on": [True], "both": [False, True]}[args.sync]
    results: dict[str, Figures] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-disk-", dir=args.dir) as workdir:
        fstype = _filesystem(workdir)
        gib = args.rows * args.row_bytes / 2**30
        size = f"{args.rows} rows x {args.row_bytes / 2**20:g} MiB ({gib:.2f} GiB)"
        where = f"{workdir} on {fstype}, {os.cpu_count()} CPUs, {platform.machine()}"
        print(f"{size} per pass, {args.batch} rows per batch, {args.rounds} rounds; {where}")
        print(f"measured: {MEASURED}; medians")
        setup = Setup(args.rows, args.row_bytes, args.batch, args.rounds, workdir)
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            for sync in policies:
                results["fsync" if sync else "nosync"] = runner.run(Bench(setup, sync).run())
    print(
        f"{'policy':7} {'write':>6} {'plain':>6} {'ratio':>6} | {'cold rd':>7} {'plain':>6} {'ratio':>6} | "
        f"{'warm rd':>7} {'plain':>6} {'ratio':>6}   (GB/s; target ratio >= {TARGET})"
    )
    for name, fig in results.items():
        print(
            f"{name:7} {fig.write_gbps:6.2f} {fig.plain_write_gbps:6.2f} {fig.write_ratio:6.2f} | "
            f"{fig.read_gbps:7.2f} {fig.plain_read_gbps:6.2f} {fig.read_ratio:6.2f} | "
            f"{fig.warm_read_gbps:7.2f} {fig.plain_warm_read_gbps:6.2f} {fig.warm_read_ratio:6.2f}"
        )
    headline = "nosync" if "nosync" in results else "fsync"
    if args.json:
        payload = {
            "command": command,
            "measured": MEASURED,
            "baseline": "plain sequential pwritev/readv of the same bytes, same run, same fsync policy",
            "page_cache": "writes and cold reads start with their files fsynced and dropped (DONTNEED)",
            "statistic": "median over rounds; the two sides alternate who goes first",
            "headline_policy": headline,
            "write_ratio": results[headline].write_ratio,
            "read_ratio": results[headline].read_ratio,
            "target": TARGET,
            "rows": args.rows,
            "row_bytes": args.row_bytes,
            "batch_rows": args.batch,
            "rounds": args.rounds,
            "filesystem": fstype,
            "cpus": os.cpu_count(),
            "policies": {name: asdict(fig) for name, fig in results.items()},
        }
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
