"""``kvtier bench policy``'s scheduler table: what a vLLM user gets, per trace and host size.

Every policy asked for is driven directly (``HostTierManager``) and through vLLM's factory
(``KVTierOffloadingSpec.get_manager()``), beside vLLM's ``CPUOffloadingManager`` with
``lru`` and ``arc``, by ``bench.scheduler_driver`` (the calls vLLM's scheduler makes, one
step per request). The jobs run in alternated rounds (every job once per round), so a load
that comes and goes on a shared machine hits them all alike; each figure is the best round,
and every ratio is taken within a round (its range over the rounds is printed).

- hit ratio: host hits over all blocks requested, deterministic (the same every round; the
  same direct and through the adapter, or the adapter changed a decision: checked);
- calls/s: the scheduler's calls per CPU second;
- adapter: the direct manager's seconds over the adapter's for the same trace (the adapter
  answers one call more per request, ``on_new_request``: seconds, not calls/s, compare
  the same work);
- vs arc: kvtier through the factory over vLLM ``arc``, calls/s and hit ratio.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.scheduler_driver import alternate, make_job
from bench.simulate import device_prefix_hits
from bench.traces import Request, trace_stats

VLLM_POLICIES = ("lru", "arc")
SPEED_TRACES = ("long-doc-qa", "multi-turn", "real")
"""Where the default must run at ``TARGET_SPEEDUP`` x vLLM ``arc`` through the adapter."""
TARGET_SPEEDUP = 2.0
TARGET_ADAPTER = 0.9


def run_drive(
    trace: Sequence[Request],
    policies: Sequence[str],
    *,
    host_fraction: float,
    device_fraction: float,
    rounds: int,
    vllm: bool,
) -> dict[str, Any]:
    """One trace at one host size: every policy direct and through the factory, vLLM's beside."""
    stats = trace_stats(list(trace))
    host = max(1, round(stats["distinct"] * host_fraction))
    device_hits = device_prefix_hits(trace, max(1, round(stats["distinct"] * device_fraction)))
    accesses = stats["accesses"]
    jobs = {}
    for policy in policies:
        jobs[f"direct:{policy}"] = make_job("direct", trace, device_hits, host, policy)
        jobs[f"factory:{policy}"] = make_job("factory", trace, device_hits, host, policy)
    if vllm:
        for policy in VLLM_POLICIES:
            jobs[f"vllm:{policy}"] = make_job("vllm", trace, device_hits, host, policy)
    results = alternate(jobs, rounds)
    for name, runs in results.items():
        if len({r.hits for r in runs}) != 1:
            raise AssertionError(f"{name}: hits differ between rounds {[r.hits for r in runs]}")
    out: dict[str, Any] = {"host_fraction": host_fraction, "host_blocks": host, "rounds": rounds}
    arc_runs = results.get("vllm:arc")
    for name, runs in results.items():
        entry: dict[str, Any] = {
            "hit_ratio": runs[0].hits / accesses,
            "calls": runs[0].calls,
            "calls_per_s": max(r.calls_per_s for r in runs),
        }
        if arc_runs and not name.startswith("vllm:"):
            entry["vs_vllm_arc_calls"] = [
                a.calls_per_s / b.calls_per_s for a, b in zip(runs, arc_runs, strict=True)
            ]
        out[name] = entry
    for policy in policies:
        direct, factory = results[f"direct:{policy}"], results[f"factory:{policy}"]
        if direct[0].hits != factory[0].hits:
            raise AssertionError(
                f"{policy}: the adapter changed a decision ({direct[0].hits} vs {factory[0].hits})"
            )
        out[f"factory:{policy}"]["adapter"] = [
            d.seconds / f.seconds for d, f in zip(direct, factory, strict=True) if f.seconds
        ]
    return out


def _pct(x: float) -> str:
    return f"{100 * x:6.2f}%"


