"""``kvtier bench serve --client vllm``: ``kvtier bench serve``'s rows driven by vLLM's own benchmark client.

The same rows as ``bench.serve`` (vLLM alone, + kvtier host, + host over disk, + host over
a real ``kvtier peer``), but each row is a real ``vllm serve`` (``bench.vllm_server``) and
the load is vLLM's own ``vllm bench serve`` (``vllm.benchmarks.serve``'s ``add_cli_args``
and ``main``, run in this process: the CPU wheel's ``vllm`` script cannot start), with
its datasets (``prefix_repetition``, ``random``), concurrency and request rate. Users can
reproduce kvtier's figures with the tool they already trust.

TTFT and requests/s are the client's; where prompt tokens came from is the server's own
``/metrics`` (``vllm:prefix_cache_hits``: the device cache; ``vllm:external_prefix_cache_hits``:
loaded by the connector, i.e. kvtier), read before and after each row's run. Every row sees
the same prompts in the same order (the client's seed).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench import serve_requests
from bench.report import write_json
from bench.serve import CONFIGS, Sizes, _peer, engine_missing, engine_version, kvtier_extra
from bench.ttft import percentile
from bench.vllm_server import stop_on_sigterm

log = logging.getLogger(__name__)

DATASETS = ("prefix_repetition", "random")
WARM_UP = list(range(100, 164))  # token ids no dataset prompt starts with: the first request's costs
SERVER_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
"""Every row's server reserves one core for vLLM's scheduler process, as vLLM alone does by
itself. With a ``--kv-transfer-config``, vLLM 0.32's CPU build reserves one more (for NIXL's
P/D); on a 2-core machine that left the worker every core and two OpenMP threads, which it
then keeps for serving (``OMP_NUM_THREADS=2 is set``) and which spin-wait beside the
scheduler's own busy loop. Measured: 3 requests of 96 decode tokens took 1.6-1.8 s each with
vLLM alone and 6-26 s with kvtier's host tier (and no kvtier hit): the rows then compared
thread settings, not kvtier."""


@dataclass(frozen=True)
class Load:
    """What the client sends: the dataset and its sizes, how many requests, how fast."""

    dataset: str = "prefix_repetition"
    num_prompts: int = 16
    prefix_len: int = 1024  # prefix_repetition: each prefix's tokens
    suffix_len: int = 64  # prefix_repetition: each request's own tokens after its prefix
    num_prefixes: int = 4  # prefix_repetition
    input_len: int = 1024  # random: prompt tokens
    random_prefix_len: int = 0  # random: tokens every prompt shares
    output_len: int = 8
    concurrency: int = 2
    request_rate: float = float("inf")
    seed: int = 0

    def client_argv(self, port: int, model: str) -> list[str]:
        """``vllm bench serve``'s arguments for this load against a server on ``port``."""
        argv = [
            "--backend", "vllm", "--host", "127.0.0.1", "--port", str(port), "--model", model,
            "--dataset-name", self.dataset, "--num-prompts", str(self.num_prompts),
            "--max-concurrency", str(self.concurrency), "--request-rate", str(self.request_rate),
            "--seed", str(self.seed), "--temperature", "0", "--ignore-eos", "--disable-tqdm",
            "--save-detailed", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99",
        ]  # fmt: skip
        if self.dataset == "prefix_repetition":
            argv += [
                "--prefix-repetition-prefix-len", str(self.prefix_len),
                "--prefix-repetition-suffix-len", str(self.suffix_len),
                "--prefix-repetition-num-prefixes", str(self.num_prefixes),
                "--prefix-repetition-output-len", str(self.output_len),
            ]  # fmt: skip
        else:
            argv += [
                "--random-input-len", str(self.input_len),
                "--random-output-len", str(self.output_len),
                "--random-prefix-len", str(self.random_prefix_len),
                "--random-range-ratio", "0",
            ]  # fmt: skip
        return argv

    @property
    def shared_len(self) -> int:
        """Tokens a prompt shares with others: its prefix (0: none)."""
        return self.prefix_len if self.dataset == "prefix_repetition" else self.random_prefix_len

    @property
    def longest_prompt(self) -> int:
        if self.dataset == "prefix_repetition":
            return self.prefix_len + self.suffix_len
        return self.random_prefix_len + self.input_len


def run_client(load: Load, port: int, model: str, log_path: Path) -> tuple[dict[str, Any], list[str]]:
    """vLLM's benchmark client, in this process (its prints go to ``log_path``): its result,
    and the prompts it sent, in its order (what its per-request records are in)."""
    from vllm.benchmarks import serve as client_module
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    client_module.add_cli_args(parser)
    args = parser.parse_args(load.client_argv(port, model))
    sent: list[Any] = []
    get_samples = client_module.get_samples

    def recording(*given: Any, **named: Any) -> Any:  # the client keeps its samples to itself
        samples = get_samples(*given, **named)
        sent.extend(samples)
        return samples

    client_module.get_samples = recording
    try:
        with log_path.open("a") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            result = client_module.main(args)
    finally:
        client_module.get_samples = get_samples
    prompts = [s.prompt if isinstance(s.prompt, str) else " ".join(map(str, s.prompt)) for s in sent]
    return result, prompts


