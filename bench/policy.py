"""``kvtier bench policy``: hit ratios of every policy, OPT and vLLM's manager, per trace.

For each trace (four generated ones and the production trace), below one device prefix
cache: the host tier's hit ratio under every kvtier policy, under vLLM's own
``CPUOffloadingManager`` with ``lru`` and ``arc`` (where vLLM imports), and Belady's OPT
for the same capacity; then one two-tier chain (host with the trace's best policy,
write-back, promotion on hit; disk 4x larger, LRU, seen-twice admission) with per-tier hit
ratios; then the scheduler-side throughput of kvtier's manager (``offload.manager``)
beside vLLM's on the same calls (``bench.manager_throughput``).

Sizes are fractions of each trace's distinct blocks, the same rule for every trace:
device 2%, host 10% (``--device-fraction``, ``--host-fraction``), disk 4x the host.
A hit ratio is blocks served by the tier over all blocks requested; the device's share is
the same for every policy and is printed once per trace.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.report import write_json
from bench.simulate import SimResult, TierSpec, device_prefix_hits, opt_hits, simulate
from bench.traces import GENERATORS, REAL_TRACE, Request, generate, load_jsonl, trace_stats

POLICIES = (
    "lru",
    "slru",
    "arc",
    "s3fifo",
    "tinylfu",
    "tinylfu-adaptive",
    "cost",
    "lhd",
    "hazard",
    "prefix:lru",
    "prefix:arc",
    "prefix:s3fifo",
    "prefix:tinylfu",
    "prefix:cost",
)
VLLM_POLICIES = ("lru", "arc")
TARGET_TRACES = ("agentic", "multi-turn", "real")
TARGET_GAIN = 0.10  # best kvtier >= vLLM arc * 1.10
TARGET_OPT_GAP = 0.05  # best kvtier >= OPT * 0.95
TARGET_SPEEDUP = 2.0  # kvtier manager calls/s >= 2x vLLM's


@dataclass
class TraceReport:
    name: str
    stats: dict[str, float]
    device_blocks: int
    host_blocks: int
    device_hit_ratio: float
    policies: dict[str, float] = field(default_factory=dict)
    vllm: dict[str, float] = field(default_factory=dict)
    opt: float = 0.0
    chain: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def best(self) -> tuple[str, float]:
        name = max(self.policies, key=lambda p: self.policies[p])
        return name, self.policies[name]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvtier bench policy", description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="also write every figure to FILE as JSON")
    parser.add_argument(
        "--trace-fraction",
        type=float,
        default=1.0,
        help="leading fraction of the production trace's requests to replay (default 1.0: all)",
    )
    parser.add_argument("--real-trace", default=str(REAL_TRACE), help="JSONL trace to replay as 'real'")
    parser.add_argument(
        "--traces",
        default=",".join([*GENERATORS, "real"]),
        help="comma-separated traces: generated names and/or 'real' (default: all)",
    )
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated kvtier policies")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated traces")
    parser.add_argument("--device-fraction", type=float, default=0.02, help="device blocks / distinct blocks")
    parser.add_argument("--host-fraction", type=float, default=0.10, help="host blocks / distinct blocks")
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM's manager even if it imports")
    parser.add_argument("--no-throughput", action="store_true", help="skip the manager throughput run")
    parser.add_argument("--jobs", type=int, default=2, help="traces replayed at once (processes)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="throughput rounds, kvtier and vLLM alternated (best counts)"
    )
    args = parser.parse_args(argv)
    if not 0.0 < args.trace_fraction <= 1.0:
        parser.error(f"--trace-fraction must be in (0, 1], got {args.trace_fraction}")
    for name in ("device_fraction", "host_fraction"):
        if not 0.0 < getattr(args, name) < 1.0:
            parser.error(f"--{name.replace('_', '-')} must be in (0, 1), got {getattr(args, name)}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    unknown = [t for t in args.traces.split(",") if t not in GENERATORS and t != "real"]
    if unknown:
        parser.error(f"unknown traces {unknown}: choose from {[*GENERATORS, 'real']}")
    return args


def load_traces(args: argparse.Namespace) -> dict[str, list[Request]]:
    traces: dict[str, list[Request]] = {}
    for name in args.traces.split(","):
        if name == "real":
            traces[name] = load_jsonl(args.real_trace, args.trace_fraction)
        else:
            traces[name] = generate(name, seed=args.seed)
    return traces


def run_trace(
    name: str, trace: list[Request], args: argparse.Namespace, policies: Sequence[str], vllm: bool
) -> TraceReport:
    started = time.perf_counter()
    stats = trace_stats(trace)
    device = max(1, round(stats["distinct"] * args.device_fraction))
    host = max(1, round(stats["distinct"] * args.host_fraction))
    device_hits = device_prefix_hits(trace, device)
    accesses = stats["accesses"]
    report = TraceReport(name, stats, device, host, sum(device_hits) / accesses)
    for policy in policies:
        result = simulate(trace, [TierSpec("host", host, policy)], device, device_hits)
        report.policies[policy] = result.tier_hit_ratio
    report.opt = opt_hits(trace, host, device_hits) / accesses
    if vllm:
        from bench.vllm_baseline import simulate_vllm

        for policy in VLLM_POLICIES:
            report.vllm[policy] = simulate_vllm(trace, host, policy, device_hits).tier_hit_ratio
    best, _ = report.best()
    chain = [
        TierSpec("host", host, best, placement={"write": "back", "promote": True}),
        TierSpec("disk", 4 * host, "lru", placement={"write": "none", "admit": "seen-twice"}),
    ]
    result: SimResult = simulate(trace, chain, device, device_hits)
    report.chain = {
        "tiers": [
            {"name": "host", "blocks": host, "policy": best, "write": "back", "promote": True},
            {"name": "disk", "blocks": 4 * host, "policy": "lru", "admit": "seen-twice"},
        ],
        "hit_ratio": {n: result.hit_ratio(i) for i, n in enumerate(result.tier_names)},
        "tier_hit_ratio": result.tier_hit_ratio,
        "opt_same_total_capacity": opt_hits(trace, 5 * host, device_hits) / accesses,
    }
    report.seconds = time.perf_counter() - started
    return report


def _replay_all(
    traces: dict[str, list[Request]], args: argparse.Namespace, policies: Sequence[str], vllm: bool
) -> Iterator[TraceReport]:
    """``run_trace`` for every trace, in order; over ``args.jobs`` forked processes (forked so
    that vLLM, already imported here, is not imported again in each)."""
    jobs = [(name, trace, args, policies, vllm) for name, trace in traces.items()]
    if args.jobs == 1 or len(jobs) == 1 or "fork" not in mp.get_all_start_methods():
        yield from (run_trace(*job) for job in jobs)
        return
    with mp.get_context("fork").Pool(min(args.jobs, len(jobs))) as pool:
        yield from pool.imap(_run_trace_job, jobs)


def _run_trace_job(job: tuple[str, list[Request], argparse.Namespace, Sequence[str], bool]) -> TraceReport:
    return run_trace(*job)


def run_throughput(trace: list[Request], args: argparse.Namespace, best: str, vllm: bool) -> dict[str, Any]:
    """Calls/s of kvtier's manager with lru, arc and ``best``; vLLM's with lru and arc,
    alternated round by round with kvtier's on the same policy (``manager_throughput.compare``)."""
    from bench.manager_throughput import Throughput, compare, kvtier_throughput

    def figures(t: Throughput) -> dict[str, float]:
        return {"calls_per_s": t.calls_per_s, "keys_per_s": t.keys_per_s, "calls": t.calls}

    stats = trace_stats(trace)
    host = max(1, round(stats["distinct"] * args.host_fraction))
    device_hits = device_prefix_hits(trace, max(1, round(stats["distinct"] * args.device_fraction)))
    out: dict[str, Any] = {
        "host_blocks": host,
        "rounds": args.rounds,
        "kvtier": {},
        "vllm": {},
        "round_ratios": {},
    }
    for policy in dict.fromkeys(("lru", "arc", best)):
        if vllm and policy in VLLM_POLICIES:
            both = compare(trace, device_hits, host, policy, rounds=args.rounds)
            out["kvtier"][policy] = figures(both.kvtier)
            out["vllm"][policy] = figures(both.vllm)
            out["round_ratios"][policy] = both.round_ratios
        else:
            out["kvtier"][policy] = figures(
                kvtier_throughput(trace, device_hits, host, policy, repeat=args.rounds)
            )
    return out


