"""``kvtier bench e2e``: an engine's workload through every tier, with real bytes.

Drives kvtier as an engine does, through ``offload.api.Offloader`` (``bench.e2e_workload``):
a device prefix cache smaller than the working set, the host tier, LMDB in a temporary
folder, and a local ``kvtier peer`` that this benchmark starts and stops. Every loaded
block is byte-checked against the key it was stored under.

Reported per tier: hits (rows), bytes moved, GB/s achieved against a ceiling measured in
the same run (``torch`` copy, plain file reads, raw NIXL READ), p50/p99 load latency
(lookup to loaded, promotions included). Overall: tokens served from each source versus
recomputed; the miss path's overhead (the same requests with nothing reusable, with and
without kvtier); TTFT modelled for a stated model and accelerator, and measured here with
a tiny random-weight transformer (``bench.ttft``). Side by side (``bench.e2e_compare``):
vLLM's native CPU offloading (``lru``, ``arc``, where vLLM imports) and kvtier's host tier
alone, under the same device cache and host capacity. ``--plot DIR`` writes PNGs
(``bench.e2e_plots``); a progress bar goes to stderr on a terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench import e2e_compare, e2e_plots
from bench.e2e_workload import SOURCES, DeviceCache, Replay, Shape, Tally, clip
from bench.progress import Progress
from bench.report import write_json
from bench.traces import GENERATORS, REAL_TRACE, Request, add_block_tokens_option, generate, load_jsonl
from bench.ttft import CostModel, measure_ttft, modelled_ttft, percentile
from bench.vllm_baseline import vllm_version
from offload.api import Offloader

DEFAULT_WORKLOADS = "multi-turn,long-doc-qa,agentic,real"
TIERS = ("host", "disk", "remote")
MISS_REPEATS = 3


@dataclass
class Sizing:
    """Tier sizes of one workload, in blocks: all smaller than its working set."""

    distinct: int
    device: int
    host: int
    disk: int
    remote: int


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvtier bench e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workload",
        default=DEFAULT_WORKLOADS,
        help=f"comma-separated: {', '.join(GENERATORS)}, real (the production trace) or a TRACE.jsonl",
    )
    parser.add_argument(
        "--config", metavar="TOML", help="use these tiers for every workload instead of the built-in sizing"
    )
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    parser.add_argument(
        "--plot", metavar="DIR", help="write PNG plots here (needs matplotlib: kvtier[bench])"
    )
    parser.add_argument(
        "--requests", type=int, default=1500, help="leading requests of each generated workload"
    )
    parser.add_argument("--real-fraction", type=float, default=0.1, help="leading fraction of a JSONL trace")
    add_block_tokens_option(parser)
    parser.add_argument(
        "--max-blocks", type=int, default=48, help="a request's prompt is cut to this many blocks"
    )
    parser.add_argument("--device-fraction", type=float, default=0.05, help="device blocks / distinct blocks")
    parser.add_argument("--host-fraction", type=float, default=0.15, help="host rows / distinct blocks")
    parser.add_argument("--disk-fraction", type=float, default=0.5, help="disk rows / distinct blocks")
    parser.add_argument("--remote-fraction", type=float, default=0.5, help="remote rows / distinct blocks")
    parser.add_argument(
        "--miss-requests", type=int, default=60, help="requests of the no-reuse (miss path) runs"
    )
    parser.add_argument(
        "--prompt-blocks", type=int, default=64, help="prompt of the measured TTFT, in blocks"
    )
    parser.add_argument("--no-remote", action="store_true", help="no peer, no remote tier")
    parser.add_argument("--no-raw-nixl", action="store_true", help="skip the raw NIXL ceiling")
    parser.add_argument(
        "--no-vllm", action="store_true", help="no side by side with vLLM's CPU offloading manager"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def load_workload(name: str, args: argparse.Namespace) -> tuple[list[Request], str]:
    """The requests of a workload and how it was scaled (said in the output)."""
    if name in GENERATORS:
        return generate(name, seed=args.seed)[: args.requests], f"first {args.requests} requests"
    path = REAL_TRACE if name == "real" else Path(name)
    requests = load_jsonl(path, args.real_fraction, args.trace_block_tokens)
    return requests, f"first {args.real_fraction:.0%} of {path.name} ({len(requests)} requests)"


def sizing(requests: list[Request], args: argparse.Namespace) -> Sizing:
    distinct = len({k for r in requests for k in clip(r.keys, args.max_blocks)})
    return Sizing(
        distinct=distinct,
        device=max(2 * args.max_blocks, round(args.device_fraction * distinct)),
        host=max(2 * args.max_blocks, round(args.host_fraction * distinct)),
        disk=max(4, round(args.disk_fraction * distinct)),
        remote=max(4, round(args.remote_fraction * distinct)),
    )


def tier_config(
    size: Sizing, shape: Shape, workdir: Path, tenant: str, peer: str | None, token: Path
) -> dict:
    """Host, disk (write-back, seen-twice) and remote (write-through) tiers for one workload."""
    row = shape.block_bytes
    tiers: list[dict[str, Any]] = [
        {"kind": "host", "capacity": size.host * row},
        {
            "kind": "disk",
            "path": str(workdir / f"lmdb-{tenant}"),
            "capacity": size.disk * row,
            "placement": "write-back",
            "admission": "seen-twice",
        },
    ]
    if peer is not None:
        tiers.append(
            {
                "kind": "remote",
                "peers": [peer],
                "capacity": size.remote * row,
                "token_file": str(token),
                "placement": "write-through",
                "admission": "all",
            }
        )
    return {"namespace": {"model": "kvtier-bench-e2e", "tenant": tenant}, "tiers": tiers}


# -- ceilings, measured in the same run ---------------------------------------------------


def _median_gbps(nbytes: int, fn: Callable[[], object], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def ceilings(shape: Shape, workdir: Path, raw_nixl: bool) -> dict[str, float | None]:
    """GB/s of the plain operation under each tier, on rows of the benchmark's block size."""
    row, rows = shape.block_bytes, max(1, (32 << 20) // shape.block_bytes)
    src = torch.empty(rows * row, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    out: dict[str, float | None] = {"torch_copy": _median_gbps(src.numel(), lambda: dst.copy_(src))}
    path = workdir / "raw.bin"
    data = memoryview(src.numpy())
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(rows):
            os.pwrite(fd, data[i * row : (i + 1) * row], i * row)
        os.fsync(fd)
        buffer = bytearray(row)

        def read_all() -> None:
            for i in range(rows):
                os.preadv(fd, [buffer], i * row)

        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        out["file_read_cold"] = _median_gbps(rows * row, read_all, repeats=1)
        out["file_read_warm"] = _median_gbps(rows * row, read_all)
    finally:
        os.close(fd)
        path.unlink()
    out["raw_nixl_read"] = _raw_nixl(row, min(rows, 64)) if raw_nixl else None
    return out


def _raw_nixl(row: int, rows: int) -> float | None:
    """Raw NIXL READ of ``rows`` rows from a bare agent in another process (``bench.remote``)."""
    try:
        from bench.remote import RawBaseline, aligned_zeros, spawn

        env = {**os.environ, "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN")}
        env.setdefault("UCX_NET_DEVICES", "lo")
        proc, line = spawn(["-m", "bench.remote", "--raw-target", str(rows * row)], env)
    except Exception as exc:
        print(f"raw NIXL ceiling skipped: {exc}", file=sys.stderr)
        return None
    try:
        host = aligned_zeros(rows * row)
        raw = RawBaseline(host, line)
        addrs = [host.ctypes.data + i * row for i in range(rows)]
        raw.move("READ", addrs, row)
        return _median_gbps(rows * row, lambda: raw.move("READ", addrs, row))
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(10)


# -- the peer -------------------------------------------------------------------------------


def peer_capacity(
    loaded: dict[str, tuple[list[Request], str]], args: argparse.Namespace, shape: Shape
) -> int:
    """Room for the largest workload's remote rows and its miss paths', with a quarter to spare.

    Workloads run one after the other under their own namespaces, so the peer's LRU gives
    up an earlier workload's rows first.
    """
    need = 0
    for requests, _ in loaded.values():
        miss = sum(len(clip(r.keys, args.max_blocks)) for r in requests[: args.miss_requests])
        need = max(need, sizing(requests, args).remote + MISS_REPEATS * miss)
    return max(64, need * 5 // 4) * shape.block_bytes


@contextlib.contextmanager
def local_peer(workdir: Path, capacity: int, row_bytes: int) -> Iterator[tuple[str, Path, int]]:
    """A ``kvtier peer`` on 127.0.0.1 for the run: address, token file, capacity; stopped after."""
    from bench.remote import spawn

    token = workdir / "token"
    token.write_bytes(os.urandom(32).hex().encode())
    env = {**os.environ, "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN")}
    env.setdefault("UCX_NET_DEVICES", "lo")
    args = ["-m", "tiers.remote.server", "--listen", "127.0.0.1:0", "--capacity", str(capacity)]
    args += ["--row-bytes", str(row_bytes), "--token-file", str(token)]
    proc, ready = spawn(args, env)
    try:
        yield ready.split()[4].rstrip(":"), token, capacity
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except Exception:
            proc.kill()
            proc.wait(10)


# -- one workload -----------------------------------------------------------------------------


def replay(
    requests: list[Request],
    shape: Shape,
    size: Sizing,
    config: Any,
    salt: str,
    args: argparse.Namespace,
    label: str,
) -> tuple[Tally, dict[str, Any]]:
    device = DeviceCache(shape, size.device)
    kv, groups = device.kv_caches()
    progress = Progress(label, len(requests), enabled=not args.quiet)
    if config is None:
        return Replay(device, None, salt, args.max_blocks).run(requests, progress), {}
    with Offloader(kv, groups, config, block_size=shape.block_tokens) as offloader:
        tally = Replay(device, offloader, salt, args.max_blocks).run(requests, progress)
        return tally, offloader.stats()


def unique(requests: list[Request]) -> list[Request]:
    """The same requests with nothing reusable: every block key made distinct."""
    return [Request(r.timestamp, tuple((i << 32) | k for k in r.keys)) for i, r in enumerate(requests)]


def tier_figures(tally: Tally, stats: dict[str, Any], shape: Shape) -> dict[str, dict[str, float]]:
    row = shape.block_bytes
    tiers = stats.get("tiers", {})
    out = {}
    for kind in TIERS:
        if kind != "host" and kind not in tiers:
            continue
        # Every hit crosses host -> device; a lower tier's hits also cross tier -> host first.
        read = sum(tally.rows.values()) * row if kind == "host" else tally.rows[kind] * row
        if kind == "host":
            written = int(stats.get("stored_rows", 0)) * row
        elif kind == "disk":
            written = int(tiers[kind].get("stored", 0)) * row
        else:
            written = int(tiers[kind].get("bytes_written", 0))
        latency = tally.latency_s[kind]
        out[kind] = {
            "hits": tally.rows[kind],
            "bytes_read": read,
            "bytes_written": written,
            "copy_s": tally.copy_s[kind],
            "gbps": read / tally.copy_s[kind] / 1e9 if tally.copy_s[kind] else 0.0,
            "p50_ms": percentile(latency, 50) * 1e3,
            "p99_ms": percentile(latency, 99) * 1e3,
            "latencies": len(latency),
            "latency_list": latency,
        }
    return out


def label_of(name: str) -> str:
    """A workload's name in tables: a JSONL trace by its file's stem."""
    return name if name in GENERATORS or name == "real" else Path(name).stem


def run_workload(
    name: str,
    loaded: tuple[list[Request], str],
    args: argparse.Namespace,
    shape: Shape,
    workdir: Path,
    peer: tuple[str, Path] | None,
    vllm: str | None,
) -> dict:
    requests, scaling = loaded
    size = sizing(requests, args)
    label = label_of(name)
    print(
        f"{label}: {scaling}, {size.distinct} distinct blocks (prompts cut to {args.max_blocks} blocks, "
        f"head and tail); "
        f"device {size.device}, host {size.host}, disk {size.disk}, "
        f"remote {size.remote if peer else 0} blocks",
        flush=True,
    )
    address, token = peer if peer else (None, workdir / "no-token")
    run_id = os.urandom(3).hex()

    def config_for(tag: str) -> Any:
        if args.config:
            return args.config
        return tier_config(size, shape, workdir, f"{label}-{tag}-{run_id}", address, token)

    tally, stats = replay(requests, shape, size, config_for("reuse"), label, args, label)
    side = compare(requests, tally, stats, size, shape, args, label, vllm)
    miss_requests = unique(requests[: args.miss_requests])
    # Interleaved and repeated, the faster of each kept: on a shared machine one slow run must
    # not decide the sign of the overhead. Each kvtier run has its own namespace (nothing to hit).
    bases, with_tiers = [], []
    for i in range(MISS_REPEATS):
        tag = f"{label} miss path {i + 1}/{MISS_REPEATS}"
        bases.append(replay(miss_requests, shape, size, None, f"{label}-miss", args, f"{tag}, no kvtier")[0])
        with_tiers.append(
            replay(
                miss_requests, shape, size, config_for(f"miss{i}"), f"{label}-miss", args, f"{tag}, kvtier"
            )[0]
        )
    base = min(bases, key=lambda t: t.wall_s)
    with_tier = min(with_tiers, key=lambda t: t.wall_s)
    blocks = sum(t["recomputed"] for t in base.per_request) // shape.block_tokens
    return {
        "scaling": scaling,
        "sizing": size.__dict__,
        "requests": tally.requests,
        "tokens": tally.tokens,
        "checked_blocks": tally.checked_blocks,
        "stored_blocks": tally.stored_blocks,
        "failed_stores": tally.failed_stores,
        "wall_s": tally.wall_s,
        "tiers": tier_figures(tally, stats, shape),
        "per_request_tokens": tally.per_request,
        "miss_path": {
            "requests": len(miss_requests),
            "blocks": blocks,
            "no_kvtier_s": base.wall_s,
            "kvtier_s": with_tier.wall_s,
            "overhead_us_per_block": (with_tier.wall_s - base.wall_s) / max(1, blocks) * 1e6,
            "overhead_ratio": with_tier.wall_s / max(1e-12, base.wall_s),
            "kvtier_hits": sum(sum(t.rows.values()) for t in with_tiers),
            "repeats": MISS_REPEATS,
        },
        "stats": {k: v for k, v in stats.items() if k != "tiers"} | {"tiers": stats.get("tiers", {})},
        "side_by_side": side,
    }


def compare(
    requests: list[Request],
    chain: Tally,
    stats: dict[str, Any],
    size: Sizing,
    shape: Shape,
    args: argparse.Namespace,
    label: str,
    vllm: str | None,
) -> dict[str, Any]:
    """The side by side's replays (``bench.e2e_compare``): kvtier's host tier alone (real bytes)
    and vLLM's manager with each policy, under the device cache of the ``chain`` run."""
    block_bytes, config = shape.block_bytes, args.config
    host_blocks = e2e_compare.host_blocks_of(size.host, block_bytes, config)
    host_config = e2e_compare.host_only_config(size.host, block_bytes, config)
    host_only, _ = replay(requests, shape, size, host_config, label, args, f"{label} kvtier host only")
    device_tokens = [t["device"] for t in chain.per_request]
    if [t["device"] for t in host_only.per_request] != device_tokens:
        raise RuntimeError(f"{label}: the host-only replay's device cache differs from the chain's")
    rows: dict[str, list[dict[str, int]]] = {}
    if vllm:
        for policy in e2e_compare.VLLM_POLICIES:
            rows[f"vLLM CPU {policy}"] = e2e_compare.vllm_per_request(
                requests, args.max_blocks, device_tokens, host_blocks, shape.block_tokens, policy
            )
    rows["kvtier host"] = host_only.per_request
    rows["kvtier " + "+".join(("host", *stats.get("tiers", {})))] = chain.per_request
    return {
        "method": e2e_compare.METHOD,
        "vllm": vllm,
        "device_blocks": size.device,
        "host_blocks": host_blocks,
        "host_only_wall_s": host_only.wall_s,
        "per_request": rows,
    }


# -- report -------------------------------------------------------------------------------------


def merge_tiers(results: dict[str, dict], ceiling: dict[str, float | None]) -> dict[str, dict[str, Any]]:
    """Per tier over all workloads: sums, GB/s over the summed time against the tier's ceiling,
    latency percentiles of every request."""
    merged: dict[str, dict[str, float]] = {}
    for kind in TIERS:
        parts = [r["tiers"][kind] for r in results.values() if kind in r["tiers"]]
        if not parts:
            continue
        copy_s = sum(p["copy_s"] for p in parts)
        read = sum(p["bytes_read"] for p in parts)
        gbps = read / copy_s / 1e9 if copy_s else 0.0
        latencies = [s for r in results.values() for s in r["latency_all"].get(kind, [])]
        name = CEILING_OF[kind]
        top = ceiling.get(name) or 0.0
        merged[kind] = {
            "hits": sum(p["hits"] for p in parts),
            "bytes_read": read,
            "bytes_written": sum(p["bytes_written"] for p in parts),
            "gbps": gbps,
            "ceiling": name,
            "ceiling_gbps": top,
            "ratio": gbps / top if top else 0.0,
            "p50_ms": percentile(latencies, 50) * 1e3,
            "p99_ms": percentile(latencies, 99) * 1e3,
        }
    return merged


CEILING_OF = {"host": "torch_copy", "disk": "file_read_warm", "remote": "raw_nixl_read"}


def print_tiers(merged: dict[str, dict[str, Any]]) -> None:
    print(
        f"{'tier':7} {'hits':>7} {'read MiB':>9} {'written MiB':>11} {'GB/s':>6} {'ceiling':>21} "
        f"{'ratio':>6} {'p50 ms':>7} {'p99 ms':>7}"
    )
    for kind, fig in merged.items():
        top, name = fig["ceiling_gbps"], fig["ceiling"]
        ceiling_text = f"{top:6.2f} {name}" if top else "not measured"
        print(
            f"{kind:7} {fig['hits']:7d} {fig['bytes_read'] / 2**20:9.1f} "
            f"{fig['bytes_written'] / 2**20:11.1f} {fig['gbps']:6.2f} {ceiling_text:>21} "
            f"{fig['ratio']:6.2f} {fig['p50_ms']:7.2f} {fig['p99_ms']:7.2f}"
        )


TIER_NOTE = (
    "GB/s: bytes into the tier above over the time waited for them (host: every hit's host->device copy;\n"
    "  disk, remote: promotions into the host tier); ceilings: torch copy, plain file preadv (page cache\n"
    "  warm), raw NIXL READ. Latency, as the engine sees it, per request that loaded anything: from its\n"
    "  first lookup, through the lookups answered HIT_PENDING while disk/peer rows are promoted, to its\n"
    "  blocks in the device cache; a request counts under the slowest tier it used (host < disk < remote)"
)


def print_tokens(results: dict[str, dict]) -> None:
    print(f"{'workload':12} " + " ".join(f"{s:>10}" for s in SOURCES) + f" {'checked':>8} {'wall s':>6}")
    for name, r in results.items():
        total = max(1, sum(r["tokens"].values()))
        cells = " ".join(f"{r['tokens'][s] / total:10.1%}" for s in SOURCES)
        print(f"{name:12} {cells} {r['checked_blocks']:8d} {r['wall_s']:6.1f}")


def print_miss_path(results: dict[str, dict]) -> None:
    print(f"{'miss path':12} {'blocks':>6} {'no kvtier s':>11} {'kvtier s':>8} {'ratio':>6} {'us/block':>8}")
    for name, r in results.items():
        m = r["miss_path"]
        print(
            f"{name:12} {m['blocks']:6d} {m['no_kvtier_s']:11.2f} {m['kvtier_s']:8.2f} "
            f"{m['overhead_ratio']:6.2f} {m['overhead_us_per_block']:8.0f}"
        )


def rates(merged: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The two GB/s bounds of the modelled TTFT: what each tier achieved, and its ceiling."""
    return {
        "achieved": {kind: fig["gbps"] for kind, fig in merged.items()},
        "ceiling": {kind: fig["ceiling_gbps"] or fig["gbps"] for kind, fig in merged.items()},
    }


def report_modelled_ttft(
    results: dict[str, dict], merged: dict[str, dict[str, Any]], cost: CostModel
) -> dict:
    """Modelled TTFT per workload, at the GB/s each tier achieved and at its ceiling."""
    bounds = rates(merged)
    print(
        f"TTFT modelled: {cost.model} on {cost.accelerator}: {cost.flops_per_token / 1e9:.1f} GFLOP/token, "
        f"{cost.kv_bytes_per_token // 1024} KiB KV/token; loads at each tier's achieved GB/s | at its ceiling"
    )
    out: dict[str, dict] = {}
    for name, r in results.items():
        per_request = r["per_request_tokens"]
        out[name] = {bound: modelled_ttft(per_request, gbps, cost) for bound, gbps in bounds.items()}
        a, c = out[name]["achieved"], out[name]["ceiling"]
        if a:
            print(
                f"  {name:12} recompute all {a['no_kvtier_mean_ms']:6.2f} ms mean "
                f"(p99 {a['no_kvtier_p99_ms']:.2f}); "
                f"kvtier {a['mean_ms']:6.2f} ms (p99 {a['p99_ms']:.2f}) {a['speedup_mean']:.2f}x | "
                f"{c['mean_ms']:6.2f} ms (p99 {c['p99_ms']:.2f}) {c['speedup_mean']:.2f}x"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = Shape()
    cost = CostModel()
    command = "kvtier bench e2e " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"$ {command.strip()}")
    print(
        f"block: {shape.describe()}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.machine()}; every loaded block byte-checked"
    )
    names = [n.strip() for n in args.workload.split(",") if n.strip()]
    for name in names:
        if name == "real" and not REAL_TRACE.is_file():
            print(f"workload 'real': the production trace {REAL_TRACE} is not there", file=sys.stderr)
            return 2
        if name not in GENERATORS and name != "real" and not Path(name).is_file():
            print(
                f"unknown workload {name!r}: {', '.join(GENERATORS)}, real, or a JSONL file", file=sys.stderr
            )
            return 2
    if args.plot:
        try:
            e2e_plots.pyplot()
        except ImportError as exc:
            print(exc, file=sys.stderr)
            return 2
    vllm = None if args.no_vllm else vllm_version()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-e2e-") as tmp:
        workdir = Path(tmp)
        ceiling = ceilings(shape, workdir, raw_nixl=not args.no_raw_nixl and not args.no_remote)
        print("ceilings GB/s: " + ", ".join(f"{k} {v:.2f}" for k, v in ceiling.items() if v is not None))
        loaded = {name: load_workload(name, args) for name in names}
        peer_ctx: Any = contextlib.nullcontext(None)
        if not args.no_remote and not args.config:
            peer_ctx = local_peer(workdir, peer_capacity(loaded, args, shape), shape.block_bytes)
        with peer_ctx as peer:
            if peer:
                print(f"peer: kvtier peer on {peer[0]} (started by this benchmark, {peer[2] >> 20} MiB)")
            for name in names:
                results[label_of(name)] = run_workload(
                    name, loaded[name], args, shape, workdir, peer[:2] if peer else None, vllm
                )
        if not args.quiet:
            print("TTFT: measuring a tiny transformer's prefill", file=sys.stderr, flush=True)
        ttft_measured = measure_ttft(shape, args.prompt_blocks)
    for r in results.values():  # per-request latencies: merged for the percentiles, not in the JSON
        r["latency_all"] = {k: r["tiers"][k].pop("latency_list") for k in r["tiers"]}
    merged = merge_tiers(results, ceiling)
    print_tiers(merged)
    print(TIER_NOTE)
    print_tokens(results)
    print_miss_path(results)
    ttft_model = report_modelled_ttft(results, merged, cost)
    m = ttft_measured
    print(
        f"TTFT measured here: {m['model']} ({m['model_params'] / 1e6:.1f} M params), "
        f"{m['prompt_tokens']}-token prompt: prefill {m['prefill_ms']:.1f} ms "
        f"({m['cpu_gflops']:.1f} GFLOP/s) "
        f"vs loading its cached KV ({m['kv_bytes'] / 2**20:.0f} MiB) from the host tier "
        f"{m['cached_load_ms']:.1f} ms: {m['speedup']:.1f}x"
    )
    bounds = rates(merged)
    for r in results.values():
        side = r["side_by_side"]
        side["rows"] = e2e_compare.side_by_side(side["per_request"], bounds, cost)
    e2e_compare.print_side_by_side(results, vllm)
    # Per-request lists feed the plots and percentiles; the JSON keeps only their summaries.
    latencies = {k: [s for r in results.values() for s in r["latency_all"].get(k, [])] for k in merged}
    series = {name: r["side_by_side"].pop("per_request") for name, r in results.items()}
    for r in results.values():
        r.pop("latency_all")
        r.pop("per_request_tokens")
    payload = {
        "command": command.strip(),
        "shape": {
            **{k: getattr(shape, k) for k in ("layers", "kv_heads", "head_dim", "block_tokens")},
            "dtype": str(shape.dtype),
            "block_bytes": shape.block_bytes,
        },
        "ceilings_gbps": ceiling,
        "tiers": merged,
        "workloads": results,
        "ttft": {"cost_model": cost.as_dict(), "modelled": ttft_model, "measured": ttft_measured},
    }
    if args.plot:
        chain = {name: list(rows)[-1] for name, rows in series.items()}
        side = {name: r["side_by_side"]["rows"] for name, r in results.items()}
        paths = e2e_plots.write_plots(
            args.plot, series, chain, latencies, side, ttft_measured, f"{cost.model} on {cost.accelerator}"
        )
        print("wrote " + ", ".join(str(p) for p in paths))
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