def _hits(metrics: dict[str, float], name: str) -> float:
    return metrics.get(f"{name}_total", metrics.get(name, 0.0))


def run_row(config: str, load: Load, sizes: Sizes, model_dir: str, workdir: Path) -> dict[str, Any]:
    """One ``vllm serve`` for ``config``; the client's run through it; the server's counters."""
    from bench.vllm_server import ServerProcess

    rowdir = workdir / config
    (rowdir / "shm").mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        peer = stack.enter_context(_peer(rowdir, sizes)) if config == "peer" else None
        spec = sizes.server_spec(model_dir, kvtier_extra(config, sizes, rowdir, peer), SERVER_ENV)
        server = stack.enter_context(ServerProcess(spec, rowdir / "server.log"))
        server.complete(WARM_UP, max_tokens=2)
        before = server.metrics()
        load_before = os.getloadavg()[0]
        started = time.monotonic()
        result, prompts = run_client(load, server.port, model_dir, rowdir / "client.log")
        wall = time.monotonic() - started
        load_after = os.getloadavg()[0]
        after = server.metrics()
    left = list((rowdir / "shm").iterdir())
    if left:
        raise RuntimeError(f"{config}: the server left {[p.name for p in left]} in its shm folder")
    tokens = {
        name: int(_hits(after, metric) - _hits(before, metric))
        for name, metric in (
            ("prompt", "vllm:prompt_tokens"),
            ("device", "vllm:prefix_cache_hits"),
            ("kvtier", "vllm:external_prefix_cache_hits"),
        )
    }
    return {
        "start_s": server.start_s,
        "wall_s": wall,
        "tokens": tokens,
        "client": result,
        "requests": serve_requests.records(result, prompts, load.shared_len),
        "loadavg": (load_before, load_after),
    }