def _pct(x: float) -> str:
    return f"{100 * x:6.2f}%"


def _rel(a: float, b: float) -> str:
    return f"{100 * (a / b - 1):+6.1f}%" if b else "     -"


def print_trace(report: TraceReport, fraction_note: str, flush: bool = False) -> None:
    s = report.stats
    print(
        f"\n== {report.name}{fraction_note}: {s['requests']:,} requests, {s['accesses']:,} block accesses, "
        f"{s['distinct']:,} distinct blocks (infinite cache: {_pct(s['infinite_hit_ratio']).strip()} hit)"
    )
    print(
        f"   device {report.device_blocks:,} blocks (LRU, serves {_pct(report.device_hit_ratio).strip()}), "
        f"host tier {report.host_blocks:,} blocks; hit ratio = host hits / all blocks [{report.seconds:.1f}s]"
    )
    arc = report.vllm.get("arc")
    header = f"   {'policy':<18}{'hit ratio':>10}{'vs OPT':>9}"
    if arc is not None:
        header += f"{'vs vLLM arc':>13}"
    print(header)
    rows = [(f"vllm:{p}", v) for p, v in report.vllm.items()] + list(report.policies.items())
    for name, value in rows:
        line = f"   {name:<18}{_pct(value):>10}{_rel(value, report.opt):>9}"
        if arc is not None:
            line += f"{_rel(value, arc):>13}"
        print(line)
    print(f"   {'OPT (Belady)':<18}{_pct(report.opt):>10}")
    best, value = report.best()
    print(f"   best kvtier: {best} {_pct(value).strip()}")
    chain = report.chain
    per_tier = ", ".join(f"{n} {_pct(v).strip()}" for n, v in chain["hit_ratio"].items())
    print(
        f"   chain host({best}, write-back, promote) + disk(lru, 4x, seen-twice): {per_tier}; "
        f"tiers {_pct(chain['tier_hit_ratio']).strip()} (OPT at the same total capacity "
        f"{_pct(chain['opt_same_total_capacity']).strip()})",
        flush=flush,
    )


