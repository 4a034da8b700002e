"""MLA under tensor parallelism in vLLM's CPU engine, with kvtier's host tier
(``docs/models.md``): the one-band host row, and what a loaded prefix gives.

.. code-block:: text

    .venv-vllm-cpu/bin/python -m bench.mla_tensor_parallel --tp 2

One engine (``bench.tiny_families``' DeepSeek-V2 checkpoint, one OpenMP thread). A
450-token document computed, then asked twice more: vLLM's CPU engine has no prefix cache
for MLA, so both repeats load the prefix from kvtier's host tier. Prints each run's loaded
tokens, greedy tokens and logprobs, and kvtier's start-log line (the host row's bytes).
There is no run over the same KV to compare with on CPU (vLLM's own CPU offloading starts
only on GPUs), so this reports; the exactness tests are ``tests/engine/test_families.py``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.serve_workloads import document
from bench.tiny_families import FAMILIES, write_family
from bench.vllm_engine import EngineProcess, EngineSpec


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor parallel size")
    args = parser.parse_args(argv)
    family = FAMILIES["deepseek-v2-mla"]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        (workdir / "shm").mkdir()
        kvtier = {
            "spec_name": "KVTierOffloadingSpec",
            "spec_module_path": "offload.vllm",
            "cpu_bytes_to_use": 64 << 20,
            "shm_dir": str(workdir / "shm"),
        }
        spec = EngineSpec(
            model_dir=str(write_family(workdir / "models", family)),
            kvtier=kvtier,
            env={"OMP_NUM_THREADS": "1"},
            device_blocks=80,
            max_model_len=1024,
            tensor_parallel_size=args.tp,
            **family.engine,
        )
        log_path = workdir / "engine.log"
        prompt = document(1, 450)
        with EngineProcess(spec, log_path) as engine:
            runs = [("computed", *engine.generate([prompt])), ("load 1", *engine.generate([prompt]))]
            runs.append(("load 2", *engine.generate([prompt])))
        print(f"command: .venv-vllm-cpu/bin/python -m bench.mla_tensor_parallel --tp {args.tp}")
        for line in log_path.read_text(errors="replace").splitlines():
            if "kvtier: tiers" in line:
                print(line.split("kvtier: ", 1)[1])
                break
        for name, run in runs:
            logprobs = [round(p, 4) for p in run.logprobs]
            print(
                f"{name}: {run.external_cached_tokens} tokens loaded, tokens {run.tokens}, "
                f"logprobs {logprobs}"
            )


if __name__ == "__main__":
    main()
