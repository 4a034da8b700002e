"""``kvtier bench sglang``: the SGLang backend's page calls against its tier's own calls.

The same bytes go two ways in the same run, interleaved in every round (who goes first
alternates), each round with new keys:

- the tier: ``DiskTier.put`` / ``DiskTier.get`` of rows already laid end to end in one
  buffer, awaited directly: the cost of the tier alone;
- the backend: ``KVTierStorage.batch_set_v1`` / ``batch_get_v1`` of SGLang host pages
  (``bench.sglang_pool``: an MHA ``page_first`` pool, K and V of a page apart), as SGLang's
  backup and IO threads call them: key conversion, the pool's buffer meta, the copies into
  and out of staging rows, the tier engine's thread and the same tier underneath.

Reported: GB/s of each (medians over rounds), and ``set_ratio`` / ``get_ratio`` (backend
over tier; the backend's overhead is what keeps them under 1). Reads are warm (the rows
file in the page cache), so they show CPU costs, not the device. Every get is checked
byte for byte.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import uvloop

from bench.report import write_json
from bench.sglang_pool import dynamic_config, make_pool, storage_config
from offload.sglang import KVTierStorage, page_key
from tiers.disk import DiskTier
from tiers.settings import DiskSettings

NAMESPACE = bytes(range(16))
LAYOUT_ID = bytes(range(16, 32))


def page_keys(n: int, salt: str) -> list[str]:
    return [hashlib.sha256(f"{salt}-{i}".encode()).hexdigest() for i in range(n)]


def measure(args: argparse.Namespace, workdir: Path) -> dict:
    pool = make_pool(
        "mha",
        "page_first",
        page_size=args.page_tokens,
        pages=2 * args.pages,
        layers=args.layers,
        heads=args.heads,
        head_dim=args.head_dim,
    )
    src, dst = list(range(args.pages)), list(range(args.pages, 2 * args.pages))
    sent = [pool.fill(p, seed=p) for p in src]
    row_bytes = len(sent[0])
    capacity = (args.rounds + 2) * args.pages * row_bytes * 2
    tier_settings = {"kind": "disk", "capacity": capacity}
    backend = KVTierStorage(
        storage_config(dynamic_config([{**tier_settings, "path": str(workdir / "backend")}])), {}
    )
    backend.register_mem_pool_host(pool)
    raw = DiskTier(DiskSettings(path=str(workdir / "tier"), capacity_bytes=capacity), NAMESPACE, LAYOUT_ID)
    rows = np.frombuffer(b"".join(sent), dtype=np.uint8).copy()
    out = np.zeros_like(rows)
    view, out_view = memoryview(rows), memoryview(out)
    times: dict[str, list[float]] = {"tier_set": [], "backend_set": [], "tier_get": [], "backend_get": []}
    op_bytes = args.pages * row_bytes
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(raw.open(None))
        try:
            for r in range(args.rounds + 1):  # round 0 warms up, untimed
                keys = page_keys(args.pages, f"round{r}")
                raw_keys = [page_key(k) for k in keys]
                put_rows = [(k, view[i * row_bytes : (i + 1) * row_bytes]) for i, k in enumerate(raw_keys)]
                get_rows = [
                    (k, out_view[i * row_bytes : (i + 1) * row_bytes]) for i, k in enumerate(raw_keys)
                ]

                def tier_set() -> None:
                    assert all(runner.run(raw.put(put_rows)))  # noqa: B023 (called in this round)

                def backend_set() -> None:
                    assert all(backend.batch_set_v1(keys, pool.slots(*src)))  # noqa: B023

                def tier_get() -> None:
                    assert all(runner.run(raw.get(get_rows)))  # noqa: B023

                def backend_get() -> None:
                    assert all(backend.batch_get_v1(keys, pool.slots(*dst)))  # noqa: B023

                pairs = [(tier_set, backend_set), (tier_get, backend_get)]
                for first, second in pairs:
                    order = (first, second) if r % 2 else (second, first)
                    for op in order:
                        began = time.perf_counter()
                        op()
                        if r:
                            times[op.__name__].append(time.perf_counter() - began)
                if bytes(out) != bytes(rows) or any(
                    pool.page_bytes(d) != s for d, s in zip(dst, sent, strict=True)
                ):
                    raise AssertionError("a get returned other bytes than were set")
                for d in dst:
                    pool.wipe(d)
        finally:
            runner.run(raw.close())
            backend.close()
    gbps = {name: op_bytes / statistics.median(t) / 1e9 for name, t in times.items()}
    return {
        "row_bytes": row_bytes,
        "pages": args.pages,
        **{f"{name}_gbps": value for name, value in gbps.items()},
        "set_ratio": gbps["backend_set"] / gbps["tier_set"],
        "get_ratio": gbps["backend_get"] / gbps["tier_get"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier bench sglang", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    parser.add_argument("--pages", type=int, default=32, help="pages per call (SGLang sends up to 128)")
    parser.add_argument("--page-tokens", type=int, default=64, help="tokens per page (SGLang's --page-size)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8, help="KV heads of this rank")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--dir", default=None, help="where the disk tiers go (default: the temp dir)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    command = " ".join(["kvtier bench sglang", *argv])
    print(f"$ {command}")
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-sglang-", dir=args.dir) as workdir:
        result = measure(args, Path(workdir))
    mib = result["row_bytes"] / 2**20
    print(
        f"{args.pages} pages of {mib:g} MiB per call (fp16 MHA page_first, K and V apart), "
        f"{args.rounds} rounds; {os.cpu_count()} CPUs, {platform.machine()}; warm reads; medians, GB/s"
    )
    print(f"{'':5} {'tier':>6} {'backend':>8} {'ratio':>6}")
    for what in ("set", "get"):
        print(
            f"{what:5} {result[f'tier_{what}_gbps']:6.2f} {result[f'backend_{what}_gbps']:8.2f} "
            f"{result[f'{what}_ratio']:6.2f}"
        )
    write_json(args.json, {"command": command, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