def print_throughput(name: str, throughput: dict[str, Any]) -> None:
    print(
        f"\n== manager throughput on '{name}': lookup + prepare_store + complete_store + touch, "
        f"host {throughput['host_blocks']:,} blocks, best of {throughput['rounds']} rounds "
        "(kvtier and vLLM alternated)"
    )
    print("   kvtier: offload.manager.OffloadingManager; vLLM: CPUOffloadingManager")
    for policy, ours in throughput["kvtier"].items():
        rates = f"{ours['calls_per_s']:>10,.0f} calls/s {ours['keys_per_s']:>11,.0f} keys/s"
        line = f"   kvtier {policy:<14}{rates}"
        theirs = throughput["vllm"].get(policy)
        if theirs:
            ratio = ours["calls_per_s"] / theirs["calls_per_s"]
            line += f"   vLLM {policy}: {theirs['calls_per_s']:>9,.0f} calls/s  ratio {ratio:.2f}x"
            rounds = throughput["round_ratios"].get(policy)
            if rounds:
                line += f" (rounds {min(rounds):.2f}-{max(rounds):.2f}x)"
        print(line)


def print_targets(summary: dict[str, Any]) -> None:
    print("\n== targets (best kvtier >= vLLM arc +10%, within 5% of OPT; manager >= 2x vLLM)")
    for name, entry in summary.items():
        if not isinstance(entry, dict) or "best" not in entry:
            continue
        value = entry["hit_ratio"]
        line = f"   {name:<12} best {entry['best']:<16} {_pct(value)} vs OPT {_rel(value, entry['opt'])}"
        if "vllm_arc" in entry:
            line += f"   vs vLLM arc {_rel(value, entry['vllm_arc'])}"
            line += "  [+10%: " + ("met" if entry["beats_vllm_arc_by_10pct"] else "NOT met") + "]"
        line += "  [OPT-5%: " + ("met" if entry["within_5pct_of_opt"] else "NOT met") + "]"
        print(line)
    if "throughput_ratio" in summary:
        ratios = ", ".join(f"{p} {r:.2f}x" for p, r in summary["throughput_ratio"].items())
        verdict = "met" if summary["throughput_2x"] else "NOT met"
        print(f"   manager throughput vs vLLM: {ratios}  [2x: {verdict}]")


