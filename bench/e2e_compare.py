"""``kvtier bench e2e``'s side by side: vLLM's native CPU offloading, kvtier's host tier alone,
and kvtier's whole chain, under one device prefix cache and one host capacity.

vLLM's worker needs CUDA, so its side is its ``CPUOffloadingManager`` (``lru`` and
``arc``) driven on the same key stream as kvtier's replay, the way its connector drives
it (``bench.vllm_baseline``): which blocks it would serve is exact, the bytes are not
moved. Its loads are modelled at the rates kvtier's host tier achieved (and its ceiling)
in the same run, the same host -> device copy of the same bytes; every row of the table
is modelled at those same per-tier rates, so TTFT differences come only from where each
token came from. kvtier's host-only row is a real replay (real bytes, byte-checked).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.e2e_workload import SOURCES, clip
from bench.traces import Request
from bench.ttft import CostModel, modelled_ttft

VLLM_POLICIES = ("lru", "arc")
SERVED = ("host", "disk", "remote")
METHOD = (
    "same device prefix cache and host capacity (blocks); vLLM: its CPUOffloadingManager driven on the "
    "same key stream (no bytes moved: its loads modelled at kvtier's host-tier rate of this run); "
    "kvtier host only and kvtier chain: real replays"
)


def host_only_config(host_blocks: int, block_bytes: int, config: str | None) -> dict[str, Any]:
    """kvtier with only a host tier: ``host_blocks`` rows, or the host tier of ``--config``."""
    if config is None:
        return {"tiers": [{"kind": "host", "capacity": host_blocks * block_bytes}]}
    from offload.config import load_config

    host = load_config(config).host
    tier = {"kind": "host", "capacity": host.capacity_bytes, "eviction": host.eviction}
    return {"tiers": [tier | {"eviction_params": dict(host.eviction_params)}]}


def host_blocks_of(host_blocks: int, block_bytes: int, config: str | None) -> int:
    """The host tier's capacity in rows, as kvtier's host tier counts them."""
    if config is None:
        return host_blocks
    from offload.config import load_config

    return load_config(config).host.capacity_bytes // block_bytes


def vllm_per_request(
    requests: Sequence[Request],
    max_blocks: int,
    device_tokens: Sequence[int],
    host_blocks: int,
    block_tokens: int,
    policy: str,
) -> list[dict[str, int]]:
    """Tokens per source of each request with vLLM's CPU tier below the same device cache."""
    from bench.vllm_baseline import replay_vllm

    clipped = [Request(r.timestamp, tuple(clip(r.keys, max_blocks))) for r in requests]
    device = [t // block_tokens for t in device_tokens]
    hits, _ = replay_vllm(clipped, host_blocks, policy, device)
    out = []
    for request, d, h in zip(clipped, device, hits, strict=True):
        tokens = dict.fromkeys(SOURCES, 0)
        tokens.update(device=d * block_tokens, host=h * block_tokens)
        tokens["recomputed"] = (len(request.keys) - d - h) * block_tokens
        out.append(tokens)
    return out


def summary(per_request: Sequence[dict[str, int]]) -> dict[str, Any]:
    """Token totals by source, and the share of the device's misses that a tier served."""
    tokens = {s: sum(t[s] for t in per_request) for s in SOURCES}
    missed = sum(tokens[s] for s in (*SERVED, "recomputed"))
    served = sum(tokens[s] for s in SERVED)
    return {
        "tokens": tokens,
        "served_tokens": served,
        "recomputed_tokens": tokens["recomputed"],
        "tier_hit_ratio": served / missed if missed else 0.0,
    }


def side_by_side(
    rows: dict[str, Sequence[dict[str, int]]], rates: dict[str, dict[str, float]], cost: CostModel
) -> dict[str, dict[str, Any]]:
    """Per row: its ``summary`` and its modelled TTFT at each bound of ``rates``."""
    return {
        name: summary(per_request)
        | {"ttft": {bound: modelled_ttft(per_request, gbps, cost) for bound, gbps in rates.items()}}
        for name, per_request in rows.items()
    }


def print_side_by_side(results: dict[str, dict], vllm: str | None) -> None:
    """One block per workload: each row's share served, recomputed, and modelled mean TTFT."""
    where = f"vLLM {vllm}" if vllm else "vLLM does not import here: its rows are left out"
    print(f"side by side ({where}): {METHOD}")
    print(
        f"{'workload':12} {'':22} {'tier hits':>9} {'served':>8} {'recomputed':>10} "
        f"{'TTFT ms achieved':>16} {'ceiling':>8}"
    )
    for workload, r in results.items():
        side = r["side_by_side"]
        for i, (name, fig) in enumerate(side["rows"].items()):
            total = max(1, sum(fig["tokens"].values()))
            a, c = fig["ttft"]["achieved"], fig["ttft"]["ceiling"]
            print(
                f"{workload if i == 0 else '':12} {name:22} {fig['tier_hit_ratio']:9.1%} "
                f"{fig['served_tokens'] / total:8.1%} {fig['recomputed_tokens'] / total:10.1%} "
                f"{a.get('mean_ms', 0.0):16.2f} {c.get('mean_ms', 0.0):8.2f}"
            )
        none = next(iter(side["rows"].values()))["ttft"]["achieved"]
        if none:
            print(f"{'':12} {'recompute all':22} {'':9} {'':8} {'':10} {none['no_kvtier_mean_ms']:16.2f}")
    print(
        "  tier hits: blocks a tier served / blocks the device lacked; served, recomputed: share of "
        "prompt tokens;\n  TTFT: mean over requests, every row at the same per-tier GB/s of this run"
    )
