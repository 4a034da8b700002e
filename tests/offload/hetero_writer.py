"""Engine A for the conversion tests, in a process of its own.

``python -m tests.offload.hetero_writer CONFIG.json`` stores, for every writer the file
names, that writer's prompt (``logical_kv(seed)``) through an ``Offloader`` of its layout,
written through to every lower tier of the config, and exits once the rows are down.
"""

from __future__ import annotations

import json
import sys

import torch

from bench.engine_layouts import EngineLayout, ModelShape
from tests.offload.kv_engines import ROW_TOKENS, SHAPE, blocks_per_key, logical_kv


def prompt_keys(writer: str, rows: int) -> list[bytes]:
    """One key per stored row (``ROW_TOKENS`` tokens), the same for every engine."""
    from offload.keys import make_key

    return [make_key(f"{writer}/{i}".encode().ljust(16, b"."), 0) for i in range(rows)]


def write(spec: EngineLayout, config: dict, writer: str, seed: int, rows: int) -> None:
    bpk = blocks_per_key(spec)
    engine, kv = spec.offloader(config, rows * bpk + 2, ROW_TOKENS)
    block_ids = list(range(1, 1 + rows * bpk))  # block 0 left unused: ids need not start at 0
    spec.fill(kv, logical_kv(seed, rows, spec.shape), block_ids)
    with engine:
        engine.store(prompt_keys(writer, rows), block_ids)
        engine.wait()
        engine.wait_tiers()
        stats = engine.stats()["lower"]
        expected = rows * (len(config["tiers"]) - 1)
        if stats["spills_done"] != expected:  # type: ignore[index]
            raise SystemExit(f"{writer}: {stats} spilled, expected {expected}")


def main(path: str) -> None:
    with open(path) as f:
        job = json.load(f)
    for entry in job["writers"]:
        shape = ModelShape(
            SHAPE.layers,
            entry.get("heads", SHAPE.heads),
            SHAPE.head_dim,
            getattr(torch, entry.get("dtype", "float16")),
        )
        spec = EngineLayout(entry["kind"], entry["block_tokens"], shape)
        config = dict(job["config"], namespace={"model": entry.get("model", job["model"])})
        write(spec, config, entry["writer"], entry["seed"], entry["rows"])


if __name__ == "__main__":
    main(sys.argv[1])
