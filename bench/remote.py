"""``kvtier bench remote``: put and get GB/s through a ``kvtier peer``, against raw NIXL.

One peer process (started here, with a token) and one raw NIXL target process (an agent
with a registered buffer, nothing else) run on this machine. The same host rows
(Llama-3-8B-shaped blocks: 2 MiB by default) move four ways, interleaved in every repeat
so drift hits all alike:

- raw WRITE / raw READ: one NIXL request from an agent in this process to the raw target,
  one descriptor per row: the cost of the bytes alone.
- ``RemoteTier.put`` / ``RemoteTier.get``: the whole tier (routing, control messages,
  checksums, verification), into and out of the peer's pool. The peer initiates every
  transfer, so a put is a READ by the peer (out of this process) and a get a WRITE by the
  peer (into it): on CMA, ``process_vm_readv`` and ``process_vm_writev``, which do not run
  at one speed. ``put_ratio``/``get_ratio`` keep the baseline of the figures before that
  change (put over raw WRITE, get over raw READ); ``*_same_direction`` set each against the
  raw transfer of the same direction the tier makes (put over raw READ, get over raw WRITE).

Also timed, for the ceilings: raw WRITE / READ cut into the tier's parts (``--transfer-bytes``)
with each part's rows checksummed (xxh3) right after the part moved, on one thread: what a
tier that verifies every row can reach when copy and hash do not overlap, control messages
left out (``put_ceiling``, ``get_ceiling``: that time over the raw one). The tier hashes on a
thread beside its copies (``--checksum-thread on``, the default) and passes this ceiling
where a core is free for it; ``parts_checksummed_beside`` says how many parts were hashed
there (the rest alternated with the copies, as with ``--checksum-thread off``).

Reported: GB/s of each, ``put_ratio`` and ``get_ratio`` (tier over raw, target >= 0.8), the
ceilings, and descriptors per NIXL transfer. Every get is checked byte for byte against what
was put.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import uvloop

from bench.report import write_json
from tiers.address import Address
from tiers.fast_checksum import checksum_at
from tiers.remote import RemoteTier
from tiers.remote.nixl_agent import create_agent, descriptors
from tiers.settings import RemoteSettings
from tiers.sizes import parse_size

TARGET = 0.8
ALIGN = 2 << 20
_STARTUP_S = 30.0


def aligned_zeros(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """Zeroed bytes starting at a multiple of ``align``, every page faulted in.

    Alignment matters: a CMA copy between buffers that differ in alignment mod 64 runs at
    about half speed (measured here), and torch allocations (the host tier) are aligned, so
    both the host rows and the raw target are aligned like the peer's slots.
    """
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    out = raw[start : start + nbytes]
    out[::4096] = 0
    return out


def serve_raw_target(capacity: int) -> int:
    """The baseline's far end: register a buffer, say where it is, let the transport wire up."""
    agent = create_agent(f"kvtier-bench-raw-{os.getpid()}")
    memory = aligned_zeros(capacity)
    agent.register_memory([(memory.ctypes.data, memory.nbytes, 0, "")], "DRAM")
    sys.stdout.write(f"{memory.ctypes.data} {agent.get_agent_metadata().hex()}\n")
    sys.stdout.flush()
    while True:  # until the benchmark closes our stdin
        agent.get_new_notifs()
        readable, _, _ = select.select([sys.stdin], [], [], 0.001)
        if readable and not sys.stdin.readline():
            return 0


_PRCTL = ctypes.CDLL(None).prctl  # resolved here: the child, after fork, only calls it