def row_figures(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per row: the client's TTFT (mean, median, p99) and requests/s, failures, hits, and the
    ratios against vLLM alone measured in the same run."""
    figures: dict[str, dict[str, Any]] = {}
    for config, row in rows.items():
        client = row["client"]
        ttfts = [t for t, e in zip(client["ttfts"], client["errors"], strict=True) if not e]
        figures[config] = {
            "completed": client["completed"],
            "failed": client.get("failed", 0),
            "ttft_s": {
                "mean": statistics.fmean(ttfts) if ttfts else 0.0,
                "median": statistics.median(ttfts) if ttfts else 0.0,
                "p99": percentile(ttfts, 99),
            },
            "requests_per_s": client["request_throughput"],
            "output_tok_s": client["output_throughput"],
            "tokens": row["tokens"],
            "slowest": serve_requests.slowest(row["requests"]),
            "loadavg": row["loadavg"],
        }
    alone = figures.get("vllm")
    if alone is not None:
        for config, fig in figures.items():
            if config == "vllm":
                continue
            fig["vs_vllm"] = {
                stat: alone["ttft_s"][stat] / fig["ttft_s"][stat] if fig["ttft_s"][stat] else 0.0
                for stat in ("mean", "median", "p99")
            }
            fig["vs_vllm"]["requests_per_s"] = fig["requests_per_s"] / alone["requests_per_s"]
    return figures


def print_report(figures: dict[str, dict[str, Any]]) -> None:
    print(
        f"  {'row':22} {'mean s':>7} {'median s':>8} {'p99 s':>7} {'req/s':>6} {'failed':>6}"
        f" {'device tok':>10} {'kvtier tok':>10} {'TTFT x (mean/med/p99)':>22} {'req/s x':>7}"
    )
    for config, fig in figures.items():
        ttft, tokens = fig["ttft_s"], fig["tokens"]
        ratios = fig.get("vs_vllm")
        speed = "-" if ratios is None else "/".join(f"{ratios[s]:.1f}" for s in ("mean", "median", "p99"))
        rps = "-" if ratios is None else f"{ratios['requests_per_s']:.2f}"
        print(
            f"  {CONFIGS[config]:22} {ttft['mean']:7.3f} {ttft['median']:8.3f} {ttft['p99']:7.3f}"
            f" {fig['requests_per_s']:6.3f} {fig['failed']:6d} {tokens['device']:10d} {tokens['kvtier']:10d}"
            f" {speed:>22} {rps:>7}"
        )
    print("\n  slowest requests (the first is the p99 of up to 100; load average before/after the row):")
    for config, fig in figures.items():
        slow = "; ".join(serve_requests.describe(r) for r in fig["slowest"])
        print(f"  {CONFIGS[config]:22} {slow} [load {fig['loadavg'][0]:.1f}/{fig['loadavg'][1]:.1f}]")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvtier bench serve --client vllm", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--client", choices=("vllm",), default="vllm", help="vLLM's own benchmark client")
    parser.add_argument("--rows", default=",".join(CONFIGS), help=f"comma-separated: {', '.join(CONFIGS)}")
    parser.add_argument("--dataset", choices=DATASETS, default=Load.dataset)
    parser.add_argument("--num-prompts", type=int, default=Load.num_prompts)
    parser.add_argument("--prefix-len", type=int, default=Load.prefix_len, help="prefix_repetition")
    parser.add_argument("--suffix-len", type=int, default=Load.suffix_len, help="prefix_repetition")
    parser.add_argument("--num-prefixes", type=int, default=Load.num_prefixes, help="prefix_repetition")
    parser.add_argument(
        "--input-len", "--random-input-len", type=int, default=Load.input_len, help="random: own tokens"
    )
    parser.add_argument(
        "--random-prefix-len", type=int, default=Load.random_prefix_len, help="random: shared tokens"
    )
    parser.add_argument("--output-len", "--random-output-len", type=int, default=Load.output_len)
    parser.add_argument(
        "--concurrency", type=int, default=Load.concurrency, help="the client's max concurrency"
    )
    parser.add_argument(
        "--request-rate", type=float, default=Load.request_rate, help="requests/s (inf: all at once)"
    )
    parser.add_argument("--seed", type=int, default=Load.seed)
    parser.add_argument("--device-blocks", type=int, default=64, help="vLLM's device cache, blocks of 32")
    parser.add_argument("--dtype", default=Sizes.dtype, choices=("float32", "bfloat16"))
    parser.add_argument("--json", metavar="FILE", help="write the figures and the client's results as JSON")
    args = parser.parse_args(argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    for name in args.rows:
        if name not in CONFIGS:
            parser.error(f"unknown row {name!r}: {', '.join(CONFIGS)}")
    if not args.rows:
        parser.error("at least one row")
    for name in ("num_prompts", "output_len", "concurrency", "device_blocks", "prefix_len", "input_len"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.random_prefix_len < 0:
        parser.error("--random-prefix-len must be 0 or more")
    if args.dataset == "prefix_repetition" and args.num_prompts < args.num_prefixes:
        parser.error("--num-prompts must be at least --num-prefixes")
    if args.request_rate <= 0:
        parser.error("--request-rate must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    missing = engine_missing()
    if missing:
        print(f"kvtier bench serve --client vllm runs a real vllm serve: {missing}", file=sys.stderr)
        return 2
    from bench.tiny_llama import TinyLlama, write_model
    from bench.vllm_server import write_tokenizer

    load = Load(
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
        num_prefixes=args.num_prefixes,
        input_len=args.input_len,
        random_prefix_len=args.random_prefix_len,
        output_len=args.output_len,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        seed=args.seed,
    )
    block = Sizes.block_size
    max_model_len = -(-(load.longest_prompt + load.output_len + 1) // block) * block
    if args.device_blocks < max_model_len // block + 1:  # vLLM keeps one block aside
        print(
            f"--device-blocks must hold a {max_model_len}-token request and one block more"
            f" (>= {max_model_len // block + 1})",
            file=sys.stderr,
        )
        return 2
    sizes = replace(Sizes(), device_blocks=args.device_blocks, dtype=args.dtype, max_model_len=max_model_len)
    command = "kvtier bench serve --client vllm " + " ".join(
        a for a in (sys.argv[1:] if argv is None else argv) if a not in ("--client", "vllm")
    )
    print(f"$ {command.strip()}")
    print(
        f"engine: {engine_version()} (vllm serve), {TinyLlama().name} ({sizes.dtype}, eager);"
        f" device cache {sizes.device_blocks} blocks of {block} tokens;"
        f" host tier {sizes.host_bytes >> 20} MiB"
        f" (host row), {sizes.small_host_bytes >> 20} MiB over {sizes.lower_bytes >> 20} MiB of disk or peer"
    )
    print(
        f"client: vLLM's bench serve, {load.dataset}, {load.num_prompts} requests, concurrency"
        f" {load.concurrency}, request rate {load.request_rate}"
    )
    rows: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvtier-serve-client-") as tmp:
        workdir = Path(tmp)
        model_dir = write_model(workdir / "models")
        write_tokenizer(model_dir, TinyLlama().vocab)
        for config in args.rows:
            print(f"  {CONFIGS[config]} ...", file=sys.stderr, flush=True)
            rows[config] = run_row(config, load, sizes, str(model_dir), workdir)
    figures = row_figures(rows)
    print()
    print_report(figures)
    print(f"\n{len(rows)} servers, {time.monotonic() - started:.0f} s in all")
    write_json(
        args.json,
        {
            "command": command,
            "engine": engine_version(),
            "sizes": asdict(sizes),
            "load": asdict(load),
            "figures": figures,
            "server_start_s": {c: r["start_s"] for c, r in rows.items()},
            "client": {
                c: {k: v for k, v in r["client"].items() if k not in ("generated_texts", "itls")}
                for c, r in rows.items()
            },
            "requests": {c: [asdict(q) for q in r["requests"]] for c, r in rows.items()},
        },
    )
    failed = {c: f["failed"] for c, f in figures.items() if f["failed"]}
    if failed:
        print(f'failed requests: {failed} (their errors: the client\'s "errors" in --json)', file=sys.stderr)
        return 1
    return 0