def _range(values: Sequence[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}x" if values else "-"


def print_drive(name: str, figures: dict[str, Any], policies: Sequence[str]) -> None:
    print(
        f"\n== '{name}' as vLLM drives it, host {100 * figures['host_fraction']:g}% "
        f"({figures['host_blocks']:,} blocks), {figures['rounds']} alternated rounds, calls per CPU second"
    )
    arc = figures.get("vllm:arc")
    print(
        f"   {'policy':<18}{'hit ratio':>10}{'vs arc':>8}{'direct calls/s':>16}{'vLLM factory':>14}"
        f"{'adapter':>13}{'vs vLLM arc calls/s':>22}"
    )
    for policy in VLLM_POLICIES:
        entry = figures.get(f"vllm:{policy}")
        if entry:
            rel = f"{100 * (entry['hit_ratio'] / arc['hit_ratio'] - 1):+6.1f}%" if arc else "-"
            calls = f"{entry['calls_per_s']:>14,.0f}"
            print(f"   {'vllm:' + policy:<18}{_pct(entry['hit_ratio']):>10}{rel:>8}{'-':>16}{calls}")
    for policy in policies:
        direct, factory = figures[f"direct:{policy}"], figures[f"factory:{policy}"]
        rel = f"{100 * (factory['hit_ratio'] / arc['hit_ratio'] - 1):+6.1f}%" if arc else "-"
        vs = factory.get("vs_vllm_arc_calls")
        print(
            f"   {policy:<18}{_pct(factory['hit_ratio']):>10}{rel:>8}{direct['calls_per_s']:>16,.0f}"
            f"{factory['calls_per_s']:>14,.0f}{_range(factory['adapter']):>13}"
            f"{(f'{max(vs):.2f}x ({_range(vs)})' if vs else '-'):>22}",
            flush=True,
        )


def drive_targets(drive: dict[str, list[dict[str, Any]]], default: str) -> dict[str, Any]:
    """For the default policy, per trace and size: hit ratio >= vLLM lru and arc; through the
    adapter >= 2x vLLM arc's calls/s (``SPEED_TRACES``); the adapter >= 0.9x direct."""
    out: dict[str, Any] = {}
    for name, sizes in drive.items():
        for figures in sizes:
            factory = figures.get(f"factory:{default}")
            if factory is None:
                continue
            entry: dict[str, Any] = {"adapter": max(factory["adapter"], default=0.0)}
            entry["adapter_met"] = entry["adapter"] >= TARGET_ADAPTER
            if "vllm:arc" in figures:
                best = max(figures[f"vllm:{p}"]["hit_ratio"] for p in VLLM_POLICIES)
                entry["hit_vs_best_vllm"] = factory["hit_ratio"] / best - 1 if best else 0.0
                entry["hit_met"] = factory["hit_ratio"] >= best
                entry["speedup"] = max(factory["vs_vllm_arc_calls"])
                if name in SPEED_TRACES:
                    entry["speed_met"] = entry["speedup"] >= TARGET_SPEEDUP
            out[f"{name}@{figures['host_fraction']:g}"] = entry
    return out


def print_drive_targets(summary: dict[str, Any], default: str) -> None:
    print(
        f"\n== targets for the default ({default}) as vLLM drives it: hit ratio >= vLLM lru and arc; "
        f"calls/s >= {TARGET_SPEEDUP:g}x vLLM arc on {', '.join(SPEED_TRACES)}; "
        f"adapter >= {TARGET_ADAPTER:g}x direct"
    )
    for where, entry in summary.items():
        line = (
            f"   {where:<26} adapter {entry['adapter']:.2f}x [{'met' if entry['adapter_met'] else 'NOT met'}]"
        )
        if "hit_met" in entry:
            verdict = "met" if entry["hit_met"] else "NOT met"
            line += f"  hit vs best vLLM {100 * entry['hit_vs_best_vllm']:+5.1f}% [{verdict}]"
            line += f"  {entry['speedup']:.2f}x vLLM arc"
            if "speed_met" in entry:
                line += f" [{'met' if entry['speed_met'] else 'NOT met'}]"
        print(line)