def targets(reports: dict[str, TraceReport], throughput: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in TARGET_TRACES:
        report = reports.get(name)
        if report is None:
            continue
        best, value = report.best()
        entry: dict[str, Any] = {"best": best, "hit_ratio": value, "opt": report.opt}
        entry["vs_opt"] = value / report.opt - 1 if report.opt else None
        entry["within_5pct_of_opt"] = bool(report.opt and value >= (1 - TARGET_OPT_GAP) * report.opt)
        if "arc" in report.vllm:
            entry["vllm_arc"] = report.vllm["arc"]
            entry["vs_vllm_arc"] = value / report.vllm["arc"] - 1 if report.vllm["arc"] else None
            entry["beats_vllm_arc_by_10pct"] = value >= (1 + TARGET_GAIN) * report.vllm["arc"]
        out[name] = entry
    if throughput and throughput.get("vllm"):
        ratios = {}
        for policy, figures in throughput["vllm"].items():
            ours = throughput["kvtier"].get(policy)
            if ours:
                ratios[policy] = ours["calls_per_s"] / figures["calls_per_s"]
        out["throughput_ratio"] = ratios
        out["throughput_2x"] = bool(ratios) and all(r >= TARGET_SPEEDUP for r in ratios.values())
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "kvtier bench policy " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    print(f"command: {command.strip()}")
    vllm_version = None
    if not args.no_vllm:
        from bench.vllm_baseline import vllm_version as probe

        vllm_version = probe()
    print(f"vLLM: {vllm_version or 'not importable: vLLM columns skipped'}")
    traces = load_traces(args)
    fraction_note = ""
    if "real" in traces:
        note = f"{args.trace_fraction:g} of the requests" if args.trace_fraction < 1 else "all requests"
        print(f"real trace: {args.real_trace} ({note})")
        fraction_note = f" ({args.trace_fraction:g} of its requests)" if args.trace_fraction < 1 else ""
    policies = [p for p in args.policies.split(",") if p]
    reports: dict[str, TraceReport] = {}
    for report in _replay_all(traces, args, policies, vllm=vllm_version is not None):
        reports[report.name] = report
        print_trace(report, fraction_note if report.name == "real" else f" (seed {args.seed})", flush=True)
    throughput = None
    if not args.no_throughput:
        name = "real" if "real" in traces else next(iter(traces))
        best = reports[name].best()[0]
        throughput = run_throughput(traces[name], args, best, vllm=vllm_version is not None)
        print_throughput(name, throughput)
    summary = targets(reports, throughput)
    print_targets(summary)
    if args.json:
        payload = {
            "command": command.strip(),
            "vllm": vllm_version,
            "config": {k: v for k, v in vars(args).items() if k != "json"},
            "traces": {name: r.__dict__ for name, r in reports.items()},
            "throughput": throughput,
            "targets": summary,
        }
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
