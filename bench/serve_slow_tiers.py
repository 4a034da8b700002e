"""``kvtier bench serve --slow-tiers``: a slow lower tier must never slow the engine.

The same workload, at concurrency 16, through vLLM alone and through vLLM + kvtier whose
tier below a small host tier is slow on purpose:

- ``disk``: a disk tier (``sync = true``: each batch flushed) on an ext4 file system of its
  own, on a loop device whose reads and writes the kernel throttles (cgroup v1 blkio
  ``throttle.{read,write}_bps_device``; this machine has no cgroup v2 ``io.max`` and no
  device mapper). A flush is I/O the writer thread submits, so it is throttled; a read the
  page cache serves is not (rows just written are in it);
- ``peer``: a real ``kvtier peer`` in a network namespace of the cluster harness
  (``bench.cluster_net``) behind a ``tbf`` qdisc on its link, each way.

Rows run in the order given and then in reverse (``--rounds 2``), so a drift of the shared
machine's load shows as a difference between the two runs of the same row; every figure is
a ratio against vLLM alone's run of the same round. Needs root (loop devices, namespaces).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.report import write_json
from bench.serve_workloads import document
from bench.ttft import percentile
from tiers.remote import net_iface

ROWS = ("vllm", "disk", "peer")
BLKIO = Path("/sys/fs/cgroup/blkio")
NOISE = 1.10  # kvtier's mean TTFT and throughput within this of vLLM alone's


def workload(seed: int, prefixes: int, prefix_tokens: int, requests: int, concurrency: int) -> list[dict]:
    """``vllm bench serve``'s prefix_repetition, as token ids: ``requests`` prompts, each one
    of ``prefixes`` shared prefixes (picked at random) and 32 tokens of its own."""
    rng = random.Random(seed)
    docs = [document(seed * 100 + i, prefix_tokens) for i in range(prefixes)]
    return [
        {
            "prompt": docs[rng.randrange(prefixes)] + document(seed * 100_000 + i, 32),
            "max_tokens": 16,
            "arrival_s": 0.0,
            "max_in_flight": concurrency,
        }
        for i in range(requests)
    ]


def _sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout.strip()


@contextlib.contextmanager
def throttled_disk(workdir: Path, bytes_per_s: int) -> Iterator[Path]:
    """An ext4 file system on a loop device throttled to ``bytes_per_s`` each way; its mount point."""
    image, mount = workdir / "disk.img", workdir / "slow-disk"
    with open(image, "wb") as f:
        f.truncate(3 << 30)
    loop = _sh("losetup", "-f", "--show", str(image))
    try:
        _sh("mkfs.ext4", "-q", loop)
        mount.mkdir()
        _sh("mount", loop, str(mount))
        device = os.stat(loop).st_rdev
        rule = f"{os.major(device)}:{os.minor(device)}"
        try:
            for name in ("read_bps_device", "write_bps_device"):
                (BLKIO / f"blkio.throttle.{name}").write_text(f"{rule} {bytes_per_s}\n")
            yield mount
        finally:
            for name in ("read_bps_device", "write_bps_device"):
                with contextlib.suppress(OSError):
                    (BLKIO / f"blkio.throttle.{name}").write_text(f"{rule} 0\n")
            subprocess.run(["umount", str(mount)], check=False)
    finally:
        subprocess.run(["losetup", "-d", loop], check=False)


def _extra(row: str, sizes: Any, rowdir: Path, below: dict[str, Any] | None) -> dict[str, Any] | None:
    if row == "vllm":
        return None
    assert below is not None
    return {
        "spec_name": "KVTierOffloadingSpec",
        "spec_module_path": "offload.vllm",
        "cpu_bytes_to_use": sizes.small_host_bytes,
        "shm_dir": str(rowdir / "shm"),
        "kvtier_config": {"tiers": [{"kind": "host", "eviction": "lru"}, below]},
    }


def run_row(
    row: str, requests: list[dict], sizes: Any, model_dir: str, rowdir: Path, args: argparse.Namespace
) -> dict[str, Any]:
    from bench.vllm_engine import EngineProcess

    (rowdir / "shm").mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        below: dict[str, Any] | None = None
        if row == "disk":
            mount = stack.enter_context(throttled_disk(rowdir, args.disk_bps))
            below = {"kind": "disk", "path": str(mount / "kvtier"), "capacity": sizes.lower_bytes}
            below |= {"admission": "all", "sync": True}
        elif row == "peer":
            from bench.cluster_net import Cluster

            cluster = stack.enter_context(Cluster(1, rowdir / "cluster"))
            cluster.start_peers(capacity="1GiB", row_bytes=str(sizes.row_bytes))
            cluster.set_rate(cluster.hosts[0], args.peer_rate)
            below = {
                "kind": "remote",
                "peers": [cluster.hosts[0].peer_address()],
                "capacity": sizes.lower_bytes,
            }
        spec = sizes.engine_spec(model_dir, _extra(row, sizes, rowdir, below))
        # kvtier sets UCX's interface from the peer's address, as on a machine of its own: a
        # value of this process's (meant for 127.0.0.1 peers) would win (bench.cluster_vllm).
        saved = {name: os.environ.pop(name) for name in net_iface.VARIABLES if name in os.environ}
        try:
            engine = stack.enter_context(EngineProcess(spec, rowdir / "engine.log"))
        finally:
            os.environ.update(saved)
        engine.generate([document(-7, 64)], max_tokens=2)  # warm-up: tokens no request holds
        answer = engine.timed(requests)
        stats = engine.kvtier_stats()
        peak_rss = _peak_rss(engine.process.pid)
    ttft = [o.ttft_s for o in answer["outputs"]]
    return {
        "row": row,
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "requests_per_s": len(ttft) / answer["wall_s"],
        "wall_s": answer["wall_s"],
        "kvtier_tokens": sum(o.external_cached_tokens or 0 for o in answer["outputs"]),
        "device_tokens": sum(o.num_cached_tokens for o in answer["outputs"]),
        "steps_waiting_on_loads": answer["steps_waiting_on_loads"],
        "peak_rss_bytes": peak_rss,
        "kvtier_stats": stats,
    }


def _peak_rss(pid: int) -> int:
    """The engine process's peak resident memory (``VmHWM``), bytes; 0 where unknown."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def print_rows(results: list[dict[str, Any]]) -> None:
    print(
        f"\n  {'round':>5} {'row':6} {'mean s':>7} {'p50 s':>7} {'p90 s':>7} {'p99 s':>7} {'req/s':>6}"
        f" {'TTFT x':>7} {'req/s x':>7} {'kvtier tok':>10} {'promo refused':>13} {'spills dropped':>14}"
        f" {'dirty evicted':>13} {'spill refused':>13} {'pauses':>6} {'peak RSS MiB':>12}"
    )
    for r in results:
        lower = r["kvtier_stats"].get("lower", {})
        print(
            f"  {r['round']:5d} {r['row']:6} {r['ttft_mean_s']:7.3f} {r['ttft_p50_s']:7.3f}"
            f" {r['ttft_p90_s']:7.3f} {r['ttft_p99_s']:7.3f} {r['requests_per_s']:6.2f}"
            f" {r.get('ttft_vs_vllm', 1.0):7.2f} {r.get('throughput_vs_vllm', 1.0):7.2f}"
            f" {r['kvtier_tokens']:10d} {lower.get('promotions_refused', 0):13d}"
            f" {lower.get('spills_dropped', 0):14d} {lower.get('dirty_dropped', 0):13d}"
            f" {lower.get('spills_refused', 0):13d} {lower.get('tier_pauses', 0):6d}"
            f" {r['peak_rss_bytes'] / (1 << 20):12.0f}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvtier bench serve --slow-tiers", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated: {', '.join(ROWS)}")
    parser.add_argument("--rounds", type=int, default=2, help="the rows in order, then reversed, ...")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--disk-bps", type=int, default=2 << 20, help="the disk's throttle, bytes/s each way")
    parser.add_argument("--peer-rate", default="20mbit", help="the peer's link (tc tbf rate), each way")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if "vllm" not in args.rows or any(r not in ROWS for r in args.rows):
        parser.error(f"--rows: some of {', '.join(ROWS)}, vllm among them (the baseline)")
    if os.geteuid() != 0:
        parser.error("needs root: a throttled loop device and network namespaces")
    return args


def main(argv: list[str] | None = None) -> int:
    from bench.serve import Sizes, engine_version
    from bench.tiny_llama import write_model

    args = parse_args(argv)
    sizes = Sizes()
    command = f"kvtier bench serve --slow-tiers {' '.join(argv or [])}".rstrip()
    print(f"$ {command}")
    print(
        f"engine: {engine_version()}; {args.requests} requests at concurrency {args.concurrency}, one of"
        f" {args.prefixes} prefixes of {args.prefix_tokens} tokens each (+32 own); device cache"
        f" {sizes.device_blocks} blocks of {sizes.block_size};"
        f" host tier {sizes.small_host_bytes >> 20} MiB over"
        f" a disk throttled to {args.disk_bps / (1 << 20):.1f} MiB/s each way (sync) or a peer behind"
        f" tbf {args.peer_rate}; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    requests = workload(args.seed, args.prefixes, args.prefix_tokens, args.requests, args.concurrency)
    results: list[dict[str, Any]] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvtier-slow-tiers-") as tmp:
        workdir = Path(tmp)
        model_dir = str(write_model(workdir / "models"))
        for round_ in range(args.rounds):
            order = args.rows if round_ % 2 == 0 else args.rows[::-1]
            mine = []
            for row in order:
                result = run_row(row, requests, sizes, model_dir, workdir / f"{round_}-{row}", args)
                result["round"] = round_
                mine.append(result)
            alone = next(r for r in mine if r["row"] == "vllm")
            for r in mine:
                r["ttft_vs_vllm"] = r["ttft_mean_s"] / alone["ttft_mean_s"]
                r["throughput_vs_vllm"] = r["requests_per_s"] / alone["requests_per_s"]
            results += mine
    print_rows(results)
    for row in args.rows:
        if row == "vllm":
            continue
        ttft = max(r["ttft_vs_vllm"] for r in results if r["row"] == row)
        rate = min(r["throughput_vs_vllm"] for r in results if r["row"] == row)
        met = ttft <= NOISE and rate >= 1 / NOISE
        print(
            f"  {row}: worst round mean TTFT {ttft:.2f}x vLLM alone's, throughput {rate:.2f}x"
            f" (target: within {NOISE:.2f}x): {'met' if met else 'NOT MET'}"
        )
    print(f"\n{len(results)} engines, {time.monotonic() - started:.0f} s in all")
    write_json(args.json, {"command": command, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
