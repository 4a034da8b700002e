"""``kvtier bench serve --hit-gap``: what a kvtier hit costs over a hit of vLLM's own device cache.

One engine per lower tier (``host``: the host tier alone; ``disk``; ``peer``: a real
``kvtier peer``), each written through to its tier. Per prompt length and repetition, a
fresh prefix of that length is asked four times, each with a 32-token question of its own:

1. ``computed``: first time: every token computed (and stored by kvtier);
2. ``device``: vLLM's device prefix cache holds the prefix;
3. ``host``: the device cache emptied: kvtier's host tier serves the prefix (vLLM's
   connector loads it asynchronously: the request waits at least one engine step);
4. ``disk`` / ``peer``: the host tier emptied too (``reset_prefix_cache(reset_connector)``;
   lower tiers keep their rows): the prefix is promoted from the tier, then loaded.

Every figure is a ratio against the device hit timed in the same engine, the same
repetition, a few seconds apart (the machine may be shared: absolute times move, ratios
much less). Lengths are visited in a rotated order each repetition.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import write_json
from bench.serve_workloads import document

LENGTHS = (500, 1000, 2000, 4000)
CONFIGS = ("host", "disk", "peer")
QUESTION_TOKENS = 32
HIT_GAP_TARGET = 1.3  # a host-tier hit's TTFT within this of a device-cache hit's


def _extra(config: str, rowdir: Path, sizes: Any, peer: dict[str, Any] | None) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [{"kind": "host", "eviction": "lru"}]
    below = {"placement": "write-through", "admission": "all", "capacity": sizes.lower_bytes}
    if config == "disk":
        tiers.append({"kind": "disk", "path": str(rowdir / "disk"), **below})
    elif config == "peer":
        assert peer is not None
        tiers.append({**peer, **below})
    return {
        "spec_name": "KVTierOffloadingSpec",
        "spec_module_path": "offload.vllm",
        "cpu_bytes_to_use": sizes.host_bytes,
        "shm_dir": str(rowdir / "shm"),
        "kvtier_config": {"tiers": tiers},
    }


def _ask(engine: Any, prompt: list[int]) -> dict[str, Any]:
    answer = engine.timed([{"prompt": prompt, "max_tokens": 2, "arrival_s": 0.0}])
    out = answer["outputs"][0]
    return {
        "ttft_s": out.ttft_s,
        "steps": answer["steps"],
        "steps_waiting_on_loads": answer["steps_waiting_on_loads"],
        "cached": out.num_cached_tokens,
        "kvtier": out.external_cached_tokens or 0,
    }


def _wait_below(engine: Any, timeout_s: float = 60.0) -> None:
    """Until every row stored went below (write-through) and nothing is in flight there."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.kvtier_stats()
        lower = stats["lower"]
        if (
            stats["lower_inflight"] == 0
            and lower["spills_done"] + lower["spills_dropped"] >= stats["stored_rows"]
        ):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"rows not below the host tier in {timeout_s} s: {lower}")
        time.sleep(0.05)


def run_config(
    config: str, lengths: list[int], reps: int, sizes: Any, model_dir: str, workdir: Path, seed: int
) -> list[dict[str, Any]]:
    """One engine; per repetition and length, the four (or three) asks of one fresh prefix."""
    from bench.serve import _peer
    from bench.vllm_engine import EngineProcess

    rowdir = workdir / config
    (rowdir / "shm").mkdir(parents=True)
    samples = []
    with contextlib.ExitStack() as stack:
        peer = stack.enter_context(_peer(rowdir, sizes)) if config == "peer" else None
        spec = sizes.engine_spec(model_dir, _extra(config, rowdir, sizes, peer))
        engine = stack.enter_context(EngineProcess(spec, rowdir / "engine.log"))
        engine.generate([document(seed - 1, 600)], max_tokens=2)  # warm: tokens no ask holds
        for rep in range(reps):
            order = lengths[rep % len(lengths) :] + lengths[: rep % len(lengths)]
            for length in order:
                prefix = document(seed + 7919 * rep + length, length)
                prompts = iter(
                    prefix + document(seed + 104729 * rep + length * 10 + ask, QUESTION_TOKENS)
                    for ask in range(1, 5)
                )
                sample: dict[str, Any] = {"config": config, "length": length, "rep": rep}
                sample["computed"] = _ask(engine, next(prompts))
                if config != "host":
                    _wait_below(engine)
                sample["device"] = _ask(engine, next(prompts))
                assert engine.reset_prefix_cache(), "vLLM refused a cache reset"
                sample["host"] = _ask(engine, next(prompts))
                if config != "host":
                    assert engine.reset_prefix_cache(connector=True), "vLLM refused a cache reset"
                    sample[config] = _ask(engine, next(prompts))
                assert engine.reset_prefix_cache(connector=True), "vLLM refused a cache reset"
                samples.append(sample)
    return samples


