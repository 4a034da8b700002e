"""``python -m bench.soak_probe``: the soak's load on vLLM's offline engine in one process,
with tracemalloc snapshots, to find what grows (a leak in Python, or memory held below it).

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so kvtier's
manager, its worker and the tiers' threads are all here: tracemalloc sees every Python
allocation of them, and the RSS not traced is what native code (torch, LMDB, NIXL, glibc's
arenas) holds. Batches like ``bench.soak``'s (prefixes shared within a batch, new prompts
each batch) run until ``--batches``; at each ``--snapshot-at`` batch a tracemalloc snapshot
is taken and compared with the first one. ``--no-kvtier`` runs vLLM alone (the control).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path
from typing import Any


def _rss() -> int:
    """This process's resident bytes, as the soak reads a process's (its kinds summed)."""
    from bench.soak import _rss_kinds

    return sum(_rss_kinds(os.getpid()).values())


def _batch(seed: int, batch: int, prefix_len: int, suffix_len: int) -> list[list[int]]:
    from bench.serve_workloads import document

    prefixes = [document(seed * 1000 + i, prefix_len) for i in range(max(1, batch // 4))]
    return [prefixes[i % len(prefixes)] + document(seed * 1000 + 500 + i, suffix_len) for i in range(batch)]


def _types() -> collections.Counter[str]:
    return collections.Counter(type(o).__name__ for o in gc.get_objects())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--snapshot-at", type=int, nargs="+", default=[10, 25, 40])
    parser.add_argument("--no-kvtier", action="store_true", help="vLLM alone: the control")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--trace", action="store_true", help="tracemalloc (slower)")
    parser.add_argument("--frames", type=int, default=1)
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) before each RSS sample")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from bench.serve import Sizes, _peer
    from bench.soak import SoakSizes
    from bench.tiny_llama import write_model

    sizes = replace(Sizes(), device_blocks=96, max_model_len=2048)
    tiers = SoakSizes()
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-probe-"))
    shm_dir = Path(tempfile.mkdtemp(prefix="kvtier-probe-", dir="/dev/shm"))
    libc = ctypes.CDLL("libc.so.6")
    rows: list[dict[str, Any]] = []
    try:
        model_dir = str(write_model(workdir / "models"))
        with contextlib.ExitStack() as stack:
            kwargs: dict[str, Any] = {
                "model": model_dir,
                "dtype": sizes.dtype,
                "skip_tokenizer_init": True,
                "max_model_len": sizes.max_model_len,
                "block_size": sizes.block_size,
                "enable_prefix_caching": True,
                "enforce_eager": True,
                "num_gpu_blocks_override": sizes.device_blocks,
                "disable_log_stats": False,
            }
            if not args.no_kvtier:
                lower: list[dict[str, Any]] = [
                    {
                        "kind": "disk",
                        "path": str(workdir / "disk"),
                        "capacity": tiers.disk_bytes,
                        "admission": "all",
                    }
                ]
                if not args.no_peer:
                    peer = stack.enter_context(_peer(workdir, replace(sizes, lower_bytes=tiers.peer_bytes)))
                    lower.append({**peer, "capacity": tiers.peer_bytes})
                kwargs["kv_transfer_config"] = KVTransferConfig(
                    kv_connector="OffloadingConnector",
                    kv_role="kv_both",
                    kv_connector_extra_config={
                        "spec_name": "KVTierOffloadingSpec",
                        "spec_module_path": "offload.vllm",
                        "cpu_bytes_to_use": tiers.host_bytes,
                        "shm_dir": str(shm_dir),
                        "kvtier_config": {"tiers": [{"kind": "host", "eviction": "lru"}, *lower]},
                    },
                )
            llm = LLM(**kwargs)
            params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
            if args.trace:
                tracemalloc.start(args.frames)
            first: Any = None
            first_types: collections.Counter[str] | None = None
            started = time.monotonic()
            for seed in range(1, args.batches + 1):
                prompts = _batch(seed, args.batch, args.prefix_len, 128)
                llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
                if args.trim:
                    libc.malloc_trim(0)
                row = {"batch": seed, "t_s": round(time.monotonic() - started, 1), "rss_mib": _rss() / 2**20}
                if args.trace:
                    row["traced_mib"] = tracemalloc.get_traced_memory()[0] / 2**20
                rows.append(row)
                print(json.dumps(row), flush=True)
                if seed in args.snapshot_at:
                    gc.collect()
                    types = _types()
                    if args.trace:
                        snap = tracemalloc.take_snapshot().filter_traces(
                            [tracemalloc.Filter(False, tracemalloc.__file__)]
                        )
                    if first is None and args.trace:
                        first, first_types = snap, types
                        continue
                    if first_types is None:
                        first_types = types
                        continue
                    print(f"--- batch {seed} vs batch {args.snapshot_at[0]}: object types grown", flush=True)
                    grown = {k: types[k] - first_types.get(k, 0) for k in types}
                    for name, n in sorted(grown.items(), key=lambda kv: -kv[1])[:15]:
                        print(f"  {name:40} +{n}")
                    if args.trace:
                        print("  tracemalloc, by line:", flush=True)
                        for stat in snap.compare_to(first, "lineno")[:25]:
                            print(f"  {stat}")
                        if args.frames > 1:
                            for stat in snap.compare_to(first, "traceback")[:5]:
                                print(f"  {stat}")
                                for line in stat.traceback.format()[-2 * args.frames :]:
                                    print(f"      {line}")
                    sys.stdout.flush()
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
