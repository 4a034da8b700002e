"""A child process for the disk tier's multi-process tests (run with ``python -m``).

``storm PATH REPORT SEED SYNC``: put batches of rows into a ``DiskTier`` at PATH forever;
after each batch is committed, append its keys (hex, one line per batch) to REPORT. The
parent kills it with SIGKILL at a random moment; every key on a complete line of REPORT
was committed before the kill.

``hold PATH``: open a ``DiskTier`` at PATH, print ``ready``, and hold it until stdin closes
(a real other process holding the directory lock).

``open PATH``: open a ``DiskTier`` at PATH (whose files a test has damaged), read every key
back, and print one JSON line: ``{"outcome": "error", "message": ...}`` for a ``TierError``,
else ``{"outcome": "opened", "rows": ..., "hits": ..., "wrong": ..., "stored": ...}`` (``wrong``:
rows served that are not the row stored; ``stored``: of 5 new rows put after the reads, in
one batch). ``open PATH N``: the same with N new rows, each put in a commit of its own. A
signal shows as the process's negative return code.

Row contents are a function of the key alone (``expected_row``), so the parent can check
every row it reads back without being told what was written.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import sys

import uvloop

from tiers.base import TierError
from tiers.disk import DiskTier
from tiers.settings import DiskSettings

NAMESPACE = b"storm-namespace!"
LAYOUT_ID = b"storm-layout-id!"
KEYS = 300
ROW_BYTES = (1_000, 9_000, 70_000)  # in a leaf page, just past it, and many overflow pages
CAPACITY = 64 << 20  # above KEYS x max(ROW_BYTES): nothing is ever evicted


def key_of(i: int) -> bytes:
    """An OffloadKey-shaped key: 32-byte hash + 4-byte group index (the row size class)."""
    return hashlib.sha256(i.to_bytes(4, "big")).digest() + (i % len(ROW_BYTES)).to_bytes(4, "big")


def row_bytes(key: bytes) -> int:
    return ROW_BYTES[int.from_bytes(key[-4:], "big")]


def expected_row(key: bytes) -> bytes:
    return hashlib.shake_128(key).digest(row_bytes(key))


def make_tier(path: str, sync: bool = False) -> DiskTier:
    return DiskTier(DiskSettings(path=path, capacity_bytes=CAPACITY), NAMESPACE, LAYOUT_ID, sync=sync)


async def storm(path: str, report: str, seed: int, sync: bool) -> None:
    rng = random.Random(seed)
    tier = make_tier(path, sync)
    await tier.open()
    fd = os.open(report, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    while True:
        keys = [key_of(rng.randrange(KEYS)) for _ in range(rng.randint(1, 12))]
        rows = [(key, memoryview(expected_row(key))) for key in keys]
        stored = await tier.put(rows)
        done = [key.hex() for key, ok in zip(keys, stored, strict=True) if ok]
        os.write(fd, (" ".join(done) + "\n").encode())


async def hold(path: str) -> None:
    tier = make_tier(path)
    await tier.open()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await tier.close()


async def open_and_read(path: str, commits: int = 0) -> None:
    tier = make_tier(path)
    try:
        await tier.open()
    except TierError as exc:
        print(json.dumps({"outcome": "error", "message": str(exc)}), flush=True)
        return
    try:
        keys = [key_of(i) for i in range(KEYS)]
        dsts = [(key, memoryview(bytearray(row_bytes(key)))) for key in keys]
        found = await tier.get(dsts)
        wrong = sum(
            ok and bytes(dst) != expected_row(key) for (key, dst), ok in zip(dsts, found, strict=True)
        )
        rows = int(tier.stats()["rows"])
        fresh = [
            key_of(KEYS + i) for i in range(commits or 5)
        ]  # then the tier takes new rows (or drops them)
        if commits:  # each row its own commit
            stored = sum([sum(await tier.put([(key, memoryview(expected_row(key)))])) for key in fresh])
        else:
            stored = sum(await tier.put([(key, memoryview(expected_row(key))) for key in fresh]))
    finally:
        await tier.close()
    report = {"outcome": "opened", "rows": rows, "hits": sum(found), "wrong": wrong, "stored": stored}
    print(json.dumps(report), flush=True)


def main(argv: list[str]) -> None:
    if argv[0] == "storm":
        uvloop.run(storm(argv[1], argv[2], int(argv[3]), argv[4] == "1"))
    elif argv[0] == "hold":
        uvloop.run(hold(argv[1]))
    elif argv[0] == "open":
        uvloop.run(open_and_read(argv[1], int(argv[2]) if len(argv) > 2 else 0))
    else:
        raise SystemExit(f"unknown mode {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
