"""Model families under tensor parallelism in vLLM's real CPU engine, with kvtier's host tier
(``docs/models.md``): does the family run at ``--tp``, and does a reset prefix come back exact.

.. code-block:: text

    .venv-vllm-cpu/bin/python -m bench.family_tensor_parallel --tp 2 qwen3-moe gemma2 qwen3-next

One engine per family (``bench.tiny_families``' tiny checkpoint, one OpenMP thread per
rank), the steps of ``tests/engine/test_families.py``: a 450-token document computed, again
from vLLM's device prefix cache (the reference), then reset out of the device cache and
loaded from kvtier's host tier; "exact" is equal greedy tokens and logprobs, and another
document's tokens differ. At TP > 1, each rank's band of the rows (a hybrid's state rows)
is checked to be its own (non-zero, unlike the other ranks'), then the bands are rotated
between the ranks and the prefix loaded again: the output must no longer be the
reference's (``tests/engine/test_families_tp.py`` runs these steps for two families). For
MLA (no device prefix cache on CPU) the reference is the cold run, and the figure is the
largest logprob difference. A family whose engine does not start prints the error vLLM
raised (``--no-kvtier``: the same without kvtier, to tell the engine's own failures from
kvtier's). Prints one line per family, and JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.serve_workloads import document
from bench.tiny_families import FAMILIES, write_family
from bench.vllm_engine import EngineError, EngineProcess, EngineSpec

MLA = {"deepseek-v2-mla"}
HYBRIDS = {"qwen3-next", "nemotron-h", "granite-4-h"}  # a recurrent state group (vLLM's MambaSpec)


def engine_spec(name: str, models: Path, shm: Path, *, tp: int, dtype: str, kvtier: bool) -> EngineSpec:
    family = FAMILIES[name]
    extra = (
        {
            "spec_name": "KVTierOffloadingSpec",
            "spec_module_path": "offload.vllm",
            "cpu_bytes_to_use": 64 << 20,
            "shm_dir": str(shm),
        }
        if kvtier
        else None
    )
    return EngineSpec(
        model_dir=str(write_family(models, family)),
        kvtier=extra,
        env={"OMP_NUM_THREADS": "1"},
        device_blocks=80,
        max_model_len=1024,
        tensor_parallel_size=tp,
        dtype=dtype,
        **family.engine,
    )


def swap_bands(engine: EngineProcess, name: str, tp: int, doc: list[int], reference: Any) -> dict[str, Any]:
    """Each rank's band of the rows (the state rows for a hybrid): ``bands_distinct`` when
    every row's bands are all non-zero and unequal (each rank wrote its own shard); then the
    bands are rotated between the ranks and the prefix loaded again: ``swapped_differs``
    when that output is no longer the reference's."""
    spec_type = "MambaSpec" if name in HYBRIDS else "AttentionSpec"
    rows = engine.row_bands(spec_type, tp)
    distinct = all(not any(r["zero"]) and len(set(r["digests"])) == tp for r in rows)
    engine.row_bands(spec_type, tp, rotate=True)
    assert engine.reset_prefix_cache()
    swapped = engine.generate([doc])[0]
    return {
        "banded_rows": f"{len(rows)} {spec_type}",
        "bands_distinct": distinct,
        "swapped_loaded_tokens": swapped.external_cached_tokens,
        "swapped_differs": swapped.logprobs != reference.logprobs,
    }


def run_family(name: str, models: Path, *, tp: int, dtype: str, kvtier: bool) -> dict[str, Any]:
    """The family's steps; ``error`` (the engine's last log lines) where the engine fails."""
    result: dict[str, Any] = {"family": name, "tp": tp, "dtype": dtype, "kvtier": kvtier}
    doc, other = document(1, 450), document(2, 450)
    with tempfile.TemporaryDirectory(prefix=f"kvtier-tp-{name}-") as tmp:
        workdir = Path(tmp)
        (workdir / "shm").mkdir()
        log_path = workdir / "engine.log"
        spec = engine_spec(name, models, workdir / "shm", tp=tp, dtype=dtype, kvtier=kvtier)
        started = time.monotonic()
        try:
            with EngineProcess(spec, log_path) as engine:
                result["start_s"] = round(engine.start_s, 1)
                cold = engine.generate([doc])[0]
                if name in MLA:
                    reference = cold
                else:
                    reference = engine.generate([doc])[0]
                    result["device_cached"] = reference.num_cached_tokens
                    assert engine.reset_prefix_cache()
                loaded = engine.generate([doc])[0]
                result["loaded_tokens"] = loaded.external_cached_tokens
                result["reference"] = {"tokens": reference.tokens, "logprobs": reference.logprobs}
                result["loaded"] = {"tokens": loaded.tokens, "logprobs": loaded.logprobs}
                result["tokens_equal"] = loaded.tokens == reference.tokens
                result["logprobs_equal"] = loaded.logprobs == reference.logprobs
                result["max_logprob_diff"] = max(
                    abs(a - b) for a, b in zip(loaded.logprobs, reference.logprobs, strict=True)
                )
                if kvtier:
                    result["loaded_rows"] = engine.kvtier_stats()["loaded_rows_by_tier"]
                result["other_differs"] = engine.generate([other])[0].tokens != reference.tokens
                if kvtier and tp > 1 and name not in MLA:
                    result.update(swap_bands(engine, name, tp, doc, reference))
        except (EngineError, AssertionError) as exc:
            result["error"] = str(exc)[-1500:]
        result["wall_s"] = round(time.monotonic() - started, 1)
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        result["kvtier_log"] = [
            line.split("kvtier", 1)[1] for line in text.splitlines() if "kvtier: tiers" in line
        ]
        if "error" in result:
            errors = [line for line in text.splitlines() if "Error" in line or "error" in line]
            result["log_errors"] = errors[-8:]
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", default=sorted(FAMILIES), help="bench.tiny_families names")
    parser.add_argument("--tp", type=int, default=2, help="tensor parallel size")
    parser.add_argument("--dtype", default="auto", help="the model's dtype (auto: bfloat16)")
    parser.add_argument("--no-kvtier", action="store_true", help="vLLM alone")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvtier-tp-models-") as models:
        results = [
            run_family(name, Path(models), tp=args.tp, dtype=args.dtype, kvtier=not args.no_kvtier)
            for name in args.families
        ]
    given = " ".join(sys.argv[1:] if argv is None else argv)
    print(f"command: .venv-vllm-cpu/bin/python -m bench.family_tensor_parallel {given}")
    for result in results:
        print(json.dumps(result) if args.json else result)


if __name__ == "__main__":
    main()