def figures(samples: list[dict[str, Any]], lengths: list[int]) -> dict[str, Any]:
    """Per length and source: median TTFT, and the median over repetitions of its ratio to the
    device hit of the same engine and repetition."""
    table: dict[str, Any] = {}
    for length in lengths:
        mine = [s for s in samples if s["length"] == length]
        row: dict[str, Any] = {}
        for source in ("computed", "device", "host", "disk", "peer"):
            picked = [s for s in mine if source in s]
            if not picked:
                continue
            ratios = [s[source]["ttft_s"] / s["device"]["ttft_s"] for s in picked]
            row[source] = {
                "n": len(picked),
                "ttft_s": statistics.median(s[source]["ttft_s"] for s in picked),
                "vs_device": statistics.median(ratios),
                "steps": statistics.median(s[source]["steps"] for s in picked),
                "loaded_tokens": statistics.median(s[source]["kvtier"] for s in picked),
            }
        table[str(length)] = row
    return table


def print_table(table: dict[str, Any]) -> None:
    sources = ("computed", "device", "host", "disk", "peer")
    print(f"\n  {'prompt':>7} " + " ".join(f"{s + ' ms':>11} {'x dev':>6} {'steps':>5}" for s in sources))
    for length, row in table.items():
        cells = []
        for source in sources:
            cell = row.get(source)
            if cell is None:
                cells.append(f"{'-':>11} {'-':>6} {'-':>5}")
            else:
                cells.append(f"{cell['ttft_s'] * 1e3:11.1f} {cell['vs_device']:6.2f} {cell['steps']:5.0f}")
        print(f"  {length:>7} " + " ".join(cells))
    worst = max((row["host"]["vs_device"] for row in table.values() if "host" in row), default=0.0)
    mark = "met" if worst <= HIT_GAP_TARGET else "NOT MET"
    print(
        f"\n  host-tier hit vs device-cache hit, worst length: {worst:.2f}x"
        f" (target {HIT_GAP_TARGET}x): {mark}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvtier bench serve --hit-gap", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prompt lengths, tokens")
    parser.add_argument("--rows", default=",".join(CONFIGS), help=f"comma-separated: {', '.join(CONFIGS)}")
    parser.add_argument("--reps", type=int, default=3, help="fresh prefixes per length and row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    for name in args.rows:
        if name not in CONFIGS:
            parser.error(f"unknown row {name!r}: {', '.join(CONFIGS)}")
    if not args.lengths or min(args.lengths) < 64 or max(args.lengths) > 4000:
        parser.error("--lengths: between 64 and 4000 tokens (the engine's 4,096-token context)")
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    from bench.serve import Sizes, engine_version
    from bench.tiny_llama import TinyLlama, write_model

    args = parse_args(argv)
    sizes = Sizes()
    print(f"$ kvtier bench serve --hit-gap {' '.join(argv or [])}".rstrip())
    print(
        f"engine: {engine_version()}, {TinyLlama().name} ({sizes.dtype}, eager); block {sizes.block_size}"
        f" tokens; host tier {sizes.host_bytes >> 20} MiB, written through to the row's tier;"
        f" {args.reps} fresh prefixes per length; TTFT medians, ratios to the device hit of the same rep"
    )
    started = time.monotonic()
    samples: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-hit-gap-") as tmp:
        workdir = Path(tmp)
        model_dir = str(write_model(workdir / "models"))
        for config in args.rows:
            samples += run_config(config, args.lengths, args.reps, sizes, model_dir, workdir, args.seed)
    table = figures(samples, args.lengths)
    print_table(table)
    print(f"\n{len(args.rows)} engines, {time.monotonic() - started:.0f} s in all")
    write_json(args.json, {"command": "kvtier bench serve --hit-gap", "figures": table, "samples": samples})
    return 0


if __name__ == "__main__":
    sys.exit(main())