def _die_with_parent() -> None:
    """In a child: be killed when the benchmark dies, however it dies."""
    _PRCTL(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def spawn(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
        preexec_fn=_die_with_parent,
    )
    assert proc.stdout is not None
    readable, _, _ = select.select([proc.stdout], [], [], _STARTUP_S)
    line = proc.stdout.readline() if readable else ""
    if not line:
        proc.kill()
        raise RuntimeError(f"{' '.join(args[:3])} did not start")
    return proc, line.strip()


class RawBaseline:
    """An agent in this process moving the same rows to the raw target in one request."""

    def __init__(self, host: np.ndarray, target_line: str) -> None:
        addr, metadata = target_line.split()
        self.agent = create_agent(f"kvtier-bench-raw-client-{os.getpid()}")
        self.agent.register_memory([(host.ctypes.data, host.nbytes, 0, "")], "DRAM")
        self.remote_name = self.agent.add_remote_agent(bytes.fromhex(metadata))
        self.remote_addr = int(addr)

    def move(self, op: str, local_addrs: list[int], row_bytes: int, first_row: int = 0) -> None:
        lengths = [row_bytes] * len(local_addrs)
        remote_addrs = [self.remote_addr + (first_row + i) * row_bytes for i in range(len(local_addrs))]
        handle = self.agent.initialize_xfer(
            op,
            self.agent.get_xfer_descs(descriptors(local_addrs, lengths), "DRAM"),
            self.agent.get_xfer_descs(descriptors(remote_addrs, lengths), "DRAM"),
            self.remote_name,
        )
        state = self.agent.transfer(handle)
        while state == "PROC":
            state = self.agent.check_xfer_state(handle)
        handle.release()
        if state != "DONE":
            raise RuntimeError(f"raw {op} failed: {state}")

    def move_checked(self, op: str, rows: list[memoryview], addrs: list[int], part_rows: int) -> None:
        """``move`` ``part_rows`` rows at a time, each part's rows checksummed right after it
        moved (while in cache): a serial tier's best, copy and hash on one thread."""
        row_bytes = len(rows[0])
        for start in range(0, len(rows), part_rows):
            self.move(op, addrs[start : start + part_rows], row_bytes, first_row=start)
            for view, addr in zip(
                rows[start : start + part_rows], addrs[start : start + part_rows], strict=True
            ):
                checksum_at(view, addr)


def _ceiling(raw_gbps: float, checksum_gbps: float) -> float:
    """The best ratio a tier that checksums every row can reach if hashing and copying do not
    overlap (as on a machine with no core free for a second thread)."""
    return (1 / raw_gbps) / (1 / raw_gbps + 1 / checksum_gbps)


async def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    result = fn()
    if asyncio.iscoroutine(result):
        result = await result
    elapsed = time.perf_counter() - start
    if isinstance(result, list) and not all(result):
        raise RuntimeError(f"{sum(not r for r in result)} of {len(result)} rows failed")
    return elapsed


async def measure(args: argparse.Namespace, workdir: Path) -> dict:
    rows, row_bytes = args.rows, args.row_bytes
    env = {**os.environ, "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN")}
    token_file = workdir / "token"
    token_file.write_bytes(os.urandom(32).hex().encode())
    pool_bytes = 3 * rows * row_bytes  # room for three repeats; older ones are evicted (LRU)
    peer, ready = spawn(
        [
            "-m",
            "tiers.remote.server",
            "--listen",
            "127.0.0.1:0",
            "--capacity",
            str(pool_bytes),
            "--row-bytes",
            str(row_bytes),
            "--token-file",
            str(token_file),
            "--max-request-bytes",  # a request is cut after the row that reaches transfer_bytes
            str(max(256 << 20, (args.transfer_bytes or 0) + row_bytes)),
        ],
        env,
    )
    raw_target, raw_line = spawn(["-m", "bench.remote", "--raw-target", str(rows * row_bytes)], env)
    tier = None
    try:
        address = ready.split()[4].rstrip(":")
        host = aligned_zeros(2 * rows * row_bytes)
        src, dst = host[: rows * row_bytes], host[rows * row_bytes :]
        src[:] = np.random.default_rng(args.seed).integers(0, 256, src.nbytes, dtype=np.uint8)
        view = memoryview(host)
        src_rows = [view[i * row_bytes : (i + 1) * row_bytes] for i in range(rows)]
        dst_rows = [view[(rows + i) * row_bytes : (rows + i + 1) * row_bytes] for i in range(rows)]
        src_addrs = [host.ctypes.data + i * row_bytes for i in range(rows)]
        dst_addrs = [a + rows * row_bytes for a in src_addrs]
        settings = RemoteSettings(
            capacity_bytes=rows * row_bytes,
            peers=(Address.parse(address),),
            checksum_thread=args.checksum_thread == "on",
        )
        tier = RemoteTier(
            settings,
            namespace=os.urandom(16),
            layout_id=b"bench-remote-v1\0",
            token=token_file.read_bytes().strip(),
            **({"transfer_bytes": args.transfer_bytes} if args.transfer_bytes else {}),
        )
        await tier.open(view)
        if not tier.peers_up():
            raise RuntimeError(f"peer {address} is not reachable")
        raw = RawBaseline(host, raw_line)

        def keys(repeat: int) -> list[bytes]:
            return [repeat.to_bytes(4, "big") + i.to_bytes(28, "big") + bytes(4) for i in range(rows)]

        def checksum_all() -> None:
            for view, addr in zip(src_rows, src_addrs, strict=True):
                checksum_at(view, addr)

        times: dict[str, list[float]] = {
            "raw_write": [],
            "put": [],
            "raw_read": [],
            "get": [],
            "checksum": [],
            "raw_write_checked": [],
            "raw_read_checked": [],
        }
        part_rows = max(1, -(-tier.transfer_bytes // row_bytes))  # rows per tier request
        before = dict(tier.stats())
        for repeat in range(args.repeats + 1):  # the first round warms up and is not counted
            batch = keys(repeat)
            round_times = {
                "raw_write": await _timed(lambda: raw.move("WRITE", src_addrs, row_bytes)),
                "put": await _timed(lambda b=batch: tier.put(list(zip(b, src_rows, strict=True)))),
            }
            dst.fill(0)
            round_times["raw_read"] = await _timed(lambda: raw.move("READ", dst_addrs, row_bytes))
            if not np.array_equal(src, dst):
                raise RuntimeError("raw READ did not return the bytes written")
            dst.fill(0)
            round_times["get"] = await _timed(lambda b=batch: tier.get(list(zip(b, dst_rows, strict=True))))
            round_times["checksum"] = await _timed(checksum_all)
            round_times["raw_write_checked"] = await _timed(
                lambda: raw.move_checked("WRITE", src_rows, src_addrs, part_rows)
            )
            round_times["raw_read_checked"] = await _timed(
                lambda: raw.move_checked("READ", dst_rows, dst_addrs, part_rows)
            )
            if not np.array_equal(src, dst):
                raise RuntimeError("get did not return the bytes put")
            if repeat == 0:
                before = dict(tier.stats())
                continue
            for name, seconds in round_times.items():
                times[name].append(seconds)
        after = tier.stats()
    finally:
        if tier is not None:
            await tier.close()
        for proc in (peer, raw_target):
            proc.terminate()
        for proc in (peer, raw_target):
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
    total = rows * row_bytes
    gbps = {name: total / statistics.median(t) / 1e9 for name, t in times.items()}
    transfers = after["transfers"] - before["transfers"]
    descs = after["descriptors"] - before["descriptors"]
    beside = after["parts_checksummed_beside"] - before["parts_checksummed_beside"]
    return {
        **ratio_figures(gbps, put_base="raw_write", get_base="raw_read"),
        # the peer READs a put's rows and WRITEs a get's: the raw transfer of the same direction
        "put_ratio_same_direction": gbps["put"] / gbps["raw_read"],
        "get_ratio_same_direction": gbps["get"] / gbps["raw_write"],
        # measured, not modelled: raw moved part by part, each part hashed as it lands
        "raw_write_checked_gbps": gbps["raw_write_checked"],
        "raw_read_checked_gbps": gbps["raw_read_checked"],
        "put_ceiling": gbps["raw_write_checked"] / gbps["raw_write"],
        "get_ceiling": gbps["raw_read_checked"] / gbps["raw_read"],
        "descriptors_per_transfer": descs / transfers if transfers else 0.0,
        "transfers_per_op": transfers / (2 * args.repeats),
        "checksum_thread": args.checksum_thread,
        # parts hashed on the thread beside the copying one; the rest alternated with the copies
        "parts_checksummed_beside": beside / transfers if transfers else 0.0,
        "raw_descriptors_per_transfer": rows,
        **row_figures(args),
    }


def ratio_figures(gbps: dict[str, float], *, put_base: str, get_base: str) -> dict[str, float]:
    """The tier's put/get GB/s, its baselines' (``gbps[put_base]``, ``gbps[get_base]``), the
    ratios, and the ceilings a tier that checksums every row can reach (``gbps["checksum"]``)."""
    return {
        "put_gbps": gbps["put"],
        "get_gbps": gbps["get"],
        f"{put_base}_gbps": gbps[put_base],
        f"{get_base}_gbps": gbps[get_base],
        "put_ratio": gbps["put"] / gbps[put_base],
        "get_ratio": gbps["get"] / gbps[get_base],
        "checksum_gbps": gbps["checksum"],
        "put_ceiling": _ceiling(gbps[put_base], gbps["checksum"]),
        "get_ceiling": _ceiling(gbps[get_base], gbps["checksum"]),
    }


def row_figures(args: argparse.Namespace) -> dict:
    """What every remote-tier benchmark reports of the rows it moved (all verified byte for byte)."""
    return {
        "row_bytes": args.row_bytes,
        "rows_per_op": args.rows,
        "bytes_per_op": args.rows * args.row_bytes,
        "repeats": args.repeats,
        "verified": True,
    }


def add_row_arguments(parser: argparse.ArgumentParser, *, repeats: int) -> None:
    """The options every remote-tier benchmark takes: rows per op, their size, repeats, seed, JSON."""
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    parser.add_argument("--rows", type=int, default=64, help="rows per put/get (default 64 = 128 MiB)")
    parser.add_argument("--row-bytes", type=parse_size, default=2 << 20, help="bytes per row (2MiB)")
    parser.add_argument("--repeats", type=int, default=repeats, help="timed repeats per figure (median)")
    parser.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier bench remote", description=__doc__.split("\n\n")[0])
    add_row_arguments(parser, repeats=15)
    parser.add_argument(
        "--transfer-bytes",
        type=parse_size,
        default=None,
        help="the tier's bytes of rows per request (the tier's default)",
    )
    parser.add_argument(
        "--checksum-thread",
        choices=("on", "off"),
        default="on",
        help="the tier hashes each part on a thread beside the copying one (on, the default) or after"
        " the copy on the same thread (off)",
    )
    parser.add_argument("--raw-target", type=parse_size, metavar="SIZE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # everything here is on 127.0.0.1
    if args.raw_target:
        return serve_raw_target(args.raw_target)
    command = "kvtier bench remote " + " ".join(sys.argv[3:] if argv is None else argv)
    print(f"$ {command.strip()}")
    print(
        f"{args.rows} rows of {args.row_bytes} B per op, one peer and one raw NIXL target on 127.0.0.1, "
        f"{os.cpu_count()} cores, {platform.machine()}"
    )
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-remote-") as workdir:
        fig = uvloop.run(measure(args, Path(workdir)))
    print(f"{'op':4} {'tier GB/s':>9} {'raw GB/s':>8} {'ratio':>6} {'target':>6} {'ceiling':>7}")
    for op, raw in (("put", "raw_write"), ("get", "raw_read")):
        tier_gbps, ratio, ceiling = (fig[f"{op}_{k}"] for k in ("gbps", "ratio", "ceiling"))
        print(f"{op:4} {tier_gbps:9.2f} {fig[f'{raw}_gbps']:8.2f} {ratio:6.2f} {TARGET:>6} {ceiling:7.2f}")
    print(
        f"against the raw transfer of the direction the peer makes (put: its READ, get: its WRITE): "
        f"put {fig['put_ratio_same_direction']:.2f}, get {fig['get_ratio_same_direction']:.2f}"
    )
    print(
        f"xxh3 of the same rows (in DRAM): {fig['checksum_gbps']:.2f} GB/s; ceiling = raw moved in the tier's"
        " parts, each part checksummed as it lands, on one thread (measured; hashing beside can pass it)"
    )
    print(
        f"descriptors per transfer: tier {fig['descriptors_per_transfer']:.0f} "
        f"({fig['transfers_per_op']:.1f} transfers per op), raw {fig['raw_descriptors_per_transfer']}"
    )
    print(
        f"checksum thread {fig['checksum_thread']}: {fig['parts_checksummed_beside']:.0%} of the requests'"
        " rows hashed beside the event loop (puts; a get's rows are verified by the peer)"
    )
    if args.json:
        payload = {
            "command": command.strip(),
            "baseline": "raw NIXL READ/WRITE of the same rows to a bare agent, one request, same run",
            "target": TARGET,
            **fig,
        }
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
