"""``python -m bench.soak --minutes 30``: vLLM's benchmark client against ``vllm serve`` with
kvtier's host, disk and peer tiers, for a while, watching that nothing grows.

What runs: a real ``kvtier peer`` (NIXL, 127.0.0.1) and ``vllm serve`` with kvtier over a
small host tier, a disk tier (LMDB) and that peer, the lower tiers small enough to fill
during warm-up so that the run spends its time evicting, not growing. vLLM's own client
(``bench.serve_client.run_client``) sends ``prefix_repetition`` batches at concurrency 8,
each batch with new prompts (its own seed), until the time is up.

What is watched, every ``--sample-s``: the server's process tree (RSS, open fds, threads,
processes; each process's RSS by kind: anonymous, file, shared), ``/dev/shm`` (kvtier's
host-tier folder there, and the filesystem's use, which other processes on the machine
share), the disk tier's size, the peer's RSS, fds and threads; failed requests per batch.
Flatness is judged after warm-up: over the second half of the run, max - min against the
first sample after warm-up.

``--no-kvtier`` is the control: the same client against vLLM alone (no peer, no output
check), which tells kvtier's growth from vLLM's own.

Outputs are checked before and after: a fixed set of prompts is answered (greedy, with
logprobs) by vLLM alone from its device prefix cache, then by the soaked server with the
prefixes loaded from kvtier; tokens and logprobs must be identical (float32: the same KV
attended gives the same logits).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.report import write_json
from bench.serve import Sizes, _peer
from bench.serve_client import SERVER_ENV, WARM_UP, Load, run_client
from bench.serve_workloads import document
from bench.vllm_server import ServerProcess, stop_on_sigterm

FIXED_PROMPTS = 4
FIXED_TOKENS = 1000  # not a multiple of the block: the last partial block is computed in both runs
FIXED_OUTPUT = 16


@dataclass(frozen=True)
class SoakSizes:
    """The tiers: a host tier of ~2 prefixes over disk and peer tiers that fill in a few batches."""

    host_bytes: int = 16 << 20
    disk_bytes: int = 192 << 20
    peer_bytes: int = 192 << 20


def _du(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total


def _rss_kinds(pid: int) -> dict[str, int]:
    """A process's resident memory by kind (``/proc/PID/status``, bytes): ``anon`` (its heap:
    what a leak grows), ``file`` (mapped files: code, the disk tier's maps) and ``shmem``
    (shared memory: kvtier's host tier)."""
    kinds = {"RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
    found: dict[str, int] = {}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, rest = line.partition("\t")
            if name in kinds:
                found[kinds[name]] = int(rest.split()[0]) * 1024
    return found


def _tree(pid: int) -> dict[str, Any]:
    """RSS, fds and threads summed over ``pid`` and its descendants; and each process's RSS
    by kind (``rss_by_name``: the root is ``server``, the others by their process name, which
    vLLM sets: ``VLLM::EngineCore``), to tell which process grows and how."""
    import psutil

    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    totals: dict[str, Any] = {"rss": 0, "fds": 0, "threads": 0, "processes": 0, "rss_by_pid": {}}
    by_name: dict[str, dict[str, int]] = {}
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            rss = proc.memory_info().rss
            name = "server" if proc.pid == pid else proc.name()
            totals["rss_by_pid"][f"{proc.pid} {proc.name()}"] = rss  # which process grows
            mine = by_name.setdefault(name, {"rss": 0, "anon": 0, "file": 0, "shmem": 0})
            mine["rss"] += rss
            for kind, value in _rss_kinds(proc.pid).items():
                mine[kind] += value
            totals["rss"] += rss
            totals["fds"] += proc.num_fds()
            totals["threads"] += proc.num_threads()
            totals["processes"] += 1
    totals["rss_by_name"] = by_name
    return totals


class Sampler(threading.Thread):
    """Samples the server, the peer and the tiers' files every ``period_s`` until stopped."""

    def __init__(
        self, server: ServerProcess, peer_pid: int | None, shm_dir: Path, disk_dir: Path, period_s: float
    ) -> None:
        super().__init__(daemon=True, name="soak-sampler")
        self.server, self.peer_pid = server, peer_pid
        self.shm_dir, self.disk_dir = shm_dir, disk_dir
        self.period_s = period_s
        self.samples: list[dict[str, Any]] = []
        self.started = time.monotonic()
        self._done = threading.Event()

    def sample(self) -> dict[str, Any]:
        shm = shutil.disk_usage("/dev/shm")
        metrics: dict[str, float] = {}
        with contextlib.suppress(OSError):
            metrics = self.server.metrics()
        peer = _tree(self.peer_pid) if self.peer_pid is not None else {"rss": 0, "fds": 0, "threads": 0}
        return {
            "t_s": round(time.monotonic() - self.started, 1),
            "server": _tree(self.server.process.pid),
            "peer": {"rss": peer["rss"], "fds": peer["fds"], "threads": peer["threads"]},
            "shm_kvtier_bytes": _du(self.shm_dir),
            "shm_used_bytes": shm.used,
            "disk_tier_bytes": _du(self.disk_dir),
            "kvtier_hit_tokens": metrics.get("vllm:external_prefix_cache_hits_total", 0.0),
            "device_hit_tokens": metrics.get("vllm:prefix_cache_hits_total", 0.0),
        }

    def run(self) -> None:
        while not self._done.is_set():
            self.samples.append(self.sample())
            self._done.wait(self.period_s)

    def stop(self) -> None:
        self._done.set()
        self.join()
        self.samples.append(self.sample())


SERIES = {
    "server RSS (MiB)": lambda s: s["server"]["rss"] / 2**20,
    "server fds": lambda s: s["server"]["fds"],
    "server threads": lambda s: s["server"]["threads"],
    "server processes": lambda s: s["server"]["processes"],
    "kvtier /dev/shm (MiB)": lambda s: s["shm_kvtier_bytes"] / 2**20,
    "/dev/shm used, machine (MiB)": lambda s: s["shm_used_bytes"] / 2**20,
    "disk tier (MiB)": lambda s: s["disk_tier_bytes"] / 2**20,
    "peer RSS (MiB)": lambda s: s["peer"]["rss"] / 2**20,
    "peer fds": lambda s: s["peer"]["fds"],
    "peer threads": lambda s: s["peer"]["threads"],
}


def _by_process(name: str, kind: str) -> Any:
    return lambda s: s["server"].get("rss_by_name", {}).get(name, {}).get(kind, 0) / 2**20


def process_series(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """One series per process of the server's tree (by name) and kind of RSS: which process
    grows, and whether it is its heap (``anon``), mapped files or shared memory."""
    names = sorted({n for s in samples for n in s["server"].get("rss_by_name", {})})
    return {
        f"{name} {kind} (MiB)": _by_process(name, kind)
        for name in names
        for kind in ("rss", "anon", "file", "shmem")
    }


def flatness(samples: list[dict[str, Any]], warm_up_s: float) -> dict[str, dict[str, float]]:
    """Per series: the first sample after warm-up, min and max over the run's second half,
    their spread, and the last sample minus the first after warm-up."""
    after = [s for s in samples if s["t_s"] >= warm_up_s] or samples[-1:]
    half = samples[-1]["t_s"] / 2
    second = [s for s in samples if s["t_s"] >= half] or samples[-1:]
    table = {}
    for name, get in {**SERIES, **process_series(samples)}.items():
        values = [get(s) for s in second]
        first = get(after[0])
        table[name] = {
            "first_after_warm_up": first,
            "second_half_min": min(values),
            "second_half_max": max(values),
            "second_half_spread": max(values) - min(values),
            "last_minus_first": get(samples[-1]) - first,
        }
    return table


def answer_fixed(server: ServerProcess, prompts: list[list[int]]) -> list[dict[str, Any]]:
    return [server.complete(p, FIXED_OUTPUT) for p in prompts]


def reference(sizes: Sizes, model_dir: str, prompts: list[list[int]], workdir: Path) -> list[dict[str, Any]]:
    """vLLM alone's answers with each prompt's prefix found in its device prefix cache."""
    spec = sizes.server_spec(model_dir, kvtier=None)
    with ServerProcess(spec, workdir / "reference.log") as server:
        server.complete(WARM_UP, max_tokens=2)
        answers = []
        for prompt in prompts:
            server.complete(prompt, FIXED_OUTPUT)  # computed; its blocks stay in the device cache
            answers.append(server.complete(prompt, FIXED_OUTPUT))
        assert all(a["cached_tokens"] > 0 for a in answers), "vLLM alone's device cache did not hit"
        return answers


def compare(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> dict[str, Any]:
    diffs = [
        max((abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"], strict=True)), default=0.0)
        for g, w in zip(got, want, strict=True)
    ]
    return {
        "prompts": len(got),
        "same_tokens": sum(g["tokens"] == w["tokens"] for g, w in zip(got, want, strict=True)),
        "same_logprobs": sum(d == 0.0 for d in diffs),
        "max_logprob_diff": max(diffs),
        "cached_tokens": [g["cached_tokens"] for g in got],
    }


def loaded_from_kvtier(server: ServerProcess, prompts: list[list[int]]) -> dict[str, Any]:
    """The fixed prompts answered with their prefixes in kvtier and not in the device cache:
    answered once (stored), the device cache emptied, answered again (loaded)."""
    answer_fixed(server, prompts)
    server.reset_prefix_cache()
    before = server.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)
    answers = answer_fixed(server, prompts)
    loaded = server.metrics().get("vllm:external_prefix_cache_hits_total", 0.0) - before
    return {"answers": answers, "kvtier_tokens": int(loaded)}


def soak(args: argparse.Namespace) -> dict[str, Any]:
    from bench.tiny_llama import TinyLlama, write_model
    from bench.vllm_server import write_tokenizer

    load = Load(
        dataset="prefix_repetition",
        num_prompts=args.batch,
        prefix_len=args.prefix_len,
        suffix_len=128,
        num_prefixes=max(1, args.batch // 4),
        output_len=16,
        concurrency=args.concurrency,
    )
    sizes = replace(Sizes(), device_blocks=args.device_blocks, max_model_len=2048)
    tiers = SoakSizes()
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-soak-"))
    shm_dir = Path(tempfile.mkdtemp(prefix="kvtier-soak-", dir="/dev/shm"))
    try:
        model_dir = str(write_model(workdir / "models"))
        write_tokenizer(model_dir, TinyLlama().vocab)
        prompts = [document(9000 + i, FIXED_TOKENS) for i in range(FIXED_PROMPTS)]
        want = None
        if not args.no_kvtier:
            print("reference: vLLM alone, device prefix cache ...", flush=True)
            want = reference(sizes, model_dir, prompts, workdir)
        with contextlib.ExitStack() as stack:
            extra, peer_pid = None, None
            if not args.no_kvtier:
                peer = stack.enter_context(_peer(workdir, replace(sizes, lower_bytes=tiers.peer_bytes)))
                peer_pid = _peer_pid(workdir)
                extra = _kvtier_extra(tiers, workdir, shm_dir, peer)
            # the core vLLM alone reserves, unless --server-env says otherwise
            spec = sizes.server_spec(model_dir, extra, {**SERVER_ENV, **dict(args.server_env)})
            print(
                "vllm serve alone (the control) ..."
                if args.no_kvtier
                else "vllm serve with kvtier host + disk + peer ...",
                flush=True,
            )
            server = stack.enter_context(ServerProcess(spec, workdir / "server.log"))
            server.complete(WARM_UP, max_tokens=2)
            before = None if want is None else loaded_from_kvtier(server, prompts)
            sampler = Sampler(server, peer_pid, shm_dir, workdir / "disk", args.sample_s)
            sampler.start()
            deadline = time.monotonic() + args.minutes * 60  # the client's time, after the starts
            batches = []
            seed = 0
            while time.monotonic() < deadline:
                seed += 1
                started = time.monotonic()
                result = run_client(replace(load, seed=seed), server.port, model_dir, workdir / "client.log")
                batches.append(
                    {
                        "seed": seed,
                        "t_s": round(started - sampler.started, 1),
                        "wall_s": round(time.monotonic() - started, 1),
                        "completed": result["completed"],
                        "failed": result.get("failed", 0),
                        "mean_ttft_s": result["mean_ttft_ms"] / 1000,
                        "errors": sorted({e for e in result["errors"] if e})[:3],
                    }
                )
                print(
                    f"  batch {seed}: {result['completed']} done, {result.get('failed', 0)} failed,"
                    f" mean TTFT {result['mean_ttft_ms'] / 1000:.2f} s;"
                    f" server RSS {sampler.samples[-1]['server']['rss'] >> 20} MiB",
                    flush=True,
                )
            sampler.stop()
            after = None if want is None else loaded_from_kvtier(server, prompts)
            pids = [server.process.pid, *_children(server.process.pid)]
            pids += [] if peer_pid is None else [peer_pid]
        left = _still_running(pids)
    finally:
        leftover_shm = sorted(os.listdir(shm_dir)) if shm_dir.exists() else []
        shutil.rmtree(shm_dir, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    warm_up_s = args.warm_up_minutes * 60
    return {
        "minutes": args.minutes,
        "warm_up_s": warm_up_s,
        "sample_s": args.sample_s,
        "load": asdict(load),
        "sizes": asdict(sizes),
        "tiers": asdict(tiers),
        "requests": sum(b["completed"] for b in batches),
        "failed": sum(b["failed"] for b in batches),
        "batches": batches,
        "kvtier": not args.no_kvtier,
        "server_env": dict(args.server_env),
        "outputs_before": _outputs(before, want),
        "outputs_after": _outputs(after, want),
        "flatness": flatness(sampler.samples, warm_up_s),
        "samples": sampler.samples,
        "left_running": left,
        "left_in_shm": leftover_shm,
    }


def _kvtier_extra(tiers: SoakSizes, workdir: Path, shm_dir: Path, peer: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``kv_connector_extra_config``: kvtier over the host, disk and peer tiers."""
    return {
        "spec_name": "KVTierOffloadingSpec",
        "spec_module_path": "offload.vllm",
        "cpu_bytes_to_use": tiers.host_bytes,
        "shm_dir": str(shm_dir),
        "kvtier_config": {
            "tiers": [
                {"kind": "host", "eviction": "lru"},
                {
                    "kind": "disk",
                    "path": str(workdir / "disk"),
                    "capacity": tiers.disk_bytes,
                    "admission": "all",
                },
                {**peer, "capacity": tiers.peer_bytes},
            ]
        },
    }


def _outputs(got: dict[str, Any] | None, want: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The fixed prompts' check (None for the control: there is nothing of kvtier's to check)."""
    if got is None or want is None:
        return None
    return compare(got["answers"], want) | {"kvtier_tokens": got["kvtier_tokens"]}


def _peer_pid(workdir: Path) -> int:
    """The peer ``bench.serve._peer`` just started: the newest child of this process running it."""
    import psutil

    peers = [
        p
        for p in psutil.Process().children()
        if "tiers.remote.server" in " ".join(p.cmdline()) and str(workdir) in " ".join(p.cmdline())
    ]
    return max(peers, key=lambda p: p.create_time()).pid


def _children(pid: int) -> list[int]:
    import psutil

    with contextlib.suppress(psutil.Error):
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    return []


def _still_running(pids: list[int], grace_s: float = 10.0) -> list[int]:
    """The pids still alive ``grace_s`` after the server stopped: a child that exits a moment
    after its parent (vLLM's ``python`` helper of the API server did, in a control run) is
    not left running."""
    deadline = time.monotonic() + grace_s
    while True:
        left = [pid for pid in pids if _alive(pid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    import psutil

    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    return False


def print_report(result: dict[str, Any]) -> None:
    print(
        f"\n{result['minutes']:g} minutes, {result['requests']} requests, {result['failed']} failed;"
        f" {len(result['samples'])} samples every {result['sample_s']:g} s,"
        f" warm-up {result['warm_up_s']:.0f} s"
    )
    print(
        f"  {'series':30} {'after warm-up':>13} {'2nd half min':>12} {'max':>10}"
        f" {'spread':>8} {'last-first':>10}"
    )
    for name, row in result["flatness"].items():
        print(
            f"  {name:30} {row['first_after_warm_up']:13.1f} {row['second_half_min']:12.1f}"
            f" {row['second_half_max']:10.1f} {row['second_half_spread']:8.1f}"
            f" {row['last_minus_first']:10.1f}"
        )
    for when in ("before", "after"):
        out = result[f"outputs_{when}"]
        if out is None:
            continue
        print(
            f"  outputs {when}: {out['same_tokens']}/{out['prompts']} same tokens,"
            f" {out['same_logprobs']}/{out['prompts']} same logprobs (max diff {out['max_logprob_diff']:.2g})"
            f" as vLLM alone's device-cache run; {out['kvtier_tokens']} prompt tokens loaded by kvtier"
        )
    left, shm = result["left_running"] or "nothing", result["left_in_shm"] or "nothing"
    print(f"  left running: {left}; left in /dev/shm: {shm}")


def _env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the client sends requests")
    parser.add_argument("--warm-up-minutes", type=float, default=None, help="default: a sixth of --minutes")
    parser.add_argument("--sample-s", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32, help="requests per client run (new prompts each)")
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--device-blocks", type=int, default=96, help="vLLM's device cache, blocks of 32")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, disk tier)")
    parser.add_argument(
        "--no-kvtier", action="store_true", help="the control: vLLM alone under the same client, no peer"
    )
    parser.add_argument(
        "--server-env",
        metavar="NAME=VALUE",
        action="append",
        default=[],
        type=_env_pair,
        help="an environment variable for the server (e.g. MALLOC_ARENA_MAX=2); repeatable",
    )
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.sample_s <= 0 or args.concurrency <= 0 or args.batch <= 0:
        parser.error("--minutes, --sample-s, --concurrency and --batch must be positive")
    if args.warm_up_minutes is None:
        args.warm_up_minutes = args.minutes / 6
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    command = "python -m bench.soak " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"$ {command.strip()}", flush=True)
    result = soak(args)
    result["command"] = command
    print_report(result)
    write_json(args.json, result)
    ok = (
        result["failed"] == 0
        and not result["left_running"]
        and all(
            out is None or out["same_tokens"] == FIXED_PROMPTS
            for out in (result["outputs_before"], result["outputs_after"])
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
